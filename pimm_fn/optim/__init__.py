"""Optimizers as pure, optax-style transforms: sgd / adam / adamw, clipping, param groups.

``tx = chain(clip_by_global_norm(1.0), grouped(adamw, groups, lr=..., weight_decay=...))``;
``updates, opt_state = tx.update(grads, opt_state, params)``;
``params = apply_updates(params, updates)``. Schedules live in :mod:`pimm_fn.schedules`.
``freeze(tx, "backbone.")`` fine-tunes with frozen params (torch's ``requires_grad=False``).
"""
from .base import (
                   GradientTransformation,
                   Params,
                   ScalarOrSchedule,
                   Schedule,
                   apply_updates,
                   as_schedule,
                   chain,
                   frozen_names,
                   update_and_apply,
)
from .freeze import Frozen, freeze, resolve_frozen
from .groups import GroupedState, assign_groups, grouped
from .torch_interop import from_torch_state_dict, to_torch_state_dict
from .transforms import AdamState, EmptyState, SgdState, adam, adamw, clip_by_global_norm, sgd

__all__ = [
    "AdamState",
    "EmptyState",
    "Frozen",
    "GradientTransformation",
    "GroupedState",
    "Params",
    "ScalarOrSchedule",
    "Schedule",
    "SgdState",
    "adam",
    "adamw",
    "apply_updates",
    "as_schedule",
    "assign_groups",
    "chain",
    "clip_by_global_norm",
    "freeze",
    "from_torch_state_dict",
    "frozen_names",
    "grouped",
    "resolve_frozen",
    "sgd",
    "to_torch_state_dict",
    "update_and_apply",
]
