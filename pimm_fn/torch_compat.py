"""Every torch internal pimm_fn relies on, in one place (written for torch 2.13).

Everything here reaches below torch's documented surface: dynamo's dim markings, its
compile callbacks, counters and logs, inductor's mode table and CPU probes, shape-
environment settings, the foreach kernels, the functional collectives
(``torch.distributed._functional_collectives``). When torch moves them, this module is the
one to change; pyproject pins ``torch==2.13.*`` until a test lane runs another version.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import types

import torch
import torch.fx.experimental._config as _shape_config
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, guard_or_true

__all__ = ["all_gather", "all_reduce", "backendless_mesh", "clear_unbacked", "compilation_reasons",
           "compiled_graph_count", "complete_loaded_guards", "cpu_vec_isa_class", "dynamo_compile_hooks",
           "dynamo_config", "dynamo_counters", "generator_untouched_by_this_thread", "graph_break_count",
           "graph_break_records", "guard_or_true", "inductor_config", "inductor_cpp_kernels",
           "inductor_mode_options", "is_compiled_module", "is_data_dependent_error", "is_dynamo_unsupported",
           "is_marked_dynamic", "mark_backed", "mark_dynamic", "mark_unbacked", "profiler_enabled", "reduce_scatter",
           "reset_dynamo", "step_tracing_config", "tensorify_restart_error", "trace_inductor_dummy_module",
           "unbacked_dims", "uncompiled_module"]

TORCH_VERSION_WRITTEN_FOR = "2.13"

# Dynamo is imported where it is used: pimm_fn's core modules import this one, and
# `import pimm_fn` must not load the compiler (~1 s).


def _dynamo():
    import torch._dynamo

    return torch._dynamo


def mark_unbacked(t: torch.Tensor, dim: int, min: int = 2) -> None:
    """Trace ``t.shape[dim]`` as an unknown size of at least ``min``: one graph for every size.

    No guard is ever put on an unbacked size (a backed one collects guards such as
    inductor's ``size <= 4096`` choice of reduction, which recompile when a later batch
    crosses them); code that branches on the size fails to trace instead.
    """
    _dynamo().decorators.mark_unbacked(t, dim, min=min)


def clear_unbacked(t: torch.Tensor) -> None:
    """Undo :func:`mark_unbacked` on ``t`` (dynamo keeps the marks as tensor attributes)."""
    for name in ("_dynamo_unbacked_indices", "_dynamo_unbacked_bounds", "_specialize_on", "_dynamo_hint_overrides"):
        if hasattr(t, name):
            delattr(t, name)
    if hasattr(t, "_has_dynamo_dim_marking") and not any(
            hasattr(t, a) for a in ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices",
                                    "_dynamo_strict_unbacked_indices", "_dynamo_static_indices")):
        del t._has_dynamo_dim_marking


def mark_backed(t: torch.Tensor, dim: int) -> None:
    """Trace ``t.shape[dim]`` as a symbolic size with guards (dynamo may still specialise it)."""
    _dynamo().maybe_mark_dynamic(t, dim)



def mark_dynamic(t: torch.Tensor, dim: int, **bounds) -> None:
    """``torch._dynamo.mark_dynamic``: the dim is symbolic, and specialising it is an error."""
    _dynamo().mark_dynamic(t, dim, **bounds)


def is_marked_dynamic(t: torch.Tensor) -> bool:
    """Whether ``t`` carries dims marked by :func:`mark_dynamic`."""
    return bool(getattr(t, "_dynamo_dynamic_indices", None))


def unbacked_dims(t: torch.Tensor) -> frozenset:
    """The dims of ``t`` marked by :func:`mark_unbacked`."""
    return frozenset(getattr(t, "_dynamo_unbacked_indices", ()) or ())


def is_data_dependent_error(err: BaseException) -> bool:
    """Whether tracing failed because code asked for the value of an unbacked size."""
    while err is not None:
        if isinstance(err, GuardOnDataDependentSymNode) or "data-dependent" in str(err).split("\n")[0]:
            return True
        err = err.__cause__
    return False


def is_dynamo_unsupported(err: BaseException) -> bool:
    """Whether ``err`` is dynamo refusing to trace something (a graph break under fullgraph)."""
    return "torch._dynamo" in sys.modules and isinstance(err, torch._dynamo.exc.Unsupported)


def tensorify_restart_error() -> type:
    """The exception dynamo raises to restart a trace after specialising a float input."""
    return _dynamo().exc.TensorifyScalarRestartAnalysis


def step_tracing_config():
    """The settings a step's trace needs, as one context of ``config.patch`` es.

    ``trace_autograd_ops`` lets dynamo trace ``torch.autograd.grad`` (which, unlike the
    torch.func transforms, handles BatchNorm's in-place buffer updates). Duck shaping is off:
    two point counts of a batch that happen to be equal (a level's points and another's
    patches) would otherwise share one symbol and a guard that they stay equal, and the next
    batch would recompile.
    """
    stack = contextlib.ExitStack()
    stack.enter_context(_dynamo().config.patch(trace_autograd_ops=True))
    stack.enter_context(_shape_config.patch(use_duck_shape=False))
    return stack


def complete_loaded_guards(fn) -> None:
    """Give a step loaded from the precompile API (``load_compiled_function``) the module
    aliases its guards look up. A dynamic step's shape guards (dynamo specialising float
    defaults such as ``ord=2.0``) read ``G['__import_pimm_fn_dot_tree']``; the global scope
    the artifact restores its guards under lacks these aliases, so every call failed the
    guards and compiled the step again. The aliases are the artifact's own import list."""
    import importlib

    artifacts = getattr(fn, "_artifacts", None)
    scope = getattr(getattr(artifacts, "guard_manager", None), "global_scope", None)
    env = getattr(artifacts, "runtime_env", None)
    if not isinstance(scope, dict) or not isinstance(scope.get("G"), dict) or env is None:
        return
    for alias, module in getattr(env, "import_sources", {}).items():
        if alias not in scope["G"]:
            scope["G"][alias] = importlib.import_module(module)


