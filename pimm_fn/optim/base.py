"""The transform interface: pure ``init`` / ``update`` pairs over pytrees (optax's shape).

A :class:`GradientTransformation` never mutates its inputs. ``update`` maps gradients to
updates (the deltas that :func:`apply_updates` adds to the params) and returns a new
optimizer state. Every counter lives in that state, so a skipped step is simply the old
state kept with ``torch.where``.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from ..tree import tree_map

Params = dict  # name -> tensor, as named_parameters() names them
Schedule = Callable[[torch.Tensor], torch.Tensor]  # step (0-dim int64) -> value (0-dim float)
ScalarOrSchedule = Union[float, Schedule]


class GradientTransformation(NamedTuple):
    """A pure optimizer piece.

    init(params) -> opt_state
    update(grads, opt_state, params) -> (updates, new_opt_state)
    hyperparams(opt_state) -> dict[str, 0-dim tensor]: current values worth logging
        (for example ``{"lr": ...}`` or ``{"lr/group0": ..., "lr/block": ...}``). Optional.
    """

    init: Callable[[Params], Any]
    update: Callable[[Params, Any, Params], tuple[Params, Any]]
    hyperparams: Optional[Callable[[Any], dict]] = None


def as_schedule(value: ScalarOrSchedule) -> Schedule:
    """A number becomes a constant schedule; a schedule is returned unchanged."""
    if callable(value):
        return value
    const = float(value)
    return lambda count: torch.full((), const, dtype=torch.float32, device=count.device)


def apply_updates(params: Params, updates: Params) -> Params:
    """New params ``p + u``, cast back to each param's dtype."""
    return tree_map(lambda p, u: (p + u).to(p.dtype), params, updates)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transforms in order; the state is the tuple of their states."""

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(grads, opt_state, params):
        new_states = []
        for t, s in zip(transforms, opt_state):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        return grads, tuple(new_states)

    def hyperparams(opt_state):
        merged: dict = {}
        for t, s in zip(transforms, opt_state):
            if t.hyperparams is not None:
                merged.update(t.hyperparams(s))
        return merged

    return GradientTransformation(init, update, hyperparams)
