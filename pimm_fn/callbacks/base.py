"""The callback base class and Ignite-style event filters.

A callback is any callable ``cb(event, state) -> None | Stop | SaveNow | Event | list``.
:class:`Callback` dispatches each event type to an ``on_<event>`` method. ``order`` sorts
callbacks (stable, ascending) before ``fit`` runs them; checkpointing callbacks run last so
that every other callback has seen (and flushed) a step before it is saved.
"""
from __future__ import annotations

from typing import Callable, Optional

from .. import events as ev

_METHODS = {
    ev.TrainStart: "on_train_start",
    ev.EpochStart: "on_epoch_start",
    ev.StepEnd: "on_step_end",
    ev.StepBlock: "on_step_block",
    ev.EvalEnd: "on_eval_end",
    ev.EpochEnd: "on_epoch_end",
    ev.SaveRequested: "on_save_requested",
    ev.CheckpointSaved: "on_checkpoint_saved",
    ev.TrainEnding: "on_train_ending",
    ev.TrainEnd: "on_train_end",
    ev.Interrupted: "on_interrupted",
    ev.Failed: "on_failed",
    ev.AlreadyComplete: "on_already_complete",
}


class Callback:
    """Base class: override the ``on_*`` methods you need; each gets ``(event, state)``.

    ``on_end(event, state)`` is called for every terminal event (TrainEnd, Interrupted,
    Failed, AlreadyComplete) after its own method: the place to close files.
    ``state_dict`` / ``load_state_dict``: what :class:`Checkpoint` stores for this callback
    and :func:`pimm_fn.callbacks.resume` restores (override both or neither).
    ``wants(event_type)``: optional; returning False for ``StepEnd`` takes the callback off
    the per-step path (a callback acting every n-th step still wants it). A callback that
    only records or shows steps (a logger, a progress bar) should take ``StepBlock`` events
    (``on_step_block``) instead: fit delivers them a few times a second.
    """

    order: int = 0

    def __call__(self, event, state):
        name = _METHODS.get(type(event))
        out = getattr(self, name)(event, state) if name is not None else None
        if isinstance(event, ev.TERMINAL_EVENTS):
            self.on_end(event, state)
        return out

    def on_train_start(self, event, state): ...
    def on_epoch_start(self, event, state): ...
    def on_step_end(self, event, state): ...
    def on_step_block(self, event, state): ...
    def on_eval_end(self, event, state): ...
    def on_epoch_end(self, event, state): ...
    def on_save_requested(self, event, state): ...
    def on_checkpoint_saved(self, event, state): ...
    def on_train_ending(self, event, state): ...
    def on_train_end(self, event, state): ...
    def on_interrupted(self, event, state): ...
    def on_failed(self, event, state): ...
    def on_already_complete(self, event, state): ...
    def on_end(self, event, state): ...

    def state_dict(self) -> Optional[dict]:
        """Plain data to store in checkpoints; None when the callback has nothing to keep."""
        return None

    def load_state_dict(self, state: dict) -> None:
        pass


def handles(cb, event_type: type) -> bool:
    """Whether ``cb`` can act on ``event_type`` events (False only when that is certain).

    A :class:`Callback` that overrides neither ``__call__`` nor the event's ``on_*`` method
    ignores it, and so does an :func:`on` filter for another event type; a callback with a
    ``wants(event_type)`` method says itself; any other callable may act on anything, except
    :class:`~pimm_fn.events.StepBlock`, which is opt-in (it repeats what StepEnd said).
    """
    if isinstance(cb, _Filtered):
        return cb.event_type is event_type
    wants = getattr(cb, "wants", None)
    if callable(wants):
        return bool(wants(event_type))
    name = _METHODS.get(event_type)
    if isinstance(cb, Callback):
        overrides = name is not None and getattr(type(cb), name) is not getattr(Callback, name)
        if event_type is ev.StepBlock:
            return overrides
        if type(cb).__call__ is Callback.__call__:
            return name is None or overrides
        return True
    return event_type is not ev.StepBlock


def callback_name(cb) -> str:
    return getattr(cb, "name", None) or getattr(cb, "__name__", None) or type(cb).__name__


_EPOCH_EVENTS = (ev.EpochStart, ev.EpochEnd)


class _Filtered:
    """``fn`` called only for events of ``event_type`` that pass the filter (see :func:`on`)."""

    def __init__(self, fn, event_type, every, once, last, when):
        self.fn = fn
        self.event_type = event_type
        self.every, self.once, self.last, self.when = every, once, last, when
        self.name = f"on({event_type.__name__})({callback_name(fn)})"
        self.order = getattr(fn, "order", 0)

    def _passes(self, event) -> bool:
        if self.every is None and self.once is None and not self.last:
            ok = True
        else:
            if isinstance(event, _EPOCH_EVENTS):
                count, at = event.epoch + 1, event.epoch
            else:
                count = at = event.step
            ok = (
                (self.every is not None and count % self.every == 0)
                or (self.once is not None and at == self.once)
                or (self.last and bool(getattr(event, "is_last", False)))
            )
        return ok and (self.when is None or bool(self.when(event)))

    def __call__(self, event, state):
        if type(event) is self.event_type and self._passes(event):
            return self.fn(event, state)
        return None


def on(
    event_type: type,
    *,
    every: Optional[int] = None,
    once: Optional[int] = None,
    last: bool = False,
    when: Optional[Callable] = None,
):
    """Decorator: call ``fn(event, state)`` only for ``event_type`` events that pass a filter.

    For StepEnd, ``every=n`` passes steps n, 2n, ... and ``once=s`` passes step s; for
    EpochStart / EpochEnd, ``every=n`` passes every n-th epoch (epochs n-1, 2n-1, ...
    0-based) and ``once=e`` passes epoch e. ``last=True`` passes the run's last step /
    last epoch. Given several, an event passes if any passes (Ignite's ``|``);
    ``when(event) -> bool`` must then also hold. With none, every such event passes.
    Example: ``fit(..., callbacks=[on(StepEnd, every=100)(log_fn)])``.
    """
    if not (isinstance(event_type, type) and issubclass(event_type, ev.Event)):
        raise TypeError(f"on() needs an event class such as StepEnd, got {event_type!r}")
    for label, n in (("every", every), ("once", once)):
        if n is not None and (not isinstance(n, int) or n < (1 if label == "every" else 0)):
            raise ValueError(f"on({event_type.__name__}, {label}={n!r}): need a positive int")
    if (every is not None or once is not None or last) and event_type not in (
        ev.StepEnd, ev.EpochStart, ev.EpochEnd
    ):
        raise ValueError(
            f"every/once/last filter StepEnd, EpochStart and EpochEnd only, not {event_type.__name__};"
            " use when=... for other events"
        )
    if last and event_type is ev.EpochStart:
        raise ValueError("last=True is defined for StepEnd and EpochEnd")

    def wrap(fn):
        return _Filtered(fn, event_type, every, once, last, when)

    return wrap


def check_every(label: str, n) -> None:
    """A ValueError unless ``n`` (a callback's ``every_steps`` / ``every_epochs``) is None or an int >= 1."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{label} must be a positive int or None (never), got {n!r}")


def due(count: int, every: Optional[int]) -> bool:
    """``every`` > 0 and ``count`` is a multiple of it."""
    return bool(every) and count % every == 0
