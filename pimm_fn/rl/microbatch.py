"""Micro-batches: slicing a batch of trajectories into weighted pieces, and combining their
metrics with the rule ranks' metrics combine by (:func:`reduce_across_ranks_op`, defined
with the cross-rank reduction in :mod:`pimm_fn.distributed.collectives`): Pointcept's
substring rules for min / max / mean, ``count`` summed."""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch

from ..distributed.collectives import reduce_across_ranks_op


def _as_tensor(v, like: torch.Tensor) -> torch.Tensor:
    return v.to(like.device, torch.float32) if isinstance(v, torch.Tensor) else torch.tensor(
        float(v), dtype=torch.float32, device=like.device
    )


def combine_microbatches(
    outputs: Sequence[tuple[Mapping[str, torch.Tensor], int | float | torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Combine the metrics of the micro-batches of one policy update.

    ``_min`` keys take the min, ``_max`` / ``abs_max`` keys the max, ``count`` the sum,
    all others the count-weighted mean (Pointcept's ``sum(value * count / total)``). Only
    tensor ops: traces when the key set is static.

    Args:
        outputs: ``(metrics, count)`` per micro-batch; ``count`` is the number of units the
            metrics averaged over (an int or a 0-dim tensor, e.g. ``metrics["count"]``).

    A key missing from some micro-batches is averaged over those that have it, renormalised
    by their counts (Pointcept leaves such a sum under-weighted); non-tensor values are taken
    from the first micro-batch that has them.
    """
    if not outputs:
        raise ValueError("combine_microbatches got no micro-batch outputs (was the rollout empty?)")
    keys: list[str] = []
    for metrics, _ in outputs:
        keys.extend(k for k in metrics if k not in keys)
    combined: dict[str, torch.Tensor] = {}
    for key in keys:
        present = [(m[key], c) for m, c in outputs if key in m]
        values = [v for v, _ in present]
        if not isinstance(values[0], torch.Tensor):
            combined[key] = values[0]
            continue
        stacked = torch.stack([v.detach() for v in values])
        op = reduce_across_ranks_op(key)
        if op == "min":
            combined[key] = stacked.min()
        elif op == "max":
            combined[key] = stacked.max()
        elif op == "sum":
            combined[key] = stacked.sum()
        else:
            counts = torch.stack([_as_tensor(c, stacked) for _, c in present]).to(stacked.dtype)
            # clamp: an all-empty update (every count 0) gives 0, as in Pointcept, not NaN.
            combined[key] = (stacked * counts).sum() / counts.sum().clamp(min=1e-12)
    return combined


def combine_updates(outputs: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Summarise the metrics of the P policy updates made on one rollout.

    Every key takes its last update's value, except ``loss`` (mean over updates). Every
    ``rl_*`` key present in the first and last update also gets ``<k>_update0`` (first),
    ``<k>_last`` (last) and ``<k>_mean_update`` (mean over the updates that have it).
    The seed does this for a fixed list of rl_* keys; here it is every rl_* key.

    Args:
        outputs: one metrics dict per policy update, in order.
    """
    if not outputs:
        raise ValueError("combine_updates got no policy-update outputs (policy_updates_per_rollout >= 1)")
    first, last = outputs[0], outputs[-1]
    detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
    combined = {k: detach(v) for k, v in last.items()}
    if "loss" in first:
        combined["loss"] = torch.stack([o["loss"].detach() for o in outputs if "loss" in o]).mean()
    for key in first:
        if not key.startswith("rl_") or key not in last:
            continue
        combined[f"{key}_update0"] = detach(first[key])
        combined[f"{key}_last"] = detach(last[key])
        if isinstance(first[key], torch.Tensor):
            combined[f"{key}_mean_update"] = torch.stack(
                [o[key].detach() for o in outputs if key in o]
            ).mean()
    return combined


class Microbatch(NamedTuple):
    """One trajectory slice ``[start, end)`` and the weight of its loss in the update."""

    start: int
    end: int
    count: int | torch.Tensor
    weight: float | torch.Tensor


def microbatch_slices(
    num_trajectories: int,
    microbatch_size: int,
    group_size: int | None = None,
    counts: torch.Tensor | None = None,
) -> list[Microbatch]:
    """Split N trajectories into chunks whose weighted losses sum to the full-batch loss.

    ``sum(weight_i * loss(chunk_i))`` equals ``loss(all)`` -- and so do the gradients --
    when the loss is a mean over the units counted: trajectories for
    ``reduction="sequence"`` (the default; weights ``len(chunk) / N``, as in Pointcept), or
    tokens for ``reduction="token"`` (pass ``counts`` = valid steps per trajectory,
    e.g. ``mask.sum(-1)``). Advantages must be computed on the whole group first.

    Args:
        num_trajectories: N.
        microbatch_size: trajectories per chunk; 0 means no splitting (one chunk).
        group_size: if given, chunks never cross a group boundary (Pointcept slices each
            event's trajectories separately), so a chunk may be shorter than the size.
        counts: optional ``[N]`` per-trajectory unit counts; weights become 0-dim tensors.

    Returns:
        list of :class:`Microbatch` ``(start, end, count, weight)``.
    """
    n, size = int(num_trajectories), int(microbatch_size)
    if n <= 0:
        raise ValueError(f"num_trajectories must be positive, got {n}")
    if size < 0:
        raise ValueError(f"microbatch_size must be >= 0 (0 disables splitting), got {size}")
    if group_size is not None and (group_size <= 0 or n % group_size):
        raise ValueError(f"group_size {group_size} does not divide num_trajectories {n}")
    if counts is not None and tuple(counts.shape) != (n,):
        raise ValueError(f"counts must have shape [{n}], got {tuple(counts.shape)}")
    if size == 0:
        bounds = [(0, n)]
    else:
        g = n if group_size is None else int(group_size)
        bounds = [
            (s, min(s + size, g0 + g)) for g0 in range(0, n, g) for s in range(g0, g0 + g, size)
        ]
    if counts is None:
        return [Microbatch(s, e, e - s, (e - s) / n) for s, e in bounds]
    c = counts.to(torch.float32)
    # clamp: an all-empty batch gives zero weights rather than NaN.
    total = c.sum().clamp(min=1e-12)
    return [Microbatch(s, e, c[s:e].sum(), c[s:e].sum() / total) for s, e in bounds]