def dynamo_config():
    """dynamo's config module (``.patch(...)``, ``save_config_portable()``)."""
    return _dynamo().config


def inductor_config():
    """inductor's config module (``.patch(...)``, ``save_config_portable()``)."""
    import torch._inductor.config

    return torch._inductor.config


def inductor_mode_options(mode: str, dynamic) -> dict:
    """The inductor config a ``torch.compile(mode=...)`` stands for."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode, dynamic))


def cpu_vec_isa_class():
    """inductor's ``cpu_vec_isa`` module (its ISA probes are ``VecISA.check_build``)."""
    from torch._inductor import cpu_vec_isa

    return cpu_vec_isa


@functools.cache
def inductor_cpp_kernels() -> types.SimpleNamespace:
    """What inductor builds CPU kernels with (torch 2.13): ``AsyncCompile`` (the generated
    code calls its ``cpp_pybinding(argtypes, source)`` per kernel, then ``wait(globals())``),
    ``LambdaFuture``, ``CodeCache`` (``CppPythonBindingsCodeCache``: ``load_async`` /
    ``load_pybinding_async``, keyed by source) and ``compile_threads()``."""
    from torch._inductor import async_compile, codecache

    return types.SimpleNamespace(AsyncCompile=async_compile.AsyncCompile, LambdaFuture=async_compile.LambdaFuture,
                                 CodeCache=codecache.CppPythonBindingsCodeCache,
                                 compile_threads=async_compile.get_compile_threads)


_QUIET_RNG_THREADS: set = set()
_QUIET_RNG_LOCK = threading.Lock()
_RNG_SETTERS: dict = {}


@contextlib.contextmanager
def generator_untouched_by_this_thread():
    """While the block runs, this thread's calls of ``torch.random.set_rng_state`` (and
    CUDA's) do nothing.

    dynamo saves the global generator's state before each trace and sets it back after
    (``convert_frame.preserve_global_state``). A compile in a background thread would so
    rewind the generator under a step running in the main thread, between its seeding and
    its dropout. Tracing with fake tensors draws nothing, so skipping the restore loses
    nothing. Other threads' calls pass through; the wrappers are removed when the last
    such block ends.
    """
    me = threading.get_ident()
    with _QUIET_RNG_LOCK:
        if not _QUIET_RNG_THREADS:
            modules = [torch.random] + ([torch.cuda] if torch.cuda.is_available() else [])
            for module in modules:
                original = module.set_rng_state

                def quiet(*args, _original=original, **kwargs):
                    if threading.get_ident() not in _QUIET_RNG_THREADS:
                        _original(*args, **kwargs)

                _RNG_SETTERS[module] = original
                module.set_rng_state = quiet
        _QUIET_RNG_THREADS.add(me)
    try:
        yield
    finally:
        with _QUIET_RNG_LOCK:
            _QUIET_RNG_THREADS.discard(me)
            if not _QUIET_RNG_THREADS:
                for module, original in _RNG_SETTERS.items():
                    module.set_rng_state = original
                _RNG_SETTERS.clear()


