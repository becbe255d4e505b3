"""GRPO primitives: group advantages, clipped surrogate, KL penalties and metric rules.

Every tensor function here is pure (no in-place writes on inputs, no ``.item()``, no host
branch on a tensor's value) and traces under ``torch.compile(fullgraph=True)``. Branches
on *shapes* and on Python configuration (``level``, ``reduction``, ``kl_coef == 0``) are
resolved at trace time and are fine.

Shapes used throughout:

* rewards: ``[B, G]`` -- B events (prompts / scenes), G trajectories sampled per event.
* log-probabilities: ``[N, T]`` per step (N trajectories, T padded steps) or ``[N]`` when
  each trajectory has already been reduced to one log-probability.
* mask: same shape as the log-probabilities; 1 / True marks a real step, 0 a pad.
* advantages: ``[N]`` (one per trajectory, broadcast over its steps) or ``[N, T]``.

Standard deviations are population std (``unbiased=False``, divide by n): the group is
the whole population being standardised, and a group of two then gives advantages of
exactly +-1. The DeepSeekMath / DAPO papers write ``std(r)`` without saying which; TRL
and verl call ``torch.std``, whose default is Bessel-corrected. Pass ``unbiased=True`` to
match those. Groups whose rewards are all equal get advantage 0 (0 / (0 + eps)).

Metric names follow the seed's GRPOTrainer (``rl_pg_loss``, ``rl_kl_loss``, ``rl_kl``,
``rl_ratio_geom``, ``rl_log_ratio`` (+ ``_min`` / ``_max``), ``rl_clip_frac``,
``rl_logprob``, ``rl_advantage_abs_max``); ``rl_clip_frac_low`` / ``_high``,
``reward_mean`` / ``reward_std`` and ``count`` are additions. The combination rules
(:func:`combine_microbatches`, :func:`combine_updates`, :func:`reduce_across_ranks_op`)
reproduce the seed's substring rules.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import torch

__all__ = [
    "validate_rewards",
    "grpo_advantages",
    "rloo_advantages",
    "step_advantages",
    "masked_mean",
    "clipped_surrogate",
    "kl_k1",
    "kl_k3",
    "grpo_loss",
    "rollout_metrics",
    "combine_microbatches",
    "combine_updates",
    "reduce_across_ranks_op",
    "Microbatch",
    "microbatch_slices",
    "COUNT_KEY",
]

# The one metric that is not an average: how many units (trajectories or tokens) the
# other metrics of the same dict are averaged over. It is summed when combining.
COUNT_KEY = "count"

# The log-ratio fed to exp() is clamped so that one wildly off-policy token gives a large
# but finite ratio / KL instead of inf (inf * 0 advantage = NaN poisons the whole batch).
_LOG_RATIO_LIMIT = 20.0


# --------------------------------------------------------------------------- validation


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


# --------------------------------------------------------------------------- reductions


def _as_steps(x: torch.Tensor) -> torch.Tensor:
    """View per-trajectory log-probs ``[N]`` as ``[N, 1]`` so one code path serves both."""
    return x.unsqueeze(-1) if x.dim() == 1 else x


REDUCTIONS = ("sequence", "token", "constant")


def _check_reduction(reduction: str, max_length) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if max_length is not None:
        if reduction != "constant":
            raise ValueError(
                f"max_length={max_length} is the divisor of reduction='constant'; with "
                f"reduction={reduction!r} it would be ignored. Pass reduction='constant' or drop it."
            )
        if not isinstance(max_length, (int, float)) or max_length <= 0:
            raise ValueError(f"max_length must be a positive number (e.g. the max generation length), got {max_length!r}")


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
    _check_reduction(reduction, max_length)
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


# --------------------------------------------------------------------------- surrogate


def _check_logp(logp_new, logp_old, advantages, mask):
    if tuple(logp_new.shape) != tuple(logp_old.shape):
        raise ValueError(
            f"logp_new shape {tuple(logp_new.shape)} != logp_old shape {tuple(logp_old.shape)}"
        )
    if logp_new.dim() not in (1, 2):
        raise ValueError(f"log-probs must be [N] or [N, T], got {tuple(logp_new.shape)}")
    if mask is not None and tuple(mask.shape) != tuple(logp_new.shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} != log-prob shape {tuple(logp_new.shape)}")
    n = logp_new.shape[0]
    if advantages.dim() == 0 or advantages.shape[0] != n or (
        advantages.dim() == 2 and tuple(advantages.shape) != tuple(_as_steps(logp_new).shape)
    ) or advantages.dim() > 2:
        raise ValueError(
            f"advantages must be [N] or [N, T] matching log-probs {tuple(logp_new.shape)}, got "
            f"{tuple(advantages.shape)}; flatten [B, G] advantages with .reshape(-1)"
        )


def clipped_surrogate(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    level: str = "token",
    reduction: str = "sequence",
    max_length: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped policy-gradient loss with separate low / high clip bounds.

    The ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` (DAPO's clip-higher uses
    ``clip_high > clip_low``). The loss is minus the pessimistic surrogate
    ``min(ratio * A, clip(ratio) * A)``.

    Args:
        logp_new: ``[N, T]`` or ``[N]`` log-probs of the taken actions under the policy
            being trained (carries the gradient).
        logp_old: same shape, from the rollout policy; treated as a constant.
        advantages: ``[N]`` or ``[N, T]``; treated as a constant.
        mask: same shape as the log-probs, or None (all valid).
        clip_low, clip_high: clip bounds (floats or 0-dim tensors).
        level: ``"token"`` -- one ratio per step; ``"sequence"`` -- one ratio per
            trajectory, the geometric mean of its step ratios (GSPO); needs ``[N]``
            advantages and ``reduction="sequence"``.
        reduction: how the per-step surrogate is averaged, see :func:`masked_mean`:
            ``"sequence"`` (GRPO), ``"token"`` (DAPO) or ``"constant"`` (Dr. GRPO: each
            trajectory's sum over its steps divided by ``max_length``).
        max_length: the constant divisor of ``reduction="constant"`` (None: the padded T).

    Returns:
        ``(loss, metrics)``: the 0-dim loss and a dict of detached 0-dim metrics
        (``rl_pg_loss``, ``rl_ratio_geom``, ``rl_log_ratio`` and its ``_min`` / ``_max``,
        ``rl_clip_frac_low`` / ``_high`` / ``rl_clip_frac``, ``rl_logprob``,
        ``rl_advantage_abs_max``, ``count``). Fractions are over the units of ``reduction``
        (``"constant"``: per-trajectory fractions of valid steps, averaged over trajectories,
        as ``"sequence"``).
    """
    _check_logp(logp_new, logp_old, advantages, mask)
    _check_reduction(reduction, max_length)
    # Means that describe the batch (clip fractions, log-ratios) are not length-normalised
    # sums: under "constant" they average like "sequence" (same units, trajectories).
    stat_reduction = "sequence" if reduction == "constant" else reduction
    lp_new = _as_steps(logp_new)
    # Old log-probs and advantages are rollout constants: no gradient may reach them even
    # if the caller forgot to detach (e.g. advantages computed from a value head).
    lp_old = _as_steps(logp_old).detach()
    adv = advantages.detach()
    m = None if mask is None else _as_steps(mask)
    mf = torch.ones_like(lp_new) if m is None else m.to(lp_new.dtype)

    if level == "token":
        adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
        adv = adv.expand_as(lp_new)
        log_ratio = (lp_new - lp_old).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        unit_mask, unit_reduction = m, stat_reduction
    elif level == "sequence":
        if adv.dim() != 1:
            raise ValueError("level='sequence' needs one advantage per trajectory, shape [N]")
        if reduction != "sequence":
            raise ValueError("level='sequence' gives one ratio per trajectory: use reduction='sequence'")
        seq_log_ratio = ((lp_new - lp_old) * mf).sum(-1) / mf.sum(-1).clamp(min=1)
        log_ratio = seq_log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        unit_mask, unit_reduction = None, "sequence"
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")

    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    if level == "token":
        loss = -masked_mean(surrogate, m, reduction, max_length)
    else:
        loss = -masked_mean(surrogate, None, "sequence")

    with torch.no_grad():
        # Clipping is "active" where the clipped branch wins and kills the gradient.
        low = ((ratio < 1.0 - clip_low) & (adv < 0)).to(lp_new.dtype)
        high = ((ratio > 1.0 + clip_high) & (adv > 0)).to(lp_new.dtype)
        lr = log_ratio.detach()
        mean_log_ratio = masked_mean(lr, unit_mask, unit_reduction)
        metrics = {
            "rl_pg_loss": loss.detach(),
            "rl_ratio_geom": mean_log_ratio.exp(),
            "rl_log_ratio": mean_log_ratio,
            "rl_log_ratio_min": _masked_extreme(lr, unit_mask, largest=False),
            "rl_log_ratio_max": _masked_extreme(lr, unit_mask, largest=True),
            "rl_clip_frac_low": masked_mean(low, unit_mask, unit_reduction),
            "rl_clip_frac_high": masked_mean(high, unit_mask, unit_reduction),
            "rl_logprob": masked_mean(lp_new.detach(), m, stat_reduction),
            "rl_advantage_abs_max": _masked_extreme(adv.abs(), unit_mask, largest=True),
            COUNT_KEY: _count(lp_new, m, reduction),
        }
        metrics["rl_clip_frac"] = metrics["rl_clip_frac_low"] + metrics["rl_clip_frac_high"]
    return loss, metrics


