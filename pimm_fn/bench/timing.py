"""benchmark_step: compile a step, time it (optionally against its eager self), count its
recompiles and graph breaks, measure its memory."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import torch

from ..compile import CompiledStep, as_step, compile_step, explain_step
from ..data.count import count_batch
from .compile_cache import measure_compile_cache
from .memory import PeakMemory
from .result import BenchResult, machine_info


def _device_of(state) -> torch.device:
    params = getattr(state, "params", None)
    if isinstance(params, dict) and params:
        return next(iter(params.values())).device
    return torch.device("cpu")


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_breaks(step_fn, state, batch) -> tuple[int, list[str]]:
    """``(graph_break_count, break_reasons)`` of any step, from :func:`pimm_fn.compile.explain_step`.

    A count of 0 with a listed reason (e.g. an unsupported ``.item()``) is still a break:
    check both. A step that cannot be traced at all is reported as one break, not raised.
    Explaining resets dynamo, dropping every compiled graph in the process, so call it
    before compiling (:func:`benchmark_step` does).
    """
    try:
        out = explain_step(step_fn, state, batch)
    except Exception as e:
        return 1, [f"explain failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
    return int(out.graph_break_count), [f"{b.kind}: {b.reason.splitlines()[0]} at {b.location} ({b.code})"
                                        for b in out.breaks]


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
    size_fn: ``batch -> (samples, points or None)`` (default :func:`pimm_fn.data.count_batch`).
    If compiling fails (a graph break under fullgraph, an unsupported op), the error is in
    ``compile_error``, ``compiled`` is False and the step is timed eagerly instead.
    """
    batches = list(batch_or_batches) if isinstance(batch_or_batches, list) else [batch_or_batches]
    if not batches:
        raise ValueError("benchmark_step needs at least one batch")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = _device_of(state)
    size_fn = size_fn or count_batch
    name = name or getattr(step_fn, "name", None) or getattr(step_fn, "__name__", "step")

    gb_count, gb_reasons = (None, [])
    if check_graph_breaks:
        gb_count, gb_reasons = graph_breaks(step_fn, state, batches[0])

    if isinstance(step_fn, CompiledStep):
        runner = step_fn
    elif compile:
        # The first call's time is reported as the compile: not a load from the step cache.
        runner = compile_step(step_fn, dynamic=dynamic, mode=mode, options=options, cache=False)
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
    for n in per_round:
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
