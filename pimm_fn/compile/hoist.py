"""Per-step scalars computed once per step in compiled code, not once per vector of a leaf.

Inductor inlines a cheap 0-dim pointwise value into every kernel that reads it. A
per-step scalar (the scheduled lr, Adam's bias corrections, the clip coefficient, the
finite flag) is then recomputed inside each leaf's element loop. Since the loop stores
through pointers that may alias the scalar's inputs, gcc cannot hoist the recomputation
out of it (benchmarks/README.md, "Per-step scalars hoisted").

:func:`hoist` makes inductor store the value in a buffer (a reduction over two copies of
it: reductions are always realized), so the element loops load it instead.
"""
from __future__ import annotations

import torch

__all__ = ["hoist"]


def hoist(x: torch.Tensor) -> torch.Tensor:
    """``x`` (a 0-dim tensor), stored once per compiled step rather than recomputed per element.

    Exact: the max of ``x`` and ``x`` is ``x`` itself, including -0.0 and NaN. Eager code
    gets ``x`` back untouched, so it pays nothing.
    """
    if not torch.compiler.is_compiling():
        return x
    pair = torch.stack((x, x))
    return pair.any(0) if x.dtype == torch.bool else pair.amax(0)
