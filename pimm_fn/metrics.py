"""Evaluation metrics as summable statistics: per-batch counts that add up over batches and ranks.

Semantic segmentation follows Pointcept's evaluator: per class intersection / union / target
counts over the points whose label is not ``ignore_index`` (-1); ``iou = I / (U + 1e-10)``,
``mIoU`` its mean, ``acc = I / (T + 1e-10)``, ``mAcc`` its mean, ``allAcc = sum I / (sum T +
1e-10)``. Classification: correct / total.

A metric object has ``init() -> stats``, ``update(stats, output) -> stats`` (output: what
the eval function returned for a batch), ``reduce(stats)`` (sum over ranks when
torch.distributed is initialised) and ``compute(stats) -> {name: float}``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._validate import check_int

EPS = 1e-10


def _labels(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``pred`` as labels shaped like ``target``: logits (floating, class dim last) are
    argmax-ed, integer labels with a trailing 1 (``argmax(-1, keepdim=True)``) squeezed;
    anything else must already have the target's shape."""
    if pred.dim() == target.dim() + 1 and pred.shape[:-1] == target.shape:
        if pred.is_floating_point() and pred.shape[-1] > 1:
            return pred.argmax(-1)
        if not pred.is_floating_point() and pred.shape[-1] == 1:
            return pred.squeeze(-1)
    if pred.shape != target.shape:
        raise ValueError(
            f"pred has shape {tuple(pred.shape)} and target {tuple(target.shape)}: pass pred as labels of the "
            "target's shape, or as logits of the target's shape plus a last dim of the classes (a class dim "
            "elsewhere, e.g. [B, C, N], must be moved last)")
    return pred


def intersection_and_union(pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int = -1):
    """Per-class (intersection, union, target) point counts, int64 tensors of length ``num_classes``.

    pred: predicted labels (or logits with the class dim last); target: labels, same shape
    as pred's labels; points with ``target == ignore_index`` are left out.
    """
    pred = _labels(pred, target)
    pred = pred.reshape(-1).long()
    target = target.reshape(-1).long()
    keep = target != ignore_index
    pred, target = pred[keep], target[keep]
    outside = target[(target < 0) | (target >= num_classes)]
    if outside.numel():  # Pointcept's histogram drops them silently and scores the rest
        raise ValueError(
            f"target label {int(outside[0])} is outside the {num_classes} classes (0..{num_classes - 1}) and is not "
            f"ignore_index={ignore_index}: pass the data's num_classes, its ignore_index, or remap its labels")
    inter = pred[pred == target]
    area_i = torch.bincount(inter, minlength=num_classes)[:num_classes]
    area_p = torch.bincount(pred[(pred >= 0) & (pred < num_classes)], minlength=num_classes)[:num_classes]
    area_t = torch.bincount(target, minlength=num_classes)[:num_classes]
    return area_i, area_p + area_t - area_i, area_t


def segmentation_scores(intersection, union, target, names: Optional[Sequence[str]] = None) -> dict:
    """mIoU, mAcc, allAcc (and per-class iou/acc) from summed counts, as Pointcept computes them."""
    i, u, t = (torch.as_tensor(x, dtype=torch.float64) for x in (intersection, union, target))
    iou = i / (u + EPS)
    acc = i / (t + EPS)
    out = {
        "mIoU": float(iou.mean()),
        "mAcc": float(acc.mean()),
        "allAcc": float(i.sum() / (t.sum() + EPS)),
    }
    names = list(names) if names is not None else [str(c) for c in range(len(iou))]
    for name, a, b in zip(names, iou.tolist(), acc.tolist()):
        out[f"iou/{name}"] = a
        out[f"acc/{name}"] = b
    return out


def accuracy_counts(pred: torch.Tensor, target: torch.Tensor, ignore_index: int = -1):
    """(correct, total) as int64 0-dim tensors; ``pred`` may be labels or logits (class dim last)."""
    pred = _labels(pred, target)
    keep = target != ignore_index
    correct = (pred[keep] == target[keep]).sum()
    return correct.long(), keep.sum().long()


def _all_reduce_sum(stats: dict) -> dict:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stats
    out = {}
    for k, v in stats.items():
        v = v.clone()
        dist.all_reduce(v, op=dist.ReduceOp.SUM)
        out[k] = v
    return out


