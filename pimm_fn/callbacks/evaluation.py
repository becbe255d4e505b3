"""Evaluate: run an eval function over a validation loader and emit EvalEnd."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import events as ev
from ..data.count import count_batch
from .base import Callback, check_every, due


def _batches(loader):
    if callable(getattr(loader, "iter_epoch", None)):
        return loader.iter_epoch(0, 0)
    return iter(loader)


def _check_metric(metric) -> None:
    if metric is None:
        return
    if isinstance(metric, type):
        raise TypeError(f"Evaluate(metric=...) takes a metric instance: {metric.__name__}(...), not the class")
    missing = [m for m in ("init", "update", "reduce", "compute") if not callable(getattr(metric, m, None))]
    if missing:
        raise TypeError(f"Evaluate(metric={metric!r}) lacks {', '.join(missing)}: pass e.g. "
                        "pimm_fn.metrics.SegmentationMetric(num_classes) or Accuracy()")


class Evaluate(Callback):
    """Every n steps and/or epochs, evaluate the current state and emit :class:`EvalEnd`.

    eval_fn: ``eval_fn(state, batch) -> dict``, called under ``torch.no_grad()``; it runs the
        model functionally in eval mode (``torch.func.functional_call(state.eval_model,
        (state.params, state.buffers), ...)``; :func:`pimm_fn.steps.common.eval_forward`) and
        returns tensors: what ``metric`` reads (e.g. ``pred`` and ``target``) and any 0-dim
        values (e.g. ``loss``), which are averaged over the batches.
    loader: the validation loader (an iterable, or an object with ``iter_epoch``).
    metric: e.g. :class:`pimm_fn.metrics.SegmentationMetric` or :class:`~pimm_fn.metrics.Accuracy`
        (summed over batches, then over ranks); None for scalar outputs only.
    every_steps / every_epochs: when to evaluate; at_end: also when the run ends (on
        TrainEnding, so that its result is logged and a best checkpoint saved before the
        end; not on interrupt or failure). name: the EvalEnd name (tags ``<name>/<metric>``).
    """

    _takes_batches = True  # (Evaluate.of's subclass evaluates the whole state in one call)

    def __init__(self, eval_fn: Callable, loader, *, metric=None, every_steps: Optional[int] = None,
                 every_epochs: Optional[int] = 1, name: str = "val", at_end: bool = False):
        check_every("every_steps", every_steps)
        check_every("every_epochs", every_epochs)
        if self._takes_batches:
            if not callable(eval_fn):
                raise TypeError(f"Evaluate(eval_fn=...) must be a function eval_fn(state, batch) -> dict of "
                                f"tensors, got {eval_fn!r}")
            if loader is None or not (hasattr(loader, "iter_epoch") or hasattr(loader, "__iter__")):
                raise TypeError(f"Evaluate(loader=...) must be the validation batches (an iterable, or a loader "
                                f"with iter_epoch), got {loader!r}")
        _check_metric(metric)
        self.eval_fn, self.loader, self.metric = eval_fn, loader, metric
        self.every_steps, self.every_epochs, self.name, self.at_end = every_steps, every_epochs, name, at_end
        self.last: Optional[dict] = None
        self._last_step: Optional[int] = None

    def evaluate(self, state) -> tuple[dict, int]:
        """The metrics of ``state`` over the whole loader (floats) and the number of samples
        (:func:`pimm_fn.data.count_batch`'s; a batch it cannot count adds none)."""
        stats = self.metric.init() if self.metric is not None else None
        sums: dict = {}
        n_batches = n_samples = 0
        with torch.no_grad():
            for batch in _batches(self.loader):
                out = self.eval_fn(state, batch)
                if not isinstance(out, dict):
                    raise TypeError(f"eval_fn must return a dict of tensors, got {type(out).__name__}")
                if stats is not None:
                    stats = self.metric.update(stats, out)
                for k, v in out.items():
                    if isinstance(v, torch.Tensor) and v.numel() == 1 and k not in ("pred", "target"):
                        sums[k] = sums.get(k, 0) + v.detach().float().reshape(())
                n_batches += 1
                n_samples += _samples_in(batch)
        if n_batches == 0:
            raise ValueError(f"Evaluate({self.name!r}): the validation loader yielded no batches; is it empty?")
        metrics = {k: float(v) / n_batches for k, v in sums.items()}
        if stats is not None:
            metrics.update(self.metric.compute(self.metric.reduce(stats)))
        return metrics, n_samples

    def metrics(self, state) -> dict:
        """The metrics of ``state`` over the whole loader (floats), without an event."""
        return self.evaluate(state)[0]

    @classmethod
    def of(cls, fn: Callable, **options) -> "Evaluate":
        """An Evaluate whose whole evaluation is ``fn(state) -> {name: number}`` (a loop of
        the caller's own, e.g. several validation sets); ``options`` as for Evaluate."""
        return _WholeStateEvaluate(fn, **options)

    def _run(self, event, state):
        if self._last_step == event.step:
            return None
        self._last_step = event.step
        metrics, n = self.evaluate(state)
        self.last = metrics
        return ev.EvalEnd(step=event.step, epoch=event.epoch,
                          name=self.name, metrics=metrics, samples=n)

    def wants(self, event_type) -> bool:
        return event_type is not ev.StepEnd or bool(self.every_steps)

    def on_step_end(self, event, state):
        if due(event.step, self.every_steps):
            return self._run(event, state)

    def on_epoch_end(self, event, state):
        if due(event.epoch + 1, self.every_epochs):
            return self._run(event, state)

    def on_train_ending(self, event, state):
        if self.at_end:
            return self._run(event, state)


class _WholeStateEvaluate(Evaluate):
    """:meth:`Evaluate.of`: the evaluation is one call of ``fn(state)``."""

    _takes_batches = False

    def __init__(self, fn: Callable, **options):
        super().__init__(None, (), **options)
        self.fn = fn

    def evaluate(self, state) -> tuple[dict, int]:
        with torch.no_grad():
            out = self.fn(state)
        if not isinstance(out, dict):
            raise TypeError(f"the evaluation function must return a dict of numbers, got {type(out).__name__}")
        return {k: float(v) for k, v in out.items()}, 0


def _samples_in(batch) -> int:
    try:
        return count_batch(batch).samples
    except TypeError:  # a batch of something count_batch has no rule for
        return 0
