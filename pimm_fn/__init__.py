"""pimm_fn: a functional, JAX-style training engine for point-cloud models on PyTorch."""
from .state import Cursor, RngKey, TrainState

__all__ = ["Cursor", "RngKey", "TrainState"]
