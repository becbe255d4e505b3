"""The sharded step's collectives over DTensor ``Shard(0)`` rows, on local tensors.

Both are traceable (functional collectives; no host sync) and bucket every param of one
dtype into one collective. Uneven row counts (DTensor's layout: ``ceil(n / world)`` rows
per rank, fewer at the end) are padded to the common chunk for the collective and cut
back after it, so the padding never reaches the state.
"""
from __future__ import annotations

import math

import torch

from .. import distributed as D
from .. import torch_compat
from ..distributed.collectives import bucketed_all_reduce
from .layout import local_rows


def _chunk(shape: tuple, world: int) -> tuple[int, int]:
    """(rows per rank padded, elements per row) of a ``Shard(0)`` param."""
    return math.ceil(shape[0] / world), math.prod(shape[1:])


def _by_dtype(tensors: dict, keys) -> list:
    groups: dict = {}
    for k in keys:
        groups.setdefault(tensors[k].dtype, []).append(k)
    return list(groups.values())


def gather_rows(local: dict, specs: dict, ctx: D.DistContext) -> dict:
    """Full tensors from every rank's local rows. specs: name -> (full shape, sharded?);
    a replicated (0-dim) leaf is already full. One all-gather per dtype."""
    out = {k: v for k, v in local.items() if not specs[k][1]}
    keys = [k for k in local if specs[k][1]]
    if not ctx.is_distributed:
        out.update({k: local[k] for k in keys})
        return out
    world = ctx.world_size
    for group in _by_dtype(local, keys):
        pieces = []
        for k in group:
            c, row = _chunk(specs[k][0], world)
            flat = local[k].reshape(-1)
            pad = c * row - flat.numel()
            pieces.append(torch.cat([flat, flat.new_zeros(pad)]) if pad else flat)
        flat = torch.cat(pieces)
        gathered = torch_compat.all_gather(flat, ctx.group).view(world, flat.numel())
        offset = 0
        for k in group:
            shape = specs[k][0]
            c, row = _chunk(shape, world)
            # row r of `gathered` is rank r's padded rows; stacked they are the padded param
            out[k] = gathered[:, offset:offset + c * row].reshape(world * c, *shape[1:])[:shape[0]]
            offset += c * row
    return out


def reduce_scatter_rows(grads: dict, specs: dict, ctx: D.DistContext) -> dict:
    """This rank's rows of the mean of full ``grads`` over ranks (replicated leaves: the
    full mean). One reduce-scatter per dtype, each rank receiving only its rows; one
    all-reduce for the replicated leaves."""
    world, rank = ctx.world_size, ctx.rank
    out = {}
    keys = [k for k in grads if specs[k][1]]
    for group in _by_dtype(grads, keys):
        rows = []
        for k in group:
            c, row = _chunk(specs[k][0], world)
            flat = grads[k].reshape(-1)
            pad = world * c * row - flat.numel()
            rows.append((torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(world, c * row))
        # column block j of the (world, total) layout is param j, row r is rank r's rows of it
        mine = torch_compat.reduce_scatter(torch.cat(rows, dim=1).reshape(-1), "sum", ctx.group)
        mine = mine * (1.0 / world)  # sum then scale: gloo has no AVG reduction
        offset = 0
        for k in group:
            shape = specs[k][0]
            c, row = _chunk(shape, world)
            _, n = local_rows(shape[0], world, rank)
            out[k] = mine[offset:offset + c * row].view(c, *shape[1:])[:n]
            offset += c * row
    rep = [k for k in grads if not specs[k][1]]
    if rep:
        summed = bucketed_all_reduce([grads[k] for k in rep], "sum", ctx.group)
        out.update({k: s * (1.0 / world) for k, s in zip(rep, summed)})
    return {k: out[k] for k in grads}
