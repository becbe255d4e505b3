"""The sharded layout: DTensor leaves on a 1-D DeviceMesh, and the conversions to it.

A parameter of shape ``(n, ...)`` becomes a DTensor with placement ``Shard(0)``: rank r
holds rows ``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / world)`` (DTensor's own uneven
layout; trailing ranks may hold fewer rows, or none). A 0-dim parameter is ``Replicate()``.
Optimizer leaves kept per parameter (AdamW's ``mu`` / ``nu``) get the parameter's layout;
counters, the step, buffers and the loss scale stay plain replicated tensors.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import distributed as D
from ..state import TrainState
from ..torch_compat import backendless_mesh, uncompiled_module
from ..tree import NAMESPACE

__all__ = ["ShardingError", "mesh_for", "local_rows", "shard", "unshard", "is_sharded", "state_bytes",
           "to_local_tree", "like_tree", "param_specs"]


class ShardingError(ValueError):
    """A state or checkpoint does not fit the sharded mode it is used with."""


_MESHES: dict = {}


def mesh_for(ctx: D.DistContext) -> DeviceMesh:
    """The 1-D mesh of every rank. Distributed: over the default process group. In one
    process (or a DistContext made up for a test) a mesh without a backend: DTensors can be
    built and read, but collectives over it cannot run."""
    dist = torch.distributed
    live = ctx.is_distributed and dist.is_initialized()
    key = (ctx.device.type, ctx.world_size, ctx.rank, id(dist.group.WORLD) if live else None)
    mesh = _MESHES.get(key)
    if mesh is None:
        if live:
            mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        else:
            mesh = backendless_mesh(ctx.device.type, ctx.world_size, ctx.rank)
        _MESHES[key] = mesh
    return mesh


def local_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of rank's ``Shard(0)`` piece of ``n`` rows over ``world`` ranks."""
    c = math.ceil(n / world) if n else 0
    lo = min(n, rank * c)
    return lo, min(n, lo + c) - lo


def _to_dtensor(full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    full = full.contiguous()
    if full.dim() == 0:
        return DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False)
    lo, rows = local_rows(full.shape[0], mesh.size(), mesh.get_coordinate()[0])
    return DTensor.from_local(full[lo:lo + rows].clone(), mesh, [Shard(0)], run_check=False,
                              shape=full.shape, stride=full.stride())


def _full_shapes(state: TrainState) -> dict:
    return {k: tuple(p.shape) for k, p in uncompiled_module(state.model).named_parameters()}


def _map_param_leaves(tree: Any, fn: Callable[[Optional[str], Any], Any]) -> Any:
    """``fn(name, leaf)`` over the leaves of ``tree``; name is the last path entry (the param
    name for ``opt_state.mu[name]``)."""
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return optree.tree_unflatten(treedef, [fn(p[-1] if p else None, x) for p, x in zip(paths, leaves)])


def is_sharded(state: TrainState, world_size: Optional[int] = None) -> bool:
    """True when every param is a DTensor (on a mesh of ``world_size`` ranks, if given)."""
    return all(isinstance(p, DTensor) and (world_size is None or p.device_mesh.size() == world_size)
               for p in state.params.values())


def shard(state: TrainState, ctx: Optional[D.DistContext] = None) -> TrainState:
    """This rank's sharded copy of a full (unsharded) state: params and every optimizer
    leaf kept per param become DTensors (``Shard(0)``, 0-dim: ``Replicate()``); buffers
    and scalars are kept. Every rank must pass the same full state (same seed, or one
    checkpoint). No collective runs: each rank keeps its own rows."""
    ctx = D.world() if ctx is None else ctx
    shapes = _full_shapes(state)
    bad = [k for k, v in state.params.items() if isinstance(v, DTensor) or tuple(v.shape) != shapes.get(k)]
    if bad:
        raise ShardingError(
            f"shard() needs a full state, but params {bad[:5]} are DTensors or do not have the model's "
            "shapes (is the state already sharded?); pass the state from TrainState.create / "
            "checkpoint.restore, or unshard() it first")
    mesh = mesh_for(ctx)

    def convert(name, t):
        if isinstance(t, torch.Tensor) and name in shapes and tuple(t.shape) == shapes[name]:
            return _to_dtensor(t, mesh)
        return t

    return state.replace(params={k: _to_dtensor(v, mesh) for k, v in state.params.items()},
                         opt_state=_map_param_leaves(state.opt_state, convert))


