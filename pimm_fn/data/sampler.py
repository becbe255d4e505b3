"""Epoch order as a pure function of (seed, epoch, rank, world_size), and a resumable sampler.

The order is the one ``torch.utils.data.DistributedSampler`` produces (permutation of a
generator seeded with ``seed + epoch``; padded by repetition to a multiple of the world
size, or truncated with drop_last; rank r takes every world_size-th index from r), so a
run may switch between the two without changing what it trains on. Nothing about the
position lives in the sampler's history: the :class:`~pimm_fn.state.Cursor` alone
positions it.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch


def samples_per_rank(n: int, world_size: int = 1, drop_last: bool = False) -> int:
    """Number of indices each rank gets per epoch (DistributedSampler's ``num_samples``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if drop_last and n % world_size != 0:
        return math.ceil((n - world_size) / world_size)
    return math.ceil(n / world_size)


def epoch_order(
    n: int,
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[int]:
    """The dataset indices rank ``rank`` visits in epoch ``epoch``, in order.

    n: dataset length; seed: data seed; shuffle=False keeps 0..n-1 before padding.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if n <= 0:
        raise ValueError("cannot order an empty dataset (n=0)")
    if shuffle:
        g = torch.Generator()
        g.manual_seed(int(seed) + int(epoch))
        indices = torch.randperm(n, generator=g).tolist()
    else:
        indices = list(range(n))
    per_rank = samples_per_rank(n, world_size, drop_last)
    total = per_rank * world_size
    if total > len(indices):
        pad = total - len(indices)
        # repeat the whole order as often as needed (pad can exceed n for tiny datasets)
        indices += (indices * math.ceil(pad / len(indices)))[:pad]
    else:
        indices = indices[:total]
    return indices[rank:total:world_size]


class ResumableSampler(torch.utils.data.Sampler):
    """A distributed shuffling sampler positioned by (epoch, start) rather than by history.

    Yields ``(index, epoch)`` pairs when ``with_epoch`` is set, so a dataset wrapper can
    seed per-sample random transforms from (seed, epoch, index) inside any worker.
    """

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
        with_epoch: bool = False,
    ):
        if n <= 0:
            raise ValueError("ResumableSampler over an empty dataset")
        self.n, self.seed, self.rank, self.world_size = int(n), int(seed), int(rank), int(world_size)
        self.shuffle, self.drop_last, self.with_epoch = shuffle, drop_last, with_epoch
        self.epoch = 0
        self.start = 0  # in per-rank samples

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Position at sample ``start`` (per rank) of ``epoch``."""
        self.epoch, self.start = int(epoch), int(start)

    def order(self, epoch: Optional[int] = None) -> list[int]:
        return epoch_order(
            self.n, seed=self.seed, epoch=self.epoch if epoch is None else epoch,
            rank=self.rank, world_size=self.world_size, shuffle=self.shuffle,
            drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator:
        indices = self.order()[self.start:]
        if self.with_epoch:
            return iter([(i, self.epoch) for i in indices])
        return iter(indices)

    def __len__(self) -> int:
        return max(0, samples_per_rank(self.n, self.world_size, self.drop_last) - self.start)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.start, self.seed = int(state["epoch"]), int(state["start"]), int(state["seed"])
