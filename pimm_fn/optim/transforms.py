"""The seed's optimizers as pure transforms: sgd, adam, adamw, and gradient clipping.

Each transform reproduces the float math of torch's single-tensor (CPU default) kernels,
with scalars (lr, bias corrections, step size) computed in float64 as torch computes
them in Python floats, and rounded to the param dtype where torch's kernels round them.

``lr`` may be a number or a schedule (0-dim int64 count -> 0-dim float tensor); so may
sgd's ``momentum`` and adam's ``b1``, which torch's OneCycleLR cycles. Each transform
keeps its own ``count`` of applied updates and feeds it to its schedules: a step that a
loss scaler skips (the old state kept with ``torch.where``) does not advance them, just
as Pointcept's scheduler only sees steps whose optimizer step ran.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from ..hoist import hoist
from ..tree import global_norm, tree_leaves, tree_map
from .base import GradientTransformation, ScalarOrSchedule

__all__ = [
    "AdamState",
    "EmptyState",
    "SgdState",
    "adam",
    "adamw",
    "clip_by_global_norm",
    "sgd",
]


class EmptyState(NamedTuple):
    """The state of a transform that keeps none."""


class SgdState(NamedTuple):
    """count: updates applied (0-dim int64); momentum: buffers like the params, or None."""

    count: torch.Tensor
    momentum: Optional[Any]


class AdamState(NamedTuple):
    """count: updates applied; mu / nu: first / second moments; nu_max: amsgrad's max or None."""

    count: torch.Tensor
    mu: Any
    nu: Any
    nu_max: Optional[Any]


def _zero_count(params) -> torch.Tensor:
    leaves = tree_leaves(params)
    device = leaves[0].device if leaves else torch.device("cpu")
    return torch.zeros((), dtype=torch.int64, device=device)


def _value64(value: ScalarOrSchedule, count: torch.Tensor) -> torch.Tensor:
    """A number or schedule evaluated at ``count``, as a float64 0-dim tensor."""
    if callable(value):
        return value(count).to(torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=count.device)


def _hyper(named: dict, count: torch.Tensor) -> dict:
    """The logged hyperparameters: every one given, as float32 0-dim tensors."""
    return {k: _value64(v, count).to(torch.float32) for k, v in named.items()}


def _check_number(name: str, value, low: float = 0.0) -> None:
    if not callable(value) and not float(value) >= low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")


