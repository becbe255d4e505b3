"""Sharded training (ZeRO-3 style) over the functional state: params and optimizer state
split across ranks, the pure step unchanged for the user.

Each parameter is flattened, zero-padded to a multiple of the world size and split in
``world`` equal 1-D pieces; rank r keeps piece r in ``state.params`` and the optimizer is
initialised on those pieces, so AdamW's moments are sharded the same way (elementwise
transforms need nothing else). Buffers (BatchNorm statistics) stay replicated. Inside the
step (:func:`sharded`):

1. all-gather the pieces to full params (one functional collective per dtype),
2. forward/backward with ``functional_call`` on the full params (no FSDP module hooks,
   so ``torch.autograd.grad`` sees ordinary tensors),
3. reduce-scatter the gradients (mean): each rank receives only its piece (the full
   local gradient is transient; params and optimizer state are what stay sharded),
4. finite check and global-norm clipping over all pieces (one all-reduce of the sum of
   squares and a non-finite flag, so every rank agrees), then the optimizer on the local
   piece only.

So a sharded run computes the same numbers as :func:`pimm_fn.distributed.data_parallel`.
No FSDP2 / DTensor: torch's FSDP2 drives its collectives through module hooks that a pure
``functional_call`` step bypasses (the wrong gradients an earlier attempt found); plain
tensors plus functional collectives keep the state a pytree and the step compiled fullgraph.

Checkpoints (:func:`save` / :func:`restore`) hold full tensors in the engine's own format,
gathered on every rank and written by rank 0, so they restore under any world size and
also load without sharding (``checkpoint.restore`` into a plain state).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import optree
import torch

from . import distributed as D
from .amp import LossScaleConfig, as_autocast, unscale_factor, update_loss_scale
from .compile import Step
from .optim.base import apply_updates
from .state import TrainState
from .optim.transforms import clip_to_norm
from .steps.common import (
    applied_buffers, check_clip_grad, check_labels, forward_backward, point_batch_stats, update_metrics,
)
from .tree import NAMESPACE, all_finite, global_norm, tree_map, tree_where

__all__ = ["ShardingError", "shard", "unshard", "is_sharded", "sharded", "save", "restore", "shard_len",
           "state_bytes"]


class ShardingError(ValueError):
    """A state or checkpoint does not fit the sharded mode it is used with."""


def shard_len(numel: int, world_size: int) -> int:
    """Elements of one rank's piece: ``ceil(numel / world_size)`` (the last piece padded)."""
    return max(1, math.ceil(numel / world_size))


def _full_shapes(state: TrainState) -> dict:
    return {k: tuple(p.shape) for k, p in state.model.named_parameters()}


