"""The GRPO step's parts: the rollout record, a policy's log-probs, the clipped objective,
the frozen reference policy and the advantage kinds. :mod:`pimm_fn.steps.grpo` composes them;
a new RL step can too."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.func import functional_call

from .. import rl
from ..state import TrainState

__all__ = ["Rollout", "PolicyFn", "categorical_log_prob", "grpo_objective", "with_reference", "REF_KEY"]

REF_KEY = "grpo_ref"  # state.extra[REF_KEY]: the frozen reference policy's params


class Rollout(NamedTuple):
    """What the sampler hands the update: a pytree of tensors plus host-side metrics.

    traj: per-trajectory tensors, leading dim N = B * G (event-major: trajectory
        ``b * G + g`` is sample g of input b); micro-batches slice every entry. Must hold
        ``actions`` and ``logp_old`` (``[N, T]`` per step, or ``[N]``), optionally
        ``mask`` (same shape as ``logp_old``; 1 = real step) and anything the
        ``log_prob`` function reads (e.g. ``obs`` ``[N, T, D]``).
    shared: inputs every micro-batch needs whole (e.g. the point batch whose clouds the
        trajectories label); any pytree of tensors, or None.
    rewards: ``[B, G]`` or per-step ``[B, G, T]``; None when ``reward`` computes them.
    metrics: 0-dim tensors describing the rollout (e.g. mean episode return); they are
        added to the step's metrics unchanged.
    """

    traj: dict
    shared: Any = None
    rewards: Optional[torch.Tensor] = None
    metrics: dict = {}


class _Method(torch.nn.Module):
    """Exposes ``inner.<name>`` as ``forward`` so ``functional_call`` can call it."""

    def __init__(self, inner: torch.nn.Module, name: str):
        super().__init__()
        self.inner = inner
        self.name = name

    def forward(self, *args, **kwargs):
        return getattr(self.inner, self.name)(*args, **kwargs)


class PolicyFn:
    """``policy(inputs) -> log-probabilities [..., A]``: a module's method bound to given params.

    Built by the step for the current params (sampling, update) or the reference params;
    users only call it. ``check=True`` (the host rollout) verifies the output is a
    normalised log-probability table.
    """

    def __init__(self, model: torch.nn.Module, params: dict, buffers: dict, method: str = "log_probs",
                 check: bool = False, wrapped: Optional[torch.nn.Module] = None):
        self.model, self.method, self.check = model, method, check
        # Building a Module inside a compiled region breaks the graph: the step passes one
        # it built on the host.
        self._wrapped = wrapped if wrapped is not None else _Method(model, method)
        self._tensors = {**{f"inner.{k}": v for k, v in params.items()},
                         **{f"inner.{k}": v for k, v in buffers.items()}}

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        out = functional_call(self._wrapped, self._tensors, args, kwargs)
        if self.check:
            _check_log_probs(out, type(self.model).__name__, self.method)
        return out


def _check_log_probs(out, model_name: str, method: str) -> None:
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() < 1:
        raise TypeError(
            f"{model_name}.{method}(inputs) must return a float tensor of log-probabilities "
            f"[..., num_actions], got {type(out).__name__}"
        )
    total = out.detach().float().logsumexp(-1)
    if out.numel() and not bool(torch.allclose(total, torch.zeros_like(total), atol=1e-3)):
        raise ValueError(
            f"{model_name}.{method}(inputs) did not return log-probabilities: logsumexp over "
            f"the last dim is {float(total.flatten()[0]):.4g}, not 0. Return "
            "torch.log_softmax(logits, -1), not raw logits or probabilities."
        )


def categorical_log_prob(policy: PolicyFn, shared, traj: dict) -> dict:
    """The default ``log_prob``: log pi(action) and the entropy at every step.

    The policy is applied to ``traj["obs"]`` when the rollout has per-trajectory
    observations, else to ``shared``; its ``[..., A]`` table is gathered at
    ``traj["actions"]`` with broadcasting (a ``[P, A]`` table shared by the ``[n, P]``
    actions of n trajectories gives ``[n, P]``).

    Returns ``{"logp": like actions, "entropy": like actions}``.
    """
    if "obs" not in traj and shared is None:
        raise ValueError(
            f"the rollout has no observations to score: traj has {sorted(traj)} (no 'obs') and Rollout.shared "
            "is None; put per-trajectory inputs in traj['obs'], or one input per event in Rollout(shared=...), "
            "or pass grpo(log_prob=...) for another layout")
    table = policy(traj["obs"]) if "obs" in traj else policy(shared)
    actions = traj["actions"]
    entropy = -(table.exp() * table).sum(-1)
    while table.dim() < actions.dim() + 1:  # a table shared by every trajectory
        table = table.unsqueeze(0)
    # expand + gather, not take_along_dim: on torch 2.13 take_along_dim's broadcasting pins
    # a dynamic size to its traced value (a guard Eq(s, 2031)), so a compiled step over a
    # shared [P, A] table recompiled for every point count until the recompile limit.
    table = table.expand(actions.shape + table.shape[-1:])
    logp = table.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    return {"logp": logp, "entropy": entropy.expand_as(logp)}


LossFn = Callable[[dict, dict, int], tuple]


def grpo_objective(
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    level: str = "token",
    reduction: str = "sequence",
    max_length: Optional[float] = None,
) -> LossFn:
    """The default GRPO loss: :func:`pimm_fn.rl.grpo_loss` over one micro-batch.

    A loss function is ``loss(out, chunk, update_index) -> (loss, metrics)``; ``out`` is
    what ``log_prob`` returned for the chunk (``out["logp"]`` carries the gradient) and
    ``chunk`` holds ``logp_old``, ``advantages``, ``mask`` (or None), ``logp_ref`` (None
    without KL) and ``traj`` (the sliced per-trajectory tensors). Metrics should include
    ``count`` (units averaged over) for exact micro-batch combination.
    """
    # Checked here, when the step is built, rather than at its first call.
    rl.check_objective(clip_low, clip_high, kl_estimator, level, reduction)

    def loss(out, chunk, update_index):
        return rl.grpo_loss(
            out["logp"], chunk["logp_old"], chunk["logp_ref"], chunk["advantages"], chunk["mask"],
            clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef, kl_estimator=kl_estimator,
            level=level, reduction=reduction, max_length=max_length,
        )

    return loss


def with_reference(state: TrainState) -> TrainState:
    """The state with a frozen copy of its current params as the KL reference policy."""
    ref = {k: v.detach().clone() for k, v in state.params.items()}
    return state.replace(extra={**state.extra, REF_KEY: ref})


_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "step")


def _advantages(kind, rewards: torch.Tensor, mask: Optional[torch.Tensor], gamma: float, eps: float):
    """``[N]`` (trajectory rewards) or ``[N, T]`` (per-step rewards) advantages."""
    if callable(kind):
        return kind(rewards, mask)
    if rewards.dim() == 3:
        b, g, t = rewards.shape
        m = torch.ones_like(rewards) if mask is None else mask.reshape(b, g, t).to(rewards.dtype)
        if kind == "step":
            return rl.step_advantages(rewards, m, gamma=gamma, eps=eps).reshape(b * g, t)
        # trajectory-level advantage of the summed reward, broadcast to every step
        total = (rewards * m).sum(-1)
        return _advantages(kind, total, None, gamma, eps).reshape(b * g, 1).expand(b * g, t) * m.reshape(b * g, t)
    if kind == "step":
        raise ValueError("advantage='step' needs per-step rewards [B, G, T] from the sampler or reward function")
    if kind == "rloo":
        adv = rl.rloo_advantages(rewards)
    else:
        adv = rl.grpo_advantages(rewards, eps=eps, scale=(kind == "grpo"))
    return adv.reshape(-1)
