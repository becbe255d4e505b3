"""Mixed precision: an autocast policy and a dynamic loss scale held as pure state.

The loss scale reproduces ``torch.amp.GradScaler``: start at 2**16, multiply by the
growth factor after ``growth_interval`` consecutive finite steps, multiply by the
backoff factor (and reset the count) on a step with inf/NaN gradients. Whether a step
was finite is a 0-dim bool tensor, never a host branch, so it compiles and never syncs.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import attrs
import torch

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


class LossScaleState(NamedTuple):
    """The dynamic loss scale: ``scale`` (float32) and consecutive finite steps (int32)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor


@attrs.frozen
class LossScaleConfig:
    """Static settings of the dynamic loss scale (GradScaler's defaults)."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


def renamed_loss_scale(value, builder: str) -> None:
    """Reject the old ``loss_scale=`` keyword of a step builder with the fix in the message.

    A step builder's setting is ``loss_scale_config`` (growth / backoff); ``loss_scale`` is
    the state's (``TrainState.create(..., loss_scale=True)`` turns scaling on).
    """
    if value is not None:
        raise TypeError(
            f"{builder}(loss_scale=...) is now {builder}(loss_scale_config=LossScaleConfig(...)): "
            "the step holds the growth / backoff settings; whether scaling is on is the state's "
            "(TrainState.create(..., loss_scale=True))."
        )


def init_loss_scale(init_scale: float = 2.0**16, device=None) -> LossScaleState:
    """The initial loss-scale state (GradScaler's ``init_scale``)."""
    return LossScaleState(
        torch.full((), float(init_scale), dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int32, device=device),
    )


def unscale_factor(state: LossScaleState) -> torch.Tensor:
    """1/scale computed as GradScaler does (reciprocal in float64, then float32)."""
    return state.scale.double().reciprocal().float()


def update_loss_scale(state: LossScaleState, finite: torch.Tensor,
                      config: LossScaleConfig = LossScaleConfig()) -> LossScaleState:
    """Next loss-scale state after a step whose gradients were ``finite`` (0-dim bool)."""
    grown_tracker = state.growth_tracker + 1
    grow = finite & (grown_tracker >= config.growth_interval)
    grown = state.scale * config.growth_factor
    scale = torch.where(
        finite,
        # as GradScaler: a growth past float32's range keeps the scale (inf would skip every step)
        torch.where(grow & torch.isfinite(grown), grown, state.scale),
        state.scale * config.backoff_factor,
    )
    tracker = torch.where(finite & ~grow, grown_tracker, torch.zeros_like(grown_tracker))
    return LossScaleState(scale, tracker)


@attrs.frozen
class Autocast:
    """An autocast policy: the low-precision dtype and the device type it applies to.

    dtype: "bfloat16" / "float16" (or a torch dtype), or None for full precision.
    device_type: "cpu" or "cuda"; None takes it from the params at step time.
    """

    dtype: Optional[object] = "bfloat16"
    device_type: Optional[str] = None

    def torch_dtype(self) -> Optional[torch.dtype]:
        if self.dtype is None or isinstance(self.dtype, torch.dtype):
            return self.dtype
        try:
            return _DTYPES[str(self.dtype).lower()]
        except KeyError:
            raise ValueError(
                f"unknown autocast dtype {self.dtype!r}; use one of 'bfloat16', 'float16' or None"
            ) from None

    def context(self, device: torch.device):
        """The autocast context for params living on ``device``."""
        dtype = self.torch_dtype()
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type or device.type, dtype=dtype)


def as_autocast(policy) -> Optional[Autocast]:
    """Accept None, a dtype name, a torch dtype or an :class:`Autocast`."""
    if policy is None or isinstance(policy, Autocast):
        return policy
    return Autocast(dtype=policy)
