"""Data-parallel steps: :func:`wrap_step` makes any step data-parallel after the fact
(metrics reduced over ranks, samples counted, BatchNorm statistics optionally averaged);
:func:`data_parallel` is the supervised step built that way.

They build steps, so they live in the steps layer, above :mod:`pimm_fn.distributed` (which
still answers ``pimm_fn.distributed.data_parallel`` / ``wrap_step`` by a lazy forward here).
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

from ..compile import Step, as_step
from ..data.count import count_batch
from ..distributed import SAMPLES_KEY, DistContext, grad_transform, reduce_metrics, world
from ..distributed.collectives import bucketed_all_reduce
from .supervised import supervised


def _sharded(state) -> bool:
    # No DTensor exists unless its module was imported: a plain run does not import it.
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and bool(state.params) and isinstance(next(iter(state.params.values())), tensor.DTensor)


def wrap_step(step, ctx: Optional[DistContext] = None, *, sync_buffers: bool = False,
              reduce: bool = True, count_fn: Optional[Callable] = None, accumulate: int = 1,
              replicated: bool = True):
    """Make a step data-parallel after the fact: reduce its metrics, count samples, sync BN.

    step: any :class:`~pimm_fn.compile.Step` whose gradients are already averaged (built
        with ``grad_transform=grad_transform(ctx)``, GRPO's too); :func:`data_parallel` does
        both for a supervised step. A step's host ``prepare`` (GRPO's rollout) is kept: it
        runs on each rank's own batch, and the core's batch is what ``count_fn`` sees.
    sync_buffers: average floating-point buffers (BatchNorm running mean/var) over ranks
        after each step, so every rank holds the same statistics (see docs/distributed.md
        for how this differs from SyncBatchNorm). Integer buffers (num_batches_tracked)
        advance identically on every rank and are left alone.
    reduce: reduce the metrics over ranks (seed rules); otherwise they stay per rank.
    count_fn: ``batch -> int`` per-rank samples (default: the ``samples`` of
        :func:`pimm_fn.data.count_batch`; summed over the micro-batches when ``accumulate > 1``).
    replicated: every rank holds the whole params (data parallel): a sharded state is refused
        by name. The sharded step (:func:`pimm_fn.sharding.sharded`) passes False.
    Adds ``metrics["samples"]``: the real number of samples this step consumed over all
        ranks (an all-reduced count, so ranks with unequal batches are counted right).
    """
    step = as_step(step)
    ctx = world() if ctx is None else ctx
    core = step.core
    counter = count_fn or (lambda batch: count_batch(batch).samples)

    def local_count(batch) -> torch.Tensor:
        parts = batch if accumulate > 1 else (batch,)
        return torch.tensor(float(sum(counter(mb) for mb in parts)), dtype=torch.float32)

    def refuse_sharded(state, batch=None):
        if replicated and _sharded(state):
            raise ValueError(
                "data_parallel / wrap_step got a sharded state (its params are DTensors): a data-parallel "
                "step replicates the params on every rank. Train it with pimm_fn.sharding.sharded(...), or "
                "gather it first with pimm_fn.sharding.unshard(state)")
        if step.check_batch is not None and batch is not None:
            step.check_batch(state, batch)

    def data_parallel_step(state, batch):
        if not torch.compiler.is_compiling():  # eager calls; a compiled step runs check_batch before tracing
            refuse_sharded(state)
        new_state, metrics = core(state, batch)
        n_local = local_count(batch)
        if not ctx.is_distributed:
            metrics = dict(metrics)
            metrics[SAMPLES_KEY] = n_local
            return new_state, metrics
        buf_keys = [k for k, v in new_state.buffers.items() if v.is_floating_point()] if sync_buffers else []
        # The count goes where the state is (not ctx.device): a state kept on the CPU on a
        # GPU machine reduces its CPU tensors together, over gloo.
        extra = [n_local.to(next(iter(new_state.params.values())).device)] + [new_state.buffers[k] for k in buf_keys]
        if reduce:
            metrics, summed = reduce_metrics(metrics, ctx, extra)
        else:
            metrics, summed = dict(metrics), bucketed_all_reduce(extra, "sum", ctx.group)
        metrics[SAMPLES_KEY] = summed[0]
        if buf_keys:
            buffers = dict(new_state.buffers)
            for k, v in zip(buf_keys, summed[1:]):
                buffers[k] = v / ctx.world_size
            new_state = new_state.replace(buffers=buffers)
        return new_state, metrics

    return Step(data_parallel_step, name=f"data_parallel({step.name})",
                raise_on_nonfinite=step.raise_on_nonfinite, check_batch=refuse_sharded,
                prepare=step.prepare)


def data_parallel(ctx: Optional[DistContext] = None, *, sync_buffers: bool = False,
                  reduce: bool = True, count_fn: Optional[Callable] = None, **supervised_kwargs):
    """The data-parallel supervised step: ``supervised(**kwargs)`` with gradients averaged
    over ranks inside the step, metrics reduced, samples counted and (optionally) BatchNorm
    statistics averaged. A user ``grad_transform`` runs after the all-reduce.

    In a single process this is the plain supervised step plus ``metrics["samples"]``.
    """
    ctx = world() if ctx is None else ctx
    reduce_grads = grad_transform(ctx)
    user = supervised_kwargs.pop("grad_transform", None)
    transform = reduce_grads if user is None else (lambda g: user(reduce_grads(g)))
    step = supervised(grad_transform=transform, **supervised_kwargs)
    return wrap_step(step, ctx, sync_buffers=sync_buffers, reduce=reduce, count_fn=count_fn,
                     accumulate=supervised_kwargs.get("accumulate", 1))
