"""The supervised step: forward, backward, (unscale), clip, optimizer update, all pure.

Replaces Pointcept's ``run_step``. The step reads the model only through
``functional_call``; BatchNorm statistics come back in the new state's buffers.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..amp import LossScaleConfig, as_autocast, renamed_loss_scale
from ..compile import Step
from ..optim.base import frozen_names
from .common import (
    applied_buffers,
    check_clip_grad,
    check_labels,
    forward_backward,
    guarded_update,
    point_batch_stats,
    update_metrics,
    weighted_sum,
)

GradTransform = Callable[[dict], dict]


def supervised(
    *,
    clip_grad: Optional[float] = None,
    autocast=None,
    loss_scale_config: LossScaleConfig = LossScaleConfig(),
    nonfinite: str = "skip",
    loss_key: str = "loss",
    grad_transform: Optional[GradTransform] = None,
    accumulate: int = 1,
    microbatch_weight: Optional[Callable] = None,
    loss_scale=None,
) -> Step:
    """Build the pure supervised step ``(state, batch) -> (state, metrics)``.

    clip_grad: max global gradient norm (``clip_grad_norm_`` semantics), or None.
    autocast: None, "bfloat16", "float16" or an :class:`pimm_fn.amp.Autocast`.
    loss_scale_config: growth/backoff settings; scaling is on when the state has a loss
        scale (``TrainState.create(..., loss_scale=True)``).
    nonfinite: what a non-finite loss or gradient does: "skip" (the update is not
        applied; ``metrics["skipped"]`` is 1) or "raise" (FloatingPointError, a host sync).
        A skipped step leaves params, optimizer state and every buffer (BatchNorm's
        running statistics and ``num_batches_tracked``) exactly as they were.
        Under loss scaling such steps are always skipped, as GradScaler does.
    grad_transform: applied to the (unscaled) gradients before clipping, e.g. the
        all-reduce of data parallelism.
    accumulate: n > 1 takes a sequence of n micro-batches per step and applies one
        update with the gradient of their weighted mean loss.
    microbatch_weight: ``batch -> weight`` for accumulation (default: equal weights);
        use the sample or point count to equal one step on the concatenated batch.
    Metrics (0-dim tensors): loss, every scalar the model returns, lr per group,
    grad_norm (before clipping), loss_scale, skipped, avg_pts for point batches.
    """
    renamed_loss_scale(loss_scale, "supervised")
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    if accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {accumulate}")
    clip_grad = check_clip_grad(clip_grad)
    policy = as_autocast(autocast)

    def supervised_step(state, batch):
        scaler = state.loss_scale
        scale = scaler.scale if scaler is not None else None
        micro = _as_microbatches(batch, accumulate)
        losses, outs, grad_list, buffers = [], [], [], state.buffers
        frozen = frozen_names(state.tx, state.params)  # no gradient for params the optimizer never changes
        for mb in micro:
            loss, out, grads, buffers = forward_backward(
                state.model, state.params, buffers, mb, scale=scale, autocast=policy, loss_key=loss_key,
                frozen=frozen,
            )
            losses.append(loss), outs.append(out), grad_list.append(grads)
        weights = _weights(micro, microbatch_weight)
        grads = grad_list[0] if accumulate == 1 else weighted_sum(grad_list, weights)
        loss = losses[0] if accumulate == 1 else sum(w * mb_loss for w, mb_loss in zip(weights, losses))
        params, opt_state, finite, grad_norm, new_scaler = guarded_update(
            state.tx, state.params, state.opt_state, grads, loss=loss, scaler=scaler, scaler_config=loss_scale_config,
            clip_grad=clip_grad, grad_transform=grad_transform,
        )

        metrics = update_metrics(outs[-1], loss, state.tx, state.opt_state, grad_norm, finite, scaler, loss_key)
        for mb in micro[:1]:
            metrics.update(point_batch_stats(mb))
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            buffers=applied_buffers(finite, buffers, state.buffers),
            opt_state=opt_state,
            loss_scale=new_scaler,
        )
        return new_state, metrics

    def labels_present(state, batch):
        if loss_key == "loss":
            check_labels(state.model, batch)

    return Step(supervised_step, name="supervised", raise_on_nonfinite=(nonfinite == "raise"),
                check_batch=labels_present)


def _as_microbatches(batch, n: int) -> Sequence:
    if n == 1:
        return (batch,)
    if not isinstance(batch, (list, tuple)) or len(batch) != n:
        raise ValueError(
            f"a step built with accumulate={n} takes a sequence of {n} micro-batches, got "
            f"{type(batch).__name__}{'' if not isinstance(batch, (list, tuple)) else ' of length %d' % len(batch)}; "
            "pass a list of n micro-batches per step"
        )
    return tuple(batch)


def _weights(micro: Sequence, weight_fn) -> list:
    if weight_fn is None:
        return [1.0 / len(micro)] * len(micro)
    raw = [torch.as_tensor(weight_fn(mb), dtype=torch.float32) for mb in micro]
    total = sum(raw)
    return [w / total for w in raw]
