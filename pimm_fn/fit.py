"""The outer fold: ``fit`` runs a pure step function over epochs and batches.

``fit(state, loader, step_fn, epochs=N)`` folds ``state, metrics = step_fn(state, batch)``
over the batches of epochs ``state.cursor.epoch .. N-1``, starting inside the first one at
``state.cursor.position``. After each step it advances the cursor (position, samples seen)
and emits a :class:`~pimm_fn.events.StepEnd` to the callbacks that act on single steps (and
the steps in :class:`~pimm_fn.events.StepBlock` events to loggers); at an epoch's end it rolls
the cursor to ``(epoch + 1, 0)``. A restored state alone therefore continues a run, mid-epoch
included. Metrics stay 0-dim tensors: ``fit`` never pulls a number from them.

The table of which events fire when a run ends, stops, is interrupted or fails is in
docs/fit.md.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import operator
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import attrs
import torch

from . import events as ev
from .state import advance_cursor
from .callbacks.base import callback_name, handles

__all__ = [
    "FitResult",
    "History",
    "StateMutationError",
    "fit",
    "fit_epoch",
    "resolve_iters_per_epoch",
    "count_samples",
]

_END = object()
_STEP_EVENTS = (ev.StepEnd, ev.StepBlock)
_NULL = contextlib.nullcontext()


class StateMutationError(RuntimeError):
    """A callback tried to change the TrainState it was handed."""


# --------------------------------------------------------------------------- history


class History:
    """What a run's steps reported, kept as tensors until read.

    Per epoch, the step metrics are stacked into 1-D tensors when the epoch ends (no host
    sync); reading a value (``epoch_averages()``, ``values(k)``) is what syncs.
    """

    def __init__(self):
        self.records: list[dict] = []  # {"epoch", "steps": 1-D int64, "metrics": {k: 1-D}}
        self._pending: list[tuple[int, Any]] = []
        self._pending_epoch: Optional[int] = None

    def _open(self, epoch: int) -> list:
        """The list ``fit`` appends ``(step, metrics)`` to during ``epoch``."""
        if self._pending_epoch != epoch:
            self._close()
            self._pending_epoch = epoch
        return self._pending

    def _close(self) -> Optional[dict]:
        """Stack the pending epoch's metrics into a record; returns its averages (tensors)."""
        if not self._pending:
            self._pending_epoch = None
            return None
        metrics = self._stack_uniform()
        if metrics is not None:
            return self._record(metrics)
        keys: dict = {}
        for _, m in self._pending:
            for k in m:
                keys.setdefault(k, None)
        metrics = {}
        for k in keys:
            vals = [m[k] for _, m in self._pending if k in m and _scalar(m[k])]
            if vals:
                metrics[k] = torch.stack([
                    v.detach() if isinstance(v, torch.Tensor) and v.dim() == 0 else torch.as_tensor(v).detach().reshape(())
                    for v in vals
                ])
        return self._record(metrics)

    def _stack_uniform(self) -> Optional[dict]:
        """The common case in one ``torch.stack`` per metric: every step reported the same
        0-dim tensors (a compiled step always does). None when that does not hold."""
        first = self._pending[0][1]
        keys = tuple(first)
        if not keys or not all(isinstance(first[k], torch.Tensor) and first[k].dim() == 0 for k in keys):
            return None
        n = len(keys)
        for _, m in self._pending:
            if len(m) != n:
                return None
        try:
            # Columns in C (itemgetter + zip), then one stack per metric.
            get = operator.itemgetter(*keys) if n > 1 else (lambda m, k=keys[0]: (m[k],))
            columns = zip(*[get(m) for _, m in self._pending])
            return {k: torch.stack(col).detach() for k, col in zip(keys, columns)}
        except (KeyError, RuntimeError, TypeError):
            return None

    def _record(self, metrics: dict) -> dict:
        rec = {
            "epoch": self._pending_epoch,
            "steps": torch.tensor([s for s, _ in self._pending], dtype=torch.int64),
            "metrics": metrics,
        }
        last = self.records[-1] if self.records else None
        if last is not None and last["epoch"] == rec["epoch"] and set(last["metrics"]) == set(metrics):
            # The rest of an epoch a resumed run restored the first part of: one record.
            last["steps"] = torch.cat([last["steps"], rec["steps"]])
            last["metrics"] = {k: torch.cat([last["metrics"][k], v]) for k, v in metrics.items()}
        else:
            self.records.append(rec)
        self._pending, self._pending_epoch = [], None
        return {k: v.float().mean() for k, v in metrics.items()}

    def state_dict(self) -> dict:
        """The records so far (the open epoch's steps included), as tensors: what a
        checkpoint carries so that a resumed run can hand back the whole run's history."""
        records = [dict(r) for r in self.records]
        if self._pending:
            snapshot = History()
            snapshot._pending, snapshot._pending_epoch = list(self._pending), self._pending_epoch
            snapshot._close()
            records += snapshot.records
        keys = [sorted(r["metrics"]) for r in records]
        if records and all(k == keys[0] for k in keys):
            # One tensor per column, whatever the run's length: a checkpoint stays a handful
            # of entries, not six per epoch.
            return {
                "epochs": [r["epoch"] for r in records],
                "lengths": [len(r["steps"]) for r in records],
                "steps": torch.cat([r["steps"] for r in records]),
                "metrics": {k: torch.cat([r["metrics"][k] for r in records]) for k in keys[0]},
            }
        return {"records": [{"epoch": r["epoch"], "steps": r["steps"], "metrics": dict(r["metrics"])}
                            for r in records]}

    def load_state_dict(self, state: dict) -> None:
        if "lengths" in state:
            bounds = [0]
            for n in state["lengths"]:
                bounds.append(bounds[-1] + int(n))
            self.records = [
                {"epoch": int(e), "steps": state["steps"][a:b],
                 "metrics": {k: v[a:b] for k, v in state["metrics"].items()}}
                for e, a, b in zip(state["epochs"], bounds, bounds[1:])
            ]
        else:
            self.records = [{"epoch": int(r["epoch"]), "steps": r["steps"], "metrics": dict(r["metrics"])}
                            for r in state.get("records", [])]
        self._pending, self._pending_epoch = [], None

    @property
    def epochs(self) -> list[int]:
        return [r["epoch"] for r in self.records]

    @property
    def steps(self) -> list[int]:
        """Step numbers recorded (as ``StepEnd.step`` numbers them)."""
        return [s for r in self.records for s in r["steps"].tolist()] + [s for s, _ in self._pending]

    def values(self, key: str) -> torch.Tensor:
        """One metric over every recorded step, as a 1-D tensor (steps lacking it are left out)."""
        parts = [r["metrics"][key] for r in self.records if key in r["metrics"]]
        parts += [torch.as_tensor(m[key]).reshape(1) for _, m in self._pending if key in m]
        if not parts:
            raise KeyError(f"no step reported metric {key!r}; known: {sorted(self.keys())}")
        return torch.cat([p.reshape(-1) for p in parts])

    def keys(self) -> set:
        out = set()
        for r in self.records:
            out.update(r["metrics"])
        for _, m in self._pending:
            out.update(m)
        return out

    def epoch_averages(self) -> list[dict]:
        """Per recorded epoch: ``{"epoch": e, <metric>: mean float, ...}`` (pulls numbers)."""
        return [
            {"epoch": r["epoch"], **{k: float(v.float().mean()) for k, v in r["metrics"].items()}}
            for r in self.records
        ]

    def __len__(self) -> int:
        return sum(len(r["steps"]) for r in self.records) + len(self._pending)

    def __repr__(self) -> str:
        return f"History(steps={len(self)}, epochs={self.epochs}, metrics={sorted(self.keys())})"


