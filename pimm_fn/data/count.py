"""How many samples (and points) a batch holds: the one rule that fit, the data-parallel
step, the loaders and the benchmarks count by."""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Optional

import torch

__all__ = ["BatchCount", "count_batch"]


class BatchCount(NamedTuple):
    samples: int
    points: Optional[int] = None  # point batches only


def count_batch(batch) -> BatchCount:
    """Samples and points of one batch, read from shapes (no host sync; traceable).

    - A mapping with ``offset`` is a point batch (``offset`` holds each cloud's cumulative
      end): samples = clouds = ``len(offset)``; points = the rows of ``coord`` (which
      :func:`~pimm_fn.data.validate_point_batch` checks against ``offset[-1]``), None without it.
    - A mapping with ``image``: its leading dim. Any other mapping: the count of its first
      value that has one (0-dim tensors skipped).
    - A tensor: its leading dim (1 for a 0-dim tensor).
    - A list/tuple of mappings is a list of micro-batches: their counts summed. Any other
      list/tuple (an ``(x, y)`` pair): its first element's count, or its length when that
      element is neither a tensor, a mapping nor a sequence (prompts, seeds).

    Raises TypeError for anything else; a loader of such batches counts them with its own
    ``samples_in(batch)`` method, a data-parallel step with ``count_fn``.
    """
    n = _count(batch)
    if n is None:
        raise TypeError(
            f"cannot count the samples of a {type(batch).__name__} batch: give the loader a "
            "samples_in(batch) method (and data_parallel/wrap_step a count_fn)"
        )
    return n


def _count(x) -> Optional[BatchCount]:
    if isinstance(x, torch.Tensor):
        return BatchCount(x.shape[0] if x.dim() else 1)
    if isinstance(x, Mapping):
        offset = x.get("offset")
        if isinstance(offset, torch.Tensor):
            coord = x.get("coord")
            return BatchCount(offset.shape[0], coord.shape[0] if isinstance(coord, torch.Tensor) else None)
        image = x.get("image")
        if isinstance(image, torch.Tensor):
            return BatchCount(image.shape[0])
        for v in x.values():
            if isinstance(v, torch.Tensor):
                if v.dim():  # a 0-dim tensor is a per-batch scalar, not a sample axis
                    return BatchCount(v.shape[0])
                continue
            n = _count(v)
            if n is not None:
                return n
        return None
    if isinstance(x, (list, tuple)) and x:
        if all(isinstance(b, Mapping) for b in x):
            parts = [_count(b) for b in x]
            if any(p is None for p in parts):
                return None
            points = None if any(p.points is None for p in parts) else sum(p.points for p in parts)
            return BatchCount(sum(p.samples for p in parts), points)
        if isinstance(x[0], (torch.Tensor, Mapping, list, tuple)):
            return _count(x[0])
        return BatchCount(len(x))
    return None
