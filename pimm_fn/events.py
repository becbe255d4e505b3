"""Typed, immutable records that ``fit`` emits to callbacks, and the requests callbacks return.

Every event is a frozen attrs record; its ``metrics`` mapping is read-only. Step metrics are
0-dim tensors (pulling a number is the callback's choice, and costs a host sync); eval
metrics are floats. See docs/fit.md for the table of which events fire when.

Requests: a callback may return :class:`Stop` or :class:`SaveNow` (or an event, which ``fit``
then delivers to every callback, or a list of these). ``fit`` honours the requests once the
event and the events it caused have reached every callback.
"""
from __future__ import annotations

import types
from typing import Any, Mapping, Optional

import attrs


def _readonly(mapping) -> Mapping:
    if mapping is None:
        return types.MappingProxyType({})
    if isinstance(mapping, types.MappingProxyType):
        return mapping
    return types.MappingProxyType(dict(mapping))


_frozen = attrs.frozen(slots=True, kw_only=True)


@_frozen
class Event:
    """Base of every event. ``step``: steps applied to the state (``int(state.step)``)."""

    step: int


@_frozen
class TrainStart(Event):
    """The run begins (after the already-complete check, before the first epoch).

    epoch / position: the cursor the run starts from (position = batches already consumed
    in that epoch); resumed: the state had made progress before this call.
    loader / callbacks / history / step_fn: the training loader, the callback list, the
    run's :class:`~pimm_fn.fit.History` (or None) and the step function, for callbacks that
    save or restore their state (Checkpoint).
    """

    epoch: int
    position: int
    samples_seen: int
    epochs: int
    iters_per_epoch: int
    resumed: bool
    loader: Any = attrs.field(default=None, repr=False, eq=False)
    callbacks: tuple = attrs.field(default=(), repr=False, eq=False)
    history: Any = attrs.field(default=None, repr=False, eq=False)
    step_fn: Any = attrs.field(default=None, repr=False, eq=False)


@_frozen
class EpochStart(Event):
    """An epoch begins; ``position`` is the cursor position it starts from (> 0 on a mid-epoch resume)."""

    epoch: int
    position: int
    samples_seen: int
    iters_per_epoch: int
    epochs: Optional[int] = None


@_frozen
class StepEnd(Event):
    """One step has been applied; ``step`` counts it; ``position`` is its 0-based index in the
    epoch (``Cursor.position``).

    metrics: the step function's 0-dim tensors (read-only mapping).
    batch_size: samples in this batch on this rank; samples_seen: over all ranks, after it.
    data_time / step_time: host seconds spent fetching the batch and calling the step
    (on an accelerator the step call may return before the work is done).
    batch: the batch itself (for batch statistics); do not keep it.
    """

    epoch: int
    position: int
    samples_seen: int
    metrics: Mapping = attrs.field(converter=_readonly)
    batch_size: int
    data_time: float
    step_time: float
    iters_per_epoch: int
    epochs: Optional[int] = None
    batch: Any = attrs.field(default=None, repr=False, eq=False)

    @property
    def last_in_epoch(self) -> bool:
        """This step is the epoch's last by its length (a loader that ends early is not known here)."""
        return self.position + 1 == self.iters_per_epoch

    @property
    def is_last(self) -> bool:
        """This step is the run's last by the horizon (False under ``fit_epoch``)."""
        return self.epochs is not None and self.last_in_epoch and self.epoch + 1 == self.epochs