def _piece(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    flat = full.reshape(-1)
    s = shard_len(flat.numel(), world)
    pad = s * world - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat[rank * s:(rank + 1) * s]


def is_sharded(state: TrainState, world_size: int) -> bool:
    """True when ``state.params`` hold this world size's 1-D pieces rather than full tensors."""
    shapes = _full_shapes(state)
    got = {k: tuple(state.params[k].shape) for k in shapes}
    return got != shapes and all(g == (shard_len(math.prod(shapes[k]), world_size),) for k, g in got.items())


def _map_param_leaves(tree: Any, names: set, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn(name, leaf)`` to the leaves of ``tree`` stored under a param name
    (``opt_state.mu[name]`` ...); other leaves (counts, scalars) are kept."""
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    out = []
    for path, leaf in zip(paths, leaves):
        name = path[-1] if path else None
        out.append(fn(name, leaf) if isinstance(leaf, torch.Tensor) and name in names else leaf)
    return optree.tree_unflatten(treedef, out)


def shard(state: TrainState, ctx: Optional[D.DistContext] = None) -> TrainState:
    """This rank's sharded copy of a full (unsharded) state: params and every optimizer
    leaf kept per param become this rank's 1-D piece; buffers and scalars are kept.

    Every rank must pass the same full state (same seed, or restored from one checkpoint).
    """
    ctx = D.world() if ctx is None else ctx
    shapes = _full_shapes(state)
    bad = [k for k, v in state.params.items() if tuple(v.shape) != shapes.get(k)]
    if bad:
        raise ShardingError(
            f"shard() needs a full state, but params {bad[:5]} do not have the model's shapes "
            "(is the state already sharded?); pass the state from TrainState.create / checkpoint.restore, "
            "or unshard() it first"
        )
    names = set(shapes)
    pieces = lambda name, t: _piece(t, ctx.rank, ctx.world_size).clone() if tuple(t.shape) == shapes[name] else t  # noqa: E731
    return state.replace(
        params={k: pieces(k, v) for k, v in state.params.items()},
        opt_state=_map_param_leaves(state.opt_state, names, pieces),
    )


def _check_sharded(state: TrainState, world: int) -> dict:
    shapes = _full_shapes(state)
    bad = {k: tuple(state.params[k].shape) for k, s in shapes.items()
           if tuple(state.params[k].shape) != (shard_len(math.prod(s), world),)}
    if bad:
        k = next(iter(bad))
        full = tuple(state.params[k].shape) == shapes[k]
        raise ShardingError(
            f"the sharded step / unshard() on {world} rank(s) needs a state sharded for {world} rank(s), "
            f"but param {k!r} has shape {bad[k]} (model shape {shapes[k]}, expected piece "
            f"({shard_len(math.prod(shapes[k]), world)},)) and {len(bad) - 1} more differ: "
            + ("the state is not sharded; pass sharding.shard(state)" if full else
               "it was sharded for another world size; unshard it on that world size, or restore "
               "a checkpoint written with sharding.save (full tensors) and shard that")
        )
    return shapes


def _gather(pieces: dict, shapes: dict, ctx: D.DistContext) -> dict:
    """Full tensors from every rank's pieces: one all-gather per dtype; traceable."""
    if not ctx.is_distributed:
        return {k: v[:math.prod(shapes[k])].view(shapes[k]) for k, v in pieces.items()}
    from torch.distributed import _functional_collectives as funcol

    out = {}
    by_dtype: dict = {}
    for k, v in pieces.items():
        by_dtype.setdefault(v.dtype, []).append(k)
    for keys in by_dtype.values():
        flat = torch.cat([pieces[k] for k in keys])
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # renamed in 2.13
        gathered = gather(flat, 0, ctx.group).view(ctx.world_size, flat.numel())
        offset = 0
        for k in keys:
            s = pieces[k].numel()
            full = gathered[:, offset:offset + s].reshape(-1)[:math.prod(shapes[k])]
            out[k] = full.view(shapes[k])
            offset += s
    return out


def _reduce_scatter_mean(grads: dict, ctx: D.DistContext) -> dict:
    """This rank's piece of the mean of ``grads`` over ranks: one reduce-scatter per dtype
    (each rank receives only its piece, half the traffic of an all-reduce); traceable."""
    from torch.distributed import _functional_collectives as funcol

    world, out, by_dtype = ctx.world_size, {}, {}
    for k, g in grads.items():
        by_dtype.setdefault(g.dtype, []).append(k)
    for keys in by_dtype.values():
        rows = []
        for k in keys:
            flat = grads[k].reshape(-1)
            s = shard_len(flat.numel(), world)
            pad = s * world - flat.numel()
            rows.append((torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(world, s))
        # row r of the (world, total) layout is rank r's pieces of every param, in order
        mine = funcol.reduce_scatter_tensor(torch.cat(rows, dim=1).reshape(-1), "sum", 0, ctx.group)
        mine = mine * (1.0 / world)  # sum then scale: gloo has no AVG reduction
        offset = 0
        for k, row in zip(keys, rows):
            out[k] = mine[offset:offset + row.shape[1]]
            offset += row.shape[1]
    return out


def unshard(state: TrainState, ctx: Optional[D.DistContext] = None) -> TrainState:
    """The full state from a sharded one (a collective: every rank calls it, every rank
    gets the full params and optimizer state)."""
    ctx = D.world() if ctx is None else ctx
    shapes = _check_sharded(state, ctx.world_size)
    s_len = {k: shard_len(math.prod(s), ctx.world_size) for k, s in shapes.items()}
    params = _gather(state.params, shapes, ctx)
    paths, leaves, treedef = optree.tree_flatten_with_path(state.opt_state, namespace=NAMESPACE)
    idx = [i for i, (p, t) in enumerate(zip(paths, leaves))
           if isinstance(t, torch.Tensor) and p and p[-1] in shapes and tuple(t.shape) == (s_len[p[-1]],)]
    # one gather for all optimizer leaves: key them by position, shape by their param
    tmp = {str(i): leaves[i] for i in idx}
    full = _gather(tmp, {str(i): shapes[paths[i][-1]] for i in idx}, ctx)
    leaves = list(leaves)
    for i in idx:
        leaves[i] = full[str(i)].clone()
    return state.replace(params={k: v.clone() for k, v in params.items()},
                         opt_state=optree.tree_unflatten(treedef, leaves))


def sharded(ctx: Optional[D.DistContext] = None, *, clip_grad: Optional[float] = None, autocast=None,
            loss_scale: LossScaleConfig = LossScaleConfig(), sync_buffers: bool = False, reduce: bool = True,
            count_fn: Optional[Callable] = None, loss_key: str = "loss") -> Step:
    """The sharded supervised step: ``data_parallel``'s numbers with params and optimizer
    state sharded over ranks. Takes and returns a :func:`shard`-ed state.

    Same options as :func:`pimm_fn.distributed.data_parallel` (clip_grad, autocast, loss
    scaling, sync_buffers, metric reduction, ``metrics["samples"]``); non-finite gradients
    skip the step on every rank. Gradient accumulation is not supported here.
    Compile it with :func:`pimm_fn.compile.compile_step` (fullgraph, collectives inside).
    """
    ctx = D.world() if ctx is None else ctx
    clip_grad = check_clip_grad(clip_grad)
    policy = as_autocast(autocast)
    rank, world = ctx.rank, ctx.world_size

    def sharded_step(state, batch):
        shapes = _check_sharded(state, world)  # shapes only: runs at trace time
        scaler = state.loss_scale
        scale = scaler.scale if scaler is not None else None
        full = _gather(state.params, shapes, ctx)
        loss, out, grads, buffers = forward_backward(
            state.model, full, state.buffers, batch, scale=scale, autocast=policy, loss_key=loss_key)
        if scaler is not None:
            inv = unscale_factor(scaler)
            grads = tree_map(lambda g: g * inv, grads)
        if ctx.is_distributed:
            local = _reduce_scatter_mean(grads, ctx)
            # the norm and finite check over every rank's piece: one all-reduce of
            # [sum of squares, non-finite flag]; the same numbers on every rank
            sq = torch.stack([p.float().pow(2).sum() for p in local.values()]).sum()
            bad = (~(all_finite(local) & torch.isfinite(loss))).float()
            totals = D._bucketed_all_reduce([torch.stack([sq, bad])], "sum", ctx.group)[0]
            grad_norm, finite = totals[0].sqrt(), totals[1] == 0
        else:
            finite = all_finite(grads) & torch.isfinite(loss)
            grad_norm = global_norm(grads)
            local = {k: _piece(g, rank, world) for k, g in grads.items()}
        if clip_grad is not None:
            local = clip_to_norm(local, grad_norm, clip_grad)
        updates, new_opt = state.tx.update(local, state.opt_state, state.params)
        params = tree_where(finite, apply_updates(state.params, updates), state.params)
        opt_state = tree_where(finite, new_opt, state.opt_state)
        metrics = update_metrics(out, loss, state.tx, state.opt_state, grad_norm, finite, scaler, loss_key)
        metrics.update(point_batch_stats(batch))
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state,
            buffers=applied_buffers(finite, buffers, state.buffers),
            loss_scale=update_loss_scale(scaler, finite, loss_scale) if scaler is not None else None,
        )
        return new_state, metrics

    def labels_present(state, batch):
        if loss_key == "loss":
            check_labels(state.model, batch)

    step = Step(sharded_step, name="sharded", check_batch=labels_present)
    return D.wrap_step(step, ctx, sync_buffers=sync_buffers, reduce=reduce, count_fn=count_fn)


def state_bytes(state: TrainState) -> dict:
    """Bytes this rank holds in params and in optimizer state (sum of tensor nbytes)."""
    def nbytes(tree):
        return sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree, namespace=NAMESPACE)
                   if isinstance(t, torch.Tensor))

    p, o = nbytes(state.params), nbytes(state.opt_state)
    return {"params": p, "opt_state": o, "total": p + o}


