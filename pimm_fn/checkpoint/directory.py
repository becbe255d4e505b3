"""CheckpointDir: a folder of step checkpoints with a ``latest`` pointer, ``best.ckpt`` and pruning.

The pointer is replaced (atomically) only after the checkpoint it names is durable, so a
SIGKILL at any moment leaves a restorable ``latest()``.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union

from ..atomic import TMP_RE, atomic_replace, atomic_write, fsync_dir, fsync_file
from ..state import TrainState
from .errors import CheckpointError
from .format import _parse
from .locate import SUFFIX, _step_of
from .store import save


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointDir:
    """A folder of checkpoints with a ``latest`` pointer, a ``best.ckpt`` and pruning.

    root: the folder (created on first save).
    keep_last: default number of ``step_<n>.ckpt`` files to keep (None keeps all).

    Layout: ``step_<n>.ckpt`` files, ``latest`` (a text file naming the newest committed
    checkpoint, replaced only after that file is durable), ``best.ckpt`` (a hard link to,
    or where links are unsupported a copy of, the checkpoint saved with ``best=True``).
    Files ending in ``.tmp`` are unfinished writes and are never taken for checkpoints.
    """

    LATEST = "latest"
    BEST = "best" + SUFFIX

    def __init__(self, root: Union[str, os.PathLike], keep_last: Optional[int] = None):
        self.root = Path(root)
        self.keep_last = keep_last

    def __repr__(self) -> str:
        return f"CheckpointDir({str(self.root)!r}, keep_last={self.keep_last})"

    def make(self) -> None:
        """Create the folder (and its parents) if needed; a CheckpointError naming the cause
        when it cannot hold checkpoints (a file of that name, no permission)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise CheckpointError(
                f"the checkpoint folder {self.root} cannot be made: {self.root} or a parent of it is a "
                "file; pass a folder path") from None
        except OSError as err:
            raise CheckpointError(
                f"the checkpoint folder {self.root} cannot be made ({err.strerror}); fix the permissions "
                "or pass another folder") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CheckpointError(
                f"the checkpoint folder {self.root} is not writable; fix its permissions or pass another folder")

    def path_for(self, step: int) -> Path:
        """The file name a checkpoint of ``step`` gets."""
        return self.root / f"step_{int(step)}{SUFFIX}"

    def save(
        self,
        state: TrainState,
        step: Optional[int] = None,
        *,
        name: Optional[str] = None,
        extra: Any = None,
        keep_last: Optional[int] = None,
        best: bool = False,
    ) -> Path:
        """Save ``state`` as ``step_<step>.ckpt`` (or ``name``), then move ``latest`` to it.

        step: the number in the file name (e.g. the global batch step); default
            ``int(state.step)``.
        name: a file name instead (``.ckpt`` appended when it has no suffix); not pruned.
        extra: as in :func:`save`.
        keep_last: keep this many step files (default: the folder's ``keep_last``); the
            file ``latest`` names and the best checkpoint are never deleted.
        best: also make this checkpoint ``best.ckpt``.
        """
        self.make()
        self._remove_dead_tmp()
        if name is not None:
            target = self.root / (name if Path(name).suffix else name + SUFFIX)
            if target.name in (self.LATEST, self.BEST):
                raise ValueError(f"{target.name!r} is reserved by CheckpointDir; pick another name")
        else:
            target = self.path_for(int(state.step) if step is None else step)
        save(target, state, extra, sync_dir=False)
        if best:
            self._set_best(target)
        # The pointer moves only now: target's bytes are fsynced. The renames then reach the
        # disk with one folder fsync. The pointer's own bytes are not fsynced: after a power
        # loss it names the old file or the new one, or reads empty, and latest() then takes
        # the newest complete file; it never names a torn file (latest() checks framing).
        atomic_write(self.root / self.LATEST, lambda f: f.write((target.name + "\n").encode()), durable=False)
        fsync_dir(self.root)
        keep = self.keep_last if keep_last is None else keep_last
        if keep is not None:
            self.prune(keep)
        return target

    def _set_best(self, target: Path) -> None:
        def link_or_copy(tmp: Path) -> None:
            try:
                os.link(target, tmp)  # same inode: no extra disk, survives pruning of target
            except OSError:
                shutil.copyfile(target, tmp)
                fsync_file(tmp)

        atomic_replace(self.root / self.BEST, link_or_copy, sync_dir=False)  # save() fsyncs the folder

    def _remove_dead_tmp(self) -> None:
        """Delete temp files left by writers that are no longer running (e.g. SIGKILLed)."""
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            m = TMP_RE.match(p.name)
            if m and not _pid_alive(int(m.group("pid"))):
                try:
                    p.unlink()
                except OSError:
                    pass

    def _pointer_target(self) -> Optional[Path]:
        try:
            name = (self.root / self.LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        # Only a plain file name inside root is honoured.
        if not name or "/" in name or "\\" in name or name.startswith("."):
            return None
        return self.root / name

    @staticmethod
    def _complete(p: Path) -> bool:
        try:
            _parse(p)
            return True
        except CheckpointError:
            return False

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint files in the folder, oldest first (``best.ckpt`` excluded)."""
        if not self.root.is_dir():
            return []
        found = [
            p
            for p in self.root.iterdir()
            if p.suffix == SUFFIX and p.name != self.BEST and not p.name.startswith(".") and p.is_file()
        ]
        found = [p for p in found if self._complete(p)]
        return sorted(found, key=lambda p: (p.stat().st_mtime_ns, _step_of(p) or -1))

    def latest(self) -> Optional[Path]:
        """The checkpoint to resume from: what ``latest`` names, else the newest complete file.

        "Complete" is a cheap framing check (header parses, size matches); restore also
        verifies the checksum. Returns None when the folder holds no complete checkpoint.
        """
        target = self._pointer_target()
        if target is not None and target.is_file() and self._complete(target):
            return target
        found = self.checkpoints()
        return found[-1] if found else None

    def best(self) -> Optional[Path]:
        """``best.ckpt`` if one was saved and is complete, else None."""
        p = self.root / self.BEST
        return p if p.is_file() and self._complete(p) else None

    def prune(self, keep_last: int) -> list[Path]:
        """Delete all but the newest ``keep_last`` step files; returns the deleted paths.

        Never deletes the file ``latest`` names nor the one ``best.ckpt`` links to.
        """
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        protected = set()
        target = self._pointer_target()
        if target is not None:
            protected.add(target.name)
        best = self.root / self.BEST
        best_ino = best.stat().st_ino if best.is_file() else None
        steps = sorted(
            (p for p in self.root.iterdir() if _step_of(p) is not None and p.is_file()),
            key=_step_of,
        )
        doomed = steps[: max(0, len(steps) - keep_last)]
        deleted = []
        for p in doomed:
            if p.name in protected:
                continue
            try:
                if best_ino is not None and p.stat().st_ino == best_ino:
                    continue
                p.unlink()
                deleted.append(p)
            except FileNotFoundError:
                pass
        return deleted

