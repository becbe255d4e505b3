"""The torch internals pimm_fn's compile path relies on, in one place (written for torch 2.13).

Everything here reaches below torch's documented surface (dynamo's dim markings and
shape-environment settings); when torch moves them, this module is the one to change.
"""
from __future__ import annotations

import sys

import torch
import torch.fx.experimental._config as _shape_config
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, guard_or_true

__all__ = ["clear_unbacked", "graph_break_count", "guard_or_true", "is_compiled_module", "is_data_dependent_error",
           "graph_break_records", "mark_backed", "mark_unbacked", "recompile_limit", "set_duck_shaping",
           "uncompiled_module"]

TORCH_VERSION_WRITTEN_FOR = "2.13"

# Dynamo is imported where it is used: pimm_fn's core modules import this one, and
# `import pimm_fn` must not load the compiler (~1 s).


def mark_unbacked(t: torch.Tensor, dim: int, min: int = 2) -> None:
    """Trace ``t.shape[dim]`` as an unknown size of at least ``min``: one graph for every size.

    No guard is ever put on an unbacked size (a backed one collects guards such as
    inductor's ``size <= 4096`` choice of reduction, which recompile when a later batch
    crosses them); code that branches on the size fails to trace instead.
    """
    import torch._dynamo

    torch._dynamo.decorators.mark_unbacked(t, dim, min=min)


def clear_unbacked(t: torch.Tensor) -> None:
    """Undo :func:`mark_unbacked` on ``t`` (dynamo keeps the marks as tensor attributes)."""
    for name in ("_dynamo_unbacked_indices", "_dynamo_unbacked_bounds", "_specialize_on", "_dynamo_hint_overrides"):
        if hasattr(t, name):
            delattr(t, name)


def mark_backed(t: torch.Tensor, dim: int) -> None:
    """Trace ``t.shape[dim]`` as a symbolic size with guards (dynamo may still specialise it)."""
    import torch._dynamo

    torch._dynamo.maybe_mark_dynamic(t, dim)


def is_data_dependent_error(err: BaseException) -> bool:
    """Whether tracing failed because code asked for the value of an unbacked size."""
    while err is not None:
        if isinstance(err, GuardOnDataDependentSymNode) or "data-dependent" in str(err).split("\n")[0]:
            return True
        err = err.__cause__
    return False


def set_duck_shaping(enabled: bool) -> None:
    """Duck shaping gives equal input sizes one symbol (and a guard that they stay equal)."""
    _shape_config.use_duck_shape = enabled


def is_compiled_module(module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns."""
    if "torch._dynamo" not in sys.modules:  # no wrapper can exist before dynamo is loaded
        return False
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def uncompiled_module(module):
    """The module a ``torch.compile`` wrapper holds (its parameters carry no ``_orig_mod.``), or ``module``."""
    while is_compiled_module(module):
        module = module._orig_mod
    return module


def graph_break_count() -> int:
    """Graph breaks dynamo has met in this process so far (its own counter)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def recompile_limit(limit):
    """A context with dynamo's per-frame recompile limit set to ``limit`` (None: unchanged)."""
    import contextlib

    if limit is None:
        return contextlib.nullcontext()
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=int(limit))


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
            "foreach_lerp", "foreach_maximum", "foreach_mul", "foreach_mul_", "foreach_norm", "foreach_sqrt",
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


def foreach_mul_(xs: list, other) -> list:
    """In place on ``xs`` (tensors the caller made): ``x *= other``; returns ``xs``."""
    if not xs:
        return xs
    if _tracing():
        for x, o in zip(xs, _each(xs, other)):
            x.mul_(o)
    else:
        torch._foreach_mul_(xs, other)
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


def is_plain_eager_tensor(t) -> bool:
    """Whether ``t``'s value may be read on the host right now: a plain ``torch.Tensor``
    (no FakeTensor, DTensor or other subclass), outside ``torch.compile``/export tracing
    and outside functorch transforms (vmap, grad), whose wrapped tensors hold no one value."""
    return (type(t) is torch.Tensor and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active())


def graph_break_records(handler):
    """A context sending dynamo's graph-break records (one per break, with the user stack)
    to ``handler`` instead of stderr; breaks already reported in this process are reported again."""
    import contextlib
    import logging

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
