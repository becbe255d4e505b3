"""Policies for GRPO: a policy is any module exposing log-probabilities of actions.

The contract (what a GRPO step relies on):

* ``policy.log_probs(batch) -> [..., A]``: log-softmax over the A actions of every
  decision in the batch (a point's label, a control step's action).
* ``policy(batch) -> dict`` (the call a step makes through ``functional_call``) returns
  ``"logits"`` and ``"log_probs"`` [..., A], and, when the batch carries the taken
  actions under ``"action"`` [...] int64, ``"action_log_prob"`` [...]: the log-probability
  of each taken action, differentiable in the params.
* ``policy.sample(batch_or_obs, greedy=False)`` draws actions (no gradient) with torch's
  generator, which the step boundary seeds from the state's RNG key.

Sampling uses the Gumbel-max trick (argmax of logits + Gumbel noise): one fused tensor
expression, no ``torch.multinomial`` host sync, so it also runs inside a compiled step.
"""
from __future__ import annotations

from typing import Protocol, Sequence, Union, runtime_checkable

import torch
from torch import nn

from ._common import classification_outputs
from .point_seg import PointSegNet, batch_index


@runtime_checkable
class Policy(Protocol):
    """Anything with ``log_probs(batch) -> [..., A]`` log-softmax over actions."""

    def log_probs(self, batch) -> torch.Tensor: ...


def gumbel_sample(logits: torch.Tensor, greedy: bool = False) -> torch.Tensor:
    """One categorical sample per row of ``logits`` [..., A] (int64 [...]), or the argmax."""
    logits = logits.detach().float()
    if greedy:
        return logits.argmax(dim=-1)
    u = torch.rand_like(logits).clamp_(1e-10, 1.0 - 1e-7)  # keep log(-log u) finite
    return (logits - torch.log(-torch.log(u))).argmax(dim=-1)


def take_log_prob(log_probs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """``log_probs[..., actions]`` row by row: [..., A] and [...] -> [...]."""
    return log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)


def per_cloud_sum(values: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Sum per-point values [N] over each cloud -> [B] (a labelling's log-probability).

    offset: Pointcept's cumulative ends [B]. Works under compile with dynamic N.
    """
    cloud = batch_index(offset, values.shape[0])
    return values.new_zeros(offset.shape[0]).index_add(0, cloud, values)


def _policy_outputs(logits: torch.Tensor, batch) -> dict:
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    out = {"logits": logits, "log_probs": log_probs}
    if isinstance(batch, dict) and "action" in batch:
        out["action_log_prob"] = take_log_prob(log_probs, batch["action"])
    return out


class PointLabelPolicy(PointSegNet):
    """A per-point labelling policy: pi(label_i | cloud) = softmax(seg_logits_i).

    A :class:`PointSegNet` (same constructor, same parameter names, so a supervised
    checkpoint loads as is) whose actions are the labels of the points: one rollout
    labels every point of a cloud, and its log-probability is the per-cloud sum of the
    points' log-probabilities (:func:`per_cloud_sum`).

    ``policy(batch)``: "logits" = "seg_logits" [N, K], "log_probs" [N, K]; with
    ``batch["action"]`` [N]: "action_log_prob" [N]; with ``batch["segment"]``: also the
    supervised "loss" and "acc" (so one module serves fine-tuning and evaluation).
    """

    def log_probs(self, batch: dict) -> torch.Tensor:
        """[N, num_classes] log-softmax of the point labels."""
        return torch.log_softmax(self.head[1](self.features(batch)).float(), dim=-1)

    def log_prob(self, batch: dict, actions: torch.Tensor) -> torch.Tensor:
        """[N] log-probability of labelling point i with ``actions[i]``."""
        return take_log_prob(self.log_probs(batch), actions)

    @torch.no_grad()
    def sample(self, batch: dict, greedy: bool = False) -> torch.Tensor:
        """[N] int64 sampled labels (``greedy``: the argmax labelling)."""
        return gumbel_sample(self.head[1](self.features(batch)), greedy)

    def forward(self, batch: dict) -> dict:
        logits = self.head[1](self.features(batch))
        out = _policy_outputs(logits, batch)
        out.update(classification_outputs(logits, batch, "segment", "seg_logits",
                                          ignore_index=self.ignore_index, weight=self.class_weights))
        return out


class CategoricalMLPPolicy(nn.Module):
    """A discrete-action MLP policy for CartPole-like control.

    Args:
        obs_dim: observation width; observations are [..., obs_dim] float.
        num_actions: number of discrete actions A.
        hidden: hidden width (int) or widths (sequence); tanh between layers.
    ``policy({"obs", ["action"]})`` -> "logits", "log_probs" [..., A] and, with
    ``"action"`` [...], "action_log_prob" [...]. The last layer starts near zero, so the
    initial policy is close to uniform (every action gets explored).
    """

    def __init__(self, obs_dim: int, num_actions: int, hidden: Union[int, Sequence[int]] = 64):
        super().__init__()
        widths = [hidden] if isinstance(hidden, int) else list(hidden)
        layers, cin = [], obs_dim
        for h in widths:
            layers += [nn.Linear(cin, h), nn.Tanh()]
            cin = h
        last = nn.Linear(cin, num_actions)
        with torch.no_grad():
            last.weight.mul_(0.01)
            last.bias.zero_()
        self.net = nn.Sequential(*layers, last)
        self.obs_dim, self.num_actions = obs_dim, num_actions

    def _obs(self, batch_or_obs) -> torch.Tensor:
        obs = batch_or_obs["obs"] if isinstance(batch_or_obs, dict) else batch_or_obs
        if obs.shape[-1] != self.obs_dim:
            raise ValueError(f"observations must be [..., {self.obs_dim}], got {tuple(obs.shape)}")
        return obs.float()

    def logits(self, batch_or_obs) -> torch.Tensor:
        """[..., A] action logits for a batch dict ({"obs": ...}) or an obs tensor."""
        return self.net(self._obs(batch_or_obs))

    def log_probs(self, batch_or_obs) -> torch.Tensor:
        """[..., A] log-softmax over actions."""
        return torch.log_softmax(self.logits(batch_or_obs).float(), dim=-1)

    def log_prob(self, obs, actions: torch.Tensor) -> torch.Tensor:
        """[...] log-probability of ``actions`` [...] at observations ``obs`` [..., obs_dim]."""
        return take_log_prob(self.log_probs(obs), actions)

    @torch.no_grad()
    def sample(self, obs, greedy: bool = False) -> torch.Tensor:
        """[...] int64 sampled actions (``greedy``: the most likely action)."""
        return gumbel_sample(self.logits(obs), greedy)

    def forward(self, batch: dict) -> dict:
        return _policy_outputs(self.logits(batch), batch)
