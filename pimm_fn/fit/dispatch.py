"""Delivering events to callbacks: ordering, requests (Stop, SaveNow), and the guard that
callbacks leave the state alone."""
from __future__ import annotations

import collections
import contextlib
from typing import Callable, Optional

import attrs
import torch

from .. import events as ev
from .. import torch_compat
from ..callbacks.base import callback_name, handles
from ..user_warning import warn

__all__ = ["Dispatcher", "StateMutationError"]

_STEP_EVENTS = (ev.StepEnd, ev.StepBlock)
_NULL = contextlib.nullcontext()


class StateMutationError(RuntimeError):
    """A callback tried to change the TrainState it was handed."""


def _profiling() -> bool:
    return torch_compat.profiler_enabled()


class Dispatcher:
    """The callbacks of one run and how events reach them.

    Step events go to the callbacks that can act on them (``step_callbacks`` take StepEnd,
    ``block_callbacks`` StepBlock); any other event first delivers the pending block
    (``flush_block``, the loop's), so writers see every step before an epoch end, a save or
    the end. Requests returned by callbacks are honoured: Stop sets ``stop_reason``,
    SaveNow runs a save round (SaveRequested to every callback).
    """

    def __init__(self, callbacks, *, guard: str, trace):
        if guard not in ("off", "cheap", "full"):
            raise ValueError(f"guard_state must be 'off', 'cheap' or 'full', got {guard!r}")
        if isinstance(callbacks, Callable) and not isinstance(callbacks, (list, tuple)):
            callbacks = (callbacks,)
        cbs = list(callbacks or ())
        for cb in cbs:
            if not callable(cb):
                raise TypeError(f"callback {cb!r} is not callable: a callback is cb(event, state)")
            if isinstance(cb, type):
                raise TypeError(f"callback {cb.__name__} is a class; pass an instance: {cb.__name__}(...)")
        self.callbacks = tuple(sorted(cbs, key=lambda c: getattr(c, "order", 0)))
        self.names = {id(cb): callback_name(cb) for cb in self.callbacks}
        # StepEnd fires every step: it goes only to the callbacks that can act on it.
        self.step_callbacks = tuple(cb for cb in self.callbacks if handles(cb, ev.StepEnd))
        # Loggers and progress bars take the steps in blocks (events.StepBlock): between
        # blocks a step costs the run one list append.
        self.block_callbacks = tuple(cb for cb in self.callbacks if handles(cb, ev.StepBlock))
        self.rows: list = []  # the pending block's rows
        self.guard = guard
        self.trace = trace
        self.stop_reason: Optional[str] = None
        self.step = 0
        self._warned_unsaved = False

    def flush_block(self, state) -> None:
        """Deliver the pending steps (the loop overrides this)."""
        self.rows = []

    # ----- tracing
    def span(self, name: str):
        """A profiler span named ``name`` while tracing (see ``fit(trace=...)``), else nothing."""
        if self.trace is True or (self.trace is None and _profiling()):
            return torch.profiler.record_function(name)
        return _NULL

    def instant(self, name):
        with self.span(f"instant.{name}"):
            pass

    # ----- dispatch
    def _snapshot(self, state):
        if self.guard == "off" or not self.callbacks:
            return None
        d = state.__dict__
        snap = [tuple(d), tuple(map(id, d.values()))]
        for f in ("params", "buffers", "extra"):
            v = d.get(f)
            if isinstance(v, dict):
                snap.append((f, len(v), tuple(map(id, v.values()))))
        if self.guard == "full":
            from ..tree import tree_leaves

            snap.append(("a tensor in place", tuple((id(t), t._version) for t in tree_leaves(state)
                                                    if isinstance(t, torch.Tensor))))
        return snap

    def _changed(self, state, snap) -> list:
        now = self._snapshot(state)
        if now == snap:
            return []
        changed = []
        if now[0] != snap[0]:
            changed.append("its fields")
        else:
            changed += [f for f, a, b in zip(now[0], now[1], snap[1]) if a != b]
        changed += [a[0] for a, b in zip(now[2:], snap[2:]) if a != b]
        return changed or ["the state"]

    def _call(self, cb, event, state, snap):
        try:
            with self.span(f"callback.{self.names.get(id(cb))}.{type(event).__name__}"):
                out = cb(event, state)
        except attrs.exceptions.FrozenInstanceError as err:
            name = self.names.get(id(cb)) or callback_name(cb)
            raise StateMutationError(
                f"callback {name} tried to assign an attribute of a frozen object while handling "
                f"{type(event).__name__} at step {event.step}: the TrainState (and its cursor and "
                "rng) handed to callbacks is immutable. Callbacks observe; to end the run return "
                "Stop(), to save return SaveNow(); change training through the step function or "
                "the state you pass to fit."
            ) from err
        if snap is not None and self.guard == "full":
            self._check_unchanged(state, snap, (cb,), event)
        return out

    def _check_unchanged(self, state, snap, suspects, event):
        changed = self._changed(state, snap)
        if changed:
            names = [self.names.get(id(cb)) or callback_name(cb) for cb in suspects]
            who = f"callback {names[0]}" if len(names) == 1 else f"one of the callbacks {', '.join(names)}"
            raise StateMutationError(
                f"{who} changed the TrainState while handling {type(event).__name__} at "
                f"step {event.step} ({', '.join(changed)}): callbacks must not mutate the state's "
                "dicts or tensors. Callbacks observe; return Stop() or SaveNow() to steer the run."
                + ("" if len(names) == 1 else " (fit(..., guard_state='full') names the one)")
            )

    def dispatch(self, event, state, *, terminal=False, targets=None):
        """Deliver ``event`` (and the events callbacks emit) to every callback; honour requests.

        targets: the callbacks ``event`` itself goes to (default: all); emitted events go to all.
        """
        if self.rows and type(event) not in _STEP_EVENTS:
            self.flush_block(state)  # writers see every step before the epoch / a save / the end
        first = self.callbacks if targets is None else targets
        if not first:
            return
        snap = self._snapshot(state)
        queue = collections.deque([event])
        saves: list = []
        ran = set()
        while queue:
            e = queue.popleft()
            if e is not event and self.rows and type(e) not in _STEP_EVENTS:
                # An evaluation a StepEnd caused: the writers get the steps up to it first.
                self.flush_block(state)
            for cb in (first if e is event else self.callbacks):
                if snap is not None:
                    ran.add(cb)
                out = self._call(cb, e, state, snap)
                if out is None:
                    continue
                for item in out if isinstance(out, (list, tuple)) else (out,):
                    if item is None:
                        continue
                    if isinstance(item, ev.Stop):
                        if not terminal and self.stop_reason is None:
                            self.stop_reason = item.reason or f"{self.names.get(id(cb))} requested a stop"
                    elif isinstance(item, ev.SaveNow):
                        saves.append(item)
                    elif isinstance(item, ev.Event):
                        queue.append(item)
                    else:
                        raise TypeError(
                            f"callback {self.names.get(id(cb))} returned {item!r}; a callback returns None, "
                            "Stop(), SaveNow(), an event, or a list of these"
                        )
        if snap is not None and self.guard == "cheap":
            self._check_unchanged(state, snap, [cb for cb in self.callbacks if cb in ran], event)
        if saves and not terminal and not isinstance(event, ev.SaveRequested):
            self._save(state, saves, snap)

    def _save(self, state, saves, snap):
        if self.rows:
            self.flush_block(state)
        c = state.cursor
        req = ev.SaveRequested(
            step=self.step, epoch=c.epoch, position=c.position, samples_seen=c.samples_seen,
            reasons=tuple(dict.fromkeys(s.reason for s in saves)), best=any(s.best for s in saves),
        )
        queue = collections.deque([req])
        while queue:
            e = queue.popleft()
            for cb in self.callbacks:
                out = self._call(cb, e, state, snap)
                for item in out if isinstance(out, (list, tuple)) else (out,):
                    if isinstance(item, ev.Event):
                        queue.append(item)
                    elif isinstance(item, ev.Stop) and self.stop_reason is None:
                        self.stop_reason = item.reason or "stop requested"
        if snap is not None and self.guard == "cheap":
            self._check_unchanged(state, snap, self.callbacks, req)
        if not self._warned_unsaved and not any(getattr(cb, "saves_checkpoints", False) for cb in self.callbacks):
            self._warned_unsaved = True
            warn("a callback returned SaveNow() but no callback saved a checkpoint "
                 "(add pimm_fn.callbacks.Checkpoint to the callbacks)")

    def terminal(self, event, state):
        """Deliver a terminal event; every callback gets it even if an earlier one raises."""
        errors = []
        if self.rows:
            try:
                self.flush_block(state)
            except Exception as err:  # the terminal event must still go out
                errors.append((self.block_callbacks[0], err))
        queue = collections.deque([event])
        while queue:
            e = queue.popleft()
            for cb in self.callbacks:
                try:
                    out = cb(e, state)
                except Exception as err:  # the other callbacks still need to close
                    errors.append((cb, err))
                    continue
                for item in out if isinstance(out, (list, tuple)) else (out,):
                    if isinstance(item, ev.Event):
                        queue.append(item)
        if errors and not isinstance(event, ev.Failed):
            cb, err = errors[0]
            # The steps ran: a failing last save (a full disk) must not lose the trained state.
            error = RuntimeError(
                f"callback {self.names.get(id(cb))} failed while handling {type(event).__name__}; the run's "
                "state is kept on this error: err.state"
            )
            error.state = state
            raise error from err
