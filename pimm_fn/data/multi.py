"""A loader that mixes several data sets by ratios; the first data set defines the epoch.

One epoch repeats the cycle ``[0]*r0 + [1]*r1 + ...`` (r_i batches from loader i)
``L0 // r0`` times and ends with the ``L0 % r0`` remaining batches of loader 0, so
``len = L0 // r0 * sum(r) + L0 % r0`` (seed behaviour 25). Loaders other than the first
wrap around: their k-th batch of multi-epoch e is batch ``k % L_i`` of their own epoch
``e * passes_i + k // L_i``, a pure function of (epoch, position) like everything else,
so ``iter_epoch(epoch, start)`` resumes mid-epoch exactly.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterator, Sequence

from ..user_warning import warn


class MultiDatasetLoader:
    """Mix the batches of ``loaders`` (each following the loader protocol) by ``ratios``."""

    def __init__(self, loaders: Sequence, ratios: Sequence[int]):
        if not loaders:
            raise ValueError("MultiDatasetLoader needs at least one loader")
        if len(ratios) != len(loaders):
            raise ValueError(f"{len(loaders)} loaders but {len(ratios)} ratios")
        if any(int(r) != r or r < 1 for r in ratios):
            raise ValueError(f"ratios must be positive integers, got {list(ratios)}")
        self.loaders, self.ratios = list(loaders), [int(r) for r in ratios]
        self.batch_size = self.loaders[0].batch_size
        self.world_size = self.loaders[0].world_size
        if len(self.loaders) > 1 and len(self.loaders[0]) < self.ratios[0]:
            raise ValueError(
                f"the first loader makes {len(self.loaders[0])} batches an epoch, fewer than its ratio "
                f"{self.ratios[0]}: an epoch holds no whole cycle, so the other data sets would never be drawn; "
                "lower ratios[0], or use a smaller batch")
        self._schedule = self._build_schedule()
        self._epoch, self._position = 0, 0
        counts = Counter(self._schedule)
        # own epochs each secondary loader needs per multi-epoch (its stride in epoch space)
        self._passes = [max(1, math.ceil(counts[i] / len(ld))) for i, ld in enumerate(self.loaders)]

    def _build_schedule(self) -> list[int]:
        l0, r0 = len(self.loaders[0]), self.ratios[0]
        cycle = [i for i, r in enumerate(self.ratios) for _ in range(r)]
        return cycle * (l0 // r0) + [0] * (l0 % r0)

    def schedule(self) -> list[int]:
        """Which loader each batch of an epoch comes from."""
        return list(self._schedule)

    def __len__(self) -> int:
        return len(self._schedule)

    def samples_in(self, batch) -> int:
        return self.loaders[0].samples_in(batch)

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator:
        """Yield the mixed batches of ``epoch`` from batch index ``start`` on."""
        if not 0 <= start <= len(self):
            raise ValueError(f"start {start} outside epoch of {len(self)} batches")
        consumed = Counter(self._schedule[:start])
        self._epoch, self._position = epoch, start
        iters = {}
        positions = {i: consumed[i] for i in range(len(self.loaders))}
        for i in self._schedule[start:]:
            k = positions[i]
            own_len = len(self.loaders[i])
            if i not in iters or k % own_len == 0:
                # (re)open loader i at the own-epoch and position batch k maps to
                own_epoch = epoch * self._passes[i] + k // own_len
                iters[i] = iter(self.loaders[i].iter_epoch(own_epoch, k % own_len))
            batch = next(iters[i], None)
            if batch is None:
                return  # a sub-loader ended early (exhausted iterable): end the epoch
            positions[i] = k + 1
            self._position += 1
            yield batch

    def __iter__(self) -> Iterator:
        return self.iter_epoch(0, 0)

    def state_dict(self) -> dict:
        """The position in the mixed epoch, the ratios and epoch length that decide which
        loader each position draws from, and each loader's own state."""
        return {"epoch": self._epoch, "position": self._position, "ratios": list(self.ratios),
                "batches": len(self), "loaders": [ld.state_dict() for ld in self.loaders]}

    def load_state_dict(self, state: dict) -> None:
        """Check a saved state against this mix and hand each loader its own (see
        :meth:`EpochLoader.load_state_dict`). Other ratios or epoch length mid-epoch are a
        ValueError: the saved position would stand for other batches of each data set."""
        position, batches = state.get("position"), state.get("batches")
        changed = [f"{k}={state[k]} (now {v})" for k, v in (("ratios", self.ratios), ("batches", len(self)))
                   if state.get(k) is not None and state[k] != v]
        mid_epoch = position is not None and batches is not None and 0 < position < batches
        if changed and mid_epoch:
            raise ValueError(
                f"the checkpoint's MultiDatasetLoader had {', '.join(changed)}; the run stopped after batch "
                f"{position} of epoch {state.get('epoch')}, and those batches would now come from other data sets: "
                "build the loader as the checkpoint's run did, or resume from a checkpoint written at an epoch's end")
        if changed:
            warn(f"the checkpoint's MultiDatasetLoader had {', '.join(changed)}; the run resumes at an epoch's "
                 "start and mixes other batches than the original from here on", UserWarning)
        if position is not None and not mid_epoch:
            return  # the next epoch opens every loader afresh: their saved positions say nothing
        for ld, sd in zip(self.loaders, state["loaders"]):
            ld.load_state_dict(sd)


def build_multi_loader(datasets: Sequence, ratios: Sequence[int], *, batch_size: int, seed: int = 0,
                       **kwargs) -> MultiDatasetLoader:
    """One train loader per data set (seeds seed, seed+1, ...) mixed by ``ratios``.

    kwargs go to :func:`~pimm_fn.data.loaders.build_train_loader` (rank, world_size,
    num_workers, transform, mix_prob, collate_fn, ...).
    """
    from .loaders import build_train_loader

    loaders = [build_train_loader(d, batch_size=batch_size, seed=seed + i, **kwargs)
               for i, d in enumerate(datasets)]
    return MultiDatasetLoader(loaders, ratios)
