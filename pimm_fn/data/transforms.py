"""Point transforms as pure functions ``t(sample, generator) -> new sample``.

Each factory returns a transform; a transform never mutates its input dict or tensors
and draws randomness only from the explicit ``torch.Generator`` it is given (the loader
seeds one per (seed, epoch, sample index), which makes augmentation resumable).
Per-point keys are those whose leading dim equals ``len(coord)``; evaluation keys
(``origin_*``, ``inverse``) are left alone.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .._validate import check_int

Sample = dict
Transform = Callable[[Sample, torch.Generator], Sample]


def _t(x):
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def _is_point_key(key: str, value, n: int) -> bool:
    return (
        isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n
        and not key.startswith("origin_") and key not in ("inverse", "offset")
    )


def to_tensors(sample: Sample, g: Optional[torch.Generator] = None) -> Sample:
    """numpy arrays -> tensors (a transform, so it can head a compose)."""
    return {k: _t(v) for k, v in sample.items()}


def select_points(sample: Sample, index: torch.Tensor) -> Sample:
    """Keep the points ``index`` (a long index or bool mask) in every per-point key.

    An ``inverse`` (grid_sample's test mode: each original point's kept point) follows the
    points it names; a selection that drops one of them is refused, since original points
    would then map to no prediction."""
    sample = to_tensors(sample)
    n = sample["coord"].shape[0]
    out = {k: (v[index] if _is_point_key(k, v, n) else v) for k, v in sample.items()}
    if "inverse" in sample:
        kept = torch.arange(n)[index]
        position = torch.full((n,), -1, dtype=torch.int64)
        position[kept] = torch.arange(kept.numel())
        inverse = position[_t(sample["inverse"])]
        if (inverse < 0).any():
            raise ValueError(
                f"dropping points after grid_sample(mode='test') would leave {int((inverse < 0).sum())} original "
                "point(s) of its inverse map with no point to take a prediction from; crop or drop points "
                "before grid_sample, or evaluate the cloud whole")
        out["inverse"] = inverse
    return out


def _check_not_empty(coord: torch.Tensor, name: str) -> None:
    if coord.shape[0] == 0:
        raise ValueError(f"{name} got a cloud with no points (coord shape {tuple(coord.shape)}); drop empty "
                         "clouds in the dataset, or crop less")


def _float_coord(sample: Sample, name: str) -> torch.Tensor:
    coord = _t(sample["coord"])
    if not coord.is_floating_point():
        raise TypeError(
            f"{name} needs floating-point coord, got {coord.dtype} (scaling or rotating integer "
            "coordinates truncates them): convert coord with .float() in the dataset; voxel indices "
            "belong in grid_coord")
    return coord


def compose(*transforms: Transform) -> Transform:
    """Chain transforms left to right; all share the one generator, in order."""

    def composed(sample: Sample, g: torch.Generator) -> Sample:
        for t in transforms:
            sample = t(sample, g)
        return sample

    return composed


def center_shift(apply_z: bool = True) -> Transform:
    """Move the cloud's bounding-box centre (xy; z to its minimum unless apply_z) to 0."""

    def t(sample, g):
        coord = _t(sample["coord"])
        _check_not_empty(coord, "center_shift")
        lo, hi = coord.min(0).values, coord.max(0).values
        shift = (lo + hi) / 2
        if not apply_z:
            shift = torch.cat([shift[:2], lo[2:3]])
        return {**sample, "coord": coord - shift}

    return t


def random_rotate(angle: tuple = (-math.pi, math.pi), axis: str = "z", p: float = 1.0) -> Transform:
    """Rotate coord (and normal) about ``axis`` by a uniform angle in ``angle`` radians."""
    if axis not in ("x", "y", "z"):
        raise ValueError(f"random_rotate: axis must be 'x', 'y' or 'z', got {axis!r}")
    ax = "xyz".index(axis)

    def t(sample, g):
        _float_coord(sample, "random_rotate")
        if torch.rand((), generator=g) >= p:
            return sample
        theta = float(angle[0] + (angle[1] - angle[0]) * torch.rand((), generator=g, dtype=torch.float64))
        c, s = math.cos(theta), math.sin(theta)
        i, j = [k for k in range(3) if k != ax]
        rot = torch.eye(3, dtype=torch.float64)
        rot[i, i], rot[i, j], rot[j, i], rot[j, j] = c, -s, s, c
        out = dict(sample)
        for key in ("coord", "normal"):
            if key in sample:
                v = _t(sample[key])
                out[key] = (v.double() @ rot.T).to(v.dtype)
        return out

    return t


def random_scale(scale: tuple = (0.9, 1.1), anisotropic: bool = False) -> Transform:
    """Multiply coord by a uniform factor (one per axis when anisotropic)."""

    def t(sample, g):
        coord = _float_coord(sample, "random_scale")
        k = 3 if anisotropic else 1
        f = scale[0] + (scale[1] - scale[0]) * torch.rand(k, generator=g)
        return {**sample, "coord": coord * f.to(coord.dtype)}

    return t


def random_flip(p: float = 0.5) -> Transform:
    """Mirror x and y independently with probability p each (normals follow)."""

    def t(sample, g):
        flips = torch.rand(2, generator=g) < p
        sign = torch.tensor([-1.0 if flips[0] else 1.0, -1.0 if flips[1] else 1.0, 1.0])
        out = dict(sample)
        for key in ("coord", "normal"):
            if key in sample:
                v = _t(sample[key])
                out[key] = v * sign.to(v.dtype)
        return out

    return t


