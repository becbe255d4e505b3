"""The transform interface: pure ``init`` / ``update`` pairs over pytrees (optax's shape).

A :class:`GradientTransformation` never mutates its inputs. ``update`` maps gradients to
updates (the deltas that :func:`apply_updates` adds to the params) and returns a new
optimizer state. Every counter lives in that state, so a skipped step is simply the old
state kept with ``torch.where``.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from ..schedules import constant
from ..torch_compat import foreach_add
from ..tree import tree_flatten, tree_unflatten

Params = dict  # name -> tensor, as named_parameters() names them
Schedule = Callable[[torch.Tensor], torch.Tensor]  # step (0-dim int64) -> value (0-dim float)
ScalarOrSchedule = Union[float, Schedule]


class GradientTransformation(NamedTuple):
    """A pure optimizer piece.

    init(params) -> opt_state
    update(grads, opt_state, params) -> (updates, new_opt_state)
    hyperparams(opt_state) -> dict[str, 0-dim tensor]: current values worth logging
        (for example ``{"lr": ...}`` or ``{"lr/group0": ..., "lr/block": ...}``). Optional.
    apply(grads, opt_state, params) -> (new_params, new_opt_state): ``update`` and
        :func:`apply_updates` in one, for a transform that can make the new params
        without materialising the updates (passes over the params fewer). Optional; the
        same step (adamw's: torch's params, which its ``update`` followed by
        ``apply_updates`` reproduces exactly wherever the update ``new - old`` is exact).
    frozen(names) -> frozenset: the param names (of ``names``) the transform never
        changes and needs no gradient for (:func:`pimm_fn.optim.freeze`); the steps then
        compute no gradient for them and leave them out of the gradient norm, the finite
        check and clipping, as torch leaves out ``requires_grad=False`` params. Optional.
    """

    init: Callable[[Params], Any]
    update: Callable[[Params, Any, Params], tuple[Params, Any]]
    hyperparams: Optional[Callable[[Any], dict]] = None
    apply: Optional[Callable[[Params, Any, Params], tuple[Params, Any]]] = None
    frozen: Optional[Callable[[Any], frozenset]] = None


def as_schedule(value: ScalarOrSchedule) -> Schedule:
    """A number becomes a constant schedule; a schedule is returned unchanged."""
    return value if callable(value) else constant(value)


def apply_updates(params: Params, updates: Params) -> Params:
    """New params ``p + u``, cast back to each param's dtype (one multi-tensor add)."""
    leaves, treedef = tree_flatten(params)
    if not leaves:
        return params
    new = foreach_add(leaves, treedef.flatten_up_to(updates))
    return tree_unflatten(treedef, [n if n.dtype == p.dtype else n.to(p.dtype) for n, p in zip(new, leaves)])


def update_and_apply(tx: GradientTransformation, grads: Params, opt_state, params: Params):
    """One optimizer step: ``(new_params, new_opt_state)``.

    ``tx.apply`` where the transform has one, else ``tx.update`` then :func:`apply_updates`.
    The steps apply their gradients through this.
    """
    if tx.apply is not None:
        return tx.apply(grads, opt_state, params)
    updates, new_state = tx.update(grads, opt_state, params)
    return apply_updates(params, updates), new_state


def frozen_names(tx: GradientTransformation, names) -> frozenset:
    """The names among ``names`` (param names) that ``tx`` leaves unchanged (``tx.frozen``)."""
    return frozenset() if tx.frozen is None else tx.frozen(list(names))


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

    def apply(grads, opt_state, params):
        # Every transform but the last maps the gradients; the last makes the params.
        new_states = []
        for t, s in zip(transforms[:-1], opt_state):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        params, s = update_and_apply(transforms[-1], grads, opt_state[-1], params)
        return params, tuple(new_states) + (s,)

    def hyperparams(opt_state):
        merged: dict = {}
        for t, s in zip(transforms, opt_state):
            if t.hyperparams is not None:
                merged.update(t.hyperparams(s))
        return merged

    last = transforms[-1] if transforms else None
    # The params the last transform never changes stay unchanged whatever comes before it.
    return GradientTransformation(init, update, hyperparams, apply if last is not None and last.apply else None,
                                  last.frozen if last is not None else None)
