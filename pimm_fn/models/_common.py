"""Loss and metric pieces shared by the models (pure tensor code, compile-friendly)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def masked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -1,
                         weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Cross-entropy over the rows whose target is not ``ignore_index``.

    logits: [N, K]; target: [N] int64; weight: optional [K] class weights.
    Equals ``F.cross_entropy(logits, target, weight, ignore_index=ignore_index)`` when
    some row is labelled; a batch with every row ignored gives 0 (not NaN), so one
    unlabelled crop cannot poison a run.
    """
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    nll = -F.log_softmax(logits.float(), dim=-1).gather(1, safe.unsqueeze(1)).squeeze(1)
    w = valid.to(nll.dtype)
    if weight is not None:
        w = w * weight.to(nll.dtype)[safe]
    return (nll * w).sum() / w.sum().clamp_min(1e-12)


def masked_accuracy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -1) -> torch.Tensor:
    """Fraction of labelled rows whose argmax equals the target (0 when none is labelled)."""
    valid = target != ignore_index
    hit = (logits.argmax(dim=-1) == target) & valid
    return hit.float().sum() / valid.float().sum().clamp_min(1.0)


def classification_outputs(logits: torch.Tensor, batch: dict, label_key: str, logits_key: str, *,
                           ignore_index: int = -1, weight: Optional[torch.Tensor] = None) -> dict:
    """Pointcept-style output: logits always; loss and acc when the batch carries labels.

    Whether the labels are present is a dict-key test, resolved at trace time, so a
    compiled step keeps one graph for training batches and one for evaluation batches.
    """
    out = {logits_key: logits}
    if label_key in batch:
        target = batch[label_key]
        if target.is_floating_point() or target.dtype == torch.bool:  # static: free under compile
            raise TypeError(f"batch[{label_key!r}] holds {target.dtype} values; class labels are integers "
                            f"(int64): convert them in the dataset or collate, e.g. .long()")
        out["loss"] = masked_cross_entropy(logits, target, ignore_index=ignore_index, weight=weight)
        out["acc"] = masked_accuracy(logits.detach(), target, ignore_index=ignore_index)
    return out


def make_norm(kind: str, channels: int) -> torch.nn.Module:
    """A per-row normalisation for [N, C] features: "batch", "layer" or "none"."""
    if kind == "batch":
        return torch.nn.BatchNorm1d(channels)
    if kind == "layer":
        return torch.nn.LayerNorm(channels)
    if kind == "none":
        return torch.nn.Identity()
    raise ValueError(f"norm must be 'batch', 'layer' or 'none', got {kind!r}")