def param_specs(state: TrainState, world: int) -> dict:
    """name -> (full shape, sharded?) of a state sharded for ``world`` ranks; raises
    ShardingError naming the cause and the fix otherwise (runs at trace time: shapes only)."""
    shapes = _full_shapes(state)
    plain = [k for k in shapes if not isinstance(state.params[k], DTensor)]
    if plain:
        raise ShardingError(
            f"the sharded step / unshard() needs a state sharded for {world} rank(s), but params "
            f"{plain[:5]} are plain tensors: the state is not sharded; pass sharding.shard(state)")
    other = {k: state.params[k].device_mesh.size() for k in shapes if state.params[k].device_mesh.size() != world}
    if other:
        k = next(iter(other))
        raise ShardingError(
            f"the sharded step / unshard() runs on {world} rank(s), but param {k!r} is sharded over "
            f"{other[k]} rank(s) ({len(other) - 1} more alike): it was sharded for another world size; "
            "save it with sharding.save and sharding.restore it here (checkpoints reshard on load)")
    wrong = [k for k in shapes if tuple(state.params[k].shape) != shapes[k]]
    if wrong:
        raise ShardingError(f"params {wrong[:5]} do not have the model's shapes: the state belongs to "
                            "another model; build it from this model with TrainState.create and shard it")
    return {k: (shapes[k], isinstance(state.params[k].placements[0], Shard)) for k in shapes}


def to_local_tree(tree: Any) -> Any:
    """Every DTensor leaf as its local tensor (a view; traceable)."""
    return optree.tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, tree, namespace=NAMESPACE)


def like_tree(local: Any, like: Any) -> Any:
    """The local leaves of ``local`` wrapped as DTensors where ``like`` holds DTensors (same
    mesh, placements, global shape and stride); traceable."""
    def wrap(new, old):
        if not isinstance(old, DTensor):
            return new
        return DTensor.from_local(new, old.device_mesh, old.placements, run_check=False,
                                  shape=old.shape, stride=old.stride())
    return optree.tree_map(wrap, local, like, namespace=NAMESPACE)


def unshard(state: TrainState, ctx: Optional[D.DistContext] = None) -> TrainState:
    """The full (plain-tensor) state from a sharded one. A collective: every rank calls it,
    every rank gets the full params and optimizer state."""
    from .collectives import gather_rows

    ctx = D.world() if ctx is None else ctx
    specs = param_specs(state, ctx.world_size)
    paths, leaves, treedef = optree.tree_flatten_with_path((state.params, state.opt_state), namespace=NAMESPACE)
    idx = [i for i, t in enumerate(leaves) if isinstance(t, DTensor)]
    local = {str(i): leaves[i].to_local() for i in idx}
    full = gather_rows(local, {str(i): specs[paths[i][-1]] for i in idx}, ctx)
    leaves = list(leaves)
    for i in idx:
        leaves[i] = full[str(i)].clone()
    params, opt_state = optree.tree_unflatten(treedef, leaves)
    return state.replace(params=params, opt_state=opt_state)


def state_bytes(state: TrainState) -> dict:
    """Bytes this rank holds in params and in optimizer state (local tensors' nbytes)."""
    def nbytes(tree):
        return sum(t.numel() * t.element_size() for t in optree.tree_leaves(to_local_tree(tree), namespace=NAMESPACE)
                   if isinstance(t, torch.Tensor))

    p, o = nbytes(state.params), nbytes(state.opt_state)
    return {"params": p, "opt_state": o, "total": p + o}
