"""Hyperparameters a compiled step reads as inputs, so that a new value compiles nothing.

A schedule's or an optimizer's numbers (the peak learning rate, the run's length, the
weight decay) written into its code as Python floats become constants of the compiled
step: a notebook that changes the learning rate, or a run with more epochs, compiles the
whole step again. :class:`Hyper` holds them as float64 tensors instead, made on the
host, one set per device. ``torch.compile`` lifts such tensors (reached through the
state's optimizer) into graph inputs, so one compiled step, in this process or loaded
from the step cache in another, serves every value; the step cache keys a ``Hyper``
reached through the state's optimizer by its names only (:mod:`pimm_fn.compile.cache`).

What decides the graph's structure stays a Python value: whether a weight decay is zero,
the number of phases or milestones, a momentum buffer's presence.
"""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["Hyper", "hypers_of", "prepare"]

_CPU = torch.device("cpu")


class Hyper:
    """Named numbers as float64 tensors, one set per device.

    ``Hyper(lr=1e-3, total=100).on(device)["lr"]`` is the 0-dim tensor to compute with.
    The set for a device is made on the host the first time it is asked for, or by
    :func:`prepare` (the optimizers prepare theirs for the params' device in ``init``).
    """

    def __init__(self, **values: float):
        self.values = {name: float(v) for name, v in values.items()}
        self._vectors: dict = {}  # device -> all the values, one 1-D tensor
        self._scalars: dict = {}  # device -> name -> 0-dim view of the vector, for eager calls
        self._make(_CPU)

    def _make(self, device: torch.device) -> dict:
        vector = self._vectors[device] = torch.tensor(list(self.values.values()), dtype=torch.float64, device=device)
        made = self._scalars[device] = self._named(vector)
        return made

    def _named(self, vector: torch.Tensor) -> dict:
        return {name: vector[i] for i, name in enumerate(self.values)}

    def on(self, device: torch.device) -> dict:
        """name -> 0-dim float64 tensor on ``device``."""
        if torch.compiler.is_compiling():
            # Elements of one 1-D input: dynamo would turn each 0-dim float64 input into a
            # Python-float symbol and trace the whole step a second time to specialise them.
            vector = self._vectors.get(device)
            if vector is None:
                # Never prepared for this device: the host copy, moved inside the graph (a
                # tensor made here would be a constant of the graph). A CPU input keeps a
                # step off CUDA graphs: a schedule wrapped in a user's function is not
                # prepared unless the function lists it in its own ``hypers``.
                vector = self._vectors[_CPU].to(device)
            return self._named(vector)
        found = self._scalars.get(device)
        return found if found is not None else self._make(device)

    def __repr__(self) -> str:
        return f"Hyper({', '.join(f'{k}={v!r}' for k, v in self.values.items())})"


def hypers_of(obj) -> tuple:
    """The :class:`Hyper` sets a schedule (or a number: none) computes with."""
    return tuple(getattr(obj, "hypers", ()))


def prepare(objs: Iterable, device: torch.device) -> None:
    """Make the tensors of every schedule in ``objs`` on ``device`` now, on the host."""
    device = torch.device(device)
    for obj in objs:
        for h in hypers_of(obj):
            h.on(device)
