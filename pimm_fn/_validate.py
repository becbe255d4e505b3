"""Argument checks shared by the builders (loaders, steps): an int where a float would be
truncated silently, with the range in the message."""
from __future__ import annotations

from typing import Optional

import numpy as np


def check_int(name: str, value, minimum: int, below: Optional[int] = None, hint: str = "") -> int:
    """``value`` as an int in ``[minimum, below)``; TypeError for a non-int (a float would be
    truncated, a bool taken for 0 or 1), ValueError out of range (``hint`` appended)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum or (below is not None and value >= below):
        bound = f"in [{minimum}, {below})" if below is not None else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value}{hint}")
    return int(value)
