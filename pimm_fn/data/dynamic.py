"""Variable point counts under ``torch.compile``: mark the point dim dynamic, or pad to buckets.

Without help dynamo compiles a point step twice: static for the first point count, then
symbolic from the second (automatic dynamic shapes). ``mark_point_dims_dynamic`` makes the
point dims symbolic before the first call, so it compiles once. Padding to buckets saves
nothing under automatic dynamic shapes (the padded dim turns symbolic at the second
bucket); it suits only ``dynamic=False`` for a backend that needs static shapes (CUDA
graphs, shape-specialised kernels), at one compile per bucket plus the padded compute.
The compile counts are in benchmarks/README.md ("Variable point counts").
On torch 2.13 ``mark_dynamic(t, 0, min=2)`` without ``max`` crashes inside dynamo, so
bounds are passed only in pairs.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Sequence

import torch

from .. import torch_compat


def _point_count(batch: Mapping) -> int:
    if "coord" in batch:
        return int(batch["coord"].shape[0])
    if "offset" in batch:
        return int(batch["offset"][-1])
    raise KeyError("a point batch needs 'coord' or 'offset' to know its point count")


def mark_point_dims_dynamic(batch: Mapping, min_points: Optional[int] = None,
                            max_points: Optional[int] = None) -> Mapping:
    """Mark dim 0 of every per-point tensor (leading dim == point count) dynamic.

    Call it on a batch before passing it to a compiled function; returns the batch
    (the marks are set on the tensors themselves). ``min_points`` is the lower bound of
    min_points / max_points: optional bounds of the symbolic size, passed only when both
    are given: on torch 2.13 ``mark_dynamic(t, 0, min=2)`` without ``max`` fails inside
    dynamo ("not simple sympy type NoneType").
    """
    bounds = {} if min_points is None or max_points is None else {"min": min_points, "max": max_points}
    n = _point_count(batch)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n and key != "offset":
            torch_compat.mark_dynamic(value, 0, **bounds)
        elif isinstance(value, Mapping):
            mark_point_dims_dynamic(value, min_points, max_points)
    return batch


def bucket_size(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (ValueError when n exceeds the largest)."""
    for b in sorted(buckets):
        if n <= b:
            return int(b)
    raise ValueError(f"{n} points exceed the largest bucket {max(buckets)}; add a larger bucket")


def pad_points_to_bucket(batch: Mapping, buckets: Sequence[int], ignore_index: int = -1) -> dict:
    """Pad every per-point tensor to the next bucket size; adds ``point_mask`` [M] bool.

    Padded rows are zeros (``segment`` / ``instance`` get ``ignore_index``, so a loss
    with that ignore index skips them). ``offset`` is unchanged: it still ends at the real
    point count, so per-cloud pooling must use ``point_mask`` or only the first
    ``offset[-1]`` rows.
    """
    n = _point_count(batch)
    m = bucket_size(n, buckets)
    out = dict(batch)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n and key != "offset":
            fill = ignore_index if key in ("segment", "instance") else 0
            pad = value.new_full((m - n, *value.shape[1:]), fill)
            out[key] = torch.cat([value, pad], dim=0)
    mask = torch.zeros(m, dtype=torch.bool)
    mask[:n] = True
    out["point_mask"] = mask
    return out
