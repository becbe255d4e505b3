"""The GRPO step: sample a group of trajectories per input, score them, update the policy P times.

Replaces Pointcept's GRPOTrainer (seed-behaviour.md items 14-18). A GRPO step is a
:class:`pimm_fn.compile.Step`: its host ``prepare`` is the rollout and its pure core the
update, so ``compile_step``, ``explain_step``, ``distributed.wrap_step`` and
``bench.benchmark_step`` take it like any other step. One call
``state, metrics = step(state, batch)`` runs two phases:

1. **Rollout (``prepare``: host, eager, no grad).** torch's generator is seeded from the
   state's RNG key, then ``sample(policy, batch, group_size)`` draws G trajectories for each of the
   B inputs of the batch and returns a :class:`Rollout`. ``reward(batch, rollout)``
   scores them (``[B, G]``, or ``[B, G, T]`` per-step rewards) and the rewards are
   validated on the host (:func:`pimm_fn.rl.validate_rewards`). This phase may run any
   Python (a gymnasium environment); it is never compiled into the update.
2. **Update (pure core).** Advantages, the reference policy's log-probs (only when
   ``kl_coef != 0``), then P = ``policy_updates`` optimizer updates over the cached
   rollout, each optionally split into trajectory micro-batches whose losses are weighted
   by count / total so that one update sees the full-batch gradient. This core is a
   plain step function ``(state, rollout) -> (state, metrics)``: ``compile_step(step)``
   compiles it with ``fullgraph=True`` (the rollout stays eager);
   ``explain_step(step, state, batch)`` runs the rollout and inspects the core. Each
   update goes through :func:`pimm_fn.steps.common.guarded_update`, as a supervised
   step's does; ``grad_transform`` (the data-parallel all-reduce) applies there.

The optimizer's own count advances P times per batch, so schedules count optimizer
updates (size them ``batches * epochs * P``, as Pointcept does). The frozen reference
params live in ``state.extra["grpo_ref"]`` (see :func:`with_reference`); everything a
mid-run resume needs (params, optimizer state, reference, RNG key, cursor) is in the state.

The policy is any module with a method (default ``log_probs``) mapping inputs to
normalised log-probabilities over actions, ``[..., A]``. The step calls it through
``functional_call`` with the state's params; the module's own tensors are never read.
Sampling (``sample``), per-chunk log-probs (``log_prob``) and the objective (``loss``)
are separate arguments, so either can be swapped; docs/writing_a_step.md shows a user
writing a whole new variant from :mod:`pimm_fn.rl`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch

from .. import rl
from .._validate import check_int
from ..amp import LossScaleConfig, as_autocast, renamed_loss_scale
from ..compile import Step
from ..data.device import to_device
from ..optim.base import frozen_names
from ..rl.reductions import check_reduction
from ..state import TrainState
from ..tree import tree_map
from .common import applied_buffers, check_clip_grad, guarded_update, value_and_grad

__all__ = [
    "Rollout",
    "PolicyFn",
    "GRPOStep",
    "grpo",
    "grpo_objective",
    "categorical_log_prob",
    "with_reference",
    "REF_KEY",
]

from .policy import (  # noqa: F401 - the GRPO names users import from here
    _ADVANTAGES,
    REF_KEY,
    LossFn,
    PolicyFn,
    Rollout,
    _advantages,
    _check_log_probs,
    _Method,
    categorical_log_prob,
    grpo_objective,
    with_reference,
)


class GRPOStep(Step):
    """A GRPO step ``(state, batch) -> (state, metrics)``: host rollout + pure update core.

    A :class:`pimm_fn.compile.Step` whose ``prepare`` is :meth:`rollout` and whose ``core``
    is the update over ``(state, rollout)``; compile it with ``compile_step(step)``.
    Build it with :func:`grpo`.
    """

    def __init__(self, *, sample, reward, group_size, log_prob, loss, policy_updates, microbatch_size,
                 weight_by, advantage, gamma, eps, kl, clip_grad, method, autocast=None,
                 loss_scale_config: LossScaleConfig = LossScaleConfig(), grad_transform=None, name="grpo"):
        self.autocast, self.loss_scale_config = as_autocast(autocast), loss_scale_config
        self.sample, self.reward, self.group_size = sample, reward, group_size
        self.log_prob, self.loss = log_prob, loss
        self.policy_updates, self.microbatch_size, self.weight_by = policy_updates, microbatch_size, weight_by
        self.advantage, self.gamma, self.eps, self.kl = advantage, gamma, eps, kl
        self.clip_grad, self.method, self.grad_transform = clip_grad, method, grad_transform
        self._wrapper: Optional[_Method] = None
        super().__init__(self._core, name=name, prepare=self.rollout)

    def _policy(self, model, params, buffers, check=False) -> PolicyFn:
        w = self._wrapper
        if w is None or w.inner is not model:
            if torch.compiler.is_compiling():
                raise RuntimeError("the GRPO update core was traced without its rollout; compile the "
                                   "whole step with compile_step(step): the rollout runs on the host first")
            w = self._wrapper = _Method(model, self.method)
        return PolicyFn(model, params, buffers, self.method, check=check, wrapped=w)

    # ------------------------------------------------------------------ host phase

    def rollout(self, state: TrainState, batch) -> Rollout:
        """The step's ``prepare``: sample (no grad), score and validate one rollout for ``batch``.

        A call runs it with torch's generator seeded from ``state.rng``; seed it the same
        way (``pimm_fn.compile.seeded_rng``) to reproduce what a step samples.
        """
        model = state.model
        if self.log_prob is categorical_log_prob and not callable(getattr(model, self.method, None)):
            raise TypeError(
                f"{type(model).__name__} has no {self.method}() method: a GRPO policy must expose "
                f"log-probabilities of actions, {self.method}(inputs) -> log_softmax(logits) [..., A]. "
                "Add the method, name another with grpo(method=...), or pass your own log_prob."
            )
        if self.kl and REF_KEY not in state.extra:
            raise KeyError(
                f"kl_coef != 0 needs the frozen reference policy in state.extra[{REF_KEY!r}]; "
                "build the state with pimm_fn.steps.with_reference(state)"
            )
        # On copies of the buffers: sampling must not move the state's BatchNorm statistics.
        policy = self._policy(model, state.params, _copies(state.buffers), check=True)
        with torch.no_grad():
            ro = self.sample(policy, batch, self.group_size)
        if not isinstance(ro, Rollout):
            raise TypeError(f"sample() must return a pimm_fn.steps.Rollout, got {type(ro).__name__}")
        for key in ("actions", "logp_old"):
            if key not in ro.traj:
                raise KeyError(f"the rollout's traj has no {key!r} (keys: {sorted(ro.traj)})")
        n = ro.traj["logp_old"].shape[0]
        g = self.group_size
        if n % g:
            raise ValueError(f"the rollout has {n} trajectories, not a multiple of group_size={g}")
        for k, v in ro.traj.items():
            if v is not None and v.shape[:1] != (n,):
                raise ValueError(f"rollout traj[{k!r}] has leading dim {tuple(v.shape[:1])}, expected ({n},)")
        mask = ro.traj.get("mask")
        if mask is not None and mask.shape != ro.traj["logp_old"].shape:
            raise ValueError(
                f"traj['mask'] shape {tuple(mask.shape)} != logp_old shape {tuple(ro.traj['logp_old'].shape)}"
            )
        rewards = ro.rewards
        if self.reward is not None:
            with torch.no_grad():
                rewards = self.reward(batch, ro)
        if rewards is None:
            raise ValueError("no rewards: give grpo(reward=fn) or return Rollout(rewards=...) from sample()")
        rewards = torch.as_tensor(rewards)
        if rewards.dim() == 3:
            t = ro.traj["logp_old"].shape[-1] if ro.traj["logp_old"].dim() == 2 else 1
            if tuple(rewards.shape) != (n // g, g, t):
                raise ValueError(f"per-step rewards have shape {tuple(rewards.shape)}, expected {(n // g, g, t)} "
                                 "(events x trajectories per event x steps)")
            _validate_step_rewards(rewards)
        else:
            rl.validate_rewards(rewards, (n // g, g))
        for k, v in dict(ro.metrics).items():
            if torch.as_tensor(v).numel() != 1:
                raise ValueError(f"Rollout.metrics[{k!r}] has shape {tuple(torch.as_tensor(v).shape)}; a metric is "
                                 "one number (average it over the rollout, e.g. returns.mean())")
        metrics = {k: torch.as_tensor(v).detach().float().reshape(()) for k, v in dict(ro.metrics).items()}
        ro = ro._replace(rewards=rewards.detach().float(), metrics=metrics)
        # Rewards and trajectories made on the host (an environment, numpy) go where the
        # state is, pinned and non-blocking; on the state's device already: no copy.
        return to_device(ro, next(iter(state.params.values())).device)

    # ------------------------------------------------------------------ pure core

    def _core(self, state: TrainState, ro: Rollout):
        g, p_updates = self.group_size, self.policy_updates
        traj, shared, rewards = ro.traj, ro.shared, ro.rewards
        mask = traj.get("mask")
        n = traj["logp_old"].shape[0]
        with torch.no_grad():
            adv = _advantages(self.advantage, rewards, mask, self.gamma, self.eps)
            logp_ref = None
            if self.kl:
                ref = self._policy(state.model, state.extra[REF_KEY], _copies(state.buffers))
                logp_ref = self.log_prob(ref, shared, traj)["logp"].detach()
        counts = None
        if self.weight_by == "tokens" and mask is not None:
            counts = mask.to(torch.float32).sum(-1) if mask.dim() == 2 else mask.to(torch.float32)
        slices = rl.microbatch_slices(n, self.microbatch_size, group_size=g, counts=counts)
        transform = self.grad_transform
        weighted = getattr(transform, "weighted", None)
        if weighted is not None:
            # Each rank's gradient is a mean over its own trajectories (or tokens): weighted by
            # those counts, the mean over ranks is the one-process gradient of the global batch.
            units = counts.sum() if counts is not None else torch.tensor(
                float(traj["logp_old"].numel() if self.weight_by == "tokens" else n))
            transform = functools.partial(weighted, weight=units)

        params, opt_state, scaler, buffers = state.params, state.opt_state, state.loss_scale, state.buffers
        hyper = state.tx.hyperparams(state.opt_state) if state.tx.hyperparams is not None else {}
        ctx_device = next(iter(params.values())).device
        frozen = frozen_names(state.tx, params)  # no gradient for params the optimizer never changes
        update_metrics, skipped, scales = [], [], []
        for p in range(p_updates):
            grads, outs = None, []
            scale = scaler.scale if scaler is not None else None
            before = buffers  # BatchNorm statistics before this update's forwards
            for mb in slices:
                s, e = mb.start, mb.end
                chunk_traj = {k: (v[s:e] if v is not None else None) for k, v in traj.items()}
                chunk = {
                    "logp_old": chunk_traj["logp_old"],
                    "advantages": adv[s:e],
                    "mask": chunk_traj.get("mask"),
                    "logp_ref": None if logp_ref is None else logp_ref[s:e],
                    "traj": chunk_traj,
                }
                # Each forward of a policy in training mode moves its statistics on, as a
                # module's forwards would, on copies (the input state is never mutated).
                buffers = _copies(buffers)
                objective = self._objective(state.model, buffers, shared, chunk, p, mb.weight, ctx_device)
                _, (loss, metrics), g_chunk = value_and_grad(objective, params, frozen=frozen, scale=scale)
                grads = g_chunk if grads is None else tree_map(torch.add, grads, g_chunk)
                metrics = {k: v.detach() for k, v in metrics.items()}
                metrics.setdefault("loss", loss.detach())
                count = metrics.get(rl.COUNT_KEY, mb.count)
                outs.append((metrics, count))
            if scaler is not None:
                scales.append(scaler.scale)
            params, opt_state, finite, grad_norm, scaler = guarded_update(
                state.tx, params, opt_state, grads, scaler=scaler, scaler_config=self.loss_scale_config,
                clip_grad=self.clip_grad, grad_transform=transform,
            )
            buffers = applied_buffers(finite, buffers, before)
            m = rl.combine_microbatches(outs)
            m["grad_norm"] = grad_norm
            update_metrics.append(m)
            skipped.append((~finite).float())

        metrics = rl.combine_updates(update_metrics)
        traj_rewards = rewards if rewards.dim() == 2 else (
            rewards * (mask.reshape(rewards.shape).to(rewards.dtype) if mask is not None else 1.0)).sum(-1)
        rm = rl.rollout_metrics(traj_rewards)
        metrics["reward_mean"], metrics["reward_std"] = rm["reward_mean"], rm["reward_std"]
        metrics["skipped"] = torch.stack(skipped).sum()
        for k, v in hyper.items():
            metrics[k] = v.detach().float().reshape(())
        if scales:
            metrics["loss_scale"] = scales[0]  # the scale the rollout's first update used
        metrics.update(ro.metrics)  # the rollout's own metrics, unchanged
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, buffers=buffers,
                                  loss_scale=scaler)
        return new_state, metrics

    def _objective(self, model, buffers, shared, chunk, update_index, weight, device):
        """``params -> (loss * weight, (loss, metrics))`` over one micro-batch, for value_and_grad."""

        def objective(params):
            policy = self._policy(model, params, buffers)
            ctx = self.autocast.context(device) if self.autocast is not None else None
            if ctx is None:
                out = self.log_prob(policy, shared, chunk["traj"])
            else:
                with ctx:
                    out = self.log_prob(policy, shared, chunk["traj"])
            loss, metrics = self.loss(out, chunk, update_index)
            return loss.float() * weight, (loss, metrics)

        return objective

    def __repr__(self):
        return f"GRPOStep(G={self.group_size}, P={self.policy_updates}, M={self.microbatch_size})"


def _copies(buffers: dict) -> dict:
    return {k: v.clone() for k, v in buffers.items()}


def _validate_step_rewards(rewards: torch.Tensor) -> None:
    if not rewards.is_floating_point():
        raise TypeError(f"rewards must be floating point, got dtype {rewards.dtype}")
    if rewards.shape[1] < 2:
        rl.validate_rewards(rewards[..., 0])  # raises the G = 1 error
    finite = torch.isfinite(rewards)
    if not bool(finite.all()):
        bad = (~finite).nonzero().tolist()
        raise ValueError(
            f"per-step rewards contain {len(bad)} non-finite value(s) (NaN or inf) at [event, "
            f"trajectory, step] {bad[:8]}; fix the reward function"
        )


def grpo(
    *,
    sample: Callable[[PolicyFn, Any, int], Rollout],
    group_size: int,
    reward: Optional[Callable[[Any, Rollout], torch.Tensor]] = None,
    log_prob: Callable = categorical_log_prob,
    loss: Optional[LossFn] = None,
    policy_updates: int = 1,
    microbatch_size: int = 0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    level: str = "token",
    reduction: str = "sequence",
    max_length: Optional[float] = None,
    advantage: Union[str, Callable] = "grpo",
    gamma: float = 1.0,
    eps: float = 1e-6,
    clip_grad: Optional[float] = None,
    method: str = "log_probs",
    autocast=None,
    loss_scale_config: LossScaleConfig = LossScaleConfig(),
    grad_transform: Optional[Callable[[dict], dict]] = None,
    loss_scale=None,
) -> GRPOStep:
    """Build a GRPO step (see the module docstring).

    sample: ``sample(policy, batch, group_size) -> Rollout``, run on the host under no
        grad with torch's generator seeded from the state; ``policy(inputs)`` gives the
        current policy's log-probabilities.
    group_size: G >= 2 trajectories per input.
    reward: ``reward(batch, rollout) -> [B, G]`` (or ``[B, G, T]``); None when the sampler
        fills ``Rollout.rewards`` (an environment's rewards).
    log_prob: ``log_prob(policy, shared, traj) -> {"logp": ..., ...}`` for a chunk of
        trajectories (default :func:`categorical_log_prob`).
    loss: ``loss(out, chunk, update_index) -> (loss, metrics)``; default
        :func:`grpo_objective` built from clip_low / clip_high / kl_coef / kl_estimator /
        level / reduction.
    policy_updates: P >= 1 optimizer updates per rollout.
    microbatch_size: M trajectories per micro-batch (0 = whole rollout); chunks never
        cross an input's group; weights count / total make the update exact.
    kl_coef: 0 runs no reference pass; otherwise the state needs :func:`with_reference`.
    reduction: how the loss averages steps (:func:`pimm_fn.rl.masked_mean`): "sequence"
        (GRPO), "token" (DAPO) or "constant" (Dr. GRPO: each trajectory's sum over its
        steps divided by ``max_length``). "sequence" and "constant" weight micro-batches by
        trajectories, "token" by valid steps (pass the same reduction your custom loss
        averages with).
    max_length: the constant divisor of ``reduction="constant"`` (e.g. the maximum
        generation length); None uses the rollout's padded length T.
    advantage: "grpo", "dr_grpo" (no std scaling), "rloo", "step" (per-step rewards,
        :func:`pimm_fn.rl.step_advantages` with ``gamma``) or ``fn(rewards, mask) -> [N]/[N, T]``.
    clip_grad: max global gradient norm per update, or None.
    method: the policy module's log-probability method.
    autocast: as for :func:`pimm_fn.steps.supervised` ("bfloat16", "float16" or an
        :class:`pimm_fn.amp.Autocast`): the policy's update forwards run under it.
    loss_scale_config: the dynamic loss scale's settings, used when the state has one
        (``TrainState.create(..., loss_scale=True)``; needed with float16): each policy
        update is one scaler step, as ``torch.amp.GradScaler`` counts them; an update with
        inf/NaN gradients is skipped and the scale backs off.
    grad_transform: ``grads -> grads`` applied to each update's gradients before the finite
        check and clipping (as for :func:`pimm_fn.steps.supervised`):
        ``pimm_fn.distributed.grad_transform()`` averages them over ranks (weighted by each
        rank's trajectories or tokens, through its ``weighted``, so unequal ranks stay exact),
        and ``distributed.wrap_step`` then reduces the metrics: GRPO data-parallel.

    The update passes run the policy in the module's own mode: in training mode its
    BatchNorm statistics move on with each forward and come back in the new state (kept
    as they were for an update that was skipped); sampling and the reference pass use
    copies and move nothing.
    """
    renamed_loss_scale(loss_scale, "grpo")
    check_int("group_size", group_size, 2, hint=": GRPO compares the G trajectories sampled for one input with "
              "each other, so G = 1 leaves no group to compare against")
    check_int("policy_updates", policy_updates, 1)
    check_int("microbatch_size", microbatch_size, 0, hint=" (0 = no splitting)")
    if not callable(advantage) and advantage not in _ADVANTAGES:
        raise ValueError(f"advantage must be one of {_ADVANTAGES} or a callable, got {advantage!r}")
    check_reduction(reduction, max_length)
    clip_grad = check_clip_grad(clip_grad)
    if not callable(sample):
        raise TypeError("sample must be a function sample(policy, batch, group_size) -> Rollout")
    if loss is None:
        loss = grpo_objective(clip_low, clip_high, kl_coef, kl_estimator, level, reduction, max_length)
    return GRPOStep(
        sample=sample, reward=reward, group_size=int(group_size), log_prob=log_prob, loss=loss,
        policy_updates=int(policy_updates), microbatch_size=int(microbatch_size),
        weight_by="tokens" if reduction == "token" else "trajectories", advantage=advantage,
        gamma=float(gamma), eps=float(eps), kl=not (isinstance(kl_coef, (int, float)) and kl_coef == 0),
        clip_grad=clip_grad, method=method, autocast=autocast, loss_scale_config=loss_scale_config,
        grad_transform=grad_transform,
    )
