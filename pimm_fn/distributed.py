"""Data parallelism on torch.distributed: torchrun init, in-step collectives, rank helpers.

Replaces the seed's parallel context, DDP wrapping and comm helpers. Three parts:

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
  (the seed's key rules), the global sample count and optional BatchNorm running-stat
  averaging, each bucketed into one collective per dtype.
* Host helpers for the driver: :func:`is_main`, :func:`barrier`,
  :func:`broadcast_object`, :func:`on_main` (rank 0 writes, everyone waits),
  :func:`assert_in_sync`, :func:`guard` (turns a lost peer into :class:`PeerLostError`) and
  :func:`reshard_cursor` (resume under another world size).

See docs/distributed.md for the launch contract and the plan past one machine.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import attrs
import torch
import torch.distributed as dist

__all__ = [
    "DistContext",
    "PeerLostError",
    "RankDivergenceError",
    "init_from_env",
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
    "data_parallel",
    "wrap_step",
    "global_count",
    "assert_in_sync",
    "dist_meta",
    "reshard_cursor",
    "DEFAULT_TIMEOUT_S",
]

# Long enough for the slowest rank's cold compile or a large checkpoint write while the
# others wait in a collective; short enough that a stuck peer does not hold a job for
# torch's default 30 minutes. Override with timeout_s= or PIMM_FN_DIST_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "PIMM_FN_DIST_TIMEOUT_S"
SAMPLES_KEY = "samples"

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class PeerLostError(RuntimeError):
    """A collective failed because another rank died, hung past the timeout or left."""


class RankDivergenceError(RuntimeError):
    """Ranks that should hold identical values do not (see :func:`assert_in_sync`)."""


@attrs.frozen
class DistContext:
    """Who this process is in the run. Single-process: rank 0 of 1 on ``device``.

    rank / world_size: global; local_rank / local_world_size: on this machine.
    device: where this rank's state lives (``cuda:LOCAL_RANK`` on CUDA, else cpu).
    backend: the process group's backend, None when not distributed.
    timeout_s: the collective timeout the group was created with.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"), converter=torch.device)
    backend: Optional[str] = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that writes logs and checkpoints."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def group(self):
        """The default process group (None when not distributed)."""
        return dist.group.WORLD if self.is_distributed else None


_SINGLE = DistContext()
_current: DistContext = _SINGLE


def world() -> DistContext:
    """The current context: what :func:`init_from_env` set up, else single-process CPU."""
    return _current


def is_main() -> bool:
    """True on rank 0 (and in a single process)."""
    return _current.is_main


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_from_env(
    *,
    backend: Optional[str] = None,
    timeout_s: Optional[float] = None,
    device: Optional[Any] = None,
    env: Optional[Mapping[str, str]] = None,
) -> DistContext:
    """Join the process group torchrun describes in the environment; return the context.

    Without torchrun (no WORLD_SIZE, or WORLD_SIZE=1) nothing is initialised and a
    single-process context is returned. Calling it again returns the same context.

    backend: default "gloo" on CPU, "cpu:gloo,cuda:nccl" on CUDA (nccl for the step's
        collectives, gloo for host-side object broadcasts and counts).
    timeout_s: collective timeout (default ``$PIMM_FN_DIST_TIMEOUT_S`` or 300 s): a rank
        waiting on a dead or stuck peer raises after at most this long.
    device: override the device (default ``cuda:LOCAL_RANK`` when CUDA is present, else cpu).
    env: the environment to read (default ``os.environ``); for tests.
    """
    global _current
    env = os.environ if env is None else env
    if timeout_s is None:
        timeout_s = float(env.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    world_size = _env_int(env, "WORLD_SIZE") if "WORLD_SIZE" in env else 1
    local_rank = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
    dev = torch.device(device) if device is not None else _default_device(local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size <= 1:
        _current = DistContext(device=dev, timeout_s=timeout_s)
        return _current
    if dist.is_available() and dist.is_initialized():
        if _current.world_size != dist.get_world_size():
            raise RuntimeError(
                "a process group is already initialised outside pimm_fn.distributed; call "
                "init_from_env() before any other torch.distributed.init_process_group"
            )
        return _current
    missing = [v for v in _TORCHRUN_VARS if v not in env]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={env['WORLD_SIZE']} but {', '.join(missing)} not set: launch with "
            "`torchrun --nproc_per_node=N ...` (or set RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"
        )
    rank = _env_int(env, "RANK")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} out of range for WORLD_SIZE={world_size}")
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    if "nccl" in backend:
        # nccl raises (instead of hanging) on timeout only with async error handling on.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    kwargs = dict(
        backend=backend, init_method="env://", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    # env:// reads MASTER_ADDR/PORT from os.environ; mirror a custom env there.
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.setdefault(var, env[var])
    dist.init_process_group(**kwargs)
    _current = DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=_env_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size,
        device=dev,
        backend=backend,
        timeout_s=timeout_s,
    )
    atexit.register(shutdown)
    return _current


