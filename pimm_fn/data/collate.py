"""Collate functions: point clouds (with Mix3D), instance segmentation, images.

A point batch is a dict of per-point tensors concatenated on dim 0 (``coord`` [N,3],
``grid_coord`` [N,3], ``feat`` [N,C], ``segment`` [N], ``instance`` [N], ...) plus
``offset`` [B] int64: the exclusive cumulative ends ``[n1, n1+n2, ...]`` of the clouds.

Every collate validates its input and raises ``ValueError`` naming the offending sample
(its index in the batch and its ``name`` / ``_name`` when it has one), instead of letting
a model fail later on a shape it cannot explain.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch

# Keys that hold one row per point of the (possibly grid-sampled) cloud. Evaluation keys
# (``origin_segment``, ``inverse``) have one row per *original* point and are excluded;
# point_collate shifts ``inverse`` to index the batch and adds ``origin_offset``.
POINT_KEYS = (
    "coord", "grid_coord", "feat", "color", "normal", "strength", "intensity", "energy",
    "segment", "instance",
)
IGNORE_INDEX = -1


def _sample_label(sample: Any, i: int) -> str:
    if isinstance(sample, Mapping):
        for key in ("name", "_name"):
            if key in sample and isinstance(sample[key], str):
                return f"sample {i} ({sample[key]!r})"
    return f"sample {i}"


def _as_tensor(x):
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    return x


def collate(batch: Sequence) -> Any:
    """Collate a list of samples: tensors/arrays concatenate on dim 0, numbers become a
    1-D tensor, strings a list, sequences collate per field, mappings recurse (keys
    starting with ``_`` dropped; any ``offset`` key becomes cumulative ends).

    batch: a non-empty list of samples of one structure.
    """
    if len(batch) == 0:
        raise ValueError("collate got an empty batch")
    elem = _as_tensor(batch[0])
    if isinstance(elem, torch.Tensor):
        tensors = [_as_tensor(b) for b in batch]
        if elem.dim() == 0:
            return torch.stack(tensors)
        return torch.cat(tensors, dim=0)
    if isinstance(elem, str):
        return list(batch)
    if isinstance(elem, bool):
        return torch.tensor(batch, dtype=torch.bool)
    if isinstance(elem, int):
        return torch.tensor(batch, dtype=torch.int64)
    if isinstance(elem, float):
        return torch.tensor(batch, dtype=torch.float64)
    if isinstance(elem, Mapping):
        for i, d in enumerate(batch[1:], 1):
            if not isinstance(d, Mapping):
                raise ValueError(f"{_sample_label(d, i)} is a {type(d).__name__}, sample 0 a mapping: "
                                 "every sample of a batch needs the same structure")
            _check_keys(d, elem, i)
        out = {}
        for key in elem:
            if key.startswith("_"):
                continue  # private per-sample bookkeeping, never batched
            out[key] = collate([d[key] for d in batch])
            if "offset" in key:
                # per-sample offsets are counts; a batch holds cumulative ends
                out[key] = torch.cumsum(out[key].reshape(-1), dim=0).to(torch.int64)
        return out
    if isinstance(elem, Sequence):
        return [collate(list(fields)) for fields in zip(*batch)]
    if elem is None:
        return None
    raise TypeError(f"collate: unsupported element type {type(elem).__name__}")


def _validate_point_sample(sample: Mapping, i: int) -> int:
    label = _sample_label(sample, i)
    if "coord" not in sample:
        raise ValueError(f"{label} has no 'coord' key; point samples need coord [N,3] (samples that are not "
                         "point clouds: build the loader with collate_fn=pimm_fn.data.image_collate, or your own)")
    coord = _as_tensor(sample["coord"])
    if not isinstance(coord, torch.Tensor) or coord.dim() != 2 or coord.shape[1] != 3:
        shape = tuple(coord.shape) if isinstance(coord, torch.Tensor) else type(coord).__name__
        raise ValueError(f"{label}: coord must be [N, 3] (one xyz row per point), got {shape}")
    if coord.shape[0] == 0:
        raise ValueError(
            f"{label} has zero points (coord shape {tuple(coord.shape)}); drop empty clouds "
            "in the dataset or raise the crop / grid size"
        )
    n = coord.shape[0]
    for key in POINT_KEYS:
        if key in sample and key != "coord":
            value = _as_tensor(sample[key])
            if value.shape[0] != n:
                raise ValueError(
                    f"{label}: coord has {n} points but {key} has {value.shape[0]} rows; "
                    "every per-point key must have one row per point"
                )
    if coord.is_floating_point() and not torch.isfinite(coord).all():
        bad = int((~torch.isfinite(coord)).any(dim=1).sum())
        raise ValueError(f"{label} has {bad} point(s) with NaN/inf coordinates")
    if "offset" in sample:
        off = _as_tensor(sample["offset"]).reshape(-1)
        if off.numel() != 1 or int(off[0]) != n:
            raise ValueError(f"{label}: per-sample offset {off.tolist()} != point count {n}")
    if "inverse" in sample:
        inverse = _as_tensor(sample["inverse"])
        if inverse.numel() and (int(inverse.min()) < 0 or int(inverse.max()) >= n):
            raise ValueError(
                f"{label}: its inverse map names points {int(inverse.min())}..{int(inverse.max())} of a cloud of {n}; "
                "a transform after grid_sample(mode='test') changed the points without it")
    return n


def _check_keys(sample: Mapping, first: Mapping, i: int) -> None:
    """The same public keys as the batch's first sample (a key only some samples have
    would be dropped from the batch, or fail with a bare KeyError)."""
    keys, want = {k for k in sample if not k.startswith("_")}, {k for k in first if not k.startswith("_")}
    if keys != want:
        raise ValueError(
            f"{_sample_label(sample, i)} has keys {sorted(keys)} but {_sample_label(first, 0)} has {sorted(want)}: "
            f"every sample of a batch needs the same keys (missing {sorted(want - keys)}, extra {sorted(keys - want)})")


def _check_alike(sample: Mapping, first: Mapping, i: int) -> None:
    """:func:`_check_keys`, and per-point keys of the same width and dtype (else the batch
    fails with torch's concatenation error, or is silently promoted)."""
    _check_keys(sample, first, i)
    for key in POINT_KEYS:
        if key in sample:
            a, b = _as_tensor(sample[key]), _as_tensor(first[key])
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.shape[1:] != b.shape[1:]
                                                                                or a.dtype != b.dtype):
                raise ValueError(
                    f"{_sample_label(sample, i)}: {key} is {a.dtype} with rows of shape {tuple(a.shape[1:])}, "
                    f"{_sample_label(first, 0)}'s is {b.dtype} {tuple(b.shape[1:])}; every cloud of a batch needs "
                    "the same feature width and dtype")