def save(path, state: TrainState, extra: Any = None, ctx: Optional[D.DistContext] = None):
    """Save a sharded state as a full checkpoint (engine format): every rank gathers,
    rank 0 writes, every rank waits. Restores under any world size, sharded or not."""
    from . import checkpoint

    ctx = D.world() if ctx is None else ctx
    full = unshard(state, ctx)
    return D.on_main(lambda: str(checkpoint.save(path, full, extra)))


def restore(path, like: TrainState, ctx: Optional[D.DistContext] = None) -> tuple[TrainState, Any]:
    """Read a full checkpoint (from :func:`save`, or a plain ``checkpoint.save``) and shard
    it for this rank and world size. ``like``: a full or sharded state of the same model."""
    from . import checkpoint

    ctx = D.world() if ctx is None else ctx
    shapes = _full_shapes(like)
    if any(tuple(like.params[k].shape) != s for k, s in shapes.items()):
        # a full-shaped template on the state's devices (the module may live on meta)
        empty = {k: torch.empty(s, dtype=like.params[k].dtype, device=like.params[k].device)
                 for k, s in shapes.items()}
        like = like.replace(params=empty, opt_state=like.tx.init(empty))
    try:
        full, extra = checkpoint.restore(path, like)
    except checkpoint.CheckpointMismatchError as e:
        raise ShardingError(
            f"{path}: its tensors do not have the model's full shapes ({e}). A checkpoint written with "
            "checkpoint.save from a sharded state holds one rank's pieces only; save sharded runs with "
            "pimm_fn.sharding.save, which gathers full tensors"
        ) from e
    return shard(full, ctx), extra
