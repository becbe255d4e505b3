"""Run tracing: instants and batch statistics, to a JSON-lines file and the profiler trace.

``fit`` itself wraps the data fetch, the step and each callback in
``torch.profiler.record_function`` spans (while a profiler records), and Checkpoint wraps
its writes; this callback adds Pointcept's instants (training start / end / already complete
/ loader exhausted) and batch statistics (clouds and points, by
:func:`pimm_fn.data.count_batch`; shapes only, no device sync) every n steps.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Optional

import torch

from .. import torch_compat
from ..data.count import count_batch
from .base import Callback, check_every, due


def batch_stats(batch) -> dict:
    """``{"clouds", "points"}`` of a point batch (an ``offset`` tensor), counted by
    :func:`pimm_fn.data.count_batch` ("points" only where it has ``coord``); {} for others."""
    if not (isinstance(batch, Mapping) and isinstance(batch.get("offset"), torch.Tensor)):
        return {}
    n = count_batch(batch)
    return {"clouds": n.samples} if n.points is None else {"clouds": n.samples, "points": n.points}


class Trace(Callback):
    """Instants and batch statistics every ``batch_stats_every`` steps (None: instants only).

    jsonl: a path; each record is one JSON line ``{"t", "kind", "name", "step", ...}``,
    appended (a resumed run continues the file). Records are also kept in ``records``
    (the last ``keep`` of them) and, while a profiler records, marked in its trace.
    """

    def __init__(self, batch_stats_every: int = 1, jsonl: Optional[str] = None, keep: int = 10000):
        check_every("Trace(batch_stats_every=...)", batch_stats_every)
        self.every = batch_stats_every
        self.path = str(jsonl) if jsonl is not None else None
        self.keep = keep
        self.records: list = []
        self._f = None

    def _emit(self, kind: str, name: str, step: int, **fields):
        rec = {"t": time.time(), "kind": kind, "name": name, "step": step, **fields}
        self.records.append(rec)
        if len(self.records) > self.keep:
            del self.records[: len(self.records) - self.keep]
        if torch_compat.profiler_enabled():
            label = name if kind == "instant" else f"{name} " + " ".join(f"{k}={v}" for k, v in fields.items())
            with torch.profiler.record_function(f"{kind}.{label}"):
                pass
        if self.path is not None:
            if self._f is None:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._f = open(self.path, "a", encoding="utf-8")
            self._f.write(json.dumps(rec) + "\n")

    def on_train_start(self, event, state):
        self._emit("instant", "training_start", event.step, epoch=event.epoch, position=event.position)

    def on_step_end(self, event, state):
        if due(event.step, self.every):
            stats = batch_stats(event.batch)
            if stats:
                self._emit("scalar", "batch", event.step, epoch=event.epoch, position=event.position, **stats)

    def on_epoch_end(self, event, state):
        if event.exhausted:
            self._emit("instant", "dataloader_exhausted", event.step, epoch=event.epoch)

    def on_save_requested(self, event, state):
        if self._f is not None:
            self._f.flush()

    def on_train_end(self, event, state):
        self._emit("instant", "training_end", event.step, reason=event.reason)

    def on_interrupted(self, event, state):
        self._emit("instant", "training_interrupted", event.step)

    def on_failed(self, event, state):
        self._emit("instant", "training_failed", event.step, error=type(event.error).__name__)

    def on_already_complete(self, event, state):
        self._emit("instant", "training_already_complete", event.step, epoch=event.epoch, epochs=event.epochs)

    def on_end(self, event, state):
        if self._f is not None:
            self._f.close()
            self._f = None
