"""Data parallelism on torch.distributed: torchrun init, in-step collectives, rank helpers.

Replaces Pointcept's parallel context, DDP wrapping and comm helpers. Rooms:

    runtime      init_from_env, choose_backend, default_device, shutdown, world, is_main, barrier, broadcast_object,
                 on_main, guard, DistContext, PeerLostError
    collectives  grad_transform, all_reduce_gradients, reduce_metrics
                 (traceable, inside the pure step)
    host         global_count, assert_in_sync, dist_meta, reshard_cursor
    (data_parallel and wrap_step build steps: they live in pimm_fn.steps.parallel, one
    layer up; the names here forward to it lazily, for older imports.)

In more detail:

* Process group. :func:`init_from_env` reads torchrun's environment (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT), picks gloo on CPU and nccl (+ gloo for CPU
  tensors) on CUDA, places the process on ``cuda:LOCAL_RANK``, sets a collective timeout
  so a dead or stuck peer becomes an error in bounded time, and registers a clean
  ``destroy_process_group`` at exit. Without torchrun it returns a trivial single-process
  :class:`DistContext`, so the same code runs in both.
* Inside the pure step. DDP's autograd hooks do not fire under ``torch.func`` /
  ``torch.autograd.grad`` over ``functional_call``, so gradients are reduced explicitly
  with ``torch.distributed._functional_collectives`` (traceable; they compile fullgraph
  on gloo): :func:`grad_transform` for ``supervised(grad_transform=...)``, and
  :func:`data_parallel` / :func:`wrap_step`, which add the cross-rank metric reduction
  (Pointcept's key rules), the global sample count and optional BatchNorm running-stat
  averaging, each bucketed into one collective per dtype.
* Host helpers for the driver: :func:`is_main`, :func:`barrier`,
  :func:`broadcast_object`, :func:`on_main` (rank 0 writes, everyone waits),
  :func:`assert_in_sync`, :func:`guard` (turns a lost peer into :class:`PeerLostError`) and
  :func:`reshard_cursor` (resume under another world size).

See docs/distributed.md for the launch contract and the plan past one machine.
"""
from .collectives import (
    COUNT_KEY,
    SAMPLES_KEY,
    all_reduce_gradients,
    grad_transform,
    reduce_across_ranks_op,
    reduce_metrics,
)
from .host import assert_in_sync, dist_meta, global_count, reshard_cursor
from .runtime import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    DistContext,
    PeerLostError,
    RankDivergenceError,
    barrier,
    broadcast_object,
    choose_backend,
    default_device,
    guard,
    init_from_env,
    is_main,
    on_main,
    shutdown,
    world,
)

__all__ = [
    "DistContext",
    "PeerLostError",
    "RankDivergenceError",
    "init_from_env",
    "choose_backend",
    "default_device",
    "shutdown",
    "world",
    "is_main",
    "barrier",
    "broadcast_object",
    "on_main",
    "guard",
    "all_reduce_gradients",
    "grad_transform",
    "reduce_metrics",
    "global_count",
    "assert_in_sync",
    "dist_meta",
    "reshard_cursor",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "COUNT_KEY",
    "SAMPLES_KEY",
    "reduce_across_ranks_op",
]

# Step builders live one layer up (they import compile and steps.supervised); these
# names stay reachable here without an upward import at module level.
_STEPS = {"data_parallel", "wrap_step"}


def __getattr__(name: str):
    if name in _STEPS:
        from ..steps import parallel

        return getattr(parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
