"""The sharded supervised step over a DTensor state (see :mod:`pimm_fn.sharding`)."""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from .. import distributed as D
from ..amp import LossScaleConfig, as_autocast, renamed_loss_scale
from ..compile import Step
from ..distributed.collectives import bucketed_all_reduce
from ..optim.base import frozen_names
from ..steps.common import (
    applied_buffers,
    check_clip_grad,
    check_labels,
    forward_backward,
    guarded_update,
    point_batch_stats,
    update_metrics,
)
from ..tree import all_finite
from .collectives import gather_rows, reduce_scatter_rows
from .layout import like_tree, param_specs, to_local_tree

__all__ = ["sharded"]


def _norm_and_finite(local: dict, specs: dict, loss, ctx: D.DistContext):
    """Global gradient norm and "all finite" over every rank's rows: one all-reduce of
    [sum of squares of the sharded rows, non-finite flag]; replicated leaves are counted
    once. The same numbers on every rank, so every rank clips or skips alike."""
    zero = loss.new_zeros((), dtype=torch.float32)
    sq_sh = sum((g.float().pow(2).sum() for k, g in local.items() if specs[k][1]), zero)
    sq_rep = sum((g.float().pow(2).sum() for k, g in local.items() if not specs[k][1]), zero)
    bad = (~(all_finite(local) & torch.isfinite(loss))).float()
    totals = bucketed_all_reduce([torch.stack([sq_sh, bad])], "sum", ctx.group)[0]
    return (totals[0] + sq_rep).sqrt(), totals[1] == 0


def sharded(ctx: Optional[D.DistContext] = None, *, clip_grad: Optional[float] = None, autocast=None,
            loss_scale_config: LossScaleConfig = LossScaleConfig(), sync_buffers: bool = False,
            reduce: bool = True, count_fn: Optional[Callable] = None, loss_key: str = "loss",
            loss_scale=None) -> Step:
    """The sharded supervised step: ``data_parallel``'s numbers with params and optimizer
    state held as DTensor shards. Takes and returns a :func:`shard`-ed state.

    Same options as :func:`pimm_fn.distributed.data_parallel` (clip_grad, autocast, loss
    scaling, sync_buffers, metric reduction, ``metrics["samples"]``); non-finite gradients
    skip the step on every rank. Gradient accumulation is not supported here.
    Compile it with :func:`pimm_fn.compile.compile_step` (fullgraph, collectives inside).
    """
    renamed_loss_scale(loss_scale, "sharded")
    ctx = D.world() if ctx is None else ctx
    clip_grad = check_clip_grad(clip_grad)
    policy = as_autocast(autocast)

    def sharded_step(state, batch):
        specs = param_specs(state, ctx.world_size)  # shapes and placements only: trace time
        scaler = state.loss_scale
        scale = scaler.scale if scaler is not None else None
        # DTensor in, DTensor out; in between the step works on this rank's local rows
        params, opt_state = to_local_tree(state.params), to_local_tree(state.opt_state)
        full = gather_rows(params, specs, ctx)
        loss, out, grads, buffers = forward_backward(  # no gradient for params the optimizer never changes
            state.model, full, state.buffers, batch, scale=scale, autocast=policy, loss_key=loss_key,
            frozen=frozen_names(state.tx, full))
        shard_rows = grad_check = None  # one rank: its rows are the whole param
        if ctx.is_distributed:  # each rank updates its rows; the norm and finite check span all ranks
            shard_rows = functools.partial(reduce_scatter_rows, specs=specs, ctx=ctx)
            grad_check = functools.partial(_norm_and_finite, specs=specs, loss=loss, ctx=ctx)
        new_params, new_opt, finite, grad_norm, new_scaler = guarded_update(
            state.tx, params, opt_state, grads, loss=loss, scaler=scaler, scaler_config=loss_scale_config,
            clip_grad=clip_grad, grad_transform=shard_rows, grad_check=grad_check)
        metrics = update_metrics(out, loss, state.tx, opt_state, grad_norm, finite, scaler, loss_key)
        metrics.update(point_batch_stats(batch))
        new_state = state.replace(
            step=state.step + 1, params=like_tree(new_params, state.params),
            opt_state=like_tree(new_opt, state.opt_state),
            buffers=applied_buffers(finite, buffers, state.buffers), loss_scale=new_scaler,
        )
        return new_state, metrics

    def labels_present(state, batch):
        if loss_key == "loss":
            check_labels(state.model, batch)

    step = Step(sharded_step, name="sharded", check_batch=labels_present)
    return D.wrap_step(step, ctx, sync_buffers=sync_buffers, reduce=reduce, count_fn=count_fn, replicated=False)
