"""Loaders that ``fit`` consumes, built on torchdata's ``StatefulDataLoader``.

The protocol (what ``fit`` relies on):

    loader.iter_epoch(epoch, start) -> Iterator[batch]   batches of ``epoch`` from index
                                                          ``start`` on, exactly the rest
    len(loader)                                           iters per epoch (per rank)
    loader.batch_size, loader.world_size                  per-rank batch, ranks
    loader.samples_in(batch) -> int                       per-rank samples in a batch (optional;
                                                          default data.count_batch)
    loader.state_dict() / loader.load_state_dict(sd)      worker state (iterable data)

Map-style data: the order is :func:`~pimm_fn.data.sampler.epoch_order` and random
transforms get a generator seeded from (seed, epoch, dataset index), so (seed, epoch,
position) of the :class:`~pimm_fn.state.Cursor` reproduce every remaining batch bitwise,
with any number of workers. ``state_dict`` is then informational only.

Iterable (streaming) data: the data set shards itself over ranks and workers; the epoch
is cut at ``iters_per_epoch`` (or ``num_samples() // world_size // batch_size``).
Mid-epoch resume restores the StatefulDataLoader state saved by ``state_dict`` when it
matches (epoch, start); otherwise it calls ``dataset.set_epoch(epoch)`` (if present) and
skips ``start`` batches, which is exact for a stream that is a pure function of its epoch
(and not of the worker count).
"""
from __future__ import annotations

import functools
import math
import random
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from .._validate import check_int
from ..user_warning import warn
from .collate import PointCollate, collate
from .count import count_batch
from .sampler import ResumableSampler, samples_per_rank


