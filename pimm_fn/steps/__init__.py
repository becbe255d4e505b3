"""Pure step functions built from the optim / amp / rl pieces."""
from .supervised import supervised

__all__ = ["supervised"]