def trace_inductor_dummy_module() -> None:
    """Run now, on this thread, the one ``torch.fx.symbolic_trace`` inductor makes per process
    (``loop_body.InterpreterShim._dummy_gm``, cached; torch 2.13).

    FX's symbolic tracer replaces ``nn.Module.__call__`` for the whole process while it
    traces. Made first by a background compile, that trace catches the module calls of an
    eager step running meanwhile on the main thread, which then fail ("module is not
    installed as a submodule"). Made here, before the compile thread starts, it cannot.
    """
    from torch._inductor.loop_body import InterpreterShim

    InterpreterShim._dummy_gm()


def dynamo_compile_hooks(start, end):
    """A function that makes dynamo call ``start()`` before it traces a frame and ``end()``
    once that compile is over (the outermost compile only). Call it before each use:
    ``torch.compiler.reset()`` drops dynamo's callbacks, and it registers them again."""
    import torch._dynamo.callback

    handler = torch._dynamo.callback_handler
    trigger = torch._dynamo.callback.CallbackTrigger.DYNAMO

    def on_start(args):
        if args.callback_trigger is trigger:
            start()

    def on_end(args):
        if args.callback_trigger is trigger:
            end()

    def ensure():
        if on_start not in handler.start_callbacks:
            handler.register_start_callback(on_start)
            handler.register_end_callback(on_end)

    return ensure


def dynamo_counters():
    """dynamo's process-wide counters (``counters[group][name]``)."""
    return _dynamo().utils.counters


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process so far (its own counter)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compilation_reasons(count: int) -> list:
    """Dynamo's recorded reasons for its last ``count`` compiles (None for a first compile)."""
    records = list(_dynamo().utils.get_compilation_metrics())[-count:] if count > 0 else []
    return [getattr(m, "recompile_reason", None) for m in records]


def reset_dynamo() -> None:
    """Forget every compiled graph and dynamo's caches (``torch.compiler.reset``)."""
    torch.compiler.reset()


