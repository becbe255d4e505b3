"""The GRPO loss: the clipped surrogate, the k1 / k3 KL estimators and their sum.

Metric names follow Pointcept's GRPOTrainer (``rl_pg_loss``, ``rl_kl_loss``, ``rl_kl``,
``rl_ratio_geom``, ``rl_log_ratio`` (+ ``_min`` / ``_max``), ``rl_clip_frac``,
``rl_logprob``, ``rl_advantage_abs_max``); ``rl_clip_frac_low`` / ``_high`` and
``count`` are additions.
"""
from __future__ import annotations

import torch

from .reductions import COUNT_KEY, _as_steps, _count, _masked_extreme, check_reduction, masked_mean

# The log-ratio fed to exp() is clamped so that one wildly off-policy token gives a large
# but finite ratio / KL instead of inf (inf * 0 advantage = NaN poisons the whole batch).
_LOG_RATIO_LIMIT = 20.0


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
    check_reduction(reduction, max_length)
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


def check_objective(clip_low: float, clip_high: float, kl_estimator: str, level: str, reduction: str) -> None:
    """The GRPO loss's settings, checked once (a step builder calls it when the step is built):
    the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``, so ``0 <= clip_low < 1`` and
    ``clip_high >= 0``; a known KL estimator and level; sequence-level ratios average by sequence."""
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1): the ratio is clipped below at 1 - clip_low, got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0: the ratio is clipped above at 1 + clip_high, got {clip_high}")
    if kl_estimator not in _KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {sorted(_KL_ESTIMATORS)}, got {kl_estimator!r}")
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if level == "sequence" and reduction != "sequence":
        raise ValueError("level='sequence' gives one ratio per trajectory: use reduction='sequence'")


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