# --------------------------------------------------------------------------- KL


def kl_k1(
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    mask: torch.Tensor | None = None,
    reduction: str = "sequence",
    max_length: int | float | None = None,
) -> torch.Tensor:
    """k1 estimate of KL(pi || pi_ref): mean of ``logp - logp_ref`` over sampled steps.

    Unbiased but can be negative per sample; its gradient is not the KL's gradient, so
    prefer it as a metric and :func:`kl_k3` as a penalty.

    Args:
        logp: ``[N, T]`` / ``[N]`` log-probs under the trained policy (on-policy samples).
        logp_ref: same shape, under the reference policy; treated as a constant.
        mask, reduction, max_length: see :func:`masked_mean`.
    """
    return masked_mean(logp - logp_ref.detach(), mask, reduction, max_length)


def kl_k3(
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    mask: torch.Tensor | None = None,
    reduction: str = "sequence",
    max_length: int | float | None = None,
) -> torch.Tensor:
    """k3 estimate of KL(pi || pi_ref): mean of ``exp(d) - d - 1`` with ``d = logp_ref - logp``.

    Non-negative per sample and unbiased (Schulman's k3, used by GRPO). ``d`` is clamped
    to +-20 so an extreme token gives a large finite value rather than inf.

    Args: as :func:`kl_k1`.
    """
    d = (logp_ref.detach() - logp).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return masked_mean(d.exp() - d - 1.0, mask, reduction, max_length)