def _scalar(v) -> bool:
    return isinstance(v, torch.Tensor) and v.numel() == 1 or isinstance(v, (int, float, bool))


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


def count_samples(batch) -> int:
    """Samples in a batch on this rank: ``len(offset)`` for point batches, else the leading dim."""
    if isinstance(batch, dict):
        offset = batch.get("offset")
        if offset is not None:
            return len(offset)
        for v in batch.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                return v.shape[0]
        for v in batch.values():
            try:
                return int(len(v))
            except TypeError:
                continue
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, (tuple, list)) and batch:
        return count_samples(batch[0])
    try:
        return int(len(batch))
    except TypeError:
        return 1


def resolve_iters_per_epoch(loader, iters_per_epoch: Optional[int] = None) -> int:
    """Steps per epoch, by the seed's rule.

    Given ``iters_per_epoch``: that (an iterable stream is cut there). Else ``len(loader)``.
    Else (an iterable without a length) ``dataset.num_samples() // world_size // batch_size``.
    Raises ValueError naming the fix when none applies or the count is not positive.
    """
    name = type(loader).__name__
    if iters_per_epoch is not None:
        if isinstance(iters_per_epoch, bool) or not isinstance(iters_per_epoch, int) or iters_per_epoch <= 0:
            raise ValueError(f"iters_per_epoch must be a positive int, got {iters_per_epoch!r}")
        return iters_per_epoch
    try:
        n = len(loader)
    except TypeError:
        n = None
    if n is not None:
        if n <= 0:
            raise ValueError(
                f"the training loader ({name}) has no batches per epoch (len {n}): its dataset is "
                "empty, or smaller than one batch with drop_last=True. Check the dataset path/split "
                "and the batch size."
            )
        return int(n)
    dataset = getattr(loader, "dataset", None)
    num_samples = getattr(dataset, "num_samples", None)
    batch_size = getattr(loader, "batch_size", None)
    if not callable(num_samples) or not batch_size:
        raise ValueError(
            f"the training loader ({name}) has no length (an iterable dataset): pass "
            "fit(..., iters_per_epoch=N), or give the dataset a num_samples() method and the "
            "loader a batch_size."
        )
    world = max(1, int(getattr(loader, "world_size", 1) or 1))
    per_rank = int(num_samples()) // world
    n = per_rank // int(batch_size)
    if n <= 0:
        raise ValueError(
            f"derived iters_per_epoch={n} <= 0 (num_samples per rank={per_rank}, "
            f"batch_size={batch_size}): the dataset is smaller than one batch per rank; "
            "pass iters_per_epoch=N or use a smaller batch"
        )
    return n


