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
from .dispatch import StateMutationError
from .history import History
from .loop import FitResult, fit, fit_epoch
from .source import resolve_iters_per_epoch

__all__ = [
    "FitResult",
    "History",
    "StateMutationError",
    "fit",
    "fit_epoch",
    "resolve_iters_per_epoch",
]