class SegmentationMetric:
    """mIoU / mAcc / allAcc over an evaluation; summable across batches and ranks.

    The eval function returns ``{"pred": labels or logits, "target": labels, ...}``
    (keys configurable).
    classes: class ids the means run over (default all; e.g. the classes one data set of a
        multi-dataset run labels). present: add ``mIoU_present`` / ``mAcc_present``, the
        means over the classes that occur in the targets. per_class: add ``iou/<name>`` and
        ``acc/<name>`` for every class.
    """

    def __init__(self, num_classes: int, ignore_index: int = -1, names: Optional[Sequence[str]] = None,
                 pred_key: str = "pred", target_key: str = "target", *, classes: Optional[Sequence[int]] = None,
                 present: bool = False, per_class: bool = True):
        self.num_classes = check_int("SegmentationMetric(num_classes=...)", num_classes, 1)
        if names is not None and len(names) != self.num_classes:
            raise ValueError(f"SegmentationMetric: {len(names)} names for {self.num_classes} classes; pass one "
                             "name per class id, in order")
        self.ignore_index, self.names = ignore_index, names
        self.pred_key, self.target_key = pred_key, target_key
        bad = [c for c in (classes or ()) if not 0 <= int(c) < self.num_classes]
        if bad:
            raise ValueError(f"classes {bad} are not class ids of a {self.num_classes}-class metric")
        if classes is not None and (not len(classes) or len(set(map(int, classes))) != len(classes)):
            raise ValueError(f"SegmentationMetric(classes={list(classes)!r}): the means run over these class ids; "
                             "pass each at most once, and at least one (None: every class)")
        self.classes = None if classes is None else [int(c) for c in classes]
        self.present, self.per_class = bool(present), bool(per_class)

    def init(self) -> dict:
        z = torch.zeros(self.num_classes, dtype=torch.int64)
        return {"intersection": z, "union": z.clone(), "target": z.clone()}

    def update(self, stats: dict, output: dict) -> dict:
        i, u, t = intersection_and_union(output[self.pred_key], output[self.target_key], self.num_classes,
                                         self.ignore_index)
        dev = stats["intersection"].device
        return {"intersection": stats["intersection"] + i.to(dev), "union": stats["union"] + u.to(dev),
                "target": stats["target"] + t.to(dev)}

    def reduce(self, stats: dict) -> dict:
        return _all_reduce_sum(stats)

    def compute(self, stats: dict) -> dict:
        i, u, t = stats["intersection"], stats["union"], stats["target"]
        out = segmentation_scores(i, u, t, self.names)
        if not self.per_class:
            out = {k: out[k] for k in ("mIoU", "mAcc", "allAcc")}
        iou = i.double() / (u.double() + EPS)
        acc = i.double() / (t.double() + EPS)
        if self.classes is not None:
            out["mIoU"], out["mAcc"] = float(iou[self.classes].mean()), float(acc[self.classes].mean())
        if self.present:
            seen = t > 0
            out["mIoU_present"] = float(iou[seen].mean()) if bool(seen.any()) else float("nan")
            out["mAcc_present"] = float(acc[seen].mean()) if bool(seen.any()) else float("nan")
        return out


class Accuracy:
    """Classification accuracy (``acc``) over an evaluation; summable across batches and ranks."""

    def __init__(self, ignore_index: int = -1, pred_key: str = "pred", target_key: str = "target"):
        self.ignore_index, self.pred_key, self.target_key = ignore_index, pred_key, target_key

    def init(self) -> dict:
        return {"correct": torch.zeros((), dtype=torch.int64), "total": torch.zeros((), dtype=torch.int64)}

    def update(self, stats: dict, output: dict) -> dict:
        c, n = accuracy_counts(output[self.pred_key], output[self.target_key], self.ignore_index)
        dev = stats["correct"].device
        return {"correct": stats["correct"] + c.to(dev), "total": stats["total"] + n.to(dev)}

    def reduce(self, stats: dict) -> dict:
        return _all_reduce_sum(stats)

    def compute(self, stats: dict) -> dict:
        total = int(stats["total"])
        return {"acc": int(stats["correct"]) / total if total else float("nan")}
