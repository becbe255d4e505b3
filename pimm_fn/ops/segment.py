"""Segment reductions over CSR offsets (torch_scatter's ``segment_csr``), in plain torch.

torch_scatter's kernels have no fake implementation, so a step calling them cannot compile
whole; these are written with ``searchsorted``, ``index_add`` and ``scatter_reduce``, which
trace with symbolic (even unbacked) sizes and carry autograd, so no custom op is needed.

Semantics follow torch_scatter: segment ``i`` is ``src[indptr[i]:indptr[i+1]]``; rows of
``src`` outside ``[indptr[0], indptr[-1])`` take part in no segment; an empty segment
reduces to 0 with every reduction. For max and min the gradient goes to one row per
segment and feature, the first that attains the extreme (torch_scatter's ``arg``), not
shared among ties.
"""
from __future__ import annotations

import torch

__all__ = ["segment_csr", "segment_max_csr", "segment_min_csr"]

_REDUCTIONS = ("sum", "add", "mean", "max", "min")


def segment_csr(src: torch.Tensor, indptr: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
    """Reduce ``src`` [E, ...] over dim 0 in the segments of ``indptr`` [S+1]: [S, ...].

    reduce: "sum" (alias "add"), "mean", "max" or "min". Empty segments give 0. Like
    torch_scatter's top-level ``segment_csr``, only the values are returned; use
    :func:`segment_max_csr` / :func:`segment_min_csr` for the arg indices as well.
    In eager mode ``indptr`` is checked (non-decreasing, within ``src``); a compiled step
    skips the check, which would read its values on the host.
    """
    if reduce not in _REDUCTIONS:
        raise ValueError(f"segment_csr: reduce must be one of {_REDUCTIONS}, got {reduce!r}")
    if reduce in ("max", "min"):
        return _segment_extreme(src, indptr, reduce)[0]
    ids, _ = _segment_ids(src, indptr)
    num_segments = indptr.shape[0] - 1
    # One extra row collects the rows outside every segment; it is dropped after.
    total = src.new_zeros((num_segments + 1, *src.shape[1:])).index_add(0, ids, src)[:num_segments]
    if reduce == "mean":
        counts = (indptr[1:] - indptr[:-1]).clamp(min=1).view(-1, *([1] * (src.dim() - 1)))
        if total.dtype.is_floating_point or total.dtype.is_complex:
            total = total / counts.to(total.dtype)
        else:  # integers keep their dtype, rounding toward zero as C++ division (torch_scatter) does
            total = torch.div(total, counts, rounding_mode="trunc").to(total.dtype)
    return total


def segment_max_csr(src: torch.Tensor, indptr: torch.Tensor):
    """``(values, arg)`` of the segment max: arg [S, ...] holds the row of ``src`` each
    value came from (the first one on a tie) and ``src.shape[0]`` for an empty segment."""
    return _segment_extreme(src, indptr, "max")


def segment_min_csr(src: torch.Tensor, indptr: torch.Tensor):
    """``(values, arg)`` of the segment min; see :func:`segment_max_csr`."""
    return _segment_extreme(src, indptr, "min")


def _segment_ids(src: torch.Tensor, indptr: torch.Tensor):
    """Each row's segment (``S`` for rows outside every segment) and the number of rows E."""
    if not isinstance(src, torch.Tensor) or not isinstance(indptr, torch.Tensor):
        raise TypeError("segment_csr: src and indptr must be tensors, got "
                        f"{type(src).__name__} and {type(indptr).__name__}")
    if src.dim() < 1:
        raise ValueError("segment_csr: src needs a leading dim to reduce over; got a 0-dim tensor")
    if indptr.dim() != 1 or indptr.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"segment_csr: indptr must be a 1-D int64 or int32 tensor [S+1] (CSR offsets, "
                         f"starting at 0 for the usual case); got {indptr.dim()}-D {indptr.dtype}")
    if indptr.shape[0] < 1:
        raise ValueError("segment_csr: indptr needs at least one entry (S+1 offsets for S segments)")
    if indptr.device != src.device:
        raise ValueError(f"segment_csr: indptr is on {indptr.device} and src on {src.device}; move one")
    if not torch.compiler.is_compiling():
        _check_offsets(indptr, src.shape[0])
    indptr = indptr.long()
    num_segments = indptr.shape[0] - 1
    rows = torch.arange(src.shape[0], device=src.device)
    # Row p belongs to the last segment starting at or before it: empty segments, which
    # share their start with the next one, receive no rows.
    # Rows before indptr[0] get -1 and rows from indptr[-1] on get S: both go to row S.
    ids = torch.searchsorted(indptr, rows, right=True) - 1
    return torch.where(ids >= 0, ids, num_segments), src.shape[0]


def _check_offsets(indptr: torch.Tensor, rows: int) -> None:
    if indptr.numel() > 1 and bool((indptr[1:] < indptr[:-1]).any()):
        raise ValueError(f"segment_csr: indptr must be non-decreasing (CSR offsets), got {indptr.tolist()[:20]}")
    if indptr.numel() and (int(indptr[0]) < 0 or int(indptr[-1]) > rows):
        raise ValueError(f"segment_csr: indptr spans rows [{int(indptr[0])}, {int(indptr[-1])}) but src has "
                         f"{rows} rows; the offsets must lie in [0, {rows}]")


def _segment_extreme(src: torch.Tensor, indptr: torch.Tensor, reduce: str):
    ids, rows = _segment_ids(src, indptr)
    num_segments = indptr.shape[0] - 1
    feature_shape = src.shape[1:]
    wide = ids.view(-1, *([1] * len(feature_shape))).expand(src.shape)
    # The extreme itself needs no gradient: it only picks which row each output reads.
    plain = src.detach()
    extreme = torch.full((num_segments + 1, *feature_shape), _lowest(src.dtype, reduce == "max"),
                         dtype=src.dtype, device=src.device)
    extreme = extreme.scatter_reduce(0, wide, plain, "amax" if reduce == "max" else "amin", include_self=True)
    # The first row attaining it; empty segments keep `rows`, which reads the zero row below.
    position = torch.arange(rows, device=src.device).view(-1, *([1] * len(feature_shape))).expand(src.shape)
    hit = plain == extreme.gather(0, wide)
    arg = torch.full((num_segments + 1, *feature_shape), rows, dtype=torch.long, device=src.device)
    arg = arg.scatter_reduce(0, wide, torch.where(hit, position, rows), "amin", include_self=True)[:num_segments]
    # Gathering from src (plus one zero row) carries the gradient to the chosen rows only.
    padded = torch.cat([src, src.new_zeros((1, *feature_shape))])
    return padded.gather(0, arg), arg


def _lowest(dtype: torch.dtype, for_max: bool):
    """The identity of max (or min) in ``dtype``."""
    if dtype.is_floating_point:
        return float("-inf") if for_max else float("inf")
    if dtype == torch.bool:
        return not for_max
    info = torch.iinfo(dtype)
    return info.min if for_max else info.max