def shutdown() -> None:
    """Destroy the process group (if any) and go back to the single-process context."""
    global _current
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # a peer already gone: nothing left to tear down cleanly
            warnings.warn(f"destroy_process_group failed ({e}); continuing shutdown", stacklevel=2)
    _current = _SINGLE


def barrier() -> None:
    """Wait until every rank arrives (no-op in a single process)."""
    if _current.is_distributed:
        dist.barrier()


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (pickled; for small host values only)."""
    if not _current.is_distributed:
        return obj
    box = [obj if _current.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def on_main(fn: Callable, *args, **kwargs) -> Any:
    """Run ``fn`` on rank 0 only; every rank waits for it and returns its result.

    The broadcast of the result is the barrier: no rank goes on (e.g. to read the
    checkpoint rank 0 is writing) before rank 0 has finished. Use for checkpoint saves
    and anything else that writes shared files.
    """
    result = fn(*args, **kwargs) if _current.is_main else None
    return broadcast_object(result, src=0)


_PEER_FAILURE_HINTS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
    "timeout", "socket", "gloo", "nccl", "watchdog", "connection refused", "store",
)


def _peer_failure(e: BaseException) -> bool:
    if isinstance(e, PeerLostError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = f"{type(e).__name__}: {e}".lower()
    return isinstance(e, RuntimeError) and any(h in text for h in _PEER_FAILURE_HINTS)


@contextlib.contextmanager
def guard():
    """Turn a collective failure (a peer died, hung past the timeout) into PeerLostError.

    Wrap the training loop in it: the error names this rank and the cause, so the log of
    a surviving rank says what happened instead of a transport-level traceback. The
    process still exits non-zero (the error propagates).
    """
    try:
        yield
    except Exception as e:
        ctx = _current
        if ctx.is_distributed and _peer_failure(e):
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise PeerLostError(
                f"rank {ctx.rank}/{ctx.world_size}: a collective failed, so another rank died, "
                f"hung for more than the {ctx.timeout_s:g} s timeout, or left the group "
                f"({type(e).__name__}: {first}). This rank stops too. Restart from the last "
                "checkpoint (torchrun --max-restarts=N does it automatically)."
            ) from e
        raise


# --------------------------------------------------------------------------- in-step collectives


def _funcol():
    from torch.distributed import _functional_collectives as funcol

    return funcol


def _bucketed_all_reduce(tensors: Sequence[torch.Tensor], op: str, group) -> list:
    """All-reduce many tensors with one collective per dtype (flatten, reduce, split).

    Traceable: only tensor ops and a functional collective; no host sync.
    """
    funcol = _funcol()
    out: list = [None] * len(tensors)
    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        reduced = funcol.all_reduce(flat, op, group)
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
    ctx = _current if ctx is None else ctx
    if not ctx.is_distributed:
        return grads
    keys = list(grads)
    # sum then scale: gloo has no AVG reduction
    reduced = _bucketed_all_reduce([grads[k] for k in keys], "sum", ctx.group)
    inv = 1.0 / ctx.world_size
    return {k: g * inv for k, g in zip(keys, reduced)}


def grad_transform(ctx: Optional[DistContext] = None) -> Callable[[dict], dict]:
    """``supervised(grad_transform=grad_transform())``: average gradients over ranks.

    ctx is captured when the step is built (default: the current :func:`world`).
    """
    ctx = _current if ctx is None else ctx

    def all_reduce_mean(grads: dict) -> dict:
        return all_reduce_gradients(grads, ctx)

    return all_reduce_mean


def _metric_op(key: str) -> str:
    try:
        from .rl import reduce_across_ranks_op
    except ImportError:  # the rule as the seed states it (seed-behaviour.md item 18)
        if "_min" in key:
            return "min"
        return "max" if ("_max" in key or "abs_max" in key) else "mean"
    return reduce_across_ranks_op(key)


def reduce_metrics(metrics: Mapping[str, torch.Tensor], ctx: Optional[DistContext] = None,
                   extra_sum: Sequence[torch.Tensor] = ()) -> tuple[dict, list]:
    """Reduce 0-dim metrics over ranks with the seed's key rules; traceable.

    ``_min`` keys take the MIN, ``_max`` / ``abs_max`` keys the MAX, ``count`` the SUM,
    every other key the mean. Two collectives in all: one sum (means, sums and
    ``extra_sum``), one max (max keys and negated min keys).
    Returns (reduced metrics, the summed ``extra_sum`` tensors).
    """
    ctx = _current if ctx is None else ctx
    if not ctx.is_distributed:
        return dict(metrics), list(extra_sum)
    keys = list(metrics)
    ops = {k: _metric_op(k) for k in keys}
    sum_keys = [k for k in keys if ops[k] in ("mean", "sum")]
    ext_keys = [k for k in keys if ops[k] in ("min", "max")]
    out = dict(metrics)
    sums = _bucketed_all_reduce([metrics[k].float() for k in sum_keys] + list(extra_sum), "sum", ctx.group) \
        if (sum_keys or extra_sum) else []
    for k, v in zip(sum_keys, sums):
        out[k] = v / ctx.world_size if ops[k] == "mean" else v
    if ext_keys:
        signed = [metrics[k].float() if ops[k] == "max" else -metrics[k].float() for k in ext_keys]
        maxes = _bucketed_all_reduce(signed, "max", ctx.group)
        for k, v in zip(ext_keys, maxes):
            out[k] = v if ops[k] == "max" else -v
    return out, sums[len(sum_keys):]


def _leading(x) -> Optional[int]:
    if isinstance(x, torch.Tensor) and x.dim() > 0:
        return x.shape[0]
    if isinstance(x, Mapping):
        for v in x.values():
            n = _leading(v)
            if n is not None:
                return n
    if isinstance(x, (list, tuple)) and x and not isinstance(x[0], (int, float)):
        return _leading(x[0])
    return None


def count_samples(batch) -> int:
    """Samples in one per-rank batch (traceable, from shapes): ``len(offset)`` for point
    batches, else the leading dim of ``image`` or of the first tensor found."""
    if isinstance(batch, Mapping):
        for key in ("offset", "image"):
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key].shape[0]
    n = _leading(batch)
    if n is None:
        raise TypeError(
            f"cannot count the samples of a {type(batch).__name__} batch; pass count_fn=batch -> int"
        )
    return n


def wrap_step(step, ctx: Optional[DistContext] = None, *, sync_buffers: bool = False,
              reduce: bool = True, count_fn: Optional[Callable] = None, accumulate: int = 1):
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
    count_fn: ``batch -> int`` per-rank samples (default :func:`count_samples`; summed over
        the micro-batches when ``accumulate > 1``).
    Adds ``metrics["samples"]``: the real number of samples this step consumed over all
        ranks (an all-reduced count, so ranks with unequal batches are counted right).
    """
    from .compile import Step, as_step

    step = as_step(step)
    ctx = _current if ctx is None else ctx
    core = step.core
    counter = count_fn or count_samples

    def local_count(batch) -> torch.Tensor:
        parts = batch if accumulate > 1 else (batch,)
        return torch.tensor(float(sum(counter(mb) for mb in parts)), dtype=torch.float32)

    def data_parallel_step(state, batch):
        new_state, metrics = core(state, batch)
        n_local = local_count(batch)
        if not ctx.is_distributed:
            metrics = dict(metrics)
            metrics[SAMPLES_KEY] = n_local
            return new_state, metrics
        buf_keys = [k for k, v in new_state.buffers.items() if v.is_floating_point()] if sync_buffers else []
        extra = [n_local.to(ctx.device)] + [new_state.buffers[k] for k in buf_keys]
        if reduce:
            metrics, summed = reduce_metrics(metrics, ctx, extra)
        else:
            metrics, summed = dict(metrics), _bucketed_all_reduce(extra, "sum", ctx.group)
        metrics[SAMPLES_KEY] = summed[0]
        if buf_keys:
            buffers = dict(new_state.buffers)
            for k, v in zip(buf_keys, summed[1:]):
                buffers[k] = v / ctx.world_size
            new_state = new_state.replace(buffers=buffers)
        return new_state, metrics

    return Step(data_parallel_step, name=f"data_parallel({step.name})",
                raise_on_nonfinite=step.raise_on_nonfinite, check_batch=step.check_batch,
                prepare=step.prepare)