def _stateful_loader(*args, **kwargs) -> StatefulDataLoader:
    """``StatefulDataLoader(...)`` without the UserWarning its constructor raises about itself.

    torchdata calls the deprecated ``torch.set_vital`` in ``__init__``; every training
    command would print that warning, which is torchdata's to fix and nothing a user can act on.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        return StatefulDataLoader(*args, **kwargs)


Transform = Callable[[Any, torch.Generator], Any]


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for the random transforms of sample ``index`` in ``epoch`` (splitmix64)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(epoch) * 0xD1B54A32D192ED03 + int(index) + 1)
    z &= 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def seed_worker(worker_id: int, *, num_workers: int, rank: int, seed: int) -> None:
    """Seed torch / numpy / random in a worker with num_workers*rank + worker_id + seed.

    Only transforms that draw from the global RNGs depend on this; they are reproducible
    for a fixed worker count but, unlike generator-driven transforms, not across counts.
    """
    s = int(num_workers) * int(rank) + int(worker_id) + int(seed)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


def dataset_name(dataset, name: Optional[str] = None) -> str:
    return name or getattr(dataset, "name", None) or type(dataset).__name__


def check_nonempty(dataset, name: Optional[str] = None) -> None:
    """Raise a ValueError naming ``dataset`` when it holds no samples."""
    n = len(dataset)
    if n == 0:
        raise ValueError(
            f"data set {dataset_name(dataset, name)!r} is empty (0 samples): check its path, "
            "split and filters; an empty train set would give 0 steps per epoch"
        )


class _Keyed(torch.utils.data.Dataset):
    """Maps (index, epoch) keys to transformed samples with a per-sample generator."""

    def __init__(self, dataset, transform: Optional[Transform], seed: int):
        self.dataset, self.transform, self.seed = dataset, transform, int(seed)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        index, epoch = key
        s = sample_seed(self.seed, epoch, index)
        sample = self.dataset[index]
        if self.transform is not None:
            sample = self.transform(sample, torch.Generator().manual_seed(s))
        if isinstance(sample, Mapping):
            # Mix3D's draw for a batch is seeded by its first sample: deterministic too
            sample = dict(sample)
            sample["_mix_seed"] = s
        return sample


class EpochLoader:
    """A train/eval loader over a map-style or iterable data set (see module docstring).

    Build it with :func:`build_train_loader` / :func:`build_eval_loader`.
    """

    def __init__(
        self,
        dataset,
        *,
        batch_size: int,
        collate_fn: Callable = collate,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        transform: Optional[Transform] = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        iters_per_epoch: Optional[int] = None,
        name: Optional[str] = None,
        **loader_kwargs,
    ):
        check_int("batch_size", batch_size, 1)
        check_int("seed", seed, 0, below=2**63)
        check_int("world_size", world_size, 1)
        check_int("rank", rank, 0, below=world_size, hint=" (the rank counts from 0 and stays below world_size)")
        check_int("num_workers", num_workers, 0)
        if iters_per_epoch is not None:
            check_int("iters_per_epoch", iters_per_epoch, 1)
        self.dataset = dataset
        self.name = dataset_name(dataset, name)
        self.batch_size, self.world_size, self.rank = int(batch_size), int(world_size), int(rank)
        self.seed, self.num_workers = int(seed), int(num_workers)
        self.iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        self._pending: Optional[dict] = None
        self._epoch, self._position = 0, 0
        init_fn = functools.partial(seed_worker, num_workers=num_workers, rank=rank, seed=seed)
        common = dict(
            batch_size=self.batch_size, num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, worker_init_fn=init_fn, **loader_kwargs,
        )
        if self.iterable:
            if transform is not None:
                raise ValueError("iterable data sets apply their own transforms; pass transform=None")
            self.drop_last = True  # every rank must run the same number of full steps
            self._len = self._iterable_len(iters_per_epoch)
            # workers must see set_epoch, which a persistent worker's dataset copy would miss
            self._dl = _stateful_loader(dataset, drop_last=True, persistent_workers=False, **common)
        else:
            check_nonempty(dataset, self.name)
            self.drop_last = bool(drop_last)
            self.sampler = ResumableSampler(
                len(dataset), seed=seed, rank=rank, world_size=world_size, shuffle=shuffle,
                drop_last=drop_last, with_epoch=True,
            )
            per_rank = samples_per_rank(len(dataset), world_size, drop_last)
            natural = per_rank // self.batch_size if drop_last else math.ceil(per_rank / self.batch_size)
            if natural <= 0:
                raise ValueError(
                    f"data set {self.name!r}: {len(dataset)} samples over {world_size} rank(s) give "
                    f"{per_rank} per rank, fewer than one batch of {batch_size} with drop_last"
                )
            self._len = min(natural, int(iters_per_epoch)) if iters_per_epoch else natural
            self._dl = _stateful_loader(
                _Keyed(dataset, transform, seed), sampler=self.sampler, drop_last=drop_last,
                persistent_workers=persistent_workers and num_workers > 0, **common,
            )

    def _iterable_len(self, iters_per_epoch: Optional[int]) -> int:
        """Full batches an epoch of the stream makes on this rank (capped by ``iters_per_epoch``).

        With workers, each worker takes every ``num_workers``-th sample of the rank's share
        (as the package's streams shard) and drops its own partial last batch, so the
        count is per worker; a length over it would end every epoch early and leave
        schedules sized by ``len(loader)`` unfinished."""
        for attr, mine in (("rank", self.rank), ("world_size", self.world_size)):
            theirs = getattr(self.dataset, attr, None)
            if isinstance(theirs, int) and theirs != mine:
                raise ValueError(
                    f"iterable data set {self.name!r} shards itself with {attr}={theirs} but the loader was built "
                    f"with {attr}={mine}: build the data set with the loader's rank and world_size (a stream "
                    "picks its own share, so a mismatch gives ranks the same samples)")
        num_samples = getattr(self.dataset, "num_samples", None)
        if not callable(num_samples):
            if not iters_per_epoch:
                raise ValueError(
                    f"iterable data set {self.name!r} needs iters_per_epoch=... or a "
                    "num_samples() method to define the epoch length"
                )
            return int(iters_per_epoch)
        per_rank = int(num_samples()) // self.world_size
        workers = max(1, self.num_workers)
        natural = sum((per_rank - w + workers - 1) // workers // self.batch_size for w in range(workers))
        if natural <= 0:
            raise ValueError(
                f"iterable data set {self.name!r}: no full batch per epoch (num_samples()={num_samples()}, "
                f"per rank {per_rank}, over {workers} worker(s), batch_size {self.batch_size}); use a smaller "
                "batch or fewer workers")
        return min(natural, int(iters_per_epoch)) if iters_per_epoch else natural

    def __len__(self) -> int:
        return self._len

    def samples_in(self, batch) -> int:
        return count_batch(batch).samples

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator:
        """Yield the batches of ``epoch`` from batch index ``start`` to ``len(self)``."""
        if not 0 <= start <= self._len:
            raise ValueError(f"start {start} outside epoch of {self._len} batches ({self.name!r})")
        return self._iter(int(epoch), int(start))

    def __iter__(self) -> Iterator:
        return self.iter_epoch(0, 0)

    def _iter(self, epoch: int, start: int) -> Iterator:
        skip = 0
        if self.iterable:
            pending, self._pending = self._pending, None
            # the epoch reaches the stream before workers copy it (they are not persistent)
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(epoch)
            if pending is not None and (pending["epoch"], pending["position"]) == (epoch, start):
                self._dl.load_state_dict(pending["loader"])
            else:
                skip = start
        else:
            self.sampler.set_epoch(epoch, start * self.batch_size)
        self._epoch, self._position = epoch, start
        it = iter(self._dl)
        for _ in range(skip):
            if next(it, None) is None:
                return
        # range first: zip stops without pulling a batch past the epoch's end
        for _, batch in zip(range(self._len - start), it):
            self._position += 1
            yield batch

    def state_dict(self) -> dict:
        """The position, what decides which samples a position holds (batch size, seed,
        batches an epoch, world size) and, for iterable data, the StatefulDataLoader (worker) state."""
        sd = {"epoch": self._epoch, "position": self._position, "num_workers": self.num_workers,
              "world_size": self.world_size, "batch_size": self.batch_size, "seed": self.seed,
              "batches": self._len}
        if self.iterable:
            sd["loader"] = self._dl.state_dict()
        return sd

    def load_state_dict(self, state: dict) -> None:
        """Restore worker state for the next ``iter_epoch(epoch, position)`` call.

        Map-style loaders need nothing (the Cursor positions them). A state saved with a
        different worker count or world size is dropped: the iterable then falls back to
        set_epoch + skipping, which is exact only when the stream's order does not depend on
        them (a stream sharded over its workers interleaves them differently, so the skipped
        batches are not the ones the saved run made: samples repeat or go missing).

        A loader whose batch size, seed or epoch length differs from the saved one would put
        other samples at the saved position: mid-epoch that is a ValueError (the epoch would
        see some samples twice and miss others); at an epoch's end a warning (the run goes
        on exactly, but with other batches than the original).
        """
        self._check_same_samples(state)
        if not self.iterable or "loader" not in state:
            return
        if state.get("num_workers") != self.num_workers or state.get("world_size") != self.world_size:
            warn(f"{self.name!r}: loader state saved with num_workers={state.get('num_workers')}, "
                 f"world_size={state.get('world_size')}; now {self.num_workers}, {self.world_size}. "
                 "Dropping it; resume skips batches instead, which repeats or misses samples when the stream's "
                 "order depends on them: resume with the saved values to continue exactly.", UserWarning)
            return
        self._pending = dict(state)

    def _check_same_samples(self, state: dict) -> None:
        # The world size too: with the same epoch length, another world size still puts
        # other samples at the saved position (each rank takes every world_size-th sample).
        now = {"batch_size": self.batch_size, "seed": self.seed, "batches": self._len, "world_size": self.world_size}
        changed = [f"{k}={state[k]} (now {v})" for k, v in now.items() if state.get(k) is not None and state[k] != v]
        if not changed:
            return
        said = f"{self.name!r}: the checkpoint's loader had {', '.join(changed)}"
        position, batches = state.get("position") or 0, state.get("batches") or math.inf
        if 0 < position < batches:  # mid-epoch (a checkpoint at an epoch's end holds position == batches)
            raise ValueError(
                f"{said}; the run stopped after batch {state['position']} of epoch {state.get('epoch')}, and those "
                "batches would now be other samples: build the loader as the checkpoint's run did to resume "
                "exactly, or resume from a checkpoint written at an epoch's end (another world size or batch "
                "size on purpose: move the cursor with pimm_fn.distributed.reshard_cursor, without this state)")
        warn(f"{said}; the run resumes at an epoch's start and draws other batches than the original from here on",
             UserWarning)


def build_train_loader(
    dataset,
    *,
    batch_size: int,
    seed: int = 0,
    collate_fn: Optional[Callable] = None,
    transform: Optional[Transform] = None,
    mix_prob: float = 0.0,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    drop_last: Optional[bool] = None,
    iters_per_epoch: Optional[int] = None,
    pin_memory: Optional[bool] = None,
    persistent_workers: Optional[bool] = None,
    name: Optional[str] = None,
    device=None,
    **loader_kwargs,
) -> EpochLoader:
    """Build the shuffling, resumable training loader.

    batch_size: per rank. collate_fn: defaults to the point collate with ``mix_prob``.
    transform: ``f(sample, generator) -> sample``, seeded per (seed, epoch, index).
    drop_last: None -> True when the data set is larger than the global batch
        (batch_size * world_size), as Pointcept does; iterable data always drops.
    iters_per_epoch: required for an iterable data set without num_samples(); for
        map-style data an optional cap on the epoch.
    pin_memory: None -> on when CUDA is available. persistent_workers: None -> on with
        workers (map-style only).
    device: the training device: the loader is wrapped in a
        :class:`~pimm_fn.data.device.DeviceLoader` whose batches arrive there (pinned,
        non-blocking copies). None or a CPU device: the loader itself (batches stay on the CPU).
    """
    fixed = sorted({"shuffle", "sampler", "batch_sampler"} & set(loader_kwargs))
    if fixed:
        raise TypeError(f"build_train_loader sets {', '.join(fixed)} itself (a resumable shuffle over the "
                        "ranks); for data in a fixed order use build_eval_loader")
    if collate_fn is None:
        collate_fn = PointCollate(mix_prob)
    elif mix_prob:
        raise ValueError("mix_prob applies to the default point collate; pass it to your collate_fn")
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    if not iterable:
        check_nonempty(dataset, name)
    if drop_last is None:
        drop_last = True if iterable else len(dataset) > batch_size * world_size
    loader = EpochLoader(
        dataset, batch_size=batch_size, collate_fn=collate_fn, seed=seed, rank=rank,
        world_size=world_size, num_workers=num_workers, shuffle=True, drop_last=drop_last,
        transform=transform, iters_per_epoch=iters_per_epoch, name=name,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        persistent_workers=(num_workers > 0) if persistent_workers is None else persistent_workers,
        **loader_kwargs,
    )
    return _on_device(loader, device)


def _on_device(loader: EpochLoader, device):
    # The CPU needs no copies: the loader itself, so a script passing ctx.device gets the
    # same loader object on a CPU machine as without the option.
    if device is None or torch.device(device).type == "cpu":
        return loader
    from .device import DeviceLoader

    return DeviceLoader(loader, device)


def build_eval_loader(
    dataset,
    *,
    batch_size: int,
    collate_fn: Optional[Callable] = None,
    transform: Optional[Transform] = None,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    pin_memory: Optional[bool] = None,
    name: Optional[str] = None,
    device=None,
) -> EpochLoader:
    """Build a validation/test loader: no shuffling, no drop_last, own batch size.

    With world_size > 1 each rank takes every world_size-th sample (DistributedSampler
    with shuffle off); the last ranks repeat up to world_size - 1 samples as padding.
    Iterate it with ``iter(loader)`` or ``loader.iter_epoch(0, 0)``. device: as for
    :func:`build_train_loader`.
    """
    return _on_device(EpochLoader(
        dataset, batch_size=batch_size, collate_fn=collate_fn or PointCollate(0.0), seed=0,
        rank=rank, world_size=world_size, num_workers=num_workers, shuffle=False,
        drop_last=False, transform=transform, name=name,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        persistent_workers=False,
    ), device)
