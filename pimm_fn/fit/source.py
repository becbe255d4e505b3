"""The training loader as fit sees it: steps per epoch, samples per batch, an epoch's batches."""
from __future__ import annotations

import collections.abc
import itertools
from typing import Any, Callable, Iterable, Iterator, Optional

__all__ = ["resolve_iters_per_epoch"]


def resolve_iters_per_epoch(loader, iters_per_epoch: Optional[int] = None) -> int:
    """Steps per epoch, by Pointcept's rule.

    Given ``iters_per_epoch``: that (an iterable stream is cut there). Else ``len(loader)``.
    Else (an iterable without a length) ``dataset.num_samples() // world_size // batch_size``.
    Raises ValueError naming the fix when none applies or the count is not positive.
    """
    name = type(loader).__name__
    if iters_per_epoch is not None:
        if isinstance(iters_per_epoch, bool) or not isinstance(iters_per_epoch, int) or iters_per_epoch <= 0:
            raise ValueError(f"iters_per_epoch must be a positive int, got {iters_per_epoch!r}")
        return iters_per_epoch
    try:
        n = len(loader)
    except TypeError:
        n = None
    if n is not None:
        if n <= 0:
            raise ValueError(
                f"the training loader ({name}) has no batches per epoch (len {n}): its dataset is "
                "empty, or smaller than one batch with drop_last=True. Check the dataset path/split "
                "and the batch size."
            )
        return int(n)
    dataset = getattr(loader, "dataset", None)
    num_samples = getattr(dataset, "num_samples", None)
    batch_size = getattr(loader, "batch_size", None)
    if not callable(num_samples) or not batch_size:
        raise ValueError(
            f"the training loader ({name}) has no length (an iterable dataset): pass "
            "fit(..., iters_per_epoch=N), or give the dataset a num_samples() method and the "
            "loader a batch_size."
        )
    world = max(1, int(getattr(loader, "world_size", 1) or 1))
    per_rank = int(num_samples()) // world
    n = per_rank // int(batch_size)
    if n <= 0:
        raise ValueError(
            f"derived iters_per_epoch={n} <= 0 (num_samples per rank={per_rank}, "
            f"batch_size={batch_size}): the dataset is smaller than one batch per rank; "
            "pass iters_per_epoch=N or use a smaller batch"
        )
    return n


def _sample_counter() -> Callable[[Any], int]:
    """``batch -> samples`` by :func:`pimm_fn.data.count_batch`. Imported when a run starts,
    not with this module: importing pimm_fn.data loads the data stack, which
    `import pimm_fn` (fit included) must not."""
    from ..data.count import count_batch

    def samples(batch) -> int:
        return count_batch(batch).samples

    return samples


class _Source:
    """Adapts the loader protocol (``iter_epoch``) and plain re-iterables to one interface."""

    def __init__(self, loader, iters_per_epoch):
        if loader is None:
            raise TypeError("fit needs a training loader, got None")
        if isinstance(loader, collections.abc.Mapping):
            raise TypeError(
                f"fit got one batch (a {type(loader).__name__} with keys {sorted(map(str, loader))[:6]}) as its "
                "loader; pass the batches (a list of them, a DataLoader or a pimm_fn.data loader)")
        if isinstance(loader, collections.abc.Iterator):
            raise TypeError(
                f"fit needs a re-iterable loader (a list of batches, a DataLoader, or an object "
                f"with iter_epoch(epoch, start)); got a one-shot iterator ({type(loader).__name__}), "
                "which would be empty from the second epoch on. Pass the iterable, not iter(...)."
            )
        self.loader = loader
        self.protocol = callable(getattr(loader, "iter_epoch", None))
        if not self.protocol and not isinstance(loader, Iterable):
            raise TypeError(f"the training loader must be iterable or have iter_epoch(); got {type(loader).__name__}")
        self.iters_per_epoch = resolve_iters_per_epoch(loader, iters_per_epoch)
        self._sized = iters_per_epoch is None and isinstance(loader, collections.abc.Sized)
        self.world_size = max(1, int(getattr(loader, "world_size", 1) or 1))
        samples_in = getattr(loader, "samples_in", None)
        self.samples_in = samples_in if callable(samples_in) else _sample_counter()

    def epoch_length(self) -> int:
        """Steps in the epoch about to start: ``len(loader)`` again for a sized loader (one whose
        length changes between epochs trains each epoch whole), else the length fit was given."""
        if self._sized:
            self.iters_per_epoch = resolve_iters_per_epoch(self.loader)
        return self.iters_per_epoch

    def iter_epoch(self, epoch: int, start: int) -> Iterator:
        if self.protocol:
            return iter(self.loader.iter_epoch(epoch, start))
        # A plain iterable: tell it the epoch if it can hear it, then skip what was consumed.
        # Exact on resume only when the iterable's order for an epoch is deterministic.
        for obj in (self.loader, getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None)):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
                break
        it = iter(self.loader)
        if start > 0:
            for _ in itertools.islice(it, start):
                pass
        return it