def validate_point_batch(batch: Mapping) -> None:
    """Check a collated point batch: offsets strictly increasing and ending at N,
    per-point keys of length N, finite coordinates. Raises ValueError naming the cloud."""
    if "offset" not in batch or "coord" not in batch:
        raise ValueError("a point batch needs 'coord' and 'offset'")
    offset = batch["offset"]
    if offset.dim() != 1 or offset.numel() == 0:
        raise ValueError(f"offset must be a non-empty 1-D tensor, got shape {tuple(offset.shape)}")
    starts = torch.cat([offset.new_zeros(1), offset[:-1]])
    sizes = offset - starts
    if (sizes <= 0).any():
        j = int(torch.nonzero(sizes <= 0)[0])
        raise ValueError(
            f"offsets must be strictly increasing: cloud {j} has offset {int(offset[j])} after "
            f"{int(starts[j])} ({int(sizes[j])} points); offsets are cumulative ends "
            f"[n1, n1+n2, ...], got {offset.tolist()}"
        )
    n = batch["coord"].shape[0]
    if int(offset[-1]) != n:
        raise ValueError(f"last offset {int(offset[-1])} != number of points {n}")
    for key in POINT_KEYS:
        if key in batch and batch[key].shape[0] != n:
            raise ValueError(f"batch key {key} has {batch[key].shape[0]} rows, coord has {n}")
    coord = batch["coord"]
    if coord.is_floating_point():
        bad_rows = ~torch.isfinite(coord).all(dim=1)
        if bad_rows.any():
            first = int(torch.nonzero(bad_rows)[0])
            cloud = int(torch.searchsorted(offset, torch.tensor(first), right=True))
            raise ValueError(f"cloud {cloud} of the batch has NaN/inf coordinates (point {first})")


# Keys that hold one row per sample (or per point) beside the input they label.
_LABEL_KEYS = ("y", "label", "labels", "target", "targets", "segment", "instance")
_INPUT_KEYS = ("x", "image", "images", "input", "inputs", "feat", "coord")


