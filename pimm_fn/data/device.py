"""Batches onto the training device: pinned host memory and non-blocking copies.

:func:`to_device` copies every tensor of a batch (nested dicts, lists, tuples, named
tuples) to a device; anything else (strings, numbers, None) passes through unchanged.
For a CUDA target a CPU tensor is copied from pinned (page-locked) memory with
``non_blocking=True``: the host queues the copy and goes on to queue the step, and the
copy runs in stream order before the step's kernels, so nothing waits on the GPU.
Tensors the loader's workers already pinned (``pin_memory=True``, the default of
:func:`~pimm_fn.data.loaders.build_train_loader` when CUDA is available) are not copied
twice. A copy *to* the CPU is always blocking: a non-blocking device-to-host copy could
be read before it lands.

:class:`DeviceLoader` wraps any loader (the ``iter_epoch`` protocol fit uses, or a plain
re-iterable) and yields its batches through :func:`to_device`; everything else (``len``,
``samples_in``, ``state_dict``) is the wrapped loader's.

:func:`check_batch_device` is the host check a compiled step runs on its first batch: a
batch on another device than the state is an error naming the tensor and the fix.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch

from .._devices import same_device

__all__ = ["DeviceLoader", "batch_devices", "check_batch_device", "to_device"]


def _map(fn, batch):
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: _map(fn, v) for k, v in batch.items()}
        return items if type(batch) is dict else type(batch)(items)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(_map(fn, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(fn, v) for v in batch)
    return batch


def to_device(batch: Any, device, *, pin_memory: Optional[bool] = None, non_blocking: bool = True) -> Any:
    """``batch`` with every tensor on ``device`` (nested dicts / lists / tuples; others pass through).

    pin_memory: pin CPU tensors before a copy to CUDA (default: when the target is CUDA).
        Pinning is what makes the copy asynchronous; a tensor already pinned is used as is.
    non_blocking: queue host-to-device copies without waiting (ignored for copies to the CPU,
        which must have landed before the host reads them).
    A tensor already on ``device`` is returned as is (no copy).
    """
    device = torch.device(device)
    to_cuda = device.type == "cuda"
    pin = to_cuda if pin_memory is None else bool(pin_memory) and to_cuda
    asynchronous = non_blocking and device.type != "cpu"

    def move(t: torch.Tensor) -> torch.Tensor:
        if same_device(t.device, device):
            return t
        if pin and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=asynchronous and t.device.type == "cpu")

    return _map(move, batch)


def batch_devices(batch: Any, prefix: str = "") -> list:
    """``(path, device)`` of every tensor of dim >= 1 in ``batch`` (0-dim tensors mix freely)."""
    found = []
    if isinstance(batch, torch.Tensor):
        if batch.dim() > 0:
            found.append((prefix or "batch", batch.device))
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            found.extend(batch_devices(v, f"{prefix}[{k!r}]" if prefix else repr(k)))
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            found.extend(batch_devices(v, f"{prefix}[{i}]"))
    return found


def check_batch_device(batch: Any, device) -> None:
    """Raise ValueError naming the batch's tensors that are not on ``device`` (the state's)."""
    device = torch.device(device)
    off = [(p, d) for p, d in batch_devices(batch) if not same_device(d, device)]
    if off:
        listing = ", ".join(f"{p} on {d}" for p, d in off[:4]) + (" ..." if len(off) > 4 else "")
        raise ValueError(
            f"the batch is on another device than the state ({device}): {listing}. Move batches "
            "to the state's device: wrap the loader as pimm_fn.data.DeviceLoader(loader, state.device) "
            "(or build_train_loader(..., device=...)), or call pimm_fn.data.to_device(batch, state.device); "
            "or create the state on the batches' device with TrainState.create(..., device=...)"
        )


class DeviceLoader:
    """A loader whose batches arrive on ``device`` (pinned, non-blocking copies; see :func:`to_device`).

    loader: an :class:`~pimm_fn.data.loaders.EpochLoader`, any object with
        ``iter_epoch(epoch, start)``, or a plain re-iterable (a list, a DataLoader).
    Length, ``samples_in``, ``state_dict`` and every other attribute are the wrapped
    loader's, so ``fit`` and resume treat it exactly as the loader itself.
    """

    def __init__(self, loader, device, *, pin_memory: Optional[bool] = None, non_blocking: bool = True):
        if isinstance(loader, DeviceLoader):
            loader = loader.loader
        self.loader = loader
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.non_blocking = non_blocking

    def _move(self, batches) -> Iterator:
        for batch in batches:
            yield to_device(batch, self.device, pin_memory=self.pin_memory, non_blocking=self.non_blocking)

    @property
    def iter_epoch(self):
        # Present only when the wrapped loader has it: fit treats a loader with iter_epoch
        # through the protocol and anything else as a plain iterable.
        inner = getattr(self.loader, "iter_epoch", None)
        if not callable(inner):
            raise AttributeError("iter_epoch")
        return lambda epoch, start=0: self._move(inner(epoch, start))

    def __iter__(self) -> Iterator:
        return self._move(iter(self.loader))

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self):
        return f"DeviceLoader({self.loader!r}, device={self.device})"
