"""Compile settings and device checks of the compile boundary.

``mode_patches``: inductor's config patches for a ``compile_step(mode=...)``, with CUDA
graphs kept off graphs with a dynamic dimension. ``copy_tensors``: a state or metrics
copied out of a CUDA graph's memory pool. ``device_error``: torch's device-mismatch
error turned into one that names the batch's tensor and the fix.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import torch_compat
from ..state import TrainState

_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def mode_patches(mode: Optional[str], dynamic: Optional[bool], options: Optional[dict]) -> dict:
    """Inductor config patches for ``mode`` with the user's ``options`` on top."""
    patches = dict(options or {})
    if mode is None:
        return patches
    if mode not in _MODES:
        raise ValueError(f"compile_step: unknown mode {mode!r}; use one of {', '.join(map(repr, _MODES))} or None")
    modal = torch_compat.inductor_mode_options(mode, dynamic)
    if modal.get("triton.cudagraphs"):
        # A graph with a dynamic dimension (variable point counts) would record one CUDA
        # graph per distinct size: every step a new recording. Such graphs run without CUDA
        # graphs; the static-shape graph keeps them.
        modal.setdefault("triton.cudagraph_skip_dynamic_graphs", True)
    return {**modal, **patches}


def copy_tensors(tree):
    """``tree`` with every tensor copied (fresh memory, outside any CUDA graph pool)."""
    from ..tree import tree_map

    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def device_error(err: RuntimeError, state, batch) -> None:
    """Raise a ValueError naming the fix when ``err`` is torch's device-mismatch error
    for a batch on another device than the state (checked only once a step failed)."""
    if "device" not in str(err) or not isinstance(state, TrainState) or not state.params:
        return
    from ..data.device import check_batch_device

    try:
        check_batch_device(batch, state.device)
    except ValueError as mismatch:
        raise mismatch from err
