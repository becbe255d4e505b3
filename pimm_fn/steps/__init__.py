"""Pure step functions built from the optim / amp / rl pieces."""
from .grpo import grpo
from .supervised import supervised

__all__ = ["grpo", "supervised"]
