"""Frozen params: fine-tuning with a frozen backbone, torch's ``requires_grad=False``.

``freeze(tx, frozen)`` runs ``tx`` on the other params only. A frozen param keeps its value
bit for bit, has no optimizer state (the state is ``tx``'s over the trainable params, so it
lines up with a torch optimizer built over the ``requires_grad`` params, as Pointcept builds
it), gets no weight decay, and the steps compute no gradient for it: they leave it out of
the gradient norm, the finite check and clipping, as ``clip_grad_norm_`` over the params
with a gradient does. Which params are frozen is decided from the names alone, so it is
static under ``torch.compile``.
"""
from __future__ import annotations

import difflib
from typing import Callable, Mapping, Sequence, Union

import torch

from .base import GradientTransformation, update_and_apply

__all__ = ["Frozen", "freeze", "resolve_frozen"]

# A predicate on param names, a name keyword (substring), a list of them, or a dict of
# name -> bool (True: frozen) with an entry for every param.
Frozen = Union[Callable[[str], bool], str, Sequence[str], Mapping[str, bool]]


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:8])
    return shown + (f" ... ({len(names)} in all)" if len(names) > 8 else "")


def resolve_frozen(frozen: Frozen, names: Sequence[str]) -> frozenset:
    """The names among ``names`` that ``frozen`` freezes.

    frozen: a predicate ``name -> bool``; a keyword or a list of keywords, each freezing
        every name it is a substring of (the param-group keywords' rule; "backbone."
        freezes ``backbone.*``); or a dict ``name -> bool`` with an entry for every name.
    Raises ValueError for a keyword that matches no name, a dict naming unknown params or
    missing some, a choice that freezes nothing, or one that freezes everything (nothing
    would train). TypeError for anything else.
    """
    names = list(names)
    if isinstance(frozen, Mapping):
        unknown = [k for k in frozen if k not in set(names)]
        if unknown:
            hints = {k: difflib.get_close_matches(str(k), names, n=1) for k in unknown[:4]}
            hint = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in hints.items() if m)
            raise ValueError(f"freeze: the mask names {len(unknown)} param(s) the model does not have: "
                             f"{_listing(unknown)}" + (f" ({hint})" if hint else "")
                             + f". Parameter names: {_listing(names)}")
        missing = [n for n in names if n not in frozen]
        if missing:
            raise ValueError(f"freeze: the mask has no entry for {len(missing)} param(s): {_listing(missing)}; "
                             "give every param a bool (True: frozen), or pass a predicate or keywords")
        bad = {k: v for k, v in frozen.items() if not isinstance(v, bool)}
        if bad:
            raise TypeError(f"freeze: the mask's values must be Python bools (True: frozen), got "
                            f"{ {k: type(v).__name__ for k, v in list(bad.items())[:4]} }")
        chosen = frozenset(n for n in names if frozen[n])
        what = "the mask"
    elif callable(frozen):
        chosen = frozenset(n for n in names if frozen(n))
        what = f"the predicate {getattr(frozen, '__name__', repr(frozen))}"
    elif isinstance(frozen, str) or (isinstance(frozen, Sequence) and all(isinstance(k, str) for k in frozen)):
        keywords = [frozen] if isinstance(frozen, str) else list(frozen)
        if not keywords or any(not k for k in keywords):
            raise ValueError(f"freeze: keywords must be non-empty strings, got {frozen!r}")
        for k in keywords:
            if not any(k in n for n in names):
                raise ValueError(f"freeze: keyword {k!r} matches no parameter (it is not a substring of any "
                                 f"parameter name). Parameter names: {_listing(names)}")
        chosen = frozenset(n for n in names if any(k in n for k in keywords))
        what = f"the keywords {keywords}"
    else:
        raise TypeError(f"freeze: frozen must be a predicate on param names, a keyword, a list of keywords "
                        f"or a dict name -> bool, got {type(frozen).__name__}")
    if not chosen:
        raise ValueError(f"freeze: {what} freezes no parameter. Parameter names: {_listing(names)}")
    if len(chosen) == len(names):
        raise ValueError(f"freeze: {what} freezes every parameter ({len(names)}); nothing would train")
    return chosen


def freeze(tx: GradientTransformation, frozen: Frozen) -> GradientTransformation:
    """``tx`` on the params ``frozen`` does not select; the frozen ones never change.

    tx: the optimizer for the trainable params (``adamw(...)``, ``chain(clip, grouped(...))``).
        Wrap the whole optimizer: a transform chained after ``freeze`` would change them.
    frozen: which params stay as they are (see :func:`resolve_frozen`): a predicate
        ``name -> bool``, a keyword or list of keywords (substrings of the names, e.g.
        ``"backbone."``), or a dict ``name -> bool`` covering every param.

    The state is ``tx``'s over the trainable params only. ``update`` gives a frozen param
    the update ``-0.0`` (``p + -0.0`` is ``p`` bit for bit, ``-0.0`` included) and ignores
    its gradient (it may be absent: the steps do not compute it); ``apply`` hands the
    frozen param itself back. ``frozen`` (the field) tells the steps which names these are.
    """

    def trainable(params, fz):
        return {k: v for k, v in params.items() if k not in fz}

    def frozen_of(names):
        fz = resolve_frozen(frozen, names)
        if tx.frozen is not None:  # a freeze inside: its names count too
            fz = fz | tx.frozen([n for n in names if n not in fz])
        return fz

    def need_params(params, what):
        if not isinstance(params, Mapping):
            raise TypeError(f"freeze: {what} needs the params as a dict name -> tensor, got {type(params).__name__}")

    def init(params):
        need_params(params, "init")
        return tx.init(trainable(params, resolve_frozen(frozen, list(params))))

    def sub_grads(grads, sub_params):
        inner_frozen = tx.frozen(list(sub_params)) if tx.frozen is not None else frozenset()
        missing = [k for k in sub_params if k not in grads and k not in inner_frozen]
        if missing:
            raise KeyError(f"freeze: no gradient for trainable param(s) {_listing(missing)}")
        return {k: grads[k] for k in sub_params if k in grads}

    def update(grads, state, params):
        need_params(params, "update")
        sub_p = trainable(params, resolve_frozen(frozen, list(params)))
        upd, new_state = tx.update(sub_grads(grads, sub_p), state, sub_p)
        # -0.0 is the additive identity: p + -0.0 is p for every p, -0.0 and NaN included.
        return {k: upd[k] if k in sub_p else torch.full_like(p, -0.0) for k, p in params.items()}, new_state

    def apply(grads, state, params):
        need_params(params, "apply")
        sub_p = trainable(params, resolve_frozen(frozen, list(params)))
        new_p, new_state = update_and_apply(tx, sub_grads(grads, sub_p), state, sub_p)
        return {k: new_p[k] if k in sub_p else p for k, p in params.items()}, new_state

    return GradientTransformation(init, update, tx.hyperparams, apply, frozen_of)
