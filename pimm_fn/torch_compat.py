"""The torch internals pimm_fn's compile path relies on, in one place (written for torch 2.13).

Everything here reaches below torch's documented surface (dynamo's dim markings and
shape-environment settings); when torch moves them, this module is the one to change.
"""
from __future__ import annotations

import torch
import torch._dynamo
import torch.fx.experimental._config as _shape_config
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, guard_or_true

__all__ = ["clear_unbacked", "guard_or_true", "is_data_dependent_error", "mark_backed", "mark_unbacked",
           "set_duck_shaping"]

TORCH_VERSION_WRITTEN_FOR = "2.13"


def mark_unbacked(t: torch.Tensor, dim: int, min: int = 2) -> None:
    """Trace ``t.shape[dim]`` as an unknown size of at least ``min``: one graph for every size.

    No guard is ever put on an unbacked size (a backed one collects guards such as
    inductor's ``size <= 4096`` choice of reduction, which recompile when a later batch
    crosses them); code that branches on the size fails to trace instead.
    """
    torch._dynamo.decorators.mark_unbacked(t, dim, min=min)


def clear_unbacked(t: torch.Tensor) -> None:
    """Undo :func:`mark_unbacked` on ``t`` (dynamo keeps the marks as tensor attributes)."""
    for name in ("_dynamo_unbacked_indices", "_dynamo_unbacked_bounds", "_specialize_on", "_dynamo_hint_overrides"):
        if hasattr(t, name):
            delattr(t, name)


def mark_backed(t: torch.Tensor, dim: int) -> None:
    """Trace ``t.shape[dim]`` as a symbolic size with guards (dynamo may still specialise it)."""
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