def validate_batch(batch) -> None:
    """Host checks of a batch before it reaches the compiler (fit's first batch, a compiled
    step's first call): a point batch as :func:`validate_point_batch` checks it; otherwise
    each label key (``y``, ``label``, ``target``, ``segment``, ...) must have as many rows as
    the input (``x``, ``image``, ``feat``, ``coord``). Raises ValueError naming the key.
    Batches of other kinds pass unchecked."""
    if not isinstance(batch, Mapping):
        return
    if "offset" in batch and "coord" in batch:
        validate_point_batch(batch)
        return
    rows = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    ref = next((k for k in _INPUT_KEYS if k in rows), None)
    if ref is None:
        return
    for key in _LABEL_KEYS:
        if key in rows and rows[key] != rows[ref]:
            raise ValueError(
                f"batch key {key!r} has {rows[key]} rows, {ref!r} has {rows[ref]}: each sample needs "
                "exactly one label row; check the dataset's samples and the collate function"
            )


# Keys whose values index a cloud's own points: shifted by the points before the cloud
# when clouds are concatenated, so they index the batch.
INDEX_KEYS = ("inverse",)


def _shift_index_keys(samples: list) -> list:
    start, out = 0, []
    for s in samples:
        n = int(s["offset"][0])
        if start and any(k in s for k in INDEX_KEYS):
            s = dict(s)
            for k in INDEX_KEYS:
                if k in s:
                    s[k] = _as_tensor(s[k]) + start
        out.append(s)
        start += n
    return out


def _with_offsets(samples: Sequence[Mapping]) -> list:
    out = []
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping):
            raise TypeError(f"{_sample_label(s, i)}: a point sample must be a dict, got {type(s).__name__}")
        n = _validate_point_sample(s, i)
        if i:
            _check_alike(s, samples[0], i)
        d = dict(s)
        d["offset"] = torch.tensor([n], dtype=torch.int64)
        out.append(d)
    return out


def _draw(mix_prob: float, generator: Optional[torch.Generator]) -> bool:
    if mix_prob <= 0:
        return False
    if mix_prob >= 1:
        return True
    return bool(torch.rand((), generator=generator) < mix_prob)


def mix3d(batch: dict) -> dict:
    """Merge clouds (0,1), (2,3), ... of a collated point batch into one sample each
    (Mix3D): every other offset is dropped and the second cloud's instance ids are
    shifted past the first's so instances stay distinct. An odd last cloud stays alone.
    """
    offset = batch["offset"]
    out = dict(batch)
    if "instance" in batch:
        instance = batch["instance"].clone()
        starts = torch.cat([offset.new_zeros(1), offset[:-1]]).tolist()
        ends = offset.tolist()
        for a in range(0, len(ends) - 1, 2):
            first = instance[starts[a]:ends[a]]
            second = instance[starts[a + 1]:ends[a + 1]]
            valid_first = first[first != IGNORE_INDEX]
            shift = int(valid_first.max()) + 1 if valid_first.numel() else 0
            second[second != IGNORE_INDEX] += shift  # view: writes into the clone
        out["instance"] = instance
    # keep the ends of every second cloud (and the very last one when B is odd)
    out["offset"] = torch.cat([offset[1:-1:2], offset[-1:]])
    if "origin_offset" in out:  # original points merge the same way
        o = out["origin_offset"]
        out["origin_offset"] = torch.cat([o[1:-1:2], o[-1:]])
    return out


def point_collate(
    batch: Sequence[Mapping],
    *,
    mix_prob: float = 0.0,
    generator: Optional[torch.Generator] = None,
    seed: Optional[int] = None,
) -> dict:
    """Collate point-cloud samples into one batch, applying Mix3D with ``mix_prob``.

    batch: list of dicts with ``coord`` [N_i,3] and further per-point keys.
    mix_prob: probability that this batch is Mix3D-merged (pairs of clouds -> one).
    generator / seed: where the mixing draw comes from (a seed builds a fresh generator);
        without either, torch's global generator is used.
    """
    if len(batch) == 0:
        raise ValueError("point_collate got an empty batch")
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(int(seed))
    samples = _with_offsets(batch)
    out = collate(_shift_index_keys(samples))
    if "inverse" in out:
        # cumulative ends of each cloud's original points (rows of inverse / origin_*)
        out["origin_offset"] = torch.tensor([len(s["inverse"]) for s in samples]).cumsum(0)
    validate_point_batch(out)
    if _draw(mix_prob, generator) and out["offset"].numel() > 1:
        out = mix3d(out)
    return out


