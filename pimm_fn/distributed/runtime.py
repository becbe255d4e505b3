"""The process group: torchrun init, the current DistContext, rank helpers, peer-loss errors.

:func:`init_from_env` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), picks gloo on CPU and nccl (+ gloo for CPU tensors) on CUDA,
places the process on ``cuda:LOCAL_RANK``, sets a collective timeout so a dead or stuck
peer becomes an error in bounded time, and registers a clean ``destroy_process_group`` at
exit. Without torchrun it returns a trivial single-process :class:`DistContext`, so the
same code runs in both.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import time
import warnings
from typing import Any, Callable, Mapping, Optional

import attrs
import torch
import torch.distributed as dist

# Long enough for the slowest rank's cold compile or a large checkpoint write while the
# others wait in a collective; short enough that a stuck peer does not hold a job for
# torch's default 30 minutes. Override with timeout_s= or PIMM_FN_DIST_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "PIMM_FN_DIST_TIMEOUT_S"

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


def default_device(local_rank: int = 0, local_world_size: int = 1) -> torch.device:
    """``cuda:LOCAL_RANK`` when this machine has a GPU for every local rank, else the CPU.

    nccl needs one GPU per rank: with fewer GPUs than ranks (two ranks on a one-GPU
    machine) the ranks run on the CPU over gloo, with a warning, instead of failing in
    nccl's init. Pass ``init_from_env(device=...)`` to choose otherwise.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count < local_world_size:
        warnings.warn(
            f"{local_world_size} ranks on this machine but {count} GPU(s): nccl needs one GPU per rank, "
            "so the ranks run on the CPU with gloo; start at most one rank per GPU "
            "(torchrun --nproc_per_node=<GPUs>) to train on the GPUs", RuntimeWarning, stacklevel=3)
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def choose_backend(device) -> str:
    """The process-group backend for ranks on ``device``.

    CPU (or any non-CUDA device): "gloo". CUDA: "cpu:gloo,cuda:nccl": nccl carries the
    step's collectives on CUDA tensors, gloo the host-side ones (object broadcasts, counts)
    on CPU tensors. A CUDA device without nccl in this torch build is an error naming the fix.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "gloo"
    if not dist.is_nccl_available():
        raise RuntimeError(
            f"ranks on {device} need the nccl backend, which this torch build lacks: install a CUDA "
            "build of torch with nccl, or run the ranks on the CPU (init_from_env(device='cpu'))"
        )
    return "cpu:gloo,cuda:nccl"


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

    backend: default :func:`choose_backend` of the device: "gloo" on CPU,
        "cpu:gloo,cuda:nccl" on CUDA (nccl for the step's collectives, gloo for host-side
        object broadcasts and counts).
    timeout_s: collective timeout (default ``$PIMM_FN_DIST_TIMEOUT_S`` or 300 s): a rank
        waiting on a dead or stuck peer raises after at most this long.
    device: override the device (default :func:`default_device`: ``cuda:LOCAL_RANK`` when
        there is a GPU per local rank, else cpu).
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
    local_world = _env_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size
    dev = torch.device(device) if device is not None else default_device(local_rank, local_world)
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
        backend = choose_backend(dev)
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
        local_world_size=local_world,
        device=dev,
        backend=backend,
        timeout_s=timeout_s,
    )
    atexit.register(_shutdown_at_exit)
    return _current


def shutdown(*, drain: bool = True) -> None:
    """Destroy the process group (if any) and go back to the single-process context.

    ``drain`` (the default; every rank must call it, as at a normal end of training):
    a barrier first, so no collective is still in flight. Either way the GIL is then
    released briefly: a gloo worker thread frees a finished collective's tensors under
    the GIL, and one still waiting for it when the interpreter finalizes aborts the
    process ("terminate called without an active exception"). No barrier after
    :func:`guard` raised PeerLostError, nor from the atexit hook: after an error the
    peers may be gone or inside another collective.
    """
    global _current, _peer_lost
    if dist.is_available() and dist.is_initialized():
        if drain and not _peer_lost:
            try:
                dist.barrier()
            except Exception as e:  # a peer already gone: nothing left to drain
                warnings.warn(f"barrier before shutdown failed ({e}); continuing shutdown", stacklevel=2)
        time.sleep(0.05)
        try:
            dist.destroy_process_group()
        except Exception as e:  # a peer already gone: nothing left to tear down cleanly
            warnings.warn(f"destroy_process_group failed ({e}); continuing shutdown", stacklevel=2)
    _current, _peer_lost = _SINGLE, False


_peer_lost = False  # set by guard(): shutdown must not wait for the peers


def _shutdown_at_exit() -> None:
    shutdown(drain=False)


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
    if isinstance(e, (PeerLostError, RankDivergenceError)):  # (the ranks agreed on that one)
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
            global _peer_lost
            _peer_lost = True
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise PeerLostError(
                f"rank {ctx.rank}/{ctx.world_size}: a collective failed, so another rank died, "
                f"hung for more than the {ctx.timeout_s:g} s timeout, or left the group "
                f"({type(e).__name__}: {first}). This rank stops too. Restart from the last "
                "checkpoint (torchrun --max-restarts=N does it automatically)."
            ) from e
        raise
