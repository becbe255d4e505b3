"""Device identity, shared by the state (its tensors) and the data layer (batches); imports only torch."""
from __future__ import annotations

import torch


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same one (``cuda`` is the current CUDA device)."""
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None or b.index is None):
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index or a.index is None or b.index is None
