"""Benchmark a step function: compile time, step time, recompiles, graph breaks, memory.

:func:`benchmark_step` times any step (a :class:`~pimm_fn.compile.Step`, a plain core
function over :class:`~pimm_fn.state.TrainState`, or a ready
:class:`~pimm_fn.compile.CompiledStep`) and returns a :class:`BenchResult` with a text
``table()`` and ``to_json()``. :func:`measure_compile_cache` compiles a workload in two
fresh processes sharing one ``TORCHINDUCTOR_CACHE_DIR`` (cold, then warm from inductor's
FX-graph and AOTAutograd caches). :func:`bench_main` is the ``pimm-fn bench`` command.

Rooms:
    timing         benchmark_step, graph_breaks
    result         Workload, BenchResult, machine_info
    memory         PeakMemory
    compile_cache  measure_compile_cache, load_factory (fresh-process compile probes)
    cli            bench_main (``pimm-fn bench``, ``python -m pimm_fn.bench``)
    workloads      the built-in workloads (mlp, pointseg, cnn) and the Pointcept-style eager trainer

How memory is measured on CPU and CUDA: see :mod:`pimm_fn.bench.memory`.
"""
from .cli import BUILTIN_WORKLOADS, bench_main
from .compile_cache import load_factory, measure_compile_cache
from .memory import PeakMemory
from .result import BenchResult, Workload, machine_info
from .timing import benchmark_step, graph_breaks

__all__ = ["BUILTIN_WORKLOADS", "BenchResult", "PeakMemory", "Workload", "bench_main",
           "benchmark_step", "graph_breaks", "load_factory", "machine_info", "measure_compile_cache"]
