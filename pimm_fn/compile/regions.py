"""``compile_step(fullgraph=False)``: a step whose model has graph breaks, compiled in regions.

A model that reads sizes on the host (``offset.tolist()``), loops over clouds in Python or
calls an external kernel cannot be traced as one graph. Traced whole with breaks allowed,
the step fares worse than eager: a break inside ``functional_call``'s re-parametrisation
context cannot be resumed, so dynamo falls back to running that frame uncompiled. So the
step's Python runs as written and two regions are compiled instead:

- the model call (:func:`pimm_fn.steps.common.module_call`): ``torch.compile`` of the
  module with graph breaks allowed, so the pieces between breaks are compiled graphs and
  their backward is compiled too (the gradient itself is taken eagerly over them);
- the guarded update (:func:`pimm_fn.steps.common.guarded_update`: unscale, finite check,
  clip, optimizer, loss scale): one graph, ``fullgraph=True``.

The steps reach the regions through :func:`active`, which a compiled step sets around its
call; outside such a call (and while a whole-step compile traces) it is None and both
functions run as they are.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from .. import torch_compat

__all__ = ["CompiledRegions", "active"]

_ACTIVE: Optional["CompiledRegions"] = None


def active() -> Optional["CompiledRegions"]:
    """The regions of the graph-tolerant step being called, or None."""
    return _ACTIVE


class CompiledRegions:
    """The compiled model calls and update of one ``compile_step(..., fullgraph=False)``.

    dynamic: torch.compile's ``dynamic``; patches: inductor config (compile_step's mode and
    options); recompile_limit: recompiles allowed per region (dynamo's default otherwise).
    """

    def __init__(self, dynamic: Optional[bool], patches: dict, recompile_limit: Optional[int] = None):
        self._settings = dict(dynamic=dynamic, options=patches or None, recompile_limit=recompile_limit)
        self._modules: dict = {}  # id(module) -> (module, its compiled wrapper)
        self._update: Optional[Callable] = None

    def module(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` compiled with graph breaks allowed (one wrapper per module)."""
        if torch_compat.is_compiled_module(module):
            return module  # the user compiled it already, with their own settings
        held = self._modules.get(id(module))
        if held is None or held[0] is not module:
            held = (module, torch.compile(module, **self._settings))
            self._modules[id(module)] = held
        return held[1]

    def update(self, fn: Callable) -> Callable:
        """``fn`` (the guarded update) compiled as one graph."""
        if self._update is None:
            self._update = torch.compile(fn, fullgraph=True, **self._settings)
        return self._update

    @contextlib.contextmanager
    def activate(self):
        """Route the steps' model calls and update through these regions for the block."""
        global _ACTIVE
        previous, _ACTIVE = _ACTIVE, self
        try:
            yield self
        finally:
            _ACTIVE = previous
