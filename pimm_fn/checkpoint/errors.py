"""Checkpoint errors, and the listing their messages use to name files and keys."""
from __future__ import annotations

_MAX_LISTED = 20


class CheckpointError(Exception):
    """Base class of every checkpoint error raised by pimm_fn.checkpoint."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist (the message lists the ones that do)."""


class CheckpointCorruptError(CheckpointError):
    """The file is truncated, corrupt, or not a pimm_fn checkpoint."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the ``like`` state (missing/unexpected keys, shapes)."""


class UnsafeCheckpointError(CheckpointError):
    """The file is a pickle that would need code execution to load; it was not loaded."""


def _listing(items, limit: int = _MAX_LISTED) -> str:
    items = list(items)
    shown = "\n    ".join(str(i) for i in items[:limit])
    more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
    return "\n    " + shown + more