class PointCollate:
    """Picklable point collate with Mix3D driven by a per-batch seed.

    The loader hands each batch a seed derived from (seed, epoch, batch index) through the
    ``_mix_seed`` key of its first sample, so the mixing draw is the same on resume and
    with any worker count.
    """

    def __init__(self, mix_prob: float = 0.0):
        self.mix_prob = float(mix_prob)

    def __call__(self, batch):
        seed = batch[0].get("_mix_seed") if batch and isinstance(batch[0], Mapping) else None
        return point_collate(batch, mix_prob=self.mix_prob, seed=seed)


def instance_collate(
    batch: Sequence,
    *,
    mix_prob: float = 0.0,
    generator: Optional[torch.Generator] = None,
    seed: Optional[int] = None,
) -> dict:
    """Collate instance-segmentation samples: flatten list-of-dict samples (several views
    per item), concatenate per-point keys, keep per-instance targets as per-sample lists.

    A key is per-instance (kept as a list, one entry per cloud) when its leading dim is not
    the sample's point count, e.g. ``gt_classes`` [K] or ``gt_masks`` [K,N]. Under Mix3D
    the lists of a merged pair are concatenated; with instance ids 0..K-1 this keeps the
    shifted ids aligned with the concatenated per-instance targets.
    """
    flat = []
    for item in batch:
        if isinstance(item, Mapping):
            flat.append(item)
        elif isinstance(item, Sequence):
            flat.extend(item)
        else:
            raise TypeError(f"instance_collate: sample of type {type(item).__name__}")
    if not flat:
        raise ValueError("instance_collate got an empty batch")
    point_part, list_part = [], {}
    for i, s in enumerate(flat):
        n = _validate_point_sample(s, i)
        pp = {}
        for k, v in s.items():
            v = _as_tensor(v)
            if k.startswith("_") or k == "offset":
                continue
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
                pp[k] = v
            elif isinstance(v, str):
                pp[k] = v
            else:
                list_part.setdefault(k, []).append(v)
        point_part.append(pp)
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(int(seed))
    out = point_collate(point_part)
    if _draw(mix_prob, generator) and out["offset"].numel() > 1:
        out = mix3d(out)
        for k, values in list_part.items():
            merged = []
            for a in range(0, len(values), 2):
                pair = values[a:a + 2]
                if len(pair) == 2 and all(isinstance(p, torch.Tensor) and p.dim() > 0 for p in pair):
                    merged.append(torch.cat(pair, dim=0))
                else:
                    merged.append(pair if len(pair) == 2 else pair[0])
            list_part[k] = merged
    out.update(list_part)
    return out


class InstanceCollate(PointCollate):
    """Picklable instance collate; Mix3D seeded per batch like :class:`PointCollate`."""

    def __call__(self, batch):
        first = batch[0] if batch else None
        if isinstance(first, Sequence) and not isinstance(first, Mapping):
            first = first[0] if first else None
        seed = first.get("_mix_seed") if isinstance(first, Mapping) else None
        return instance_collate(batch, mix_prob=self.mix_prob, seed=seed)


def image_collate(batch: Sequence[Mapping]) -> dict:
    """Stack image samples: ``image`` [C,H,W] -> [B,C,H,W], numbers/0-d -> [B],
    arrays of equal shape stacked; strings to lists; ``_`` keys dropped.
    """
    if len(batch) == 0:
        raise ValueError("image_collate got an empty batch")
    out = {}
    for key in batch[0]:
        if key.startswith("_"):
            continue
        values = [_as_tensor(b[key]) for b in batch]
        if isinstance(values[0], str):
            out[key] = list(values)
            continue
        if not isinstance(values[0], torch.Tensor):
            values = [torch.as_tensor(v) for v in values]
        shape = values[0].shape
        for i, v in enumerate(values):
            if v.shape != shape:
                raise ValueError(
                    f"{_sample_label(batch[i], i)}: {key} has shape {tuple(v.shape)}, sample 0 has "
                    f"{tuple(shape)}; images must share one shape (resize or crop in the dataset)"
                )
        if key == "image" and values[0].dim() != 3:
            raise ValueError(f"image must be [C,H,W], got {tuple(shape)}")
        out[key] = torch.stack(values)
    return out
