"""Segmentation losses beyond cross-entropy, written to compile into one graph.

:func:`lovasz_softmax` is the Lovasz-softmax loss (Berman, Rannen Triki and Blaschko,
"The Lovasz-Softmax loss", CVPR 2018): for each class the Jaccard (IoU) loss is a
submodular set function of the mispredicted points, and its Lovasz extension, evaluated
at the vector of per-point errors, is a convex surrogate. The extension is the dot
product of the errors sorted in decreasing order with the increments of the Jaccard loss
along that order.

Here every class is handled at once: one batched sort over [K, N], cumulative sums for
the Jaccard increments, and a mask (not a Python ``if``) for ignored points and absent
classes, so there is no per-class loop, no host read and no data-dependent branch; the
function compiles with ``fullgraph=True`` and dynamic N.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from ._common import masked_cross_entropy

Classes = Union[str, Sequence[int]]


def lovasz_softmax(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -1,
                   classes: Classes = "present") -> torch.Tensor:
    """Lovasz-softmax loss of ``logits`` [N, K] against ``target`` [N] (int64), a 0-dim tensor.

    ignore_index: target value of points that take no part (exactly as if dropped).
    classes: "present" averages over the classes present in the (non-ignored) target,
    "all" over all K classes, a sequence of class ids over those. With no class to
    average over (e.g. every point ignored) the loss is 0. Computed in float32.
    """
    k = logits.shape[1]
    probs = torch.softmax(logits.float(), dim=1).t()                      # [K, N]
    valid = (target != ignore_index).unsqueeze(0)                         # [1, N]
    labels = torch.arange(k, device=logits.device).unsqueeze(1)           # [K, 1]
    fg = ((target.unsqueeze(0) == labels) & valid).to(probs.dtype)        # [K, N]
    # ignored points get error 0 and foreground 0: they sort after every point with a
    # positive error, and (below) add nothing to the union, so their Jaccard increments
    # are 0 and the loss equals that of the tensor with them dropped
    errors = torch.where(valid, (fg - probs).abs(), torch.zeros_like(probs))
    errors_sorted, perm = torch.sort(errors, dim=1, descending=True)
    fg_sorted = fg.gather(1, perm)
    valid_sorted = valid.expand_as(fg).gather(1, perm).to(probs.dtype)
    gts = fg.sum(dim=1, keepdim=True)                                     # [K, 1]
    intersection = gts - fg_sorted.cumsum(dim=1)
    union = gts + ((1.0 - fg_sorted) * valid_sorted).cumsum(dim=1)
    # union >= 1 wherever a valid point has been passed; clamp covers leading ignored rows
    jaccard = 1.0 - intersection / union.clamp_min(1.0)
    # the Lovasz gradient: increments of the Jaccard loss along the sorted order
    grad = torch.cat([jaccard[:, :1], jaccard[:, 1:] - jaccard[:, :-1]], dim=1)
    per_class = (errors_sorted * grad).sum(dim=1)                         # [K]
    if classes == "present":
        weight = (gts.squeeze(1) > 0).to(per_class.dtype)
    elif classes == "all":
        weight = torch.ones_like(per_class)
    elif isinstance(classes, str):
        raise ValueError(f"classes must be 'present', 'all' or a sequence of class ids, got {classes!r}")
    else:
        weight = torch.zeros_like(per_class)
        weight[list(classes)] = 1.0
    return (per_class * weight).sum() / weight.sum().clamp_min(1.0)


def cross_entropy_lovasz(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -1, *,
                         lovasz_weight: float = 1.0) -> torch.Tensor:
    """Cross-entropy plus ``lovasz_weight`` x Lovasz-softmax (present classes), the
    combination Pointcept-style segmentation configs train with (both weights 1 there).

    logits [N, K], target [N] int64; ignored points take part in neither term.
    """
    ce = masked_cross_entropy(logits, target, ignore_index=ignore_index)
    return ce + lovasz_weight * lovasz_softmax(logits, target, ignore_index=ignore_index)