def random_jitter(sigma: float = 0.01, clip: float = 0.05) -> Transform:
    """Add clipped Gaussian noise to every coordinate."""

    def t(sample, g):
        coord = _float_coord(sample, "random_jitter")
        noise = (torch.randn(coord.shape, generator=g) * sigma).clamp_(-clip, clip)
        return {**sample, "coord": coord + noise.to(coord.dtype)}

    return t


def grid_sample(grid_size: float, mode: str = "train") -> Transform:
    """Voxelise: keep one point per ``grid_size`` voxel and add ``grid_coord`` [M,3] int64.

    mode "train": a random point of each voxel. mode "test": the first point of each
    voxel, plus ``inverse`` [N] (voxel representative of every original point, to map
    predictions back to all points) and ``origin_segment`` (original labels) when a
    ``segment`` is present.
    """
    if grid_size <= 0:
        raise ValueError(f"grid_size must be > 0, got {grid_size}")
    if mode not in ("train", "test"):
        raise ValueError(f"mode must be 'train' or 'test', got {mode!r}")

    def t(sample, g):
        sample = to_tensors(sample)
        prior = sample.pop("inverse", None)  # a grid_sample before this one: composed below
        coord = sample["coord"]
        _check_not_empty(coord, "grid_sample")
        n = coord.shape[0]
        cell = torch.floor((coord - coord.min(0).values) / grid_size).to(torch.int64)
        _, voxel = torch.unique(cell, dim=0, return_inverse=True)
        m = int(voxel.max()) + 1 if n else 0
        # per-voxel argmin of a priority: random for training, the point index for test
        prio = torch.rand(n, generator=g) if mode == "train" else torch.arange(n, dtype=torch.float64)
        best = torch.full((m,), float("inf"), dtype=prio.dtype).scatter_reduce(0, voxel, prio, "amin")
        is_rep = prio == best[voxel]
        # ties are impossible for test priorities and measure-zero for random ones; keep one
        rep_point = torch.full((m,), n, dtype=torch.int64).scatter_reduce(
            0, voxel[is_rep], torch.nonzero(is_rep).squeeze(1), "amin")
        keep = torch.sort(rep_point).values
        out = select_points(sample, keep)
        out["grid_coord"] = cell[keep]
        if mode == "test" or prior is not None:
            slot = torch.empty(m, dtype=torch.int64)
            slot[voxel[keep]] = torch.arange(keep.numel())
            # each point's kept point; after an earlier grid_sample, each original point's
            out["inverse"] = slot[voxel] if prior is None else slot[voxel][prior]
            if "segment" in sample and "origin_segment" not in sample:
                out["origin_segment"] = sample["segment"]
        return out

    return t


def random_dropout(ratio: float = 0.2, p: float = 0.2) -> Transform:
    """With probability ``p``, keep a random ``1 - ratio`` of the points (Pointcept's
    RandomDropout: the cloud's density varies between epochs, which small training sets
    otherwise let a net memorise)."""
    if not 0.0 <= ratio < 1.0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"random_dropout: ratio must be in [0, 1) and p in [0, 1], got ratio={ratio!r}, p={p!r}")

    def t(sample, g):
        applies = bool(torch.rand((), generator=g) < p)
        if not applies:
            return sample
        sample = to_tensors(sample)
        n = sample["coord"].shape[0]
        return _random_subset(sample, n, max(1, int(n * (1.0 - ratio))), g)

    return t


def _random_subset(sample: dict, n: int, k: int, g) -> dict:
    """``k`` of the sample's ``n`` points drawn at random, kept in their original order."""
    return select_points(sample, torch.sort(torch.randperm(n, generator=g)[:k]).values)


def crop_points(max_points: int, mode: str = "random") -> Transform:
    """Keep at most ``max_points``: the nearest ones to a random point ("random"), to the
    centroid ("center"), or a random subset ("subsample")."""
    if mode not in ("random", "center", "subsample"):
        raise ValueError(f"unknown crop mode {mode!r}")
    max_points = check_int("crop_points: max_points", max_points, 1)

    def t(sample, g):
        sample = to_tensors(sample)
        coord = sample["coord"]
        n = coord.shape[0]
        if n <= max_points:
            return sample
        if mode == "subsample":
            return _random_subset(sample, n, max_points, g)
        if mode == "random":
            centre = coord[int(torch.randint(n, (), generator=g))]
        else:
            centre = coord.mean(0)
        d = ((coord - centre) ** 2).sum(1)
        return select_points(sample, torch.sort(torch.topk(d, max_points, largest=False).indices).values)

    return t


def assemble_feat(keys: Sequence[str] = ("coord", "color")) -> Transform:
    """Concatenate per-point keys (1-D ones as a column) into ``feat`` [N, C] float32."""

    def t(sample, g):
        parts = []
        for k in keys:
            if k not in sample:
                raise KeyError(f"assemble_feat: sample has no {k!r} (has {sorted(sample)})")
            v = _t(sample[k]).to(torch.float32)
            parts.append(v.unsqueeze(1) if v.dim() == 1 else v)
        return {**sample, "feat": torch.cat(parts, dim=1)}

    return t


def normalize_color(scale: float = 255.0) -> Transform:
    """Map colors from [0, scale] to [-1, 1]."""

    def t(sample, g):
        if "color" not in sample:
            return sample
        c = _t(sample["color"]).to(torch.float32)
        return {**sample, "color": c / (scale / 2) - 1}

    return t