class _Source:
    """Adapts the loader protocol (``iter_epoch``) and plain re-iterables to one interface."""

    def __init__(self, loader, iters_per_epoch):
        if loader is None:
            raise TypeError("fit needs a training loader, got None")
        if isinstance(loader, collections.abc.Iterator):
            raise TypeError(
                f"fit needs a re-iterable loader (a list of batches, a DataLoader, or an object "
                f"with iter_epoch(epoch, start)); got a one-shot iterator ({type(loader).__name__}), "
                "which would be empty from the second epoch on. Pass the iterable, not iter(...)."
            )
        self.loader = loader
        self.protocol = callable(getattr(loader, "iter_epoch", None))
        if not self.protocol and not isinstance(loader, Iterable):
            raise TypeError(f"the training loader must be iterable or have iter_epoch(); got {type(loader).__name__}")
        self.iters_per_epoch = resolve_iters_per_epoch(loader, iters_per_epoch)
        self.world_size = max(1, int(getattr(loader, "world_size", 1) or 1))
        samples_in = getattr(loader, "samples_in", None)
        self.samples_in = samples_in if callable(samples_in) else count_samples

    def iter_epoch(self, epoch: int, start: int) -> Iterator:
        if self.protocol:
            return iter(self.loader.iter_epoch(epoch, start))
        # A plain iterable: tell it the epoch if it can hear it, then skip what was consumed.
        # Exact on resume only when the iterable's order for an epoch is deterministic.
        for obj in (self.loader, getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None)):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
                break
        it = iter(self.loader)
        if start > 0:
            for _ in itertools.islice(it, start):
                pass
        return it


