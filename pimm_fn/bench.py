"""Benchmark a step function: compile time, step time, recompiles, graph breaks, memory.

:func:`benchmark_step` times any step (a :class:`~pimm_fn.compile.Step`, a plain core
function over :class:`~pimm_fn.state.TrainState`, or a ready
:class:`~pimm_fn.compile.CompiledStep`) and returns a :class:`BenchResult` with a text
``table()`` and ``to_json()``. :func:`measure_compile_cache` compiles a workload in two
fresh processes sharing one ``TORCHINDUCTOR_CACHE_DIR`` (cold, then warm from inductor's
FX-graph and AOTAutograd caches). :func:`bench_main` is the ``pimm-fn bench`` command.

Memory: on CUDA the peak is ``torch.cuda.max_memory_allocated`` over a step, minus what
was allocated before it. On CPU torch keeps no allocator statistics (torch 2.13 has no
``torch.cpu.memory_allocated``), and the resident set cannot see a step in a warm process
(glibc keeps freed blocks mapped, so the RSS before the step already holds them). So the
CPU figure is accounting of torch's CPU allocator: every tensor allocation and free that
the profiler's memory events report (``profile_memory=True``; inductor's kernels allocate
through the same allocator), summed in time order. The profiler does not report frees of blocks allocated before it
started, so the peak of that running sum is the peak of the memory allocated during the
step and still live (activations, gradients, a functional step's new state while the
old one is alive), on top of what was live before. Allocator slack is not included;
``memory_method`` says which method was used. The peak is measured on an extra, untimed
step (the profiler would slow a timed one).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import attrs
import torch

from .compile import CompiledStep, as_step, compile_step, explain_step

__all__ = ["BenchResult", "Workload", "benchmark_step", "bench_main", "graph_breaks", "machine_info",
           "measure_compile_cache", "batch_size"]


class Workload(NamedTuple):
    """What a benchmark factory returns: a step, its initial state and the batches to cycle."""

    name: str
    step: Any
    state: Any
    batches: Sequence
    model: Any = None
    notes: dict = {}


@attrs.define
class BenchResult:
    """Everything :func:`benchmark_step` measured. Times in seconds unless the name says ms."""

    name: str
    compiled: bool
    device: str
    steps: int
    warmup: int
    step_ms: dict  # median / min / max / mean over the timed steps
    step_times_ms: list
    first_call_s: Optional[float]  # the first call: compilation + one step
    compile_s: Optional[float]  # wall time of the calls that compiled (CompiledStep.compile_seconds)
    compile_count: int
    recompile_reasons: list
    recompiles_in_timed_steps: int
    graph_break_count: Optional[int]
    break_reasons: list
    compile_error: Optional[str]
    peak_memory_bytes: Optional[int]
    memory_method: str
    samples_per_step: float
    points_per_step: Optional[float]
    samples_per_s: float
    points_per_s: Optional[float]
    eager_step_ms: Optional[dict] = None
    speedup_vs_eager: Optional[float] = None
    compile_cache: Optional[dict] = None  # measure_compile_cache's result, when measured
    options: dict = attrs.field(factory=dict)
    machine: dict = attrs.field(factory=dict)

    @property
    def has_graph_breaks(self) -> bool:
        """True when explain saw a break: a nonzero count or any listed break reason."""
        return bool(self.graph_break_count) or bool(self.break_reasons)

    def to_dict(self) -> dict:
        d = attrs.asdict(self)
        d["has_graph_breaks"] = self.has_graph_breaks
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), indent=kw.pop("indent", 2), default=str, **kw)

    def table(self) -> str:
        """A readable two-column summary."""

        def ms(d):
            return f"{d['median']:.2f} ms (min {d['min']:.2f}, max {d['max']:.2f})"

        rows = [("step", self.name), ("mode", "compiled (fullgraph)" if self.compiled else "eager"),
                ("device", self.device)]
        if self.compile_error:
            rows.append(("COMPILE FAILED", self.compile_error.splitlines()[0][:160]))
        rows.append(("step time", ms(self.step_ms) + f" over {self.steps} steps after {self.warmup} warm-up"))
        if self.eager_step_ms:
            rows.append(("eager step time", ms(self.eager_step_ms)))
            rows.append(("speedup vs eager", f"{self.speedup_vs_eager:.2f}x"))
        if self.first_call_s is not None:
            rows.append(("first call", f"{self.first_call_s:.2f} s (compile + 1 step)"))
        if self.compile_cache:
            c = self.compile_cache
            rows.append(("compile, new process", f"cold {c['cold_s']:.2f} s, warm cache {c['warm_s']:.2f} s "
                                                 f"(warm/cold {c['warm_over_cold']:.2f})"))
        rows.append(("compilations", f"{self.compile_count} ({self.recompiles_in_timed_steps} during timed steps)"))
        for r in self.recompile_reasons[:5]:
            rows.append(("  recompile reason", r[:160]))
        gb = "not checked" if self.graph_break_count is None else str(self.graph_break_count)
        rows.append(("graph breaks", gb + (f", {len(self.break_reasons)} break reason(s)" if self.break_reasons else "")))
        for r in self.break_reasons[:5]:
            rows.append(("  break reason", r.splitlines()[0][:160]))
        mem = "n/a" if self.peak_memory_bytes is None else f"{self.peak_memory_bytes / 2**20:.1f} MiB"
        rows.append(("peak memory", f"{mem} ({self.memory_method})"))
        tp = f"{self.samples_per_s:,.0f} samples/s"
        if self.points_per_s is not None:
            tp += f", {self.points_per_s:,.0f} points/s"
        rows.append(("throughput", tp))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def machine_info() -> dict:
    """CPU model, cores, threads, torch / Python versions, CUDA device if any."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "mkl": torch.backends.mkl.is_available(),
    }
    with contextlib.suppress(OSError):
        info["load_avg"] = os.getloadavg()  # a shared machine: say how busy it was
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
    return info


