"""Finding checkpoint files: the ``.ckpt`` / ``step_<n>.ckpt`` names, a folder's checkpoints
newest first, and the not-found error that lists them."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from .errors import CheckpointNotFoundError, _listing

SUFFIX = ".ckpt"
_STEP_RE = re.compile(r"^step_(\d+)" + re.escape(SUFFIX) + "$")


def _step_of(p: Path) -> Optional[int]:
    m = _STEP_RE.match(p.name)
    return int(m.group(1)) if m else None


def _existing_checkpoints(folder: Path, exclude: Optional[Path] = None) -> list[Path]:
    """Checkpoint-looking files in ``folder``, newest first (temp files excluded)."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        if p.name.endswith(".tmp") or p.name.startswith(".") or not p.is_file():
            continue
        if p.suffix in (SUFFIX, ".pth", ".pt", ".safetensors") and (
            exclude is None or p.resolve() != exclude.resolve()
        ):
            found.append(p)
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, _step_of(p) or -1), reverse=True)


def _not_found(path: Path) -> CheckpointNotFoundError:
    folder = path.parent
    if not folder.is_dir():
        return CheckpointNotFoundError(f"checkpoint {path} does not exist (nor does its folder {folder})")
    found = _existing_checkpoints(folder)
    if found:
        return CheckpointNotFoundError(
            f"checkpoint {path} does not exist; checkpoints in {folder} (newest first):"
            + _listing(p.name for p in found)
        )
    return CheckpointNotFoundError(f"checkpoint {path} does not exist, and {folder} holds no checkpoints")

