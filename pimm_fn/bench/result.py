"""What a benchmark measures: the Workload a factory returns, the BenchResult, the machine."""
from __future__ import annotations

import contextlib
import json
import os
import platform
from typing import Any, NamedTuple, Optional, Sequence

import attrs
import torch


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
        reasons = f", {len(self.break_reasons)} break reason(s)" if self.break_reasons else ""
        rows.append(("graph breaks", gb + reasons))
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
