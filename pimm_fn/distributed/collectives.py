"""Collectives inside the pure step: traceable, functional, bucketed into one per dtype.

DDP's autograd hooks do not fire under ``torch.func`` / ``torch.autograd.grad`` over
``functional_call``, so gradients are reduced explicitly with torch's functional
collectives (through :mod:`pimm_fn.torch_compat`; they compile fullgraph on gloo). Also
the cross-rank metric reduction (Pointcept's key rules).
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from .. import torch_compat
from .runtime import DistContext, world

SAMPLES_KEY = "samples"
# The one metric that is not an average: how many units (trajectories, tokens, samples)
# the other metrics of the same dict are averaged over. It is summed when combining.
COUNT_KEY = "count"


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


def bucketed_all_reduce(tensors: Sequence[torch.Tensor], op: str, group) -> list:
    """All-reduce many tensors with one collective per dtype (flatten, reduce, split).

    Traceable: only tensor ops and a functional collective; no host sync.
    """
    out: list = [None] * len(tensors)
    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        reduced = torch_compat.all_reduce(torch.cat([tensors[i].reshape(-1) for i in idx]), op, group)
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = reduced[offset:offset + n].view(tensors[i].shape)
            offset += n
    return out


def all_reduce_gradients(grads: dict, ctx: Optional[DistContext] = None) -> dict:
    """The mean of ``grads`` over ranks (DDP's gradient), as a pure, traceable function.

    One flattened all-reduce per dtype. A non-finite value on any rank makes the sum
    non-finite on every rank, so all ranks agree to skip the step.
    """
    ctx = world() if ctx is None else ctx
    if not ctx.is_distributed:
        return grads
    keys = list(grads)
    # sum then scale: gloo has no AVG reduction
    reduced = bucketed_all_reduce([grads[k] for k in keys], "sum", ctx.group)
    inv = 1.0 / ctx.world_size
    return {k: g * inv for k, g in zip(keys, reduced)}


def grad_transform(ctx: Optional[DistContext] = None) -> Callable[[dict], dict]:
    """``supervised(grad_transform=grad_transform())``: average gradients over ranks.

    ctx is captured when the step is built (default: the current :func:`world`). The
    transform also offers ``.weighted(grads, weight)``: the mean over ranks weighted by each
    rank's ``weight`` (a 0-dim tensor: the trajectories or tokens its gradient averages
    over), which a step whose ranks average over unequal counts uses to stay exact (GRPO).
    """
    ctx = world() if ctx is None else ctx

    def all_reduce_mean(grads: dict) -> dict:
        return all_reduce_gradients(grads, ctx)

    def weighted(grads: dict, weight: torch.Tensor) -> dict:
        if not ctx.is_distributed:
            return grads
        keys = list(grads)
        weight = weight.to(device=grads[keys[0]].device, dtype=torch.float32).reshape(1)
        reduced = bucketed_all_reduce([grads[k] * weight.to(grads[k].dtype) for k in keys] + [weight], "sum",
                                      ctx.group)
        total = reduced[-1]
        return {k: g / total.to(g.dtype) for k, g in zip(keys, reduced[:-1])}

    all_reduce_mean.weighted = weighted
    return all_reduce_mean


def reduce_metrics(metrics: Mapping[str, torch.Tensor], ctx: Optional[DistContext] = None,
                   extra_sum: Sequence[torch.Tensor] = ()) -> tuple[dict, list]:
    """Reduce 0-dim metrics over ranks with Pointcept's key rules; traceable.

    ``_min`` keys take the MIN, ``_max`` / ``abs_max`` keys the MAX, ``count`` the SUM,
    every other key the mean. Two collectives in all: one sum (means, sums and
    ``extra_sum``), one max (max keys and negated min keys).
    Returns (reduced metrics, the summed ``extra_sum`` tensors).
    """
    ctx = world() if ctx is None else ctx
    if not ctx.is_distributed:
        return dict(metrics), list(extra_sum)
    keys = list(metrics)
    ops = {k: reduce_across_ranks_op(k) for k in keys}
    sum_keys = [k for k in keys if ops[k] in ("mean", "sum")]
    ext_keys = [k for k in keys if ops[k] in ("min", "max")]
    out = dict(metrics)
    sums = bucketed_all_reduce([metrics[k].float() for k in sum_keys] + list(extra_sum), "sum", ctx.group) \
        if (sum_keys or extra_sum) else []
    for k, v in zip(sum_keys, sums):
        out[k] = v / ctx.world_size if ops[k] == "mean" else v
    if ext_keys:
        signed = [metrics[k].float() if ops[k] == "max" else -metrics[k].float() for k in ext_keys]
        maxes = bucketed_all_reduce(signed, "max", ctx.group)
        for k, v in zip(ext_keys, maxes):
            out[k] = v if ops[k] == "max" else -v
    return out, sums[len(sum_keys):]
