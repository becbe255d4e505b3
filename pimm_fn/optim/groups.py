"""Parameter groups with Pointcept's ``param_dicts`` semantics, as one transform.

A parameter joins the FIRST group whose keyword is a substring of its name and takes
that group's settings (lr, weight_decay, momentum / b1, ...); every other parameter
forms the default group, which comes first, as Pointcept's optimizer builder orders its
torch param groups. The split is decided from the parameter names alone, so it is
static under ``torch.compile``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

from .base import GradientTransformation, Schedule, update_and_apply

__all__ = ["GroupedState", "grouped", "assign_groups"]

DEFAULT_GROUP = "default"


class GroupedState(NamedTuple):
    """groups: group name -> that group's optimizer state, default group first."""

    groups: dict


def assign_groups(names: Sequence[str], keywords: Sequence[str]) -> list[list[str]]:
    """Split ``names`` into ``[default, group 1, ...]`` by first keyword substring match.

    Raises ValueError for a keyword that claims no parameter, naming it and listing
    some parameter names, since a typo there silently trains with the wrong settings.
    """
    parts: list[list[str]] = [[] for _ in range(len(keywords) + 1)]
    for name in names:
        for i, keyword in enumerate(keywords):
            if keyword in name:
                parts[i + 1].append(name)
                break
        else:
            parts[0].append(name)
    for i, keyword in enumerate(keywords):
        if parts[i + 1]:
            continue
        shown = ", ".join(repr(n) for n in list(names)[:8])
        more = f" ... ({len(names)} in all)" if len(names) > 8 else ""
        earlier = [k for k in keywords[:i] if any(k in n and keyword in n for n in names)]
        why = (
            f"every parameter it matches was already claimed by the earlier keyword(s) "
            f"{earlier}"
            if earlier
            else "it is not a substring of any parameter name"
        )
        raise ValueError(
            f"param group keyword {keyword!r} matches no parameter: {why}. "
            f"Parameter names: {shown}{more}"
        )
    return parts


def _accepted(factory: Callable) -> Optional[set]:
    """The keyword names ``factory`` accepts, or None when it takes ``**kwargs``."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}


def grouped(
    factory: Callable[..., GradientTransformation],
    groups: Sequence[Mapping[str, Any]] = (),
    *,
    lr_schedule: Optional[Callable[[float], Schedule]] = None,
    **defaults: Any,
) -> GradientTransformation:
    """One transform that runs ``factory(**settings)`` separately on each param group.

    factory: a transform factory such as ``adamw`` or ``sgd``.
    groups: Pointcept's ``param_dicts``: dicts with a ``keyword`` and any of the
        factory's arguments (``lr``, ``weight_decay``, ``momentum`` or ``b1``, ...), plus
        an optional ``name`` (default: the keyword) used in the state and the logs.
    lr_schedule: maps each group's numeric lr to a schedule, e.g.
        ``lambda lr: one_cycle(T, max_lr=lr, ...)`` gives every group a OneCycle with
        its own max_lr, like torch's per-group ``max_lr`` list.
    defaults: the factory's arguments for the default group (group 0), and the
        fallback for any setting a keyword group does not give.

    The state is a :class:`GroupedState` holding one sub-state per group, default group
    first (named "default"); ``hyperparams`` returns ``"lr/<group name>"`` etc.
    """
    accepted = _accepted(factory)
    fname = getattr(factory, "__name__", repr(factory))

    def check_keys(keys, where):
        if accepted is None:
            return
        bad = sorted(set(keys) - accepted)
        if bad:
            hint = ""
            if "momentum" in bad and "b1" in accepted:
                hint = " (Adam's momentum is b1; Pointcept ignored 'momentum' for Adam)"
            raise ValueError(
                f"{where}: {fname} has no argument(s) {bad}{hint}; it accepts {sorted(accepted)}"
            )

    check_keys(defaults, "grouped defaults")
    specs = [(DEFAULT_GROUP, dict(defaults))]
    keywords = []
    for i, group in enumerate(groups):
        group = dict(group)
        keyword = group.pop("keyword", None)
        if not isinstance(keyword, str) or not keyword:
            raise ValueError(f"param group {i} needs a non-empty string 'keyword', got {keyword!r}")
        name = str(group.pop("name", keyword))
        check_keys(group, f"param group {name!r}")
        if name in (s[0] for s in specs):
            raise ValueError(f"param group name {name!r} is used twice; give one a 'name'")
        keywords.append(keyword)
        specs.append((name, {**defaults, **group}))

    if lr_schedule is not None:
        for _, settings in specs:
            if "lr" not in settings:
                raise ValueError("lr_schedule needs an lr for every group; pass lr= to grouped")
            if not callable(settings["lr"]):
                settings["lr"] = lr_schedule(float(settings["lr"]))

    names = [s[0] for s in specs]
    transforms = [factory(**settings) for _, settings in specs]

    def split(tree, parts):
        return [{n: tree[n] for n in part} for part in parts]

    def init(params):
        parts = assign_groups(list(params), keywords)
        return GroupedState(
            {g: tx.init(sub) for g, tx, sub in zip(names, transforms, split(params, parts))}
        )

    def update(grads, state, params):
        parts = assign_groups(list(grads), keywords)
        sub_params = split(params, parts) if params is not None else [None] * len(parts)
        merged, new_states = {}, {}
        for g, tx, sub_grads, sub_p in zip(names, transforms, split(grads, parts), sub_params):
            upd, new_states[g] = tx.update(sub_grads, state.groups[g], sub_p)
            merged.update(upd)
        # Hand the updates back in the gradients' order.
        return {n: merged[n] for n in grads}, GroupedState(new_states)

    def apply(grads, state, params):
        parts = assign_groups(list(grads), keywords)
        merged, new_states = {}, {}
        for g, tx, sub_grads, sub_p in zip(names, transforms, split(grads, parts), split(params, parts)):
            new_p, new_states[g] = update_and_apply(tx, sub_grads, state.groups[g], sub_p)
            merged.update(new_p)
        return {n: merged[n] for n in params}, GroupedState(new_states)

    def hyperparams(state):
        out = {}
        for g, tx in zip(names, transforms):
            if tx.hyperparams is not None:
                for k, v in tx.hyperparams(state.groups[g]).items():
                    out[f"{k}/{g}"] = v
        return out

    fused = any(tx.apply is not None for tx in transforms)
    return GradientTransformation(init, update, hyperparams, apply if fused else None)
