"""Callbacks that end a run: on a non-finite loss, when a metric stops improving, or when
data-parallel ranks no longer hold the same weights."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import events as ev
from .._validate import check_int
from ..user_warning import warn
from .base import Callback


class StopOnNonFinite(Callback):
    """Stop (or raise) when ``key`` (default the loss) is NaN or infinite.

    check_every: look every n steps, one host sync per check over the n buffered values;
        the message names the first bad step either way (1 = stop right after it).
    raise_error: raise FloatingPointError instead of returning Stop.
    """

    def __init__(self, key: str = "loss", check_every: int = 1, raise_error: bool = False):
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
        self.key, self.check_every, self.raise_error = key, check_every, raise_error
        self._rows: list = []
        self.message: Optional[str] = None

    def on_step_end(self, event, state):
        value = event.metrics.get(self.key)
        if value is None:  # watching a metric no step reports would never stop anything
            raise KeyError(f"StopOnNonFinite(key={self.key!r}): the step reported {sorted(event.metrics)}; "
                           "pass one of these")
        self._rows.append((event, value))
        if len(self._rows) >= self.check_every or event.is_last:
            return self._check()
        return None

    def _check(self):
        rows, self._rows = self._rows, []
        finite = torch.stack([torch.isfinite(v.detach().float()).reshape(()) for _, v in rows]).tolist()
        for (e, v), ok in zip(rows, finite):
            if not ok:
                self.message = (
                    f"{self.key} is {float(v)} at step {e.step} (epoch {e.epoch}, position {e.position}, "
                    f"batch of {e.batch_size} samples); stopping. Common causes: a learning rate too high, "
                    "fp16 overflow (use bf16 or loss scaling), a bad sample in this batch."
                )
                if self.raise_error:
                    raise FloatingPointError(self.message)
                warn(self.message, RuntimeWarning)
                return ev.Stop(self.message)
        return None

    def on_epoch_end(self, event, state):
        if self._rows:
            return self._check()


class EarlyStopping(Callback):
    """Stop when ``metric`` of the ``source`` evaluation has not improved for ``patience`` evaluations.

    mode: ``"max"`` or ``"min"``; min_delta: the least change that counts as improvement.
    source: the EvalEnd name (``"val"``), or ``"train"`` to watch the epoch averages.
    """

    def __init__(self, metric: str, *, mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 source: str = "val"):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        patience = check_int("EarlyStopping(patience=...)", patience, 1,
                             hint=" (the evaluations without improvement before the run stops)")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not min_delta >= 0:
            raise ValueError(f"EarlyStopping(min_delta=...) must be a number >= 0 (the least change that "
                             f"counts as an improvement, in the metric's direction), got {min_delta!r}")
        self.metric, self.mode, self.patience, self.min_delta, self.source = metric, mode, patience, min_delta, source
        self.best: Optional[float] = None
        self.bad = 0

    def state_dict(self) -> dict:
        return {"best": self.best, "bad": self.bad}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad = state.get("best"), int(state.get("bad", 0))

    def _see(self, value: float, step: int):
        better = self.best is None or (
            value > self.best + self.min_delta if self.mode == "max" else value < self.best - self.min_delta
        )
        if better and math.isfinite(value):
            self.best, self.bad = value, 0
            return None
        self.bad += 1
        if self.bad >= self.patience:
            return ev.Stop(f"early stopping: {self.source}/{self.metric} did not improve on {self.best} for "
                           f"{self.bad} evaluations (step {step})")
        return None

    def on_eval_end(self, event, state):
        if self.source != "train" and event.name == self.source:
            if self.metric not in event.metrics:
                raise KeyError(f"EarlyStopping: {event.name!r} reported {sorted(event.metrics)}, not {self.metric!r}")
            return self._see(float(event.metrics[self.metric]), event.step)

    def on_epoch_end(self, event, state):
        if self.source == "train":
            if self.metric not in event.metrics:
                raise KeyError(f"EarlyStopping: the epoch averages are {sorted(event.metrics)}, not {self.metric!r}")
            return self._see(float(event.metrics[self.metric]), event.step)


class RanksInSync(Callback):
    """Data parallel: check that every rank holds bitwise the same params when the run
    starts, after its first step and when it ends (a collective each time, so every rank
    must have it). Catches ranks that built their models from different seeds, and a step
    that does not average gradients (``grad_transform``), which otherwise train separate
    models without an error. Raises :class:`pimm_fn.distributed.RankDivergenceError`.
    Nothing to do in one process."""

    def __init__(self):
        self._first: Optional[int] = None

    def _check(self, state, when: str) -> None:
        from ..distributed import RankDivergenceError, assert_in_sync
        from ..torch_compat import is_plain_eager_tensor

        # Sharded (DTensor) params hold a different shard on every rank by design.
        replicated = {k: v for k, v in state.params.items() if is_plain_eager_tensor(v)}
        try:
            assert_in_sync(replicated)
        except RankDivergenceError as err:
            raise RankDivergenceError(f"{when}: {err}") from None

    def on_train_start(self, event, state):
        self._first = event.step + 1
        self._check(state, f"the ranks start step {event.step} from different weights (seed the model the "
                           "same on every rank, or restore every rank from one checkpoint)")

    def on_step_end(self, event, state):
        if event.step == self._first:
            self._check(state, f"the ranks' weights differ after step {event.step}, the run's first")

    def on_train_end(self, event, state):
        self._check(state, f"the ranks' weights differ at the end of the run (step {event.step})")
