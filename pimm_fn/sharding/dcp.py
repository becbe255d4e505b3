"""Sharded checkpoints with torch.distributed.checkpoint (DCP): each rank writes its own
rows, the file records the global layout, and a load into another world size's DTensors
(or into plain full tensors) reads just the rows it needs.

A checkpoint is a folder: DCP's ``.metadata`` and ``__<rank>_0.distcp`` files for the
tensor leaves of the state, plus ``host.pt`` (rank 0: the host leaves, RNG key and data
cursor, the saved world size and ``extra``).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import optree
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from .. import distributed as D
from ..atomic import atomic_write, replace_dir
from ..state import TrainState
from ..tree import NAMESPACE
from ..user_warning import warn
from .layout import ShardingError, is_sharded, shard

__all__ = ["save", "restore", "HOST_FILE"]

HOST_FILE = "host.pt"
_FORMAT = "pimm_fn.sharded-dcp/1"


def _live(ctx: D.DistContext) -> bool:
    return ctx.is_distributed and torch.distributed.is_initialized()


@contextlib.contextmanager
def _quiet_single_process():
    # DCP warns that it "assumes" one process even when told so with no_dist=True
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _leaves(state: TrainState):
    """(keys, leaves, treedef): every leaf of the state, keyed by its joined path."""
    paths, leaves, treedef = optree.tree_flatten_with_path(state, namespace=NAMESPACE)
    return ["/".join(map(str, p)) for p in paths], leaves, treedef


def save(path, state: TrainState, extra: Any = None, ctx: Optional[D.DistContext] = None) -> str:
    """Save a sharded (or plain) state to the folder ``path`` with DCP: every rank writes its
    rows, nothing is gathered. A collective: every rank calls it. Written to
    ``path + '.partial'`` and renamed by rank 0 once every rank has finished, so ``path``
    is always a complete checkpoint. Plain tensors (step, buffers) count as replicated and
    are written once, from one rank: sync BatchNorm buffers (``sync_buffers=True``) if
    every rank's must be the saved ones. Returns the path."""
    ctx = D.world() if ctx is None else ctx
    # Normalised: "ck/" + ".partial" would stage inside the folder being replaced.
    path = os.path.normpath(os.fspath(path))
    tmp = path + ".partial"
    if ctx.is_main and os.path.exists(tmp):
        shutil.rmtree(tmp)
    D.barrier()
    keys, leaves, _ = _leaves(state)
    tensors = {k: v for k, v in zip(keys, leaves) if isinstance(v, torch.Tensor)}
    host = {k: v for k, v in zip(keys, leaves) if not isinstance(v, torch.Tensor)}
    # ends with a collective: every rank has written. One process: no process group to use
    with _quiet_single_process():
        dcp.save(tensors, checkpoint_id=tmp, no_dist=not _live(ctx))

    def publish():
        meta = {"format": _FORMAT, "host": host, "world_size": ctx.world_size, "extra": extra}
        atomic_write(Path(tmp) / HOST_FILE, lambda f: torch.save(meta, f))
        replace_dir(tmp, path)
        return path

    return D.on_main(publish)


def _global_shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)  # a DTensor's shape is its global shape


def _check_fits(path: Path, stored: dict, tensors: dict) -> None:
    missing = [k for k in tensors if k not in stored]
    unexpected = [k for k in stored if k not in tensors]
    shapes, dtypes = [], []
    for k, t in tensors.items():
        meta = stored.get(k)
        if meta is None:
            continue
        if not hasattr(meta, "size"):
            dtypes.append(f"{k}: checkpoint holds a non-tensor, state a tensor")
        elif tuple(meta.size) != _global_shape(t):
            shapes.append(f"{k}: checkpoint {tuple(meta.size)} vs state {_global_shape(t)}")
        elif meta.properties.dtype != t.dtype:
            dtypes.append(f"{k}: checkpoint {meta.properties.dtype} vs state {t.dtype}")
    if missing or unexpected or shapes or dtypes:
        parts = [f"{path} does not fit this state (another model or optimizer?)."]
        for title, items in (("Missing in the checkpoint", missing), ("Not in this state", unexpected),
                             ("Shape mismatches (global shapes)", shapes), ("Type mismatches", dtypes)):
            if items:
                parts.append(f"{title} ({len(items)}): " + "; ".join(items[:8]) + (" ..." if len(items) > 8 else ""))
        parts.append("Pass as `like` a state built from the model and optimizer of the run that wrote it "
                     "(TrainState.create(model, tx)); the world size may differ, the shapes may not.")
        raise ShardingError("\n".join(parts))


