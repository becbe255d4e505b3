"""The fold itself: ``fit`` and ``fit_epoch`` over a loader, a step function and callbacks."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Optional, Sequence

import attrs
import torch

from .. import events as ev
from ..frame_room import call_with_frame_room
from .dispatch import Dispatcher
from .history import History
from .source import _Source

__all__ = ["FitResult", "fit", "fit_epoch"]

_END = object()
_NULL = contextlib.nullcontext()


@attrs.frozen
class FitResult:
    """What ``fit`` returns. Unpacks as ``state, history = fit(...)``.

    status: ``"completed"``, ``"stopped"`` (a Stop request), ``"interrupted"``
    (KeyboardInterrupt) or ``"already_complete"``; stop_reason: the Stop's reason.
    """

    state: Any
    history: History
    status: str
    stop_reason: str = ""

    def __iter__(self):
        return iter((self.state, self.history))


# --------------------------------------------------------------------------- data


class _Run(Dispatcher):
    """One call of fit: the source, the callbacks, the state as it advances."""

    def __init__(self, source, callbacks, *, epochs, guard, trace, history, empty_cache, block_seconds=0.25):
        if isinstance(block_seconds, bool) or not isinstance(block_seconds, (int, float)) or block_seconds < 0:
            raise ValueError(f"block_seconds must be a number of seconds >= 0, got {block_seconds!r}")
        if empty_cache not in (None, "step", "epoch"):
            raise ValueError(f"empty_cache must be None, 'step' or 'epoch', got {empty_cache!r}")
        super().__init__(callbacks, guard=guard, trace=trace)
        self.block_seconds = float(block_seconds)
        self.checked_first_batch = False
        self.block_epoch = 0
        self.source = source
        self.epochs = epochs
        self.history = history if isinstance(history, History) else (History() if history else None)
        self.empty_cache = empty_cache if torch.cuda.is_available() else None
        self.state = None

    def _check_first_batch(self, batch):
        # Once per run, on the host: a malformed batch is named here, before any step (and
        # the compiler) sees it. Later batches are the loader's to check.
        from ..data.collate import validate_batch

        self.checked_first_batch = True
        try:
            validate_batch(batch)
        except ValueError as err:
            c = self.state.cursor
            raise ValueError(f"the loader's batch {c.position} of epoch {c.epoch} is malformed: {err}") from None

    def flush_block(self, state):
        """Deliver the pending steps as one StepBlock to the callbacks that take blocks."""
        rows, self.rows = self.rows, []
        if not rows or not self.block_callbacks:
            return
        c = state.cursor
        self.dispatch(
            ev.StepBlock(step=rows[-1][0], epoch=self.block_epoch, samples_seen=c.samples_seen,
                         iters_per_epoch=self.source.iters_per_epoch, rows=tuple(rows), epochs=self.epochs),
            state,
            targets=self.block_callbacks,
        )

    # ----- folds
    def run_epochs(self, epochs: int) -> None:
        """Epochs until the horizon or a stop."""
        while self.stop_reason is None and self.state.cursor.epoch < epochs:
            self.run_epoch()

    def run_epoch(self) -> bool:
        """Fold over the current epoch's remaining batches. Returns True when it completed."""
        src = self.source
        ipe = src.epoch_length()
        cursor = self.state.cursor
        epoch, start = cursor.epoch, cursor.position
        it = src.iter_epoch(epoch, start) if start < ipe else iter(())
        self.dispatch(
            ev.EpochStart(step=self.step, epoch=epoch, position=start, samples_seen=cursor.samples_seen,
                          iters_per_epoch=ipe, epochs=self.epochs),
            self.state,
        )
        if self.stop_reason is not None:
            _close(it)
            return False
        pos, ran, exhausted = start, 0, False
        # Without a run History (fit(history=False)) the epoch still has its averages (EpochEnd).
        epoch_history = self.history if self.history is not None else History()
        history_rows = epoch_history._open(epoch)
        step_fn, samples_in, world = self.step_fn, src.samples_in, src.world_size
        step_callbacks = self.step_callbacks
        rows = self.rows if self.block_callbacks else None
        self.block_epoch = epoch
        perf_counter = time.perf_counter
        next_block = perf_counter() + self.block_seconds
        span = self.span
        try:
            # Loggers get the steps in blocks: a step costs them a list append.
            t0 = perf_counter()
            while pos < ipe:
                with span("data_fetch"):
                    batch = next(it, _END)
                if batch is _END:
                    exhausted = True
                    self.instant("dataloader_exhausted")
                    break
                if not self.checked_first_batch:
                    self._check_first_batch(batch)
                t1 = perf_counter()
                state = self.state
                with span("step"):
                    new, metrics = step_fn(state, batch)
                n = samples_in(batch)  # this rank's samples (the event's batch_size)
                cursor = state.cursor
                # This rank's count times the ranks (the sampler gives every rank an equal share):
                # reading the step's all-reduced count instead would sync the device every step.
                new = new.replace(cursor=cursor.replace(position=pos + 1, samples_seen=cursor.samples_seen + n * world))
                # One assignment: an interrupt lands either before the step or after it, never between.
                self.state, self.step = new, self.step + 1
                t2 = perf_counter()
                ran += 1
                history_rows.append((self.step, metrics))
                if rows is not None:
                    rows.append((self.step, pos, metrics, n, t1 - t0, t2 - t1))
                if self.empty_cache == "step":
                    torch.cuda.empty_cache()
                if step_callbacks:
                    self.dispatch(
                        ev.StepEnd(
                            step=self.step, epoch=epoch, position=pos, samples_seen=new.cursor.samples_seen,
                            metrics=metrics, batch_size=n, data_time=t1 - t0, step_time=t2 - t1,
                            iters_per_epoch=ipe, epochs=self.epochs, batch=batch,
                        ),
                        new,
                        targets=step_callbacks,
                    )
                    if rows is not None:
                        rows = self.rows  # a save it caused delivered the block
                pos += 1
                if self.stop_reason is not None:
                    break
                if t2 >= next_block and rows:
                    self.flush_block(self.state)
                    rows = self.rows
                    next_block = perf_counter() + self.block_seconds
                t0 = t2
        finally:
            _close(it)
        if exhausted and ran == 0:
            # An epoch of no steps "completes" a run that trained nothing: a generator spent by
            # the first epoch, a dataset smaller than the position a checkpoint resumes at.
            raise ValueError(
                f"the training loader yielded no batch for epoch {epoch}"
                + (f" after skipping to position {start}" if start else "")
                + f" (the run counts {ipe} batches an epoch); pass a loader that yields its batches "
                "every epoch (a list, a DataLoader, not a generator spent by an earlier epoch)"
                + (", the same data the checkpoint was written with" if start else "")
            )
        if pos < ipe and not exhausted:
            return False  # stopped mid-epoch: the epoch is not over, no EpochEnd
        averages = epoch_history._close()
        if averages is None and ran == 0:
            # resumed at the epoch's end (a checkpoint of its last step): the restored averages
            averages = epoch_history._averages_of(epoch)
        if self.rows:
            self.flush_block(self.state)
        cursor = self.state.cursor
        self.state = self.state.replace(cursor=cursor.replace(epoch=epoch + 1, position=0))
        if self.empty_cache == "epoch":
            torch.cuda.empty_cache()
        self.dispatch(
            ev.EpochEnd(step=self.step, epoch=epoch, samples_seen=cursor.samples_seen, metrics=averages or {},
                        steps=ran, exhausted=exhausted, epochs=self.epochs),
            self.state,
        )
        return True

    def _fail_or_interrupt(self, err):
        c = self.state.cursor
        kw = dict(step=self.step, epoch=c.epoch, position=c.position, samples_seen=c.samples_seen)
        if self.history is not None and self.history._pending:
            self.history._close()
        if isinstance(err, KeyboardInterrupt):
            self.terminal(ev.Interrupted(**kw), self.state)
        else:
            self.terminal(ev.Failed(error=err, **kw), self.state)