def is_compiled_module(module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns."""
    # By the class's name, not by importing dynamo or reading sys.modules: this runs inside
    # traced steps, where sys.modules may change under dynamo (another thread importing).
    cls = type(module)
    return cls.__name__ == "OptimizedModule" and cls.__module__ == "torch._dynamo.eval_frame"


def uncompiled_module(module):
    """The module a ``torch.compile`` wrapper holds (its parameters carry no ``_orig_mod.``), or ``module``."""
    while is_compiled_module(module):
        module = module._orig_mod
    return module


def graph_break_count() -> int:
    """Graph breaks dynamo has met in this process so far (its own counter)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _funcol():
    from torch.distributed import _functional_collectives

    return _functional_collectives


def all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """Traceable all-reduce of ``t`` (``"sum"``, ``"max"``...) over ``group``, waited for in eager code."""
    return _waited(_funcol().all_reduce(t, op, group))


def all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """Traceable all-gather of every rank's ``t`` along dim 0, waited for in eager code."""
    return _waited(_funcol().all_gather_single(t, 0, group))


def reduce_scatter(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """Traceable reduce-scatter along dim 0 (this rank's block of the reduction), waited for in eager code."""
    return _waited(_funcol().reduce_scatter_single(t, op, 0, group))


def _waited(t: torch.Tensor) -> torch.Tensor:
    # Eager: wait now. Views of an AsyncCollectiveTensor do not wait, so a result nobody
    # reads would leave its collective in flight and in funcol's work registry for the rest
    # of the run (draining in-flight work before the process exits is
    # pimm_fn.distributed.shutdown()'s). Compiled graphs wait in-graph.
    if not torch.compiler.is_compiling() and isinstance(t, _funcol().AsyncCollectiveTensor):
        return t.wait()
    return t


def backendless_mesh(device_type: str, world_size: int, rank: int):
    """A 1-D ``DeviceMesh`` of ``world_size`` ranks with no process group behind it: DTensors
    on it can be built, read and traced, but no collective can run over it.

    ``_dim_group_names`` is set empty, as torch's own meshes made with ``_init_backend=False``
    set it: dynamo reads it when it traces a DTensor, and a mesh without it fails to trace.
    """
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device_type, torch.arange(world_size), _init_backend=False, _rank=rank)
    if not hasattr(mesh, "_dim_group_names"):
        mesh._dim_group_names = []
    return mesh


def profiler_enabled() -> bool:
    """Whether the autograd profiler (``torch.profiler``) is recording."""
    return torch._C._autograd._profiler_enabled()


def graph_break_records(handler: logging.Handler):
    """A context sending dynamo's graph-break records (one per break, with the user stack)
    to ``handler`` instead of stderr; breaks already reported in this process are reported again."""
    from torch._dynamo import symbolic_convert, utils

    log = symbolic_convert.graph_break_log

    @contextlib.contextmanager
    def records():
        level, propagate = log.level, log.propagate
        utils.reset_graph_break_dup_checker()
        log.setLevel(logging.DEBUG)
        log.propagate = False
        log.addHandler(handler)
        try:
            yield
        finally:
            log.removeHandler(handler)
            log.setLevel(level)
            log.propagate = propagate
            utils.reset_graph_break_dup_checker()

    return records()


# ---------------------------------------------------------------------------------------
# Multi-tensor ("foreach") kernels, for the optimizers' eager update (written for torch 2.13).
#
# ``torch._foreach_*`` runs one op over a list of tensors in one call: on the CPU a C++
# loop of the same per-tensor kernels (so the same numbers as the op applied per tensor),
# on CUDA fused kernels. Over ~200 params a Python-level loop of small ops costs
# milliseconds of dispatch per op. Under ``torch.compile`` the wrappers emit the
# per-tensor ops instead: inductor fuses those into one element loop per leaf, where its
# foreach lowering kept more intermediates (a compiled MLP step's peak memory 6.1 -> 7.6 MiB).
# The pure transforms never write their inputs: the out-of-place forms make new tensors,
# and the in-place forms (trailing ``_``) are only for tensors the caller has just made
# (an allocation saved per op). A scalar may be a 0-dim tensor (a schedule's value, or a
# constant: on the CPU a Python number costs a tensor conversion per list element) or a
# number; ``other`` may also be a list, pairwise.
# ---------------------------------------------------------------------------------------
__all__ += ["foreach_add", "foreach_add_", "foreach_addcdiv", "foreach_addcdiv_", "foreach_addcmul_", "foreach_div_",
            "foreach_lerp", "foreach_maximum", "foreach_mul", "foreach_norm", "foreach_sqrt", "fused_adam_",
            "foreach_sub_", "is_plain_eager_tensor"]


def _each(xs: list, other) -> list:
    """``other`` per element of ``xs``: a list as given, anything else repeated."""
    return list(other) if isinstance(other, (list, tuple)) else [other] * len(xs)


def _tracing() -> bool:
    return torch.compiler.is_compiling()


def foreach_add(xs: list, other, *, alpha: float = 1.0) -> list:
    """``[x + alpha * y]``."""
    if not xs:
        return []
    if _tracing():
        return [torch.add(x, o, alpha=alpha) for x, o in zip(xs, _each(xs, other))]
    if isinstance(other, torch.Tensor):
        other = [other] * len(xs)  # the tensor-scalar overload copies it once per element on the CPU
    if isinstance(other, (list, tuple)):
        return list(torch._foreach_add(xs, other, alpha=alpha))
    return list(torch._foreach_add(xs, other * alpha))


def foreach_mul(xs: list, other) -> list:
    """``[x * other]``."""
    if not xs:
        return []
    if _tracing():
        return [torch.mul(x, o) for x, o in zip(xs, _each(xs, other))]
    return list(torch._foreach_mul(xs, other))


def foreach_lerp(xs: list, ys: list, weight) -> list:
    """``[torch.lerp(x, y, weight)]``: ``weight`` a 0-dim tensor (torch.lerp's tensor-weight
    kernel, as the per-tensor call with that tensor) or a number."""
    if not xs:
        return []
    if _tracing():
        return [torch.lerp(x, y, weight) for x, y in zip(xs, ys)]
    if isinstance(weight, torch.Tensor):
        return list(torch._foreach_lerp(xs, ys, [weight] * len(xs)))
    return list(torch._foreach_lerp(xs, ys, weight))


def foreach_sqrt(xs: list) -> list:
    """``[x.sqrt()]``."""
    if not xs:
        return []
    return [torch.sqrt(x) for x in xs] if _tracing() else list(torch._foreach_sqrt(xs))


def foreach_maximum(xs: list, ys: list) -> list:
    """``[torch.maximum(x, y)]`` pairwise."""
    if not xs:
        return []
    return [torch.maximum(x, y) for x, y in zip(xs, ys)] if _tracing() else list(torch._foreach_maximum(xs, ys))


def foreach_norm(xs: list, ord: float = 2.0, dtype: torch.dtype | None = None) -> list:
    """``[torch.linalg.vector_norm(x, ord, dtype=dtype)]`` (0-dim tensors)."""
    if not xs:
        return []
    if _tracing():
        return [torch.linalg.vector_norm(x, ord, dtype=dtype) for x in xs]
    return list(torch._foreach_norm(xs, ord, dtype=dtype))


def foreach_addcdiv(xs: list, t1: list, t2: list, *, value: float = 1.0) -> list:
    """``[x + value * a / b]`` (new tensors); rounding as :func:`foreach_addcdiv_`."""
    if not xs:
        return []
    if _tracing():
        return [torch.addcdiv(x, a, b, value=value) for x, a, b in zip(xs, t1, t2)]
    return list(torch._foreach_addcdiv(xs, t1, t2, value=value))


def foreach_add_(xs: list, other, *, alpha: float = 1.0) -> list:
    """In place on ``xs`` (tensors the caller made): ``x += alpha * other``; returns ``xs``."""
    if not xs:
        return xs
    if _tracing():
        for x, o in zip(xs, _each(xs, other)):
            x.add_(o, alpha=alpha)
    elif isinstance(other, (list, tuple, torch.Tensor)):
        torch._foreach_add_(xs, _each(xs, other), alpha=alpha)  # a tensor as a list: as in foreach_add
    else:
        torch._foreach_add_(xs, other * alpha)
    return xs


def foreach_sub_(xs: list, ys: list) -> list:
    """In place on ``xs`` (tensors the caller made): ``x -= y`` pairwise; returns ``xs``."""
    if not xs:
        return xs
    if _tracing():
        for x, y in zip(xs, ys):
            x.sub_(y)
    else:
        torch._foreach_sub_(xs, ys)
    return xs


def foreach_div_(xs: list, other) -> list:
    """In place on ``xs`` (tensors the caller made): ``x /= other``; returns ``xs``."""
    if not xs:
        return xs
    if _tracing():
        for x, o in zip(xs, _each(xs, other)):
            x.div_(o)
    else:
        torch._foreach_div_(xs, other)
    return xs


def foreach_addcmul_(xs: list, t1: list, t2: list, *, value: float = 1.0) -> list:
    """In place on ``xs`` (tensors the caller made): ``x += value * a * b``; returns ``xs``."""
    if not xs:
        return xs
    if _tracing():
        for x, a, b in zip(xs, t1, t2):
            x.addcmul_(a, b, value=value)
    else:
        torch._foreach_addcmul_(xs, t1, t2, value=value)
    return xs


def foreach_addcdiv_(xs: list, t1: list, t2: list, *, value: float = 1.0) -> list:
    """In place on ``xs`` (tensors the caller made): ``x += value * a / b``; returns ``xs``.
    One kernel: ``(value * a) / b`` then ``+ x``, each rounded to the dtype in float32 and
    float64 (as the three separate ops round); float16/bfloat16 round only at the end."""
    if not xs:
        return xs
    if _tracing():
        for x, a, b in zip(xs, t1, t2):
            x.addcdiv_(a, b, value=value)
    else:
        torch._foreach_addcdiv_(xs, t1, t2, value=value)
    return xs


def fused_adam_(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, max_exp_avg_sqs: list,
                step: float, *, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float,
                amsgrad: bool, decoupled: bool) -> None:
    """torch's fused Adam / AdamW kernel (``torch.optim.Adam[W](fused=True)``), eager only:
    ``params``, the moments (and ``max_exp_avg_sqs`` with ``amsgrad``) updated in place, one
    pass over each tensor; ``grads`` only read. ``step``: the incremented step count, as
    torch's float32 step tensors hold it."""
    steps = [torch.tensor(step, dtype=torch.float32)] * len(params)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
           weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=False)


def is_plain_eager_tensor(t) -> bool:
    """Whether ``t``'s value may be read on the host right now: a plain ``torch.Tensor``
    (no FakeTensor, DTensor or other subclass), outside ``torch.compile``/export tracing
    and outside functorch transforms (vmap, grad), whose wrapped tensors hold no one value."""
    return (type(t) is torch.Tensor and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active())
