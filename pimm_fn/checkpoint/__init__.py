"""Checkpoints: save and restore a whole TrainState, atomically, without ever unpickling.

Rooms:
    format       the file (a safetensors file + a JSON payload + a SHA-256), parse and read
    store        save / restore / verify one file of a TrainState
    extra        the JSON encoding of save's ``extra`` argument
    directory    CheckpointDir: step files, the ``latest`` pointer, ``best.ckpt``, pruning
    seed_import  import_seed_checkpoint: seed / Pointcept pickles, loaded weights-only
    locate       checkpoint file names and the not-found error that lists a folder
    errors       CheckpointError and its subclasses

Why safetensors + JSON and not ``torch.save``: reading it parses JSON and copies bytes,
so restoring a checkpoint can never run code from the file, by construction rather than
by a pickle allow-list. Pickle files (``torch.save`` output, seed checkpoints) are
refused by :func:`restore`; :func:`import_seed_checkpoint` reads them with
``torch.load(weights_only=True)`` and only unpickles fully when told ``trust_pickle=True``.

Atomicity: every file is written through :mod:`pimm_fn.atomic` (a temporary name in its
own folder, fsynced, renamed over the final name, the folder fsynced), so a reader sees
either the old complete file or the new complete one.
"""
from .directory import CheckpointDir
from .errors import (
                     CheckpointCorruptError,
                     CheckpointError,
                     CheckpointMismatchError,
                     CheckpointNotFoundError,
                     UnsafeCheckpointError,
)
from .format import SCHEMA_VERSION
from .locate import SUFFIX
from .seed_import import import_seed_checkpoint
from .store import restore, save, verify

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "UnsafeCheckpointError",
    "save",
    "restore",
    "verify",
    "CheckpointDir",
    "import_seed_checkpoint",
    "SUFFIX",
]
