"""Host-side helpers for the driver: global counts, the rank-divergence check, and the
metadata and rule that re-shard a cursor when a run resumes under another world size."""
from __future__ import annotations

import warnings
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from .runtime import DistContext, RankDivergenceError, world


def global_count(n_local: int, ctx: Optional[DistContext] = None) -> int:
    """Sum of a per-rank host integer over ranks (a host sync; e.g. samples seen)."""
    ctx = world() if ctx is None else ctx
    if not ctx.is_distributed:
        return int(n_local)
    t = torch.tensor([int(n_local)], dtype=torch.int64)
    dist.all_reduce(t)  # the gloo half of the group handles CPU tensors on CUDA too
    return int(t.item())


def assert_in_sync(tree: Mapping[str, torch.Tensor], ctx: Optional[DistContext] = None,
                   what: str = "params") -> None:
    """Raise RankDivergenceError unless every rank holds bitwise the same tensors.

    A debugging / test check (host sync, broadcasts rank 0's tensors): data-parallel
    ranks apply the same averaged gradients, so their params must stay identical.
    """
    ctx = world() if ctx is None else ctx
    if not ctx.is_distributed:
        return
    keys = sorted(tree)
    # Exact, not a checksum: compare against rank 0's tensors bit for bit.
    mismatch = torch.zeros(len(keys), dtype=torch.int64)
    for i, k in enumerate(keys):
        mine = tree[k].detach().contiguous().reshape(-1)
        ref = mine.clone()
        dist.broadcast(ref, src=0)
        mismatch[i] = int(not torch.equal(mine.view(torch.uint8), ref.view(torch.uint8)))
    dist.all_reduce(mismatch)  # every rank learns about every divergence, so all raise
    bad = [k for k, m in zip(keys, mismatch.tolist()) if m]
    if bad:
        raise RankDivergenceError(
            f"rank {ctx.rank}: {what} differ across ranks for {len(bad)} key(s): {bad[:10]}. "
            "Data-parallel ranks must apply identical updates: check that the step averages "
            "gradients (data_parallel / grad_transform) and that every rank started from the "
            "same state (same seed, restored from the same checkpoint)."
        )


def dist_meta(batch_size: int, ctx: Optional[DistContext] = None) -> dict:
    """What to save next to the cursor so a resume can re-shard: world size, per-rank batch."""
    ctx = world() if ctx is None else ctx
    return {"world_size": int(ctx.world_size), "batch_size": int(batch_size)}


def reshard_cursor(cursor, saved: Mapping[str, int], *, batch_size: int,
                   world_size: Optional[int] = None, epoch_len: Optional[int] = None):
    """Position a saved cursor for a run with another world size or per-rank batch.

    The rule (docs/distributed.md): ranks consume the epoch's global order (the
    DistributedSampler permutation of (seed, epoch)) as a prefix, ``position * batch *
    world`` samples long. The new cursor starts after the same prefix when it is a whole
    number of new global batches, which is exact: no sample skipped or repeated. Otherwise
    it rounds down to the last whole new global batch and warns: fewer than one global
    batch of samples is trained on twice (Pointcept instead restarts the epoch).

    saved: :func:`dist_meta` of the run that wrote the checkpoint.
    batch_size / world_size: the new run's per-rank batch and ranks (default: current).
    epoch_len: the new loader's batches per epoch; a position at or past it rolls to the
        next epoch.
    """
    world_size = world().world_size if world_size is None else int(world_size)
    if not isinstance(saved, Mapping) or not {"world_size", "batch_size"} <= set(saved):
        found = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(
            f"reshard_cursor: saved must say the old run's world_size and per-rank batch_size "
            f"(dist_meta(batch_size) of that run, or an EpochLoader's state_dict), got {found}")
    old_w, old_b = int(saved["world_size"]), int(saved["batch_size"])
    if (old_w, old_b) == (world_size, int(batch_size)):
        return cursor
    consumed = cursor.position * old_b * old_w
    per_step = int(batch_size) * world_size
    position, remainder = divmod(consumed, per_step)
    if remainder:
        warnings.warn(
            f"resuming with world_size={world_size}, batch_size={batch_size} from a checkpoint of "
            f"world_size={old_w}, batch_size={old_b}: the {consumed} samples already used in epoch "
            f"{cursor.epoch} are not a whole number of new global batches ({per_step}); resuming at "
            f"batch {position}, so {remainder} samples of this epoch are trained on twice.",
            stacklevel=2,
        )
    if epoch_len is not None and position >= epoch_len:
        return cursor.replace(epoch=cursor.epoch + 1, position=0)
    return cursor.replace(position=position)