def _close(it):
    close = getattr(it, "close", None)
    if callable(close):
        close()


@contextlib.contextmanager
def _switches(detect_anomaly: bool, matmul_precision: Optional[str]):
    previous = torch.get_float32_matmul_precision()
    if matmul_precision is not None:
        torch.set_float32_matmul_precision(matmul_precision)
    try:
        with torch.autograd.detect_anomaly() if detect_anomaly else _NULL:
            yield
    finally:
        if matmul_precision is not None:
            torch.set_float32_matmul_precision(previous)


def _check_call(state, step_fn) -> None:
    if isinstance(state, torch.nn.Module):
        raise TypeError(f"fit takes the TrainState, not the module: state = TrainState.create("
                        f"{type(state).__name__}(...), pimm_fn.optim.adamw(1e-3)), then fit(state, ...)")
    if not (hasattr(state, "cursor") and hasattr(state, "step")):
        raise TypeError(f"fit's first argument must be a TrainState (TrainState.create(model, tx)), "
                        f"got {type(state).__name__}")
    from ..compile.boundary import check_step_function  # `import pimm_fn` does not load the compile package

    check_step_function(step_fn, "step_fn")


def fit(
    state,
    loader,
    step_fn: Callable,
    *,
    epochs: int,
    callbacks: Sequence[Callable] = (),
    iters_per_epoch: Optional[int] = None,
    history=True,
    guard_state: str = "cheap",
    detect_anomaly: bool = False,
    matmul_precision: Optional[str] = None,
    empty_cache: Optional[str] = None,
    trace: Optional[bool] = None,
    block_seconds: float = 0.25,
) -> FitResult:
    """Train ``state`` with ``step_fn`` over ``loader`` up to the absolute horizon ``epochs``.

    Args:
      state: a :class:`~pimm_fn.TrainState`; its cursor says where to start (a restored state
        continues its run exactly, mid-epoch included).
      loader: an object with ``iter_epoch(epoch, start)`` and ``len`` (pimm_fn.data loaders),
        or any re-iterable (a list of batches, a torch DataLoader): that one is iterated each
        epoch and its first ``start`` batches are skipped on a resume -- exact only if its
        order per epoch is deterministic.
      step_fn: ``step_fn(state, batch) -> (new_state, metrics)``, pure; advances ``step`` and
        ``rng``, never the cursor.
      epochs: the horizon. A state whose ``cursor.epoch >= epochs`` returns at once with an
        AlreadyComplete event; a finished run given a larger horizon trains the new epochs
        (schedules are functions of the step, so they simply continue).
      callbacks: ``cb(event, state)`` callables; see :mod:`pimm_fn.callbacks`.
      iters_per_epoch: steps per epoch; needed for iterable data without a length (see
        :func:`resolve_iters_per_epoch`). A loader that ends sooner ends the epoch early.
      history: keep the step metrics (as tensors) in ``FitResult.history``; or a
        :class:`History` to continue (a resumed run: ``callbacks.resume(..., history=h)``
        fills it from the checkpoint, and ``fit(..., history=h)`` then returns the whole run's).
      guard_state: ``"cheap"`` (default) catches a callback assigning attributes or entries of
        the state, checked once per event (the error names the callbacks that saw it);
        ``"full"`` checks after each callback, names the one, and also catches in-place tensor
        changes (costs a pass over the leaves per callback call); ``"off"``.
      detect_anomaly / matmul_precision: run-level switches (restored afterwards);
      empty_cache: ``"step"`` or ``"epoch"`` empties the CUDA cache then (no-op without CUDA).
      trace: ``None`` emits ``torch.profiler.record_function`` spans only while a profiler is
        recording; True always; False never.
      block_seconds: how often the steps go, as one :class:`~pimm_fn.events.StepBlock`, to
        the callbacks that take blocks (loggers, progress bars); 0 sends a block per step.
        Blocks are always delivered before EpochEnd, SaveRequested and the end.

    Returns:
      :class:`FitResult` (``state, history = fit(...)`` unpacks it). On KeyboardInterrupt the
      last completed state, with status ``"interrupted"``. Other exceptions propagate after
      a Failed event. A callback that fails on the run's terminal event (a final checkpoint
      on a full disk) raises a RuntimeError that keeps the trained state: ``err.state``.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be a non-negative int (an absolute horizon), got {epochs!r}")
    _check_call(state, step_fn)
    if matmul_precision not in (None, "highest", "high", "medium"):
        raise ValueError(f"matmul_precision must be None, 'highest', 'high' or 'medium', got {matmul_precision!r}")
    run = _Run(_Source(loader, iters_per_epoch), callbacks, epochs=epochs, guard=guard_state, trace=trace,
               history=history, empty_cache=empty_cache, block_seconds=block_seconds)
    run.step_fn = step_fn
    run.state = state
    cursor = state.cursor
    with _switches(detect_anomaly, matmul_precision):
        run.step = int(state.step)  # the one host read of the counter; fit counts on the host after it
        if cursor.epoch >= epochs:
            run.instant("training_already_complete")
            run.terminal(
                ev.AlreadyComplete(step=run.step, epoch=cursor.epoch, epochs=epochs, samples_seen=cursor.samples_seen),
                state,
            )
            return FitResult(state, run.history, "already_complete")
        try:
            run.instant("training_start")
            run.dispatch(
                ev.TrainStart(
                    step=run.step, epoch=cursor.epoch, position=cursor.position, samples_seen=cursor.samples_seen,
                    epochs=epochs, iters_per_epoch=run.source.iters_per_epoch,
                    resumed=run.step > 0 or cursor.epoch > 0 or cursor.position > 0,
                    loader=loader, callbacks=run.callbacks, history=run.history, step_fn=step_fn,
                ),
                state,
            )
            # The steps on a frame stack of their own: called at an unlucky stack depth, a
            # step maps and unmaps memory on every call (pimm_fn.frame_room).
            call_with_frame_room(run.run_epochs, epochs)
            status, stop_reason = "stopped" if run.stop_reason is not None else "completed", run.stop_reason or ""
            c = run.state.cursor
            # Not terminal: an end-of-run evaluation and the best save it asks for happen here,
            # while the writers and checkpoints are still open.
            run.dispatch(ev.TrainEnding(step=run.step, epoch=c.epoch, samples_seen=c.samples_seen, reason=status,
                                        stop_reason=stop_reason), run.state)
        except BaseException as err:  # every exit path gets its terminal event
            run._fail_or_interrupt(err)
            if isinstance(err, KeyboardInterrupt):
                return FitResult(run.state, run.history, "interrupted")
            raise
        run.terminal(
            ev.TrainEnd(step=run.step, epoch=c.epoch, samples_seen=c.samples_seen, reason=status,
                        stop_reason=stop_reason),
            run.state,
        )
        run.instant("training_end")
        return FitResult(run.state, run.history, status, stop_reason)


def fit_epoch(
    state,
    loader,
    step_fn: Callable,
    *,
    callbacks: Sequence[Callable] = (),
    iters_per_epoch: Optional[int] = None,
    history: bool = True,
    guard_state: str = "cheap",
    trace: Optional[bool] = None,
    block_seconds: float = 0.25,
) -> FitResult:
    """The inner fold: finish the epoch ``state.cursor.epoch`` from ``state.cursor.position``.

    Emits EpochStart, StepEnd... (and StepBlocks), EpochEnd (no TrainStart / TrainEnd); Interrupted or Failed
    as ``fit`` does. Returns a :class:`FitResult`; its status is ``"completed"`` when the
    epoch ended (cursor rolled to the next epoch) and ``"stopped"`` when a Stop came first.
    """
    _check_call(state, step_fn)
    run = _Run(_Source(loader, iters_per_epoch), callbacks, epochs=None, guard=guard_state, trace=trace,
               history=history, empty_cache=None, block_seconds=block_seconds)
    run.step_fn = step_fn
    run.state = state
    run.step = int(state.step)
    try:
        done = call_with_frame_room(run.run_epoch)  # as in fit
        if run.rows:  # stopped mid-epoch: no EpochEnd delivered the last steps
            run.flush_block(run.state)
    except BaseException as err:
        run._fail_or_interrupt(err)
        if isinstance(err, KeyboardInterrupt):
            return FitResult(run.state, run.history, "interrupted")
        raise
    return FitResult(run.state, run.history, "completed" if done else "stopped", run.stop_reason or "")
