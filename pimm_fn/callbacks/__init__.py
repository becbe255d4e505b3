"""Callbacks for :func:`pimm_fn.fit`: observers of its events that may request a stop or a save.

Loaded on first use, so that ``fit`` (which needs only the protocol in
:mod:`pimm_fn.callbacks.base`) does not import every writer and the checkpoint module.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "Callback": ".base", "due": ".base", "on": ".base",
    "Checkpoint": ".checkpointing", "restore_latest": ".checkpointing", "resume": ".checkpointing",
    "EarlyStopping": ".control", "RanksInSync": ".control", "StopOnNonFinite": ".control",
    "Evaluate": ".evaluation",
    "TensorBoard": ".tensorboard", "TextLog": ".logging", "WandB": ".logging",
    "ProgressBar": ".progress",
    "Trace": ".tracing", "batch_stats": ".tracing",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'pimm_fn.callbacks' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
