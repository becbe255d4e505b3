"""GRPO primitives: group advantages, clipped surrogate, KL penalties and metric rules.

Rooms:
    advantages   validate_rewards, grpo / rloo / step advantages, rollout_metrics
    losses       clipped_surrogate, kl_k1 / kl_k3, grpo_loss
    reductions   masked_mean and the reduction rules, COUNT_KEY
    microbatch   microbatch_slices, combine_microbatches / combine_updates, reduce_across_ranks_op

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
"""
from .advantages import grpo_advantages, rloo_advantages, rollout_metrics, step_advantages, validate_rewards
from .losses import check_objective, clipped_surrogate, grpo_loss, kl_k1, kl_k3
from .microbatch import Microbatch, combine_microbatches, combine_updates, microbatch_slices, reduce_across_ranks_op
from .reductions import COUNT_KEY, masked_mean

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
    "check_objective",
    "rollout_metrics",
    "combine_microbatches",
    "combine_updates",
    "reduce_across_ranks_op",
    "Microbatch",
    "microbatch_slices",
    "COUNT_KEY",
]
