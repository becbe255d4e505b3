"""Convert optimizer state to and from a ``torch.optim`` optimizer's ``state_dict()``.

A run saved by a torch-optimizer trainer (Pointcept) continues here, and a pimm_fn run
continues under torch.optim. The walk finds the sgd / adam states inside any
``chain`` / ``grouped`` state; they correspond, in order, to the torch param groups
(default group first, then the ``param_dicts`` groups, as Pointcept builds them), and
inside a group the params follow ``named_parameters`` order.

Host code: it reads tensors with ``.item()`` and is never part of a compiled step.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch

from .base import GradientTransformation
from .groups import GroupedState
from .transforms import AdamState, SgdState

__all__ = ["from_torch_state_dict", "to_torch_state_dict"]

_OPT_STATES = (AdamState, SgdState)


def _rebuild(state: Any, fn: Callable[[Any, str], Any], group: str = "") -> Any:
    """``state`` with every sgd / adam sub-state replaced by ``fn(sub_state, group)``, in order."""
    if isinstance(state, _OPT_STATES):
        return fn(state, group)
    if isinstance(state, GroupedState):
        return GroupedState({g: _rebuild(s, fn, g) for g, s in state.groups.items()})
    if isinstance(state, tuple):
        children = [_rebuild(c, fn, group) for c in state]
        return type(state)(*children) if hasattr(state, "_fields") else tuple(children)
    return state


def _opt_states(state: Any) -> list:
    """[(group name, sgd / adam state)] in torch param-group order."""
    found = []
    _rebuild(state, lambda s, g: found.append((g, s)) or s)
    if not found:
        raise ValueError(
            "no sgd / adam / adamw state found in this optimizer state; torch interop "
            "covers those optimizers only"
        )
    return found


def _names(s) -> Optional[list]:
    """The param names a sgd / adam state covers, or None (sgd without momentum)."""
    tree = s.mu if isinstance(s, AdamState) else s.momentum
    if tree is None:
        return None
    if not isinstance(tree, dict):
        raise TypeError(f"torch interop needs params as a flat dict name -> tensor, got {type(tree)}")
    return list(tree)


def _check_names(torch_group: dict, names: Optional[list], i: int) -> None:
    """Compare with the names torch saved, when it saved any (named params, or Pointcept's 'names')."""
    saved = torch_group.get("param_names", torch_group.get("names"))
    if names is None or saved is None:
        return
    if list(saved) != names:
        diff = [(a, b) for a, b in zip(saved, names) if a != b][:5]
        raise ValueError(
            f"param group {i}: torch saved params {len(saved)} named differently from this "
            f"state's {len(names)}; first differences (torch, here): {diff}"
        )


def _check_sizes(torch_groups: list, found: list) -> None:
    if len(torch_groups) != len(found):
        raise ValueError(
            f"the torch optimizer has {len(torch_groups)} param groups but this state has "
            f"{len(found)} ({[g or 'single' for g, _ in found]}); build both with the same groups"
        )
    for i, ((g, s), tg) in enumerate(zip(found, torch_groups)):
        names = _names(s)
        if names is not None and len(names) != len(tg["params"]):
            raise ValueError(
                f"param group {i} ({g or 'single'}): torch has {len(tg['params'])} params, "
                f"this state {len(names)}"
            )
        _check_names(tg, names, i)


def from_torch_state_dict(
    state_dict: dict, template: Any, *, count: Optional[int] = None
) -> Any:
    """This library's optimizer state holding a torch optimizer's ``state_dict()``.

    template: ``tx.init(params)`` for the matching transform (same optimizer, groups in
        the same order, params as a dict in ``named_parameters`` order); it gives the
        structure, dtypes and devices.
    count: the number of updates applied (the schedule position). Adam / AdamW save it
        as ``step``; torch's SGD does not, so for sgd pass it (e.g. the torch scheduler's
        ``last_epoch`` or the run's global step). When given it overrides ``step``.
    """
    torch_groups = state_dict["param_groups"]
    torch_state = state_dict["state"]
    found = _opt_states(template)
    _check_sizes(torch_groups, found)
    groups = iter(enumerate(torch_groups))

    def load(s, g):
        i, tg = next(groups)
        names = _names(s)
        per_param = [torch_state.get(idx, torch_state.get(str(idx), {})) for idx in tg["params"]]

        def take(key, tree):
            out = {}
            for index, (n, entry) in zip(tg["params"], zip(names, per_param)):
                like = tree[n]
                value = entry.get(key)
                if value is not None and tuple(value.shape) != tuple(like.shape):
                    # Moments are matched by position: another order of the params would hand a
                    # param another's moments (a crash in the fused kernel, or silently swapped).
                    raise ValueError(
                        f"param group {i}: torch's {key} of param {index} has shape {tuple(value.shape)}, "
                        f"but param {n!r} at that position here has {tuple(like.shape)}: the torch "
                        "optimizer lists its params in another order than this state (build the model "
                        "with its submodules declared in the order of the one that saved the checkpoint, "
                        "or restore only the weights)")
                out[n] = like.clone() if value is None else value.detach().to(like).clone()
            return out

        if isinstance(s, AdamState):
            steps = [float(e["step"]) for e in per_param if "step" in e]
            n = count if count is not None else int(round(max(steps, default=0.0)))
            return AdamState(
                count=torch.full_like(s.count, int(n)),
                mu=take("exp_avg", s.mu),
                nu=take("exp_avg_sq", s.nu),
                nu_max=take("max_exp_avg_sq", s.nu_max) if s.nu_max is not None else None,
            )
        if count is None:
            raise ValueError(
                "torch.optim.SGD does not save its step count; pass count= (the torch "
                "scheduler's last_epoch, or the run's global step) so schedules resume in place"
            )
        has_buf = any(e.get("momentum_buffer") is not None for e in per_param)
        if s.momentum is None and has_buf:
            raise ValueError(
                f"param group {i}: torch saved momentum buffers but this sgd has no momentum"
            )
        buf = take("momentum_buffer", s.momentum) if s.momentum is not None else None
        return SgdState(count=torch.full_like(s.count, int(count)), momentum=buf)

    return _rebuild(template, load)


def to_torch_state_dict(
    opt_state: Any, template: Any, tx: Optional[GradientTransformation] = None
) -> dict:
    """A torch optimizer ``state_dict()`` holding ``opt_state``, for ``load_state_dict``.

    template: the torch optimizer to load into, or its ``state_dict()``: it gives the
        param groups (their indices and settings, including what a torch scheduler
        stored there, such as OneCycleLR's ``initial_lr`` / ``max_lr``).
    tx: the transform; when given, each group's current lr (and momentum / beta1 when
        scheduled) is written into the torch group, as a torch scheduler would have.
    A count of 0 writes no per-param state, like a torch optimizer that never stepped.
    """
    if isinstance(template, torch.optim.Optimizer):
        template = template.state_dict()
    torch_groups = [copy.copy(g) for g in template["param_groups"]]
    found = _opt_states(opt_state)
    _check_sizes(torch_groups, found)
    hyper = {}
    if tx is not None and tx.hyperparams is not None:
        hyper = {k: float(v) for k, v in tx.hyperparams(opt_state).items()}

    def current(key, group):
        # grouped names its hyperparams "lr/<group>"; a single transform just "lr".
        return hyper.get(f"{key}/{group}", hyper.get(key) if not group else None)

    state: dict = {}
    for (g, s), tg in zip(found, torch_groups):
        n_steps = int(s.count)
        names = _names(s)
        for j, idx in enumerate(tg["params"]):
            if n_steps == 0:
                continue
            if isinstance(s, AdamState):
                n = names[j]
                entry = {
                    # torch keeps Adam's step as a float32 tensor (non-capturable path).
                    "step": torch.tensor(float(n_steps), dtype=torch.float32),
                    "exp_avg": s.mu[n].detach().clone(),
                    "exp_avg_sq": s.nu[n].detach().clone(),
                }
                if s.nu_max is not None:
                    entry["max_exp_avg_sq"] = s.nu_max[n].detach().clone()
                state[idx] = entry
            elif s.momentum is not None:
                state[idx] = {"momentum_buffer": s.momentum[names[j]].detach().clone()}
        lr = current("lr", g)
        if lr is not None:
            tg["lr"] = lr
        momentum = current("momentum", g)
        if momentum is not None and "momentum" in tg:
            tg["momentum"] = momentum
        b1 = current("b1", g)
        if b1 is not None and "betas" in tg:
            tg["betas"] = (b1, *tuple(tg["betas"])[1:])
    return {"state": state, "param_groups": torch_groups}
