"""Atomic file replacement: the one write-temp / fsync / rename sequence of the package.

A reader (another rank, a resumed run) sees either the old file or the complete new one,
never a torn write. The temp file is hidden, pid- and token-tagged and in the target's
folder (``os.replace`` is atomic only within one filesystem), so two processes writing
the same target never share a temp name, and leftovers of dead writers can be found.
"""
from __future__ import annotations

import io
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Callable, Optional

__all__ = ["atomic_replace", "atomic_write", "fsync_dir", "fsync_file", "replace_dir", "tmp_name", "TMP_RE"]

TMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")


def tmp_name(final: Path) -> Path:
    """A hidden temp name next to ``final``, unique to this process and call."""
    final = Path(final)
    return final.parent / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable; a platform that cannot open folders skips it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: os.PathLike) -> None:
    """Flush a closed file's bytes to disk (one another library wrote by path)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_replace(final: os.PathLike, fill: Callable[[Path], None], *, durable: bool = True,
                   sync_dir: Optional[bool] = None) -> Path:
    """Put a new ``final`` in place atomically: ``fill(tmp)`` creates the complete file at a
    temp path (writes it, hard-links or copies it there), then it is renamed over
    ``final`` and the folder fsynced. On any error (or interrupt) the temp file is removed
    and ``final`` is untouched. Returns ``final``.

    sync_dir: fsync the folder after the rename (default: ``durable``); False lets a caller
    that renames several files in one folder fsync it once, with :func:`fsync_dir`."""
    final = Path(final)
    tmp = tmp_name(final)
    try:
        fill(tmp)
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    if durable if sync_dir is None else sync_dir:
        fsync_dir(final.parent)
    return final


def atomic_write(final: os.PathLike, write: Callable[[io.BufferedWriter], None], *, durable: bool = True,
                 sync_dir: Optional[bool] = None) -> Path:
    """:func:`atomic_replace` of a file written by ``write(f)``: flushed and fsynced before
    the rename. durable=False skips the fsyncs (a cache that can be rebuilt); sync_dir as
    in :func:`atomic_replace`."""

    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())

    return atomic_replace(final, fill, durable=durable, sync_dir=sync_dir)


def replace_dir(staged: os.PathLike, final: os.PathLike, *, durable: bool = True) -> Path:
    """Put the complete folder ``staged`` in place as ``final``; returns ``final``.

    A folder cannot be renamed over a non-empty one, so an existing ``final`` is first
    renamed to ``final.old`` and deleted only once the new one is in place: a crash in
    between leaves the old folder whole under that name. durable: fsync the parent folder
    after the renames (the files inside ``staged`` must be fsynced by their writer).
    """
    staged, final = Path(staged), Path(final)
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(staged, final)
    if durable:
        fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
    return final