def sgd(
    lr: ScalarOrSchedule,
    momentum: ScalarOrSchedule = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """``torch.optim.SGD``: L2 weight decay, (Nesterov) momentum, then ``-lr * d``.

    lr, momentum: numbers or schedules. The momentum buffer starts as the first gradient
        (no dampening on that step), as in torch.
    dampening: scales the gradient's share of the buffer, ``buf = m * buf + (1 - d) * g``.
    weight_decay: L2, added to the gradient.
    """
    _check_number("lr", lr)
    _check_number("momentum", momentum)
    _check_number("weight_decay", weight_decay)
    # A scheduled momentum always keeps a buffer; a constant 0 keeps none (torch's rule).
    use_momentum = callable(momentum) or float(momentum) != 0.0
    if nesterov and (not use_momentum or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    dampening, weight_decay = float(dampening), float(weight_decay)

    def init(params):
        buf = tree_map(torch.zeros_like, params) if use_momentum else None
        return SgdState(count=_zero_count(params), momentum=buf)

    def update(grads, state, params):
        count = state.count
        lr_t = _value64(lr, count)
        if weight_decay != 0.0:
            grads = tree_map(lambda g, p: torch.add(g, p, alpha=weight_decay), grads, params)
        buf = state.momentum
        if use_momentum:
            m = _per_dtype(_value64(momentum, count))
            first = hoist(count == 0)

            def new_buf(b, g):
                blended = torch.add(b * m(b.dtype), g, alpha=1.0 - dampening)
                return torch.where(first, g, blended)

            buf = tree_map(new_buf, buf, grads)
            if nesterov:
                grads = tree_map(lambda g, b: g + b * m(b.dtype), grads, buf)
            else:
                grads = buf
        neg_lr = _per_dtype(-lr_t)
        updates = tree_map(lambda d: d * neg_lr(d.dtype), grads)
        return updates, SgdState(count=count + 1, momentum=buf)

    def hyperparams(state):
        named = {"lr": lr}
        if callable(momentum):
            named["momentum"] = momentum
        return _hyper(named, state.count)

    return GradientTransformation(init, update, hyperparams)


def _per_dtype(x64: torch.Tensor):
    """``at(dtype)``: the float64 step scalar ``x64`` rounded to ``dtype`` once, and :func:`hoist`-ed.

    Rounding where torch's kernels round it (float64 -> the param dtype) keeps torch's
    numbers; hoisting keeps the compiled element loops from recomputing it per element.
    """
    rounded: dict = {}

    def at(dtype: torch.dtype) -> torch.Tensor:
        if dtype not in rounded:
            rounded[dtype] = hoist(x64.to(dtype))
        return rounded[dtype]

    return at


def _adam(lr, b1, b2, eps, weight_decay, amsgrad, decoupled) -> GradientTransformation:
    _check_number("lr", lr)
    _check_number("b1", b1)
    _check_number("eps", eps)
    _check_number("weight_decay", weight_decay)
    if not 0.0 <= float(b2) < 1.0:
        raise ValueError(f"b2 must be in [0, 1), got {b2!r}")
    b2, eps, weight_decay = float(b2), float(eps), float(weight_decay)

    def init(params):
        zeros = lambda: tree_map(torch.zeros_like, params)  # noqa: E731
        return AdamState(
            count=_zero_count(params), mu=zeros(), nu=zeros(), nu_max=zeros() if amsgrad else None
        )

    def update(grads, state, params):
        count = state.count
        lr_t = _value64(lr, count)
        b1_t = _value64(b1, count)
        if weight_decay != 0.0 and not decoupled:
            grads = tree_map(lambda g, p: torch.add(g, p, alpha=weight_decay), grads, params)
        weight = _per_dtype(1.0 - b1_t)
        mu = tree_map(lambda m, g: torch.lerp(m, g, weight(m.dtype)), state.mu, grads)
        nu = tree_map(lambda v, g: torch.addcmul(v * b2, g, g, value=1.0 - b2), state.nu, grads)
        nu_max = state.nu_max
        if amsgrad:
            nu_max = tree_map(torch.maximum, nu_max, nu)
        # torch's non-capturable path: bias corrections and step size as Python floats
        # (float64) from the incremented step, with the CURRENT beta1 raised to it.
        t = (count + 1).to(torch.float64)
        bias_c1 = 1.0 - b1_t**t
        bias_c2 = 1.0 - b2**t
        neg_step_size = -(lr_t / bias_c1)
        bias_c2_sqrt = torch.pow(bias_c2, 0.5)
        keep = 1.0 - lr_t * weight_decay
        bias_c2_sqrt, neg_step_size, keep = map(_per_dtype, (bias_c2_sqrt, neg_step_size, keep))

        def delta(m, v, p):
            dtype = m.dtype
            denom = v.sqrt() / bias_c2_sqrt(dtype) + eps
            # addcdiv's order: (value * exp_avg) / denom.
            d = (neg_step_size(dtype) * m) / denom
            if decoupled and weight_decay != 0.0:
                # AdamW scales the param by (1 - lr * wd) before the Adam step; p * keep
                # rounds as torch's mul_ does, and subtracting p from it is exact.
                d = (p * keep(dtype) - p) + d
            return d

        updates = tree_map(delta, mu, nu_max if amsgrad else nu, params)
        return updates, AdamState(count=count + 1, mu=mu, nu=nu, nu_max=nu_max)

    def hyperparams(state):
        named = {"lr": lr}
        if callable(b1):
            named["b1"] = b1
        return _hyper(named, state.count)

    return GradientTransformation(init, update, hyperparams)


def adam(
    lr: ScalarOrSchedule,
    b1: ScalarOrSchedule = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
) -> GradientTransformation:
    """``torch.optim.Adam``: weight decay is L2, added to the gradient.

    lr, b1: numbers or schedules (b1 is what OneCycleLR cycles); b2, eps: numbers.
    amsgrad: normalise by the running maximum of the second moment.
    """
    return _adam(lr, b1, b2, eps, weight_decay, amsgrad, decoupled=False)


def adamw(
    lr: ScalarOrSchedule,
    b1: ScalarOrSchedule = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    amsgrad: bool = False,
) -> GradientTransformation:
    """``torch.optim.AdamW``: decoupled weight decay, ``p * (1 - lr * wd)`` before the step.

    Arguments as :func:`adam`; the decay uses the scheduled lr of the step.
    """
    return _adam(lr, b1, b2, eps, weight_decay, amsgrad, decoupled=True)


def clip_to_norm(grads, norm: torch.Tensor, max_norm: float):
    """``grads`` scaled by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s rule).

    norm: the gradients' global L2 norm, already computed (a step reports it as a metric).
    The one place the clipping rule lives: :func:`clip_by_global_norm` and the steps'
    shared update (:func:`pimm_fn.steps.common.guarded_update`) both call it.
    """
    coef = hoist(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return tree_map(lambda g: g * coef.to(g.device), grads)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_``: scale by ``min(1, max_norm / (norm + 1e-6))``.

    The norm is the L2 norm over all gradients. A non-finite norm makes the gradients
    non-finite, as in torch; a loss scaler then skips the step.
    """
    if not float(max_norm) > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be > 0, got {max_norm!r}")
    max_norm = float(max_norm)

    def init(params):
        return EmptyState()

    def update(grads, state, params=None):
        return clip_to_norm(grads, global_norm(grads), max_norm), state

    return GradientTransformation(init, update, None)