_KL_ESTIMATORS = {"k1": kl_k1, "k3": kl_k3}


def grpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    logp_ref: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float | torch.Tensor = 0.0,
    kl_estimator: str = "k3",
    level: str = "token",
    reduction: str = "sequence",
    max_length: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss: clipped surrogate plus ``kl_coef`` times a KL penalty to a reference.

    With ``logp_ref is None`` or a Python ``kl_coef == 0`` there is no KL term, so the
    caller needs no reference forward pass; ``rl_kl_loss`` is then 0 and ``rl_kl`` absent.
    A tensor ``kl_coef`` always adds the term (its value cannot be branched on).

    Args:
        logp_ref: ``[N, T]`` / ``[N]`` reference-policy log-probs, or None.
        kl_coef: weight of the KL penalty (beta).
        kl_estimator: ``"k3"`` (default, GRPO) or ``"k1"``.
        Others: see :func:`clipped_surrogate`.

    Returns:
        ``(loss, metrics)``: metrics of :func:`clipped_surrogate` plus ``loss``,
        ``rl_kl_loss`` and (when computed) ``rl_kl``.
    """
    if kl_estimator not in _KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {sorted(_KL_ESTIMATORS)}, got {kl_estimator!r}")
    pg_loss, metrics = clipped_surrogate(
        logp_new, logp_old, advantages, mask, clip_low, clip_high, level, reduction, max_length
    )
    use_kl = logp_ref is not None and not (isinstance(kl_coef, (int, float)) and kl_coef == 0)
    if use_kl:
        if tuple(logp_ref.shape) != tuple(logp_new.shape):
            raise ValueError(
                f"logp_ref shape {tuple(logp_ref.shape)} != logp_new shape {tuple(logp_new.shape)}"
            )
        # The KL is a per-step quantity even for sequence-level ratios; it is averaged with
        # the loss's reduction so micro-batch weighting stays exact.
        kl = _KL_ESTIMATORS[kl_estimator](logp_new, logp_ref, mask, reduction, max_length)
        kl_loss = kl_coef * kl
        loss = pg_loss + kl_loss
        metrics["rl_kl"] = kl.detach()
        metrics["rl_kl_loss"] = kl_loss.detach()
    else:
        loss = pg_loss
        metrics["rl_kl_loss"] = torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)
    metrics["loss"] = loss.detach()
    return loss, metrics


# --------------------------------------------------------------------------- rollout metrics


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


# --------------------------------------------------------------------------- combination rules


def reduce_across_ranks_op(key: str) -> str:
    """How a scalar metric combines across micro-batches / ranks: ``"min"``, ``"max"``, ``"mean"``.

    The seed's substring rule, checked in this order: a key containing ``_min`` anywhere
    (also ``x_min_update0``) is a minimum; else one containing ``_max`` or ``abs_max`` is a
    maximum; else a mean. ``count`` is the one addition: it is a ``"sum"``.
    """
    if key == COUNT_KEY:
        return "sum"
    if "_min" in key:
        return "min"
    if "_max" in key or "abs_max" in key:
        return "max"
    return "mean"


def _as_tensor(v, like: torch.Tensor) -> torch.Tensor:
    return v.to(like.device, torch.float32) if isinstance(v, torch.Tensor) else torch.tensor(
        float(v), dtype=torch.float32, device=like.device
    )


def combine_microbatches(
    outputs: Sequence[tuple[Mapping[str, torch.Tensor], int | float | torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Combine the metrics of the micro-batches of one policy update.

    ``_min`` keys take the min, ``_max`` / ``abs_max`` keys the max, ``count`` the sum,
    all others the count-weighted mean (the seed's ``sum(value * count / total)``). Only
    tensor ops: traces when the key set is static.

    Args:
        outputs: ``(metrics, count)`` per micro-batch; ``count`` is the number of units the
            metrics averaged over (an int or a 0-dim tensor, e.g. ``metrics["count"]``).

    A key missing from some micro-batches is averaged over those that have it, renormalised
    by their counts (the seed leaves such a sum under-weighted); non-tensor values are taken
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
            # clamp: an all-empty update (every count 0) gives 0, as in the seed, not NaN.
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


# --------------------------------------------------------------------------- micro-batching


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
    ``reduction="sequence"`` (the default; weights ``len(chunk) / N``, as in the seed), or
    tokens for ``reduction="token"`` (pass ``counts`` = valid steps per trajectory,
    e.g. ``mask.sum(-1)``). Advantages must be computed on the whole group first.

    Args:
        num_trajectories: N.
        microbatch_size: trajectories per chunk; 0 means no splitting (one chunk).
        group_size: if given, chunks never cross a group boundary (the seed slices each
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