def batch_size(batch) -> tuple[float, Optional[float]]:
    """(samples, points) of a batch; points is None unless it is a point batch.

    A point batch is a dict with an ``offset`` tensor (Pointcept's cumulative counts):
    samples = len(offset), points = offset[-1]. Otherwise samples is the leading size of
    the first tensor found; a list/tuple of micro-batches sums its parts.
    """
    if isinstance(batch, dict) and isinstance(batch.get("offset"), torch.Tensor) and batch["offset"].numel():
        return float(batch["offset"].numel()), float(batch["offset"][-1])
    if isinstance(batch, (list, tuple)) and batch and all(isinstance(b, dict) for b in batch):
        parts = [batch_size(b) for b in batch]
        pts = [p for _, p in parts]
        return sum(s for s, _ in parts), (None if any(p is None for p in pts) else sum(pts))
    from .tree import tree_leaves

    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return float(leaf.shape[0]), None
    return 1.0, None


def _device_of(state) -> torch.device:
    params = getattr(state, "params", None)
    if isinstance(params, dict) and params:
        return next(iter(params.values())).device
    return torch.device("cpu")


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _hwm_bytes() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class PeakMemory:
    """Context manager: the peak extra memory of its body, in ``.peak_bytes`` / ``.method``.

    CUDA: ``max_memory_allocated`` minus the allocation before. CPU: the peak of the running
    sum of torch's CPU allocations minus frees, from the profiler's memory events: the
    peak of the memory allocated inside the body and still live (the profiler does not
    see frees of blocks allocated before it started). Where the profiler cannot record memory, peak RSS (``VmHWM``
    after a ``clear_refs`` reset) minus RSS before, which misses memory glibc kept mapped.
    The profiler slows the body: do not time it.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peak_bytes: Optional[int] = None
        self.method = "unavailable"
        self._prof = None
        self._hwm = False

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.method = "cuda max_memory_allocated - allocated before"
            return self
        try:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
            self.method = "cpu: torch allocator accounting (profiler memory events), peak bytes allocated in the step"
            return self
        except Exception:  # noqa: BLE001 - no profiler here: fall back to the resident set
            self._prof = None
        self._base = _rss_bytes()
        if self._base is not None:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS
                self._hwm = True
                self.method = "cpu peak RSS (VmHWM) - RSS before (misses memory glibc kept mapped)"
            except OSError:
                pass
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device) - self._base)
        elif self._prof is not None:
            self._prof.__exit__(*exc)
            if exc[0] is None:
                self.peak_bytes = _allocator_peak(self._prof)
        elif self._hwm:
            peak = _hwm_bytes()
            self.peak_bytes = None if peak is None else max(0, int(peak - self._base))
        return False


def _allocator_peak(prof) -> int:
    """Peak of the running sum of CPU allocation (+) / free (-) bytes in a profile."""
    cpu = torch.autograd.DeviceType.CPU
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == cpu)
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return int(peak)


def graph_breaks(step_fn, state, batch) -> tuple[int, list[str]]:
    """``(graph_break_count, break_reasons)`` of any step, from :func:`pimm_fn.compile.explain_step`.

    A count of 0 with a listed reason (e.g. an unsupported ``.item()``) is still a break:
    check both. A step that cannot be traced at all is reported as one break, not raised.
    Explaining resets dynamo, dropping every compiled graph in the process, so call it
    before compiling (:func:`benchmark_step` does).
    """
    try:
        out = explain_step(step_fn, state, batch)
    except Exception as e:  # noqa: BLE001 - reported in the result, not raised
        return 1, [f"explain failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
    reasons = []
    for r in out.break_reasons:
        text = getattr(r, "reason", str(r))
        frames = getattr(r, "user_stack", None) or []
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        reasons.append(f"{text}{where}")
    return int(out.graph_break_count), reasons


def _stats(times_ms: Sequence[float]) -> dict:
    return {"median": statistics.median(times_ms), "min": min(times_ms), "max": max(times_ms),
            "mean": statistics.fmean(times_ms)}


def _time_steps(fn, state, batches, n: int, start: int, device, out: list):
    for i in range(n):
        batch = batches[(start + i) % len(batches)]
        _sync(device)
        t0 = time.perf_counter()
        state, _ = fn(state, batch)
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return state


# --------------------------------------------------------------------------------------
# benchmark_step
# --------------------------------------------------------------------------------------
def benchmark_step(
    step_fn,
    state,
    batch_or_batches,
    *,
    steps: int = 30,
    warmup: int = 3,
    eager_baseline: bool = False,
    compile: bool = True,
    dynamic: Optional[bool] = None,
    mode: Optional[str] = None,
    options: Optional[dict] = None,
    check_graph_breaks: bool = True,
    rounds: int = 3,
    factory: Optional[str] = None,
    factory_kwargs: Optional[dict] = None,
    name: Optional[str] = None,
    size_fn: Optional[Callable] = None,
) -> BenchResult:
    """Time a step function and report what its compilation did.

    step_fn: a Step, a plain core ``(state, batch) -> (state, metrics)`` or a CompiledStep
        (used as it is: its counts include calls made before).
    batch_or_batches: one batch or a list of batches, cycled in order (variable-size
        point batches exercise dynamic shapes).
    steps / warmup: timed steps and untimed steps after the first (compiling) call.
    eager_baseline: also time the uncompiled step, interleaved with the compiled one in
        ``rounds`` blocks (a noisy machine then slows both alike).
    compile: False times the step eagerly only. dynamic / mode / options: passed to
        :func:`~pimm_fn.compile.compile_step`.
    check_graph_breaks: run ``torch._dynamo.explain`` on the core first (it resets dynamo).
    factory: "module:function" (or "path.py:function") returning a :class:`Workload` that
        rebuilds this step; when given, compile time is also measured cold and warm in two
        fresh processes sharing one inductor cache (:func:`measure_compile_cache`).
    size_fn: ``batch -> (samples, points or None)`` (default :func:`batch_size`).
    If compiling fails (a graph break under fullgraph, an unsupported op), the error is in
    ``compile_error``, ``compiled`` is False and the step is timed eagerly instead.
    """
    batches = list(batch_or_batches) if isinstance(batch_or_batches, list) else [batch_or_batches]
    if not batches:
        raise ValueError("benchmark_step needs at least one batch")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = _device_of(state)
    size_fn = size_fn or batch_size
    name = name or getattr(step_fn, "name", None) or getattr(step_fn, "__name__", "step")

    gb_count, gb_reasons = (None, [])
    if check_graph_breaks:
        gb_count, gb_reasons = graph_breaks(step_fn, state, batches[0])

    if isinstance(step_fn, CompiledStep):
        runner = step_fn
    elif compile:
        runner = compile_step(step_fn, dynamic=dynamic, mode=mode, options=options)
    else:
        runner = compile_step(step_fn, eager=True)
    eager_runner = as_step(step_fn.step if isinstance(step_fn, CompiledStep) else step_fn)

    compile_error = None
    compiled = not runner.eager
    _sync(device)
    t0 = time.perf_counter()
    try:
        cur, _ = runner(state, batches[0])
    except Exception as e:
        if not compiled:
            raise
        compile_error = f"{type(e).__name__}: {e}"
        compiled = False
        runner = compile_step(eager_runner, eager=True)
        cur, _ = runner(state, batches[0])
    _sync(device)
    first_call = time.perf_counter() - t0 if compiled else None
    for i in range(warmup):
        cur, _ = runner(cur, batches[(1 + i) % len(batches)])
    counted_before = runner.compile_count

    times: list[float] = []
    eager_times: list[float] = []
    eager_state = state
    if eager_baseline:
        eager_state, _ = eager_runner(eager_state, batches[0])  # eager warm-up (allocator, lazy init)
    rounds = max(1, min(rounds, steps)) if eager_baseline else 1
    per_round = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
    pos = 1 + warmup
    for r, n in enumerate(per_round):
        cur = _time_steps(runner, cur, batches, n, pos, device, times)
        if eager_baseline:
            eager_state = _time_steps(eager_runner, eager_state, batches, n, pos, device, eager_times)
        pos += n

    mem = PeakMemory(device)  # one extra, untimed step: the CPU accounting slows what it watches
    with mem:
        cur, _ = runner(cur, batches[pos % len(batches)])
        _sync(device)
    recompiles_in_timed = runner.compile_count - counted_before

    sizes = [size_fn(batches[(1 + warmup + i) % len(batches)]) for i in range(steps)]
    samples = statistics.fmean(s for s, _ in sizes)
    points = None if any(p is None for _, p in sizes) else statistics.fmean(p for _, p in sizes)
    st = _stats(times)
    # Throughput from the total time, so variable-size batches weigh in by their size.
    total_s = sum(times) / 1e3
    result = BenchResult(
        name=name,
        compiled=compiled,
        device=str(device),
        steps=steps,
        warmup=warmup,
        step_ms=st,
        step_times_ms=times,
        first_call_s=first_call,
        compile_s=sum(runner.compile_seconds) if compiled else None,
        compile_count=runner.compile_count,
        recompile_reasons=list(runner.recompile_reasons),
        recompiles_in_timed_steps=recompiles_in_timed,
        graph_break_count=gb_count,
        break_reasons=gb_reasons,
        compile_error=compile_error,
        peak_memory_bytes=mem.peak_bytes,
        memory_method=mem.method + " (one untimed step after the timed ones)",
        samples_per_step=samples,
        points_per_step=points,
        samples_per_s=samples * steps / total_s,
        points_per_s=None if points is None else points * steps / total_s,
        options={"dynamic": dynamic, "mode": mode, "options": dict(options or {}), "rounds": rounds},
        machine=machine_info(),
    )
    if eager_baseline:
        result.eager_step_ms = _stats(eager_times)
        result.speedup_vs_eager = result.eager_step_ms["median"] / st["median"]
    if factory is not None and compiled:
        result.compile_cache = measure_compile_cache(factory, factory_kwargs, dynamic=dynamic, mode=mode,
                                                     options=options)
    return result


# --------------------------------------------------------------------------------------
# compile time in fresh processes: cold vs warm cache
# --------------------------------------------------------------------------------------
def load_factory(spec: str) -> Callable:
    """Resolve "package.module:function" or "path/to/file.py:function"."""
    if ":" not in spec:
        raise ValueError(f"a factory is 'module:function' or 'file.py:function', got {spec!r}")
    mod_name, attr = spec.rsplit(":", 1)
    if mod_name.endswith(".py"):
        spec_obj = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
        module = importlib.util.module_from_spec(spec_obj)
        spec_obj.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(mod_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"{mod_name} has no factory {attr!r}") from None


def _cache_counters() -> dict:
    from torch._dynamo.utils import counters

    keys = {"inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
            "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}
    return {k: int(counters[group][k]) for group, ks in keys.items() for k in ks}


def _probe(spec: str, kwargs: dict, calls: int, compile_kw: dict) -> dict:
    """In this (fresh) process: build the workload and compile its step; report times."""
    wl = load_factory(spec)(**kwargs)
    step = compile_step(wl.step, **compile_kw)
    state = wl.state
    t0 = time.perf_counter()
    calls = max(1, min(calls, len(wl.batches)))
    for i in range(calls):
        state, _ = step(state, wl.batches[i])
    total = time.perf_counter() - t0
    return {"compile_s": sum(step.compile_seconds), "first_calls_s": total, "calls": calls,
            "compile_count": step.compile_count, "counters": _cache_counters(),
            "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}


def measure_compile_cache(factory: str, factory_kwargs: Optional[dict] = None, *, cache_dir: Optional[str] = None,
                          calls: int = 2, dynamic=None, mode=None, options=None, timeout: float = 900) -> dict:
    """Compile a workload's step in two fresh processes sharing one inductor cache.

    The first process starts from an empty ``TORCHINDUCTOR_CACHE_DIR`` (cold; a fresh
    temporary directory unless ``cache_dir`` is given), the second reuses it (warm: FX
    graph cache and AOTAutograd cache hits; dynamo still traces). ``calls`` first calls
    are made (2 covers the dynamic recompile of variable-size batches); compile time is
    the wall time of the calls that compiled. Returns cold_s, warm_s, warm_over_cold and
    each process's cache hit/miss counters.
    """
    tmp = None
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="pimm_fn_bench_cache_")
        cache_dir = tmp.name
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    payload = json.dumps({"spec": factory, "kwargs": factory_kwargs or {}, "calls": calls,
                          "compile_kw": {"dynamic": dynamic, "mode": mode, "options": options},
                          "threads": torch.get_num_threads()})
    runs = []
    try:
        for _ in range(2):
            proc = subprocess.run([sys.executable, "-m", "pimm_fn.bench", "--compile-probe", payload],
                                  env=env, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"compile probe for {factory} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        if tmp is not None:
            tmp.cleanup()
    cold, warm = runs
    return {"cold_s": cold["compile_s"], "warm_s": warm["compile_s"],
            "warm_over_cold": warm["compile_s"] / cold["compile_s"] if cold["compile_s"] else math.nan,
            "cold": cold, "warm": warm}


# --------------------------------------------------------------------------------------
# CLI: pimm-fn bench
# --------------------------------------------------------------------------------------
BUILTIN_WORKLOADS = ("mlp", "pointseg", "cnn")  # GRPO: benchmarks/grpo_step.py


def _resolve_workload(name: str) -> str:
    if ":" in name:
        return name
    if name not in BUILTIN_WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}: use one of {', '.join(BUILTIN_WORKLOADS)} or 'module:factory'")
    # The built-in workloads live in the repository's benchmarks/workloads.py (run from
    # the repository root) until the model zoo they use is part of the package.
    return f"benchmarks.workloads:{name}"


def bench_main(argv: Optional[Sequence[str]] = None) -> int:
    """``pimm-fn bench WORKLOAD [--steps N] [--warmup N] [--eager] [--cache] [--json OUT]``.

    WORKLOAD: mlp | pointseg | cnn, or "module:factory" / "file.py:factory" for your
    own step (the factory returns a :class:`Workload`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--compile-probe"]:
        p = json.loads(argv[1])
        torch.set_num_threads(p["threads"])
        print(json.dumps(_probe(p["spec"], p["kwargs"], p["calls"], p["compile_kw"])))
        return 0
    ap = argparse.ArgumentParser(prog="pimm-fn bench", description="Benchmark a compiled pimm_fn step.")
    ap.add_argument("workload", help="mlp | pointseg | cnn | module:factory | file.py:factory")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the compiling call")
    ap.add_argument("--eager", action="store_true", help="also time the eager step, interleaved")
    ap.add_argument("--cache", action="store_true",
                    help="measure compile time cold and warm in two fresh processes sharing an inductor cache")
    ap.add_argument("--mode", default=None, help="inductor mode, e.g. max-autotune")
    ap.add_argument("--dynamic", choices=["auto", "true", "false"], default="auto")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="inductor config patch, e.g. cpp_wrapper=True (repeatable)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {}
    for kv in args.option:
        k, _, v = kv.partition("=")
        try:
            options[k] = json.loads(v.lower() if v in ("True", "False") else v)
        except json.JSONDecodeError:
            options[k] = v
    dynamic = {"auto": None, "true": True, "false": False}[args.dynamic]
    spec = _resolve_workload(args.workload)
    try:
        wl = load_factory(spec)()
    except ImportError as e:
        raise SystemExit(f"cannot build workload {args.workload!r} ({spec}): {e}") from None
    res = benchmark_step(wl.step, wl.state, list(wl.batches), steps=args.steps, warmup=args.warmup,
                         eager_baseline=args.eager, dynamic=dynamic, mode=args.mode, options=options or None,
                         factory=spec if args.cache else None, name=wl.name)
    print(res.table())
    if args.json:
        with open(args.json, "w") as f:
            f.write(res.to_json())
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(bench_main())