def restore(path, like: TrainState, ctx: Optional[D.DistContext] = None, *,
            sharded: bool = True) -> tuple[TrainState, Any]:
    """Read a checkpoint written by :func:`save` under any world size. Returns (state, extra).

    like: a full state of the same model and optimizer, or one sharded for this world size.
    sharded: True: a state sharded for this rank and world size (DCP reads this rank's rows
        of each param, resharding from the writer's layout). False: a plain full state (any
        rank; e.g. one process evaluating or fine-tuning a sharded run's checkpoint).
    A checkpoint file in the engine's own format (``checkpoint.save`` of a full state) is
    also accepted: it is read whole and sharded.
    """
    from .. import checkpoint

    ctx = D.world() if ctx is None else ctx
    path = Path(path)
    if is_sharded(like) and not (sharded and is_sharded(like, ctx.world_size)):
        have = next(iter(like.params.values())).device_mesh.size()
        want = f"sharded for {ctx.world_size} rank(s)" if sharded else "plain"
        raise ShardingError(
            f"restore({path}): `like` is sharded over {have} rank(s), but the restored state is to be "
            f"{want}; pass a full state (TrainState.create(model, tx)) as `like`")
    if path.is_file():
        full, extra = checkpoint.restore(path, like if not is_sharded(like) else _template(like))
        return (shard(full, ctx) if sharded else full), extra
    host_file = path / HOST_FILE
    if not host_file.is_file():
        raise ShardingError(f"{path} is not a sharded checkpoint (no {HOST_FILE} in it): write one with "
                            "pimm_fn.sharding.save(path, state); engine checkpoint files load with "
                            "pimm_fn.checkpoint.restore")
    meta = torch.load(host_file, weights_only=True)
    if meta.get("format") != _FORMAT:
        raise ShardingError(f"{host_file} has format {meta.get('format')!r}, expected {_FORMAT!r}")
    target = like if not sharded or is_sharded(like) else shard(like, ctx)
    keys, leaves, treedef = _leaves(target)
    # fresh tensors of the target's layout for DCP to fill in place: `like` is not touched
    tensors = {k: (torch.empty_like(v) if isinstance(v, DTensor) else v.clone())
               for k, v in zip(keys, leaves) if isinstance(v, torch.Tensor)}
    _check_fits(path, dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata, tensors)
    host = meta["host"]
    missing_host = [k for k, v in zip(keys, leaves) if not isinstance(v, torch.Tensor) and k not in host]
    if missing_host:
        raise ShardingError(f"{host_file} lacks the host leaves {missing_host[:5]}: not a state of this kind")
    with _quiet_single_process():
        dcp.load(tensors, checkpoint_id=str(path), no_dist=not _live(ctx))
    new = [tensors[k] if isinstance(v, torch.Tensor) else host[k] for k, v in zip(keys, leaves)]
    state = optree.tree_unflatten(treedef, new)
    written_by = meta.get("world_size")
    cursor = getattr(state, "cursor", None)
    if written_by is not None and written_by != ctx.world_size and getattr(cursor, "position", 0):
        warn(f"{path} was written by {written_by} rank(s) in the middle of epoch {cursor.epoch} (position "
             f"{cursor.position}, counted in that run's batches); on {ctx.world_size} rank(s) move the cursor with "
             f"pimm_fn.distributed.reshard_cursor(state.cursor, {{'world_size': {written_by}, 'batch_size': <its "
             "per-rank batch>}, batch_size=...), or the epoch trains some samples twice and skips others",
             UserWarning)
    return state, meta["extra"]


def _template(like: TrainState) -> TrainState:
    """A full-shaped plain template of a sharded ``like`` (for reading an engine file)."""
    empty = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device=v.to_local().device) for k, v in like.params.items()}
    return like.replace(params=empty, opt_state=like.tx.init(empty))