@_frozen
class StepBlock(Event):
    """The steps applied since the previous block, in one event (``step`` is the last one's).

    ``fit`` collects every step's metrics and timings and delivers them as a block at most
    every ``block_seconds`` (fit's argument) and always before any EpochEnd,
    SaveRequested or terminal event, so a writer has seen every step before the epoch
    closes or a checkpoint is written. A step then costs the run one list append instead of
    an event per callback: loggers and progress bars take blocks; a callback that must act
    right after a particular step (stop, evaluate, save) takes StepEnd.

    Delivered only to callbacks that ask for it (an ``on_step_block`` method,
    ``wants(StepBlock)``, or ``on(StepBlock)``); plain callables get StepEnd.

    rows: per step ``(step, position, metrics, batch_size, data_time, step_time)``, oldest
    first; the properties below give the columns. All rows are from one epoch.
    """

    epoch: int
    samples_seen: int
    iters_per_epoch: int
    rows: tuple = attrs.field(repr=False)
    epochs: Optional[int] = None

    @property
    def steps(self) -> tuple:
        return tuple(r[0] for r in self.rows)

    @property
    def positions(self) -> tuple:
        return tuple(r[1] for r in self.rows)


    @property
    def metrics(self) -> tuple:
        """One read-only mapping of 0-dim tensors per step."""
        return tuple(types.MappingProxyType(r[2]) for r in self.rows)

    @property
    def data_time(self) -> float:
        """Host seconds fetching batches, summed over the block."""
        return sum(r[4] for r in self.rows)

    @property
    def step_time(self) -> float:
        """Host seconds in step calls, summed over the block."""
        return sum(r[5] for r in self.rows)

    @property
    def is_last(self) -> bool:
        """The block ends with the run's last step by the horizon."""
        last_position = self.rows[-1][1] if self.rows else -1
        return (self.epochs is not None and last_position + 1 == self.iters_per_epoch
                and self.epoch + 1 == self.epochs)

    def __len__(self) -> int:
        return len(self.rows)


@_frozen
class EvalEnd(Event):
    """An evaluation finished; ``metrics`` are floats (``name`` is the tag prefix, e.g. ``val``)."""

    epoch: int
    name: str
    metrics: Mapping = attrs.field(converter=_readonly)
    samples: int = 0


@_frozen
class EpochEnd(Event):
    """An epoch finished: it ran to its length, or the loader was exhausted first.

    The state handed with it already has its cursor rolled to ``(epoch + 1, 0)``.
    metrics: per-key averages (0-dim tensors) over the epoch's steps: those this call ran,
        with those of a restored History (``resume(..., history=h)``) the whole epoch's, as
        in the run that was not interrupted.
    steps: how many steps this call ran in the epoch (fewer than its length on a resume).
    """

    epoch: int
    samples_seen: int
    metrics: Mapping = attrs.field(converter=_readonly)
    steps: int
    exhausted: bool = False
    epochs: Optional[int] = None

    @property
    def is_last(self) -> bool:
        return self.epochs is not None and self.epoch + 1 == self.epochs


@_frozen
class SaveRequested(Event):
    """Some callback returned :class:`SaveNow`; checkpointing callbacks save now.

    Delivered once per step (or epoch boundary), after the events of that step reached
    every callback, with the reasons of all requests; ``best`` is True when one of them
    asked to mark the checkpoint as the best one.
    """

    epoch: int
    position: int
    samples_seen: int
    reasons: tuple = ()
    best: bool = False


@_frozen
class CheckpointSaved(Event):
    """A checkpoint was written completely (emitted by :class:`pimm_fn.callbacks.Checkpoint`)."""

    path: str
    best: bool = False


@_frozen
class TrainEnding(Event):
    """The run is about to end normally; :class:`TrainEnd` follows. The last point where an
    event a callback emits (an end-of-run evaluation) and a :class:`SaveNow` it returns are
    delivered and honoured before the writers and checkpoints close; a Stop changes nothing."""

    epoch: int
    samples_seen: int
    reason: str = "completed"
    stop_reason: str = ""


@_frozen
class TrainEnd(Event):
    """The run ended normally: ``reason`` is ``"completed"`` or ``"stopped"`` (a Stop request)."""

    epoch: int
    samples_seen: int
    reason: str = "completed"
    stop_reason: str = ""


@_frozen
class Interrupted(Event):
    """KeyboardInterrupt: ``fit`` returns the last completed state (this event's state)."""

    epoch: int
    position: int
    samples_seen: int


@_frozen
class Failed(Event):
    """An exception escaped the step, the loader or a callback; ``fit`` re-raises it after this."""

    epoch: int
    position: int
    samples_seen: int
    error: BaseException = attrs.field(eq=False)


@_frozen
class AlreadyComplete(Event):
    """The state is already at or past the horizon: no step runs, nothing else fires."""

    epoch: int
    epochs: int
    samples_seen: int


TERMINAL_EVENTS = (TrainEnd, Interrupted, Failed, AlreadyComplete)


@attrs.frozen(slots=True)
class Stop:
    """Request: end the run after the current step (or at once, from a start event)."""

    reason: str = ""


@attrs.frozen(slots=True)
class SaveNow:
    """Request: save a checkpoint of the current state once this step's events are delivered."""

    reason: str = ""
    best: bool = False


