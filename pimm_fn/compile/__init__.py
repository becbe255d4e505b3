"""Compiling steps.

- :mod:`.boundary`: :class:`Step` and what runs on the host around a pure core (RNG
  seeding, the host ``prepare``, the cursor);
- :mod:`.step`: :func:`compile_step` and :class:`CompiledStep`;
- :mod:`.regions`: the compiled regions of a ``fullgraph=False`` step;
- :mod:`.cache`: the disk cache of compiled steps (on by default);
- :mod:`.background`: a compile in a thread beside eager steps (``background=True``);
- :mod:`.modes`: compile modes, CUDA-graph copies, device errors;
- :mod:`.explain`: :func:`explain_step`, every graph break with its fix;
- :mod:`.hoist`: per-step scalars stored once in compiled code;
- :mod:`.isa_memo`: an opt-in memo of inductor's CPU probes;
- :mod:`.kernel_units`: a graph's CPU kernels compiled in a few translation units.

Compiling calls run on a frame stack of their own (:mod:`pimm_fn.frame_room`).

torch internals are reached only through :mod:`pimm_fn.torch_compat`.
"""
from .boundary import Step, as_step, seeded_rng
from .explain import GraphBreak, StepExplanation, explain_step
from .step import CompiledStep, compile_step, mark_point_batch_dynamic

__all__ = ["CompiledStep", "GraphBreak", "Step", "StepExplanation", "as_step", "compile_step", "explain_step",
           "mark_point_batch_dynamic", "seeded_rng"]
