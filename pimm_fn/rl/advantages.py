"""Rewards in, advantages out: validation, group-relative (GRPO), leave-one-out (RLOO) and
per-step advantages, and the reward statistics of a rollout.

Standard deviations are population std (``unbiased=False``, divide by n): the group is
the whole population being standardised, and a group of two then gives advantages of
exactly +-1. The DeepSeekMath / DAPO papers write ``std(r)`` without saying which; TRL
and verl call ``torch.std``, whose default is Bessel-corrected. Pass ``unbiased=True`` to
match those. Groups whose rewards are all equal get advantage 0 (0 / (0 + eps)).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .reductions import COUNT_KEY


def _check_groups(rewards: torch.Tensor, name: str = "rewards") -> None:
    """Shape checks that are static under tracing (so safe inside a compiled step)."""
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B, G], got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(
            f"{name} must have shape [B, G] (events x trajectories per event), got shape "
            f"{tuple(rewards.shape)}; reshape flat rewards with rewards.view(-1, G)"
        )
    if rewards.shape[1] < 2:
        raise ValueError(
            f"{name} has group size G={rewards.shape[1]}: GRPO advantages compare the "
            "trajectories of one event with each other, so there is no group to compare "
            "against with G=1. Sample at least 2 trajectories per event."
        )


def validate_rewards(rewards: torch.Tensor, expected_shape: Sequence[int] | None = None) -> None:
    """Host-side check of a rollout's rewards; call it outside the compiled step.

    Reads tensor values (NaN / inf check), so it syncs with the device and must not be
    traced. Raises with a message naming the problem.

    Args:
        rewards: ``[B, G]`` reward table.
        expected_shape: ``(B, G)`` the rollout was configured for, or None to skip.
    """
    _check_groups(rewards)
    if expected_shape is not None and tuple(rewards.shape) != tuple(expected_shape):
        raise ValueError(
            f"rewards have shape {tuple(rewards.shape)} but the rollout was configured for "
            f"{tuple(expected_shape)} (events x trajectories per event)"
        )
    if not rewards.is_floating_point():
        raise TypeError(f"rewards must be floating point, got dtype {rewards.dtype}")
    finite = torch.isfinite(rewards)
    if not bool(finite.all()):
        bad = (~finite).nonzero().tolist()
        raise ValueError(
            f"rewards contain {len(bad)} non-finite value(s) (NaN or inf) at [event, trajectory] "
            f"{bad[:8]}{' ...' if len(bad) > 8 else ''}; fix the reward function, a NaN reward "
            "turns every advantage of its group into NaN"
        )


# --------------------------------------------------------------------------- advantages


def _std(x: torch.Tensor, dim, unbiased: bool) -> torch.Tensor:
    return x.std(dim=dim, correction=1 if unbiased else 0, keepdim=True)


def grpo_advantages(
    rewards: torch.Tensor,
    eps: float = 1e-6,
    scale: bool = True,
    scale_by: str = "group",
    unbiased: bool = False,
) -> torch.Tensor:
    """Group-relative advantages: reward minus its group's mean, optionally std-scaled.

    Args:
        rewards: ``[B, G]``, G >= 2.
        eps: added to the std so that a group with equal rewards gives 0, not NaN.
        scale: True divides by ``std + eps`` (GRPO); False keeps only the centring
            (Dr. GRPO, which drops the std to avoid over-weighting near-solved groups).
        scale_by: ``"group"`` divides by each group's std; ``"batch"`` by one std over all
            B*G rewards (the mean stays per group), so easy and hard events keep their
            relative scale.
        unbiased: Bessel-corrected std (see the module docstring); default population std.

    Returns:
        ``[B, G]`` advantages, same dtype as ``rewards``.
    """
    _check_groups(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    if scale_by == "group":
        std = _std(rewards, 1, unbiased)
    elif scale_by == "batch":
        std = _std(rewards.reshape(1, -1), 1, unbiased)
    else:
        raise ValueError(f"scale_by must be 'group' or 'batch', got {scale_by!r}")
    return centred / (std + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantages: reward minus the mean of the *other* G-1 rewards.

    Equal to ``G / (G - 1) * (r - group_mean)``; the baseline excludes the trajectory
    itself, which keeps the gradient estimate unbiased.

    Args:
        rewards: ``[B, G]``, G >= 2.
    """
    _check_groups(rewards)
    g = rewards.shape[1]
    # The centred form rather than r - (sum - r) / (G - 1): the same value, but a group of
    # equal rewards gives exactly 0 instead of rounding noise.
    return (rewards - rewards.mean(dim=1, keepdim=True)) * (g / (g - 1))


