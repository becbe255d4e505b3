"""Pure step functions built from the optim / amp / rl pieces.

``steps.supervised`` and ``steps.grpo`` are the step builders; ``steps.Rollout`` and
``steps.with_reference`` are GRPO's rollout record and reference-policy setup;
``steps.data_parallel`` / ``steps.wrap_step`` (module ``steps.parallel``) make a step
data-parallel. (The name ``grpo`` here is the builder, which shadows the submodule:
import the module's other names as ``from pimm_fn.steps.grpo import ...``.)
"""
from .grpo import Rollout, grpo, with_reference
from .parallel import data_parallel, wrap_step
from .supervised import supervised

__all__ = ["Rollout", "grpo", "supervised", "with_reference", "data_parallel", "wrap_step"]
