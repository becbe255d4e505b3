"""Masked means over trajectories and steps: the ``reduction`` rules ("sequence", "token",
"constant") the losses share, and the ``count`` metric they report."""
from __future__ import annotations

import math

import torch

from ..distributed.collectives import COUNT_KEY  # noqa: F401 (re-exported: the count metric)


def _as_steps(x: torch.Tensor) -> torch.Tensor:
    """View per-trajectory log-probs ``[N]`` as ``[N, 1]`` so one code path serves both."""
    return x.unsqueeze(-1) if x.dim() == 1 else x


REDUCTIONS = ("sequence", "token", "constant")


def check_reduction(reduction: str, max_length) -> None:
    """Raise ValueError naming the fix for an unknown ``reduction`` or a ``max_length`` it would ignore."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if max_length is not None:
        if reduction != "constant":
            raise ValueError(
                f"max_length={max_length} is the divisor of reduction='constant'; with "
                f"reduction={reduction!r} it would be ignored. Pass reduction='constant' or drop it."
            )
        if not isinstance(max_length, (int, float)) or max_length <= 0:
            raise ValueError(
                f"max_length must be a positive number (e.g. the max generation length), got {max_length!r}"
            )


def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    reduction: str = "sequence",
    max_length: int | float | None = None,
) -> torch.Tensor:
    """Mean of ``x`` over valid steps.

    Args:
        x: ``[N, T]`` or ``[N]``.
        mask: same shape (or None for all valid).
        reduction: ``"sequence"`` averages each trajectory over its valid steps, then
            averages the N trajectories (GRPO; an all-pad trajectory contributes 0 but still
            counts, so micro-batches weighted by trajectory count are exact); ``"token"``
            averages over all valid steps of the batch (DAPO); ``"constant"`` sums each
            trajectory's valid steps, divides by one fixed constant ``max_length`` and
            averages the N trajectories (Dr. GRPO: no per-sequence length bias; exact under
            micro-batches weighted by trajectory count, like ``"sequence"``).
        max_length: the constant of ``"constant"`` (e.g. the maximum generation length);
            None uses the padded length ``T`` of ``x``. Only valid with ``"constant"``.
    """
    check_reduction(reduction, max_length)
    x = _as_steps(x)
    m = torch.ones_like(x) if mask is None else _as_steps(mask).to(x.dtype)
    if reduction == "sequence":
        per_seq = (x * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.mean()
    if reduction == "token":
        return (x * m).sum() / m.sum().clamp(min=1)
    # A Python constant (not a tensor): the divisor is fixed, whatever the valid lengths.
    length = float(x.shape[-1] if max_length is None else max_length)
    return ((x * m).sum(-1) / length).mean()


def _count(x: torch.Tensor, mask: torch.Tensor | None, reduction: str) -> torch.Tensor:
    """How many units a :func:`masked_mean` averaged over, as a 0-dim float tensor."""
    x = _as_steps(x)
    if reduction == "token":  # "sequence" and "constant" average over trajectories
        if mask is None:
            return torch.full((), float(x.numel()), dtype=torch.float32, device=x.device)
        return _as_steps(mask).to(torch.float32).sum()
    return torch.full((), float(x.shape[0]), dtype=torch.float32, device=x.device)


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor | None, largest: bool) -> torch.Tensor:
    """Max (or min) over valid entries; +-inf when nothing is valid."""
    if mask is None:
        return x.max() if largest else x.min()
    fill = torch.full((), -math.inf if largest else math.inf, dtype=x.dtype, device=x.device)
    x = torch.where(mask.to(torch.bool), x, fill)
    return x.max() if largest else x.min()
