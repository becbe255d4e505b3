"""Pytree helpers over optree, shared by every layer.

All pimm_fn pytree nodes are registered in the ``pimm_fn`` optree namespace, so every
helper here passes that namespace. The helpers are plain tensor code and trace under
``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from .torch_compat import foreach_mul, foreach_norm, is_plain_eager_tensor

NAMESPACE = "pimm_fn"


def tree_map(fn: Callable, tree: Any, *rest: Any, none_is_leaf: bool = False) -> Any:
    """``optree.tree_map`` in the pimm_fn namespace."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def tree_leaves(tree: Any) -> list:
    """Leaves of ``tree`` in the pimm_fn namespace (None is not a leaf)."""
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def all_on_cpu(tree: Any) -> bool:
    """Whether every tensor leaf of ``tree`` lives on the CPU (reading it waits for no device)."""
    return all(t.device.type == "cpu" for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class _FlatDictDef:
    """The structure of a flat ``name -> tensor`` dict (params, grads, moments).

    Dynamo cannot trace optree's flatten of a dict built inside the traced code (a grouped
    optimizer's per-group split), so the common flat case is handled in plain Python.
    """

    __slots__ = ("keys",)

    def __init__(self, keys: tuple):
        self.keys = keys

    def __eq__(self, other):
        return isinstance(other, _FlatDictDef) and self.keys == other.keys

    def __hash__(self):
        return hash(self.keys)

    def flatten_up_to(self, other) -> list:
        if type(other) is not dict or len(other) != len(self.keys) or any(k not in other for k in self.keys):
            raise ValueError(f"expected a dict with keys {list(self.keys)[:5]}..., got "
                             f"{type(other).__name__} {list(other)[:5] if isinstance(other, dict) else ''}")
        return [other[k] for k in self.keys]


def tree_flatten(tree: Any):
    """(leaves, treedef) in the pimm_fn namespace; ``treedef.flatten_up_to(other)`` gives the
    leaves of a tree of the same structure in the same order (tree_map's pairing and check),
    ``tree_unflatten(treedef, leaves)`` rebuilds."""
    if type(tree) is dict and all(isinstance(v, torch.Tensor) for v in tree.values()):
        return list(tree.values()), _FlatDictDef(tuple(tree))
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(treedef, leaves) -> Any:
    """The tree of ``treedef`` (from :func:`tree_flatten`) holding ``leaves``."""
    if isinstance(treedef, _FlatDictDef):
        return dict(zip(treedef.keys, leaves))
    return optree.tree_unflatten(treedef, leaves)


def tree_flatten_with_path(tree: Any):
    """(paths, leaves, treedef) in the pimm_fn namespace."""
    return optree.tree_flatten_with_path(tree, namespace=NAMESPACE)


def tree_where(cond: torch.Tensor, on_true: Any, on_false: Any) -> Any:
    """Select whole trees with a 0-dim bool tensor.

    Compiled, and on an accelerator, a ``torch.where`` per leaf: no host branch. In eager
    code with ``cond`` on the CPU, where reading it costs nothing, the chosen tree itself
    when the two match leaf for leaf (structure, dtypes, shapes): the same values
    without a select kernel per leaf, which over a model's params and optimizer state
    would copy them all every step.
    """
    if cond.device.type == "cpu" and cond.dim() == 0 and cond.dtype == torch.bool and is_plain_eager_tensor(cond):
        a_leaves, a_def = tree_flatten(on_true)
        b_leaves, b_def = tree_flatten(on_false)
        if a_def == b_def and all(
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            for a, b in zip(a_leaves, b_leaves)
        ):
            return on_true if bool(cond) else on_false
    return tree_map(lambda a, b: torch.where(cond, a, b), on_true, on_false)


def _scatter(groups: list, results: list, n: int) -> list:
    out = [None] * n
    for idx, res in zip(groups, results):
        for i, r in zip(idx, res):
            out[i] = r
    return out


def _group_by(leaves: list, key: Callable) -> list:
    """Indices of ``leaves`` grouped by ``key(leaf)``, groups in first-seen order."""
    groups: dict = {}
    for i, t in enumerate(leaves):
        groups.setdefault(key(t), []).append(i)
    return list(groups.values())


def leaf_norms(leaves: list) -> list:
    """``[vector_norm(t.float())]``: each leaf's L2 norm in float32, with foreach kernels."""
    if all(t.dtype == torch.float32 for t in leaves):
        return foreach_norm(leaves)

    def how(t):
        if t.dtype == torch.float32:
            return "f32"
        # The norm's dtype argument upcasts as .float() does (same numbers), without a copy.
        return "upcast" if t.dtype in (torch.float16, torch.bfloat16) else "copy"

    groups = _group_by(leaves, how)
    results = []
    for idx in groups:
        part = [leaves[i] for i in idx]
        kind = how(part[0])
        if kind == "f32":
            results.append(foreach_norm(part))
        elif kind == "upcast":
            results.append(foreach_norm(part, dtype=torch.float32))
        else:
            results.append(foreach_norm([t.float() for t in part]))
    return _scatter(groups, results, len(leaves))


def global_norm(tree: Any) -> torch.Tensor:
    """L2 norm over every tensor leaf, as ``torch.nn.utils.clip_grad_norm_`` computes it
    (each leaf's norm, then the norm of those)."""
    leaves = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    if not leaves:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(leaf_norms(leaves)))


def all_finite(tree: Any, norm: torch.Tensor | None = None) -> torch.Tensor:
    """0-dim bool tensor: every element of every tensor leaf is finite.

    norm: the tree's :func:`global_norm`, when the caller has it. A finite norm proves
    every element finite (an inf or NaN makes the sum of squares inf or NaN), so eager
    code on the CPU, where reading it costs nothing, skips the per-leaf scan (a reduction
    kernel per gradient). A non-finite norm may be an overflow of finite values: scanned.
    """
    if norm is not None and norm.device.type == "cpu" and is_plain_eager_tensor(norm):
        norm_finite = torch.isfinite(norm)
        if bool(norm_finite):
            return norm_finite
    leaves = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([torch.isfinite(t).all() for t in leaves]).all()


def tree_scale(tree: Any, factor: torch.Tensor | float) -> Any:
    """Multiply every leaf by ``factor`` (a number or a 0-dim tensor, moved to each
    leaf's device), with foreach kernels."""
    leaves, treedef = tree_flatten(tree)
    if not leaves:
        return tree
    if not isinstance(factor, torch.Tensor):
        return tree_unflatten(treedef, foreach_mul(leaves, factor))
    groups = _group_by(leaves, lambda t: t.device)
    results = [foreach_mul([leaves[i] for i in idx], factor.to(leaves[idx[0]].device)) for idx in groups]
    return tree_unflatten(treedef, results[0] if len(groups) == 1 else _scatter(groups, results, len(leaves)))
