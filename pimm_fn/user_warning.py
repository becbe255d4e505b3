"""``warn``: a warning attributed to the user's line of code, not to pimm_fn's."""
from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` at the innermost caller outside pimm_fn: how deep pimm_fn's own
    frames go differs from call to call (a compiling call runs a few frames deeper)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: warn's caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