# --------------------------------------------------------------------------- run


def _profiling() -> bool:
    return torch._C._autograd._profiler_enabled()


class _Run:
    def __init__(self, source, callbacks, *, epochs, guard, trace, history, empty_cache, block_seconds=0.25):
        if isinstance(block_seconds, bool) or not isinstance(block_seconds, (int, float)) or block_seconds < 0:
            raise ValueError(f"block_seconds must be a number of seconds >= 0, got {block_seconds!r}")
        if guard not in ("off", "cheap", "full"):
            raise ValueError(f"guard_state must be 'off', 'cheap' or 'full', got {guard!r}")
        if empty_cache not in (None, "step", "epoch"):
            raise ValueError(f"empty_cache must be None, 'step' or 'epoch', got {empty_cache!r}")
        if isinstance(callbacks, Callable) and not isinstance(callbacks, (list, tuple)):
            callbacks = (callbacks,)
        cbs = list(callbacks or ())
        for cb in cbs:
            if not callable(cb):
                raise TypeError(f"callback {cb!r} is not callable: a callback is cb(event, state)")
        self.callbacks = tuple(sorted(cbs, key=lambda c: getattr(c, "order", 0)))
        self.names = {id(cb): callback_name(cb) for cb in self.callbacks}
        # StepEnd fires every step: it goes only to the callbacks that can act on it.
        self.step_callbacks = tuple(cb for cb in self.callbacks if handles(cb, ev.StepEnd))
        # Loggers and progress bars take the steps in blocks (events.StepBlock): between
        # blocks a step costs the run one list append.
        self.block_callbacks = tuple(cb for cb in self.callbacks if handles(cb, ev.StepBlock))
        self.block_seconds = float(block_seconds)
        self.rows: list = []  # the pending block's rows
        self.checked_first_batch = False
        self.block_epoch = 0
        self.source = source
        self.epochs = epochs
        self.guard = guard
        self.trace = trace
        self.history = history if isinstance(history, History) else (History() if history else None)
        self.empty_cache = empty_cache if torch.cuda.is_available() else None
        self.stop_reason: Optional[str] = None
        self.state = None
        self.step = 0
        self._warned_unsaved = False

    # ----- tracing
    def _tracing(self) -> bool:
        return self.trace is True or (self.trace is None and _profiling())

    def instant(self, name):
        if self._tracing():
            with torch.profiler.record_function(f"instant.{name}"):
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
            from .tree import tree_leaves

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

    def _call(self, cb, event, state, snap, tracing=False):
        try:
            if tracing:
                with torch.profiler.record_function(f"callback.{self.names.get(id(cb))}.{type(event).__name__}"):
                    out = cb(event, state)
            else:
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
        tracing = self._tracing()
        queue = collections.deque([event])
        saves: list = []
        ran = set()
        while queue:
            e = queue.popleft()
            for cb in (first if e is event else self.callbacks):
                if snap is not None:
                    ran.add(cb)
                out = self._call(cb, e, state, snap, tracing)
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

    def _check_first_batch(self, batch):
        # Once per run, on the host: a malformed batch is named here, before any step (and
        # the compiler) sees it. Later batches are the loader's to check.
        from .data.collate import validate_batch

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

    def _save(self, state, saves, snap):
        if self.rows:
            self.flush_block(state)
        c = state.cursor
        req = ev.SaveRequested(
            step=self.step, epoch=c.epoch, iteration=c.position, samples_seen=c.samples_seen,
            reasons=tuple(dict.fromkeys(s.reason for s in saves)), best=any(s.best for s in saves),
        )
        queue = collections.deque([req])
        tracing = self._tracing()
        while queue:
            e = queue.popleft()
            for cb in self.callbacks:
                out = self._call(cb, e, state, snap, tracing)
                for item in out if isinstance(out, (list, tuple)) else (out,):
                    if isinstance(item, ev.Event):
                        queue.append(item)
                    elif isinstance(item, ev.Stop) and self.stop_reason is None:
                        self.stop_reason = item.reason or "stop requested"
        if snap is not None and self.guard == "cheap":
            self._check_unchanged(state, snap, self.callbacks, req)
        if not self._warned_unsaved and not any(getattr(cb, "saves_checkpoints", False) for cb in self.callbacks):
            self._warned_unsaved = True
            warnings.warn(
                "a callback returned SaveNow() but no callback saved a checkpoint "
                "(add pimm_fn.callbacks.Checkpoint to the callbacks)",
                stacklevel=3,
            )

    def terminal(self, event, state):
        """Deliver a terminal event; every callback gets it even if an earlier one raises."""
        errors = []
        if self.rows:
            try:
                self.flush_block(state)
            except Exception as err:  # noqa: BLE001 - the terminal event must still go out
                errors.append((self.block_callbacks[0], err))
        queue = collections.deque([event])
        while queue:
            e = queue.popleft()
            for cb in self.callbacks:
                try:
                    out = cb(e, state)
                except Exception as err:  # noqa: BLE001 - the others still need to close
                    errors.append((cb, err))
                    continue
                for item in out if isinstance(out, (list, tuple)) else (out,):
                    if isinstance(item, ev.Event):
                        queue.append(item)
        if errors and not isinstance(event, ev.Failed):
            cb, err = errors[0]
            raise RuntimeError(
                f"callback {self.names.get(id(cb))} failed while handling {type(event).__name__}"
            ) from err

    # ----- folds
    def run_epoch(self) -> bool:
        """Fold over the current epoch's remaining batches. Returns True when it completed."""
        src = self.source
        ipe = src.iters_per_epoch
        cursor = self.state.cursor
        epoch, start = cursor.epoch, cursor.position
        it = src.iter_epoch(epoch, start) if start < ipe else iter(())
        self.dispatch(
            ev.EpochStart(step=self.step, epoch=epoch, iteration=start, samples_seen=cursor.samples_seen,
                          iters_per_epoch=ipe, epochs=self.epochs),
            self.state,
        )
        if self.stop_reason is not None:
            _close(it)
            return False
        pos, ran, exhausted = start, 0, False
        history_rows = self.history._open(epoch) if self.history is not None else None
        step_fn, samples_in, world = self.step_fn, src.samples_in, src.world_size
        step_callbacks = self.step_callbacks
        rows = self.rows if self.block_callbacks else None
        self.block_epoch = epoch
        perf_counter = time.perf_counter
        next_block = perf_counter() + self.block_seconds
        tracing = self._tracing()
        try:
            # The per-step path does only what a step needs: at ~0.5 ms a step, every
            # microsecond here is 0.2% of the run, and Python run between compiled steps is
            # slower than its microbenchmark (cold caches). Loggers get the steps in blocks.
            t0 = perf_counter()
            while pos < ipe:
                if tracing:
                    with torch.profiler.record_function("data_fetch"):
                        batch = next(it, _END)
                else:
                    batch = next(it, _END)
                if batch is _END:
                    exhausted = True
                    self.instant("dataloader_exhausted")
                    break
                if not self.checked_first_batch:
                    self._check_first_batch(batch)
                t1 = perf_counter()
                state = self.state
                if tracing:
                    with torch.profiler.record_function("step"):
                        new, metrics = step_fn(state, batch)
                else:
                    new, metrics = step_fn(state, batch)
                n = samples_in(batch)  # this rank's samples (the event's batch_size)
                if "samples" in metrics:
                    # A data-parallel step counts the real samples of all ranks (per-rank
                    # batches may differ); reading it is one host sync, already paid by the
                    # step's collectives.
                    seen = int(metrics["samples"])
                else:
                    seen = n * world
                cursor = state.cursor
                new = advance_cursor(new, cursor, pos + 1, cursor.samples_seen + seen)
                # One assignment: an interrupt lands either before the step or after it, never between.
                self.state, self.step = new, self.step + 1
                t2 = perf_counter()
                ran += 1
                if history_rows is not None:
                    history_rows.append((self.step, metrics))
                if rows is not None:
                    rows.append((self.step, pos, metrics, n, t1 - t0, t2 - t1))
                if self.empty_cache == "step":
                    torch.cuda.empty_cache()
                if step_callbacks:
                    self.dispatch(
                        ev.StepEnd(
                            step=self.step, epoch=epoch, iteration=pos, samples_seen=new.cursor.samples_seen,
                            metrics=metrics, batch_size=n, data_time=t1 - t0, step_time=t2 - t1,
                            iters_per_epoch=ipe, epochs=self.epochs, batch=batch,
                        ),
                        new,
                        targets=step_callbacks,
                    )
                    tracing = self._tracing()
                    if rows is not None:
                        rows = self.rows  # a save it caused delivered the block
                pos += 1
                if self.stop_reason is not None:
                    break
                if t2 >= next_block and rows:
                    self.flush_block(self.state)
                    rows = self.rows
                    tracing = self._tracing()
                    next_block = perf_counter() + self.block_seconds
                t0 = t2
        finally:
            _close(it)
        if pos < ipe and not exhausted:
            return False  # stopped mid-epoch: the epoch is not over, no EpochEnd
        history = self.history
        averages = history._close() if history is not None else None
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
        kw = dict(step=self.step, epoch=c.epoch, iteration=c.position, samples_seen=c.samples_seen)
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
      a Failed event.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be a non-negative int (an absolute horizon), got {epochs!r}")
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
                    step=run.step, epoch=cursor.epoch, iteration=cursor.position, samples_seen=cursor.samples_seen,
                    epochs=epochs, iters_per_epoch=run.source.iters_per_epoch,
                    resumed=run.step > 0 or cursor.epoch > 0 or cursor.position > 0,
                    loader=loader, callbacks=run.callbacks, history=run.history,
                ),
                state,
            )
            while run.stop_reason is None and run.state.cursor.epoch < epochs:
                run.run_epoch()
        except BaseException as err:  # noqa: BLE001 - every exit path gets its terminal event
            run._fail_or_interrupt(err)
            if isinstance(err, KeyboardInterrupt):
                return FitResult(run.state, run.history, "interrupted")
            raise
        c = run.state.cursor
        status = "stopped" if run.stop_reason is not None else "completed"
        run.terminal(
            ev.TrainEnd(step=run.step, epoch=c.epoch, samples_seen=c.samples_seen, reason=status,
                        stop_reason=run.stop_reason or ""),
            run.state,
        )
        run.instant("training_end")
        return FitResult(run.state, run.history, status, run.stop_reason or "")


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
    run = _Run(_Source(loader, iters_per_epoch), callbacks, epochs=None, guard=guard_state, trace=trace,
               history=history, empty_cache=None, block_seconds=block_seconds)
    run.step_fn = step_fn
    run.state = state
    run.step = int(state.step)
    try:
        done = run.run_epoch()
        if run.rows:  # stopped mid-epoch: no EpochEnd delivered the last steps
            run.flush_block(run.state)
    except BaseException as err:  # noqa: BLE001
        run._fail_or_interrupt(err)
        if isinstance(err, KeyboardInterrupt):
            return FitResult(run.state, run.history, "interrupted")
        raise
    return FitResult(run.state, run.history, "completed" if done else "stopped", run.stop_reason or "")
