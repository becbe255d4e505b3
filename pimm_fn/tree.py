"""Pytree helpers over optree, shared by every layer.

All pimm_fn pytree nodes are registered in the ``pimm_fn`` optree namespace, so every
helper here passes that namespace. The helpers are plain tensor code and trace under
``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

NAMESPACE = "pimm_fn"


def tree_map(fn: Callable, tree: Any, *rest: Any, none_is_leaf: bool = False) -> Any:
    """``optree.tree_map`` in the pimm_fn namespace."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def tree_leaves(tree: Any) -> list:
    """Leaves of ``tree`` in the pimm_fn namespace (None is not a leaf)."""
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_flatten_with_path(tree: Any):
    """(paths, leaves, treedef) in the pimm_fn namespace."""
    return optree.tree_flatten_with_path(tree, namespace=NAMESPACE)


def tree_zeros_like(tree: Any) -> Any:
    """A tree of zero tensors shaped like ``tree``."""
    return tree_map(torch.zeros_like, tree)


def tree_where(cond: torch.Tensor, on_true: Any, on_false: Any) -> Any:
    """Select whole trees with a 0-dim bool tensor, without a host branch."""
    return tree_map(lambda a, b: torch.where(cond, a, b), on_true, on_false)


def global_norm(tree: Any) -> torch.Tensor:
    """L2 norm over every tensor leaf, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    leaves = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    if not leaves:
        return torch.zeros(())
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in leaves])
    return torch.linalg.vector_norm(norms)


def all_finite(tree: Any) -> torch.Tensor:
    """0-dim bool tensor: every element of every tensor leaf is finite."""
    leaves = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([torch.isfinite(t).all() for t in leaves]).all()


def tree_scale(tree: Any, factor: torch.Tensor | float) -> Any:
    """Multiply every leaf by ``factor``."""
    return tree_map(lambda t: t * factor, tree)


def tree_add(a: Any, b: Any) -> Any:
    """Leafwise ``a + b``."""
    return tree_map(lambda x, y: x + y, a, b)
