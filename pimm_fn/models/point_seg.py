"""A compact point-cloud segmentation net: per-point MLPs with voxel-neighbourhood context.

Each stage groups points into voxels of a growing stride (``grid_coord // stride``, per
cloud), describes every point by its offset from its voxel's centroid (local geometry),
runs a shared MLP, max-pools the features over the voxel and concatenates the pooled
context back onto every point. The head sees every stage's features (U-Net-style skips),
so each point knows its own features and its neighbourhoods at several scales.

Everything stays at the point resolution: a voxel's pooled row lives in a table with
one row per point (row = the voxel's rank among the sorted voxel keys), so every shape is
the point count N. No data-dependent output size, no ``.item()``, no host branch: the
net compiles with ``torch.compile(fullgraph=True)`` and a dynamic point dimension.

The default pooling scatters (``index_add``, ``scatter_reduce``); their backward adds into
shared rows in thread order, so on more than one thread two runs differ in the last bits.
``PointSegNet(..., deterministic=True)`` pools with :func:`segment_pool` instead (sort by
segment once, then sorted segment reductions forward and backward): bitwise repeatable.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn

from ._common import classification_outputs, make_norm


def batch_index(offset: torch.Tensor, num_points: int) -> torch.Tensor:
    """The cloud id of every point, from Pointcept's ``offset`` (exclusive cumulative ends).

    offset: [B] int64, e.g. [n0, n0+n1, ...]; num_points: N (may be a symbolic size).
    """
    points = torch.arange(num_points, device=offset.device, dtype=offset.dtype)
    return torch.searchsorted(offset, points, right=True)


def _voxel_key(grid_coord: torch.Tensor, batch: torch.Tensor, stride: int) -> torch.Tensor:
    """An exact int64 key per point for its (cloud, voxel of ``grid_coord // stride``).

    Mixed radix over each axis's extent, not a hash, so distinct voxels never collide.
    """
    g = torch.div(grid_coord, stride, rounding_mode="floor")
    g = g - g.min(dim=0).values  # non-negative digits for the mixed-radix key
    extent = g.max(dim=0).values + 1
    return ((batch * extent[0] + g[:, 0]) * extent[1] + g[:, 1]) * extent[2] + g[:, 2]


def voxel_groups(grid_coord: torch.Tensor, batch: torch.Tensor, stride: int) -> torch.Tensor:
    """Group points by (cloud, voxel of ``grid_coord // stride``): a group id in [0, N) per point.

    Ids are the rank of the voxel among the sorted voxel keys, so a table with N rows
    holds every group; rows past the number of voxels stay unused. The key is exact
    (mixed radix over each axis's extent), not a hash, so distinct voxels never collide.
    Sort + cumsum instead of ``torch.unique(return_inverse=True)`` keeps every size
    equal to N, which compiles without data-dependent (unbacked) sizes.
    """
    sorted_key, perm = torch.sort(_voxel_key(grid_coord, batch, stride))
    starts = torch.ones_like(sorted_key, dtype=torch.bool)
    starts = torch.cat([starts[:1], sorted_key[1:] != sorted_key[:-1]])
    rank_sorted = torch.cumsum(starts.to(torch.int64), dim=0) - 1
    return torch.empty_like(rank_sorted).scatter(0, perm, rank_sorted)


class Segments(NamedTuple):
    """Points grouped into segments, with the sort that makes every segment contiguous.

    group: [N] segment id of each point (as :func:`voxel_groups`), in [0, N).
    perm: [N] the points in segment order (a stable sort by key: ``x[perm]`` lists
        segment 0's points first, then segment 1's, ...).
    lengths: [N] points per segment id; ids past the number of segments have 0.
    """

    group: torch.Tensor
    perm: torch.Tensor
    lengths: torch.Tensor


def segments(key: torch.Tensor) -> Segments:
    """:class:`Segments` of the points with equal ``key`` [N] int64 (sorted once, reused).

    Every size is N (no ``unique``), so this compiles with a dynamic point count. The
    only scatters are integer ones (exact in any order) and a permutation.
    """
    sorted_key, perm = torch.sort(key, stable=True)
    starts = torch.cat([torch.ones_like(sorted_key[:1], dtype=torch.bool), sorted_key[1:] != sorted_key[:-1]])
    rank = torch.cumsum(starts.to(torch.int64), dim=0) - 1
    group = torch.empty_like(rank).scatter(0, perm, rank)
    lengths = torch.zeros_like(rank).scatter_add(0, rank, torch.ones_like(rank))
    return Segments(group, perm, lengths)


def voxel_segments(grid_coord: torch.Tensor, batch: torch.Tensor, stride: int) -> Segments:
    """:func:`voxel_groups` as :class:`Segments`, for the deterministic reductions."""
    return segments(_voxel_key(grid_coord, batch, stride))


def _segment_sum(x_sorted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-segment sums of rows already in segment order, one segment after the other."""
    return torch.segment_reduce(x_sorted, "sum", lengths=lengths, axis=0, unsafe=True)


class _SegmentPool(torch.autograd.Function):
    """Per-point mean / max over segments, forward and backward by sorted segment reductions.

    The autograd backward of ``table[group]`` (a many-to-one gather) is a scatter-add, which
    sums in thread order on more than one thread. Here every sum, forward and backward, adds
    one segment's rows in sorted order (``torch.segment_reduce``); the gathers left are
    plain reads. The backward is written out (not left to ``segment_reduce``'s own, which
    gives each of k tied maxima the whole gradient when they are not adjacent): a tie of k
    maxima shares the gradient equally, as ``scatter_reduce(reduce="amax")`` does.
    """

    @staticmethod
    def forward(x, group, perm, lengths, reduce):
        xs = x.index_select(0, perm)
        if reduce == "mean":
            table = _segment_sum(xs, lengths) / lengths.clamp_min(1).to(x.dtype).unsqueeze(1)
        else:
            table = torch.segment_reduce(xs, "max", lengths=lengths, axis=0, unsafe=True)
        return table.index_select(0, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, group, perm, lengths, reduce = inputs
        ctx.reduce = reduce
        ctx.save_for_backward(x, group, perm, lengths, output if reduce == "max" else None)

    @staticmethod
    def backward(ctx, grad):
        x, group, perm, lengths, out = ctx.saved_tensors
        total = _segment_sum(grad.index_select(0, perm), lengths)  # d loss / d table
        if ctx.reduce == "mean":
            dx = (total / lengths.clamp_min(1).to(total.dtype).unsqueeze(1)).index_select(0, group)
        else:
            tie = x == out  # the rows that hold their segment's max
            ties = _segment_sum(tie.to(grad.dtype).index_select(0, perm), lengths).clamp_min(1.0)
            dx = torch.where(tie, (total / ties).index_select(0, group), torch.zeros_like(grad))
        return dx, None, None, None, None


def segment_pool(x: torch.Tensor, seg: Segments, reduce: str) -> torch.Tensor:
    """Per-point ``reduce`` ("mean" or "max") of ``x`` [N, C] over its segment, bitwise repeatable.

    Forward and backward add each segment's values in one fixed (sorted) order, never
    through atomic scatters, so the result and the gradients are the same bits on every
    run, on any number of threads, eager or compiled. Equals :func:`group_mean` /
    :func:`group_max` (gradients too, ties shared equally) up to float rounding.
    """
    if reduce not in ("mean", "max"):
        raise ValueError(f"reduce must be 'mean' or 'max', got {reduce!r}")
    return _SegmentPool.apply(x, seg.group, seg.perm, seg.lengths, reduce)


def group_mean(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Per-point mean of ``x`` [N, C] over its group (gathered back to [N, C])."""
    n = x.shape[0]
    # In-place adds into fresh tables: pure towards the inputs, and no copy of the zeros.
    total = x.new_zeros(n, x.shape[1]).index_add_(0, group, x)
    count = x.new_zeros(n).index_add_(0, group, torch.ones_like(x[:, 0]))
    return (total / count.clamp_min(1.0).unsqueeze(1))[group]


def group_max(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Per-point max of ``x`` [N, C] over its group (gathered back to [N, C])."""
    index = group.unsqueeze(1).expand_as(x)
    pooled = x.new_zeros(x.shape).scatter_reduce(0, index, x, reduce="amax", include_self=False)
    return pooled[group]


class _Dense(nn.Sequential):
    """Linear -> norm -> ReLU over [N, C] rows."""

    def __init__(self, cin: int, cout: int, norm: str):
        super().__init__(nn.Linear(cin, cout, bias=(norm == "none")), make_norm(norm, cout), nn.ReLU(inplace=False))


class _VoxelStage(nn.Module):
    """One scale: local offsets -> shared MLP -> voxel max-pool -> fuse point and context."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str, pool: str, deterministic: bool = False):
        super().__init__()
        self.stride, self.reduce, self.deterministic = stride, pool, deterministic
        self.pool = group_max if pool == "max" else group_mean
        self.point = _Dense(cin + 3, cout, norm)
        self.fuse = _Dense(2 * cout, cout, norm)

    def forward(self, h, coord, grid_coord, batch):
        if self.deterministic:
            seg = voxel_segments(grid_coord, batch, self.stride)
            mean = lambda x: segment_pool(x, seg, "mean")  # noqa: E731
            pool = lambda x: segment_pool(x, seg, self.reduce)  # noqa: E731
        else:
            group = voxel_groups(grid_coord, batch, self.stride)
            mean = lambda x: group_mean(x, group)  # noqa: E731
            pool = lambda x: self.pool(x, group)  # noqa: E731
        # Offset from the voxel centroid: the neighbourhood's shape as seen from this point.
        local = coord - mean(coord)
        h = self.point(torch.cat([h, local], dim=1))
        return self.fuse(torch.cat([h, pool(h)], dim=1))


class PointSegNet(nn.Module):
    """Semantic segmentation of point batches: ``model(batch) -> {"seg_logits", ["loss", "acc"]}``.

    Args:
        in_channels: channels of ``batch["feat"]``.
        num_classes: number of semantic classes.
        width: channels of the first stage; stage i has ``width * widen[i]``.
        strides: voxel strides (in ``grid_coord`` units) of the stages, finest first.
        widen: per-stage width multipliers (default 1, 2, 2, ... for the given strides).
        norm: "batch" (BatchNorm1d over points, as Pointcept nets), "layer" or "none".
        pool: "max" (PointNet-style) or "mean" neighbourhood pooling.
        class_weights: optional [num_classes] cross-entropy weights.
        ignore_index: label of unlabelled points (Pointcept: -1).
        deterministic: pool with sort-based segment reductions (:func:`segment_pool`)
            instead of ``index_add`` / ``scatter_reduce``, whose backward (a scatter-add)
            sums in thread order: the step is then bitwise repeatable on any number of
            CPU threads (exact resume without ``OMP_NUM_THREADS=1``), at some cost in speed
            (``benchmarks/deterministic.py``). Same parameters either way, so a checkpoint
            loads in both modes.

    Batch keys: coord [N,3] float, grid_coord [N,3] int64, feat [N,C] float, offset [B]
    int64 (cumulative ends); segment [N] int64 for training / evaluation with labels.
    Outputs: seg_logits [N, num_classes]; with ``segment``: loss (mean over labelled
    points, 0 when none is) and acc (labelled-point accuracy, logged as a metric).
    """

    label_key = "segment"  # the batch entry its loss is computed from

    def __init__(self, in_channels: int, num_classes: int, width: int = 32,
                 strides: Sequence[int] = (2, 4, 8), widen: Optional[Sequence[int]] = None,
                 norm: str = "batch", pool: str = "max", class_weights: Optional[Sequence[float]] = None,
                 ignore_index: int = -1, deterministic: bool = False):
        super().__init__()
        if pool not in ("max", "mean"):
            raise ValueError(f"pool must be 'max' or 'mean', got {pool!r}")
        strides = tuple(int(s) for s in strides)
        if not strides or any(s < 1 for s in strides):
            raise ValueError(f"strides must be a non-empty sequence of positive ints, got {strides}")
        widen = tuple(widen) if widen is not None else (1,) + (2,) * (len(strides) - 1)
        if len(widen) != len(strides):
            raise ValueError(f"widen has {len(widen)} entries but strides has {len(strides)}; give one per stage")
        self.in_channels, self.num_classes, self.ignore_index = in_channels, num_classes, ignore_index
        self.deterministic = bool(deterministic)
        self.stem = _Dense(in_channels + 3, width, norm)
        stages, cin = [], width
        for s, m in zip(strides, widen):
            stages.append(_VoxelStage(cin, width * m, s, norm, pool, self.deterministic))
            cin = width * m
        self.stages = nn.ModuleList(stages)
        skip = width + sum(width * m for m in widen)
        self.head = nn.Sequential(_Dense(skip, 2 * width, norm), nn.Linear(2 * width, num_classes))
        if class_weights is not None:
            w = torch.as_tensor(class_weights, dtype=torch.float32)
            if w.shape != (num_classes,):
                raise ValueError(f"class_weights needs {num_classes} entries, got shape {tuple(w.shape)}")
            self.register_buffer("class_weights", w)
        else:
            self.class_weights = None

    def features(self, batch: dict) -> torch.Tensor:
        """Per-point features [N, C] before the classifier (shared with the policies)."""
        coord, grid_coord, feat = batch["coord"], batch["grid_coord"], batch["feat"]
        if feat.shape[1] != self.in_channels:
            raise ValueError(f"batch['feat'] has {feat.shape[1]} channels, PointSegNet was built with "
                             f"in_channels={self.in_channels}")
        points = batch_index(batch["offset"], coord.shape[0])
        # Coordinates centred per cloud: translation-invariant, yet the stem sees layout.
        if self.deterministic:
            centred = coord - segment_pool(coord, segments(points), "mean")
        else:
            centred = coord - group_mean(coord, points)
        h = self.stem(torch.cat([feat, centred], dim=1))
        skips = [h]
        for stage in self.stages:
            h = stage(h, coord, grid_coord, points)
            skips.append(h)
        return self.head[0](torch.cat(skips, dim=1))

    def forward(self, batch: dict) -> dict:
        logits = self.head[1](self.features(batch))
        return classification_outputs(logits, batch, "segment", "seg_logits",
                                      ignore_index=self.ignore_index, weight=self.class_weights)
