"""Sharded training: params and optimizer state as DTensor shards, the pure step unchanged
for the user, compiled fullgraph.

Layout (:mod:`.layout`): ``state.params`` leaves are DTensors on a 1-D DeviceMesh of every
rank, placement ``Shard(0)`` of the parameter's own shape (rank r holds rows
``[r*c, (r+1)*c)``, ``c = ceil(rows / world)``; uneven rows are DTensor's layout), 0-dim
params ``Replicate()``. The optimizer is a pure transform over whatever leaves it gets, so
its per-param state (AdamW's moments) mirrors them: DTensors with the same placement.
Buffers (BatchNorm statistics), the step and the loss scale stay replicated plain tensors.

The step (:func:`sharded`, :mod:`.step`), inside one compiled graph:

1. ``to_local()`` on every DTensor leaf; one functional all-gather per dtype rebuilds the
   full params from the local rows (padded to the common chunk, cut back after),
2. forward/backward with ``functional_call`` on the full params (no FSDP module hooks,
   which a functional step bypasses: ``torch.autograd.grad`` sees ordinary tensors),
3. one reduce-scatter per dtype (mean) hands each rank the rows of the gradient it owns,
4. finite check and global-norm clipping over all ranks' rows (one all-reduce), the
   optimizer on the local rows, ``DTensor.from_local`` back to the state's layout.

So a sharded run computes ``data_parallel``'s numbers and the resident params + optimizer
state per rank fall as 1/world. Checkpoints (:mod:`.dcp`) go through
``torch.distributed.checkpoint``: every rank writes its rows, and a load under another
world size (or into a plain unsharded state) reshards. See docs/distributed.md.
"""
from .dcp import restore, save
from .layout import ShardingError, is_sharded, local_rows, mesh_for, shard, state_bytes, unshard
from .step import sharded

__all__ = ["ShardingError", "shard", "unshard", "is_sharded", "sharded", "save", "restore", "local_rows",
           "mesh_for", "state_bytes"]