def _discount_matrix(t: int, gamma: float, like: torch.Tensor) -> torch.Tensor:
    """``D[s, k] = gamma ** (k - s)`` for k >= s else 0, so returns = rewards @ D.T.

    A matrix rather than a reversed cumsum with ``gamma ** -t`` factors, which overflow
    for long horizons and small gamma.
    """
    idx = torch.arange(t, device=like.device)
    lag = idx.view(1, t) - idx.view(t, 1)  # [s, k] = k - s
    base = torch.full((), gamma, dtype=like.dtype, device=like.device)
    powers = base ** lag.clamp(min=0).to(like.dtype)
    return torch.where(lag >= 0, powers, torch.zeros((), dtype=like.dtype, device=like.device))


def _masked_group_standardise(x, m, eps, scale, unbiased):
    """Centre (and scale) x over the valid entries of each group: dims (1, 2) of [B, G, T]."""
    n = m.sum(dim=(1, 2), keepdim=True)
    mean = (x * m).sum(dim=(1, 2), keepdim=True) / n.clamp(min=1)
    centred = (x - mean) * m
    if not scale:
        return centred
    denom = (n - 1) if unbiased else n
    var = (centred * centred).sum(dim=(1, 2), keepdim=True) / denom.clamp(min=1)
    return centred / (var.sqrt() + eps)


def step_advantages(
    rewards_per_step: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    eps: float = 1e-6,
    scale: bool = True,
    normalise: str = "returns",
    unbiased: bool = False,
) -> torch.Tensor:
    """Per-step advantages for multi-step trajectories, normalised within each group.

    Args:
        rewards_per_step: ``[B, G, T]`` reward received at each step (pads ignored).
        mask: ``[B, G, T]``, 1 for real steps, 0 for padding.
        gamma: discount of the returns-to-go.
        eps, scale, unbiased: as in :func:`grpo_advantages`; statistics are taken over
            all valid steps of all G trajectories of a group.
        normalise: ``"returns"`` computes returns-to-go, then standardises them within the
            group; ``"rewards"`` standardises the step rewards first and then sums them
            into returns-to-go (DeepSeekMath's process-supervision GRPO).

    Returns:
        ``[B, G, T]`` advantages, exactly 0 at padded steps.
    """
    if rewards_per_step.dim() != 3:
        raise ValueError(
            f"rewards_per_step must have shape [B, G, T], got {tuple(rewards_per_step.shape)}"
        )
    if tuple(mask.shape) != tuple(rewards_per_step.shape):
        raise ValueError(
            f"mask shape {tuple(mask.shape)} != rewards_per_step shape {tuple(rewards_per_step.shape)}"
        )
    _check_groups(rewards_per_step[..., 0], name="rewards_per_step")
    m = mask.to(rewards_per_step.dtype)
    r = rewards_per_step * m
    disc = _discount_matrix(r.shape[-1], gamma, r)
    if normalise == "returns":
        returns = (r @ disc.T) * m
        return _masked_group_standardise(returns, m, eps, scale, unbiased)
    if normalise == "rewards":
        r_norm = _masked_group_standardise(r, m, eps, scale, unbiased)
        return (r_norm @ disc.T) * m
    raise ValueError(f"normalise must be 'returns' or 'rewards', got {normalise!r}")


def rollout_metrics(rewards: torch.Tensor, unbiased: bool = False) -> dict[str, torch.Tensor]:
    """Reward statistics of a rollout.

    ``reward_mean`` is over all B*G rewards; ``reward_std`` is the mean of the per-event
    (group) stds -- the spread GRPO normalises by; 0 means no learning signal.

    Args:
        rewards: ``[B, G]``.
        unbiased: std convention (see the module docstring).
    """
    _check_groups(rewards)
    with torch.no_grad():
        return {
            "reward_mean": rewards.mean(),
            "reward_std": _std(rewards, 1, unbiased).mean(),
            COUNT_KEY: torch.full((), float(rewards.numel()), dtype=torch.float32, device=rewards.device),
        }
