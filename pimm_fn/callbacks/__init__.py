"""Callbacks for :func:`pimm_fn.fit`: observers of its events that may request a stop or a save."""
from .base import Callback, due, on
from .checkpointing import Checkpoint, restore_latest, resume
from .control import EarlyStopping, StopOnNonFinite
from .evaluation import Evaluate
from .logging import TensorBoard, TextLog, WandB
from .progress import ProgressBar
from .tracing import Trace, batch_stats

__all__ = [
    "Callback",
    "Checkpoint",
    "EarlyStopping",
    "Evaluate",
    "ProgressBar",
    "StopOnNonFinite",
    "TensorBoard",
    "TextLog",
    "Trace",
    "WandB",
    "batch_stats",
    "due",
    "on",
    "restore_latest",
    "resume",
]
