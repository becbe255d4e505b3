"""Periodic, best and final checkpoints, and resuming a run from the latest one.

Checkpoints go through :mod:`pimm_fn.checkpoint` (atomic files, a ``latest`` pointer),
named ``step_<n>.ckpt`` in ``directory``. Besides the TrainState each holds, in ``extra``:
``{"checkpoint": {metric, mode, best, best_step}, "loader": loader.state_dict() or None,
"callbacks": {key: cb.state_dict()}, "step": step_fn.state_dict() or None}``; :func:`resume`
puts all of it back.
"""
from __future__ import annotations

import collections
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import torch

from .. import checkpoint as ckpt
from .. import events as ev
from ..checkpoint import store
from ..tree import all_on_cpu
from ..user_warning import warn
from .base import Callback, callback_name, check_every, due


def _callback_keys(callbacks) -> dict:
    """Stable keys for callbacks that keep state: the class name, ``#i`` for repeats."""
    keys, seen = {}, {}
    for cb in callbacks:
        if not callable(getattr(cb, "state_dict", None)):
            continue
        name = callback_name(cb)
        seen[name] = seen.get(name, 0) + 1
        keys[id(cb)] = name if seen[name] == 1 else f"{name}#{seen[name]}"
    return keys


class Checkpoint(Callback):
    """Save the state every n steps and/or epochs, on a new best metric, at the end.

    directory: the checkpoint folder (a :class:`pimm_fn.checkpoint.CheckpointDir`).
    every_steps / every_epochs: save after steps n, 2n, ... / after every n-th epoch.
    keep_last: keep this many ``step_<n>.ckpt`` files (the latest and the best are never
        deleted).
    best_metric: a metric name of ``eval_name``'s EvalEnd (e.g. ``"mIoU"``); a better value
        (``mode`` ``"max"`` or ``"min"``) saves a checkpoint marked best (``best.ckpt``).
    save_final: save when the run ends (completed or stopped) unless this step is saved.
    save_on_interrupt: save the last completed state on KeyboardInterrupt.
    background: write files on a writer thread while training goes on (default). The
        state handed over is a snapshot by construction: steps are pure, so no tensor of a
        state is written after its step returned. Files are as atomic as a foreground save
        (temp file, fsync, rename, then the ``latest`` pointer): a SIGKILL mid-write leaves
        the previous checkpoint as ``latest``. ``CheckpointSaved`` is emitted once the file
        is durable (at a later step, or when the run ends: ``fit`` returns only after every
        write finished). A failed write raises ``CheckpointError`` on the training thread at
        a later event; ``latest`` only ever names complete files.
        States with tensors off the CPU are saved in the foreground.

    Saves happen once the step's events reached every callback (this callback runs last and
    saves on SaveRequested), so loggers have flushed that step and the best metric of an
    evaluation at this step is in the checkpoint.
    """

    order = 1000
    saves_checkpoints = True  # tells fit that SaveNow requests have a taker

    def __init__(self, directory, *, every_steps: Optional[int] = None, every_epochs: Optional[int] = 1,
                 keep_last: Optional[int] = 3, best_metric: Optional[str] = None, mode: str = "max",
                 eval_name: str = "val", save_final: bool = True, save_on_interrupt: bool = True,
                 background: bool = True):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        check_every("every_steps", every_steps)
        check_every("every_epochs", every_epochs)
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0):
            raise ValueError(f"keep_last must be an int >= 0 or None (keep all), got {keep_last!r}")
        self.dir = ckpt.CheckpointDir(directory, keep_last=keep_last)
        self.every_steps, self.every_epochs = every_steps, every_epochs
        self.keep_last = keep_last
        self.best_metric, self.mode, self.eval_name = best_metric, mode, eval_name
        self.save_final, self.save_on_interrupt = save_final, save_on_interrupt
        self.best: Optional[float] = None
        self.best_step: Optional[int] = None
        self.last_path: Optional[Path] = None
        # The last save's (step, epoch, position): an epoch end after a per-step save of the
        # same step saves again, since its state's cursor has rolled to the next epoch.
        self._last_saved_at: Optional[tuple] = None
        self._loader = self._step_fn = None
        self._callbacks: Sequence = ()
        self._evaluations: set = set()  # the EvalEnd names this run saw
        self.background = background
        self._writer: Optional[ThreadPoolExecutor] = None
        self._pending: collections.deque = collections.deque()  # (future, step, best), oldest first

    @property
    def last_saved_step(self) -> Optional[int]:
        """The step of the last checkpoint written (or handed to the writer), None before."""
        return None if self._last_saved_at is None else self._last_saved_at[0]

    # ----- state kept in checkpoints
    def state_dict(self) -> dict:
        return {"metric": self.best_metric, "mode": self.mode, "best": self.best, "best_step": self.best_step}

    def load_state_dict(self, state: dict) -> None:
        if state and state.get("metric") == self.best_metric:
            self.best, self.best_step = state.get("best"), state.get("best_step")

    def _extra(self) -> dict:
        loader_sd = getattr(self._loader, "state_dict", None)
        step_sd = getattr(self._step_fn, "state_dict", None)  # a background-compiled step's switch
        keys = _callback_keys(self._callbacks)
        history = getattr(self, "_history", None)
        return {
            "checkpoint": self.state_dict(),
            "loader": loader_sd() if callable(loader_sd) else None,
            "step": step_sd() if callable(step_sd) else None,
            "history": history.state_dict() if history is not None else None,
            "callbacks": {keys[id(cb)]: cb.state_dict() for cb in self._callbacks
                          if id(cb) in keys and cb is not self and cb.state_dict() is not None},
        }

    def save(self, state, step: int, *, best: bool = False) -> Path:
        """Write a checkpoint of ``state`` now, in the foreground (after any pending writes)."""
        self._finished(wait=True)
        path = self._write(state, step, self._extra(), best)
        self.last_path, self._last_saved_at = path, _saved_at(state, step)
        return path

    def _write(self, state, step: int, extra: dict, best: bool) -> Path:
        with torch.profiler.record_function("checkpoint.save"):
            return self.dir.save(state, step=step, extra=extra, keep_last=self.keep_last, best=best)

    def _request(self, state, step: int, best: bool) -> list:
        """Save ``state`` as ``step``: in the background where possible; returns finished events."""
        if not self.background or not all_on_cpu(state):
            return self._finished(wait=True) + [
                ev.CheckpointSaved(step=step, path=str(self.save(state, step, best=best)), best=best)]
        # What the loader and callbacks say about this step is read now, on this thread.
        extra = self._extra()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="pimm_fn-checkpoint")
        # The writer thread's own span is not in a profile of the training thread; this one
        # marks the hand-off there.
        with torch.profiler.record_function("checkpoint.save.background"):
            future = self._writer.submit(self._write, state, step, extra, best)
        self._pending.append((future, step, best))
        self.last_path, self._last_saved_at = self.dir.path_for(step), _saved_at(state, step)
        return self._finished(wait=False)

    def _finished(self, wait: bool) -> list:
        """CheckpointSaved events of the writes that completed (all of them with ``wait``)."""
        out = []
        while self._pending and (wait or self._pending[0][0].done()):
            future, step, best = self._pending.popleft()
            try:
                path = future.result()
            except BaseException as err:
                self._pending.clear()
                raise ckpt.CheckpointError(
                    f"writing the checkpoint of step {step} into {self.dir.root} failed "
                    f"({type(err).__name__}: {err}); the folder's earlier checkpoints are intact and "
                    "'latest' still names the last complete one. Free disk space or fix the folder's "
                    "permissions, then resume from it."
                ) from err
            out.append(ev.CheckpointSaved(step=step, path=str(path), best=best))
        return out

    # ----- events
    def wants(self, event_type) -> bool:
        # Per-step saves need every StepEnd; otherwise finished background writes are
        # reported at the next epoch end, evaluation, save or the run's end.
        return event_type is not ev.StepEnd or self.every_steps is not None

    def on_train_start(self, event, state):
        # A folder that cannot hold checkpoints, or a sharded state it cannot write, fails
        # the run now, not at its first save after the training it was to keep.
        self.dir.make()
        store.refuse_sharded(state)
        self._loader, self._callbacks, self._history = event.loader, event.callbacks, event.history
        self._step_fn = event.step_fn
        self._evaluations = set()

    def on_step_end(self, event, state):
        done = self._finished(wait=False) if self._pending else []
        if due(event.step, self.every_steps):
            done.append(ev.SaveNow("every_steps"))
        return done or None

    def on_epoch_end(self, event, state):
        done = self._finished(wait=False) if self._pending else []
        if due(event.epoch + 1, self.every_epochs):
            done.append(ev.SaveNow("every_epochs"))
        return done or None

    def _better(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best

    def on_eval_end(self, event, state):
        done = self._finished(wait=False) if self._pending else []
        self._evaluations.add(event.name)
        if self.best_metric is None or event.name != self.eval_name:
            return done or None
        if self.best_metric not in event.metrics:
            raise KeyError(
                f"Checkpoint(best_metric={self.best_metric!r}): the {event.name!r} evaluation reported "
                f"{sorted(event.metrics)}; pick one of these"
            )
        value = float(event.metrics[self.best_metric])
        if self._better(value):
            self.best, self.best_step = value, event.step
            done.append(ev.SaveNow("best", best=True))
        return done or None

    def on_save_requested(self, event, state):
        if _saved_at(state, event.step) == self._last_saved_at and not event.best:
            return None
        return self._request(state, event.step, event.best) or None

    def _final(self, event, state):
        out = [] if _saved_at(state, event.step) == self._last_saved_at else self._request(state, event.step, False)
        return out + self._finished(wait=True) or None

    def on_train_end(self, event, state):
        if self.best_metric is not None and self.best is None and self.eval_name not in self._evaluations:
            seen = ", ".join(repr(n) for n in sorted(self._evaluations)) or "none"
            warn(f"Checkpoint(best_metric={self.best_metric!r}, eval_name={self.eval_name!r}): no "
                 f"{self.eval_name!r} evaluation ran in this run (evaluations: {seen}), so no best checkpoint "
                 f"was kept; add Evaluate(..., name={self.eval_name!r}) or pass the eval_name of yours",
                 UserWarning)
        if self.save_final:
            return self._final(event, state)
        return self._finished(wait=True) or None

    def on_interrupted(self, event, state):
        if self.save_on_interrupt:
            return self._final(event, state)
        return self._finished(wait=True) or None

    def on_failed(self, event, state):
        # The run's own error is what fit re-raises; still let started writes finish.
        try:
            return self._finished(wait=True) or None
        except ckpt.CheckpointError:
            return None

    def on_end(self, event, state):
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None


def restore_latest(directory, like):
    """``(state, extra)`` from the newest complete checkpoint in ``directory``, or None if none.

    Errors (corrupt file, another model's checkpoint, a pickle) are those of
    :func:`pimm_fn.checkpoint.restore`.
    """
    path = ckpt.CheckpointDir(directory).latest()
    if path is None:
        return None
    return ckpt.restore(path, like)


def resume(path, like, *, loader=None, callbacks: Sequence = (), must_exist: bool = False, history=None,
           step=None):
    """The state to (re)start a run from: the latest checkpoint in ``path``, else ``like``.

    path: a checkpoint folder (its latest complete checkpoint is used; none yet, or no folder
        yet -> ``like``, a fresh run), its ``latest`` pointer, or one checkpoint file (a
        ``.ckpt`` path that does not exist is an error naming the folder's checkpoints).
    like: the fresh state (same model and optimizer) that gives the structure.
    loader / callbacks / step: their saved state (``extra["loader"]``, ``extra["callbacks"]``,
        the Checkpoint's best metric, the step index at which a ``compile_step(...,
        background=True)`` step switched to its compiled graph) is loaded back into them.
    must_exist: raise instead of starting fresh when ``path`` holds no checkpoint.
    history: a :class:`pimm_fn.History` to fill with the run's step metrics up to the
        checkpoint (carried in the checkpoint; steps a killed run made after it are not
        there, they run again); pass it on as ``fit(..., history=history)`` to get the
        whole run's history back. Left empty when the checkpoint has none.
    """
    p = Path(path)
    if p.name == ckpt.CheckpointDir.LATEST and p.is_file():
        p = p.parent  # the folder's pointer file: resume from the folder (what it names)
    if p.is_file():
        state, extra = ckpt.restore(p, like)
    elif p.is_dir() or not (must_exist or p.suffix == ckpt.SUFFIX):
        # A folder that does not exist yet is a fresh run's; a missing *file* is a mistake.
        found = restore_latest(p, like)
        if found is None:
            if must_exist:
                raise ckpt.CheckpointNotFoundError(
                    f"no complete checkpoint in {p} to resume from; train from scratch (must_exist=False) "
                    "or point at the folder a Checkpoint callback wrote"
                )
            return like
        state, extra = found
    else:
        # Let the checkpoint module name the missing file (and suggest neighbours).
        state, extra = ckpt.restore(p, like)
    extra = extra if isinstance(extra, dict) else {}
    if history is not None and extra.get("history"):
        history.load_state_dict(extra["history"])
    if loader is not None and extra.get("loader") is not None and callable(getattr(loader, "load_state_dict", None)):
        loader.load_state_dict(extra["loader"])
    if step is not None and extra.get("step") is not None and callable(getattr(step, "load_state_dict", None)):
        step.load_state_dict(extra["step"])
    saved = extra.get("callbacks") or {}
    keys = _callback_keys(callbacks)
    for cb in callbacks:
        if isinstance(cb, Checkpoint) and extra.get("checkpoint"):
            cb.load_state_dict(extra["checkpoint"])
        elif id(cb) in keys and keys[id(cb)] in saved:
            cb.load_state_dict(saved[keys[id(cb)]])
    return state


def _saved_at(state, step: int) -> tuple:
    c = state.cursor
    return step, c.epoch, c.position