def data_parallel(ctx: Optional[DistContext] = None, *, sync_buffers: bool = False,
                  reduce: bool = True, count_fn: Optional[Callable] = None, **supervised_kwargs):
    """The data-parallel supervised step: ``supervised(**kwargs)`` with gradients averaged
    over ranks inside the step, metrics reduced, samples counted and (optionally) BatchNorm
    statistics averaged. A user ``grad_transform`` runs after the all-reduce.

    In a single process this is the plain supervised step plus ``metrics["samples"]``.
    """
    from .steps.supervised import supervised

    ctx = _current if ctx is None else ctx
    reduce_grads = grad_transform(ctx)
    user = supervised_kwargs.pop("grad_transform", None)
    transform = reduce_grads if user is None else (lambda g: user(reduce_grads(g)))
    step = supervised(grad_transform=transform, **supervised_kwargs)
    return wrap_step(step, ctx, sync_buffers=sync_buffers, reduce=reduce, count_fn=count_fn,
                     accumulate=supervised_kwargs.get("accumulate", 1))


# --------------------------------------------------------------------------- host helpers


def global_count(n_local: int, ctx: Optional[DistContext] = None) -> int:
    """Sum of a per-rank host integer over ranks (a host sync; e.g. samples seen)."""
    ctx = _current if ctx is None else ctx
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
    ctx = _current if ctx is None else ctx
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
    ctx = _current if ctx is None else ctx
    return {"world_size": int(ctx.world_size), "batch_size": int(batch_size)}


def reshard_cursor(cursor, saved: Mapping[str, int], *, batch_size: int,
                   world_size: Optional[int] = None, epoch_len: Optional[int] = None):
    """Position a saved cursor for a run with another world size or per-rank batch.

    The rule (docs/distributed.md): ranks consume the epoch's global order (the
    DistributedSampler permutation of (seed, epoch)) as a prefix, ``position * batch *
    world`` samples long. The new cursor starts after the same prefix when it is a whole
    number of new global batches, which is exact: no sample skipped or repeated. Otherwise
    it rounds down to the last whole new global batch and warns: fewer than one global
    batch of samples is trained on twice (the seed instead restarts the epoch).

    saved: :func:`dist_meta` of the run that wrote the checkpoint.
    batch_size / world_size: the new run's per-rank batch and ranks (default: current).
    epoch_len: the new loader's batches per epoch; a position at or past it rolls to the
        next epoch.
    """
    world_size = _current.world_size if world_size is None else int(world_size)
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
