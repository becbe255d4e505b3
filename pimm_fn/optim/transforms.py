"""The seed's optimizers as pure transforms: sgd, adam, adamw, and gradient clipping.

Each transform reproduces the float math of torch's single-tensor (CPU default) kernels,
with scalars (lr, bias corrections, step size) computed in float64 as torch computes
them in Python floats, and rounded to the param dtype where torch's kernels round them.
The element math runs as multi-tensor ("foreach") kernels over the leaves, one call per
op for all params of a dtype (see :func:`_foreach_leaves`): the same per-tensor kernels,
so the same numbers, without a Python-level op per leaf. Inputs are never written: an
op makes new tensors or writes in place only into tensors this update has just made.

Each transform's ``apply`` makes the new params directly (:func:`pimm_fn.optim.update_and_apply`,
which the steps use): adam / adamw give torch's params bit for bit, ``p * (1 - lr * wd)``
then ``addcdiv``. In eager code on the CPU adam / adamw ``apply`` instead runs torch's fused
kernel on copies of the params and moments (``fused=True``, the default): one pass over each
tensor instead of eight, the numbers of ``torch.optim.Adam[W](fused=True)``.
AdamW's ``update`` is the difference of those params and the old ones,
which :func:`apply_updates` turns back into them exactly wherever the step is at most the
param's own size (elsewhere to an ulp).

``lr`` may be a number or a schedule (0-dim int64 count -> 0-dim float tensor); so may
sgd's ``momentum`` and adam's ``b1``, which torch's OneCycleLR cycles. Each transform
keeps its own ``count`` of applied updates and feeds it to its schedules: a step that a
loss scaler skips (the old state kept with ``torch.where``) does not advance them, just
as Pointcept's scheduler only sees steps whose optimizer step ran.

The numbers a compiled step may take as inputs, so that changing them compiles nothing
(:mod:`pimm_fn.hyper`): ``lr``, sgd's ``momentum``, adam's ``b1``, and adamw's decoupled
``weight_decay``. The rest (``b2``, ``eps``, ``dampening``, the L2 ``weight_decay`` of sgd and
adam) are scalars of torch's kernels, written into the step.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from .. import torch_compat as F
from ..compile.hoist import hoist
from ..hyper import Hyper, prepare
from ..tree import global_norm, tree_flatten, tree_leaves, tree_map, tree_scale, tree_unflatten
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


def _zero_count(params, *hyper) -> torch.Tensor:
    """The ``count`` of no updates, on the params' device; ``hyper``'s tensors made there too."""
    leaves = tree_leaves(params)
    device = leaves[0].device if leaves else torch.device("cpu")
    prepare(hyper, device)
    return torch.zeros((), dtype=torch.int64, device=device)


def _hyper_value(value: ScalarOrSchedule) -> ScalarOrSchedule:
    """A number as a float64 schedule over a :class:`Hyper` (an input of a compiled step, so
    another number compiles nothing); a schedule unchanged."""
    if callable(value):
        return value
    h = Hyper(value=value)

    def number(count: torch.Tensor) -> torch.Tensor:
        return h.on(count.device)["value"]

    number.hypers = (h,)
    return number


def _value64(value: ScalarOrSchedule, count: torch.Tensor) -> torch.Tensor:
    """A schedule (or :func:`_hyper_value`) evaluated at ``count``, as a float64 0-dim tensor."""
    return value(count).to(torch.float64)


def _hyper(named: dict, count: torch.Tensor) -> dict:
    """The logged hyperparameters: every one given, as float32 0-dim tensors."""
    return {k: _value64(v, count).to(torch.float32) for k, v in named.items()}


def _check_number(name: str, value, low: float = 0.0, high: Optional[float] = None) -> None:
    """torch's range checks; a schedule is checked at a few steps (its start included)."""
    if callable(value):
        for step in (0, 1, 100, 10_000, 1_000_000):
            got = value(torch.tensor(step))
            if not isinstance(got, torch.Tensor):
                raise TypeError(f"{name}: a schedule returns a 0-dim tensor of the step, got {type(got).__name__} "
                                f"at step {step}; use pimm_fn.schedules (constant(x) for a fixed value) or return "
                                "torch.as_tensor(x)")
            if not (float(got) >= low and (high is None or float(got) < high)):
                raise ValueError(f"{name} must be {_bounds(low, high)} throughout: its schedule gives "
                                 f"{float(got):.6g} at step {step}")
        return
    if not (float(value) >= low and (high is None or float(value) < high)):
        raise ValueError(f"{name} must be {_bounds(low, high)}, got {value!r}")


def _bounds(low: float, high: Optional[float]) -> str:
    return f">= {low}" if high is None else f"in [{low}, {high})"


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
    logged = {"lr": _hyper_value(lr)} | ({"momentum": momentum} if callable(momentum) else {})
    lr, momentum = logged["lr"], _hyper_value(momentum)

    def init(params):
        buf = tree_map(torch.zeros_like, params) if use_momentum else None
        return SgdState(count=_zero_count(params, lr, momentum), momentum=buf)

    def update(grads, state, params):
        count = state.count
        lr_t = _value64(lr, count)
        m = _per_dtype(_value64(momentum, count)) if use_momentum else None
        neg_lr = _per_dtype(-lr_t)
        first = hoist(count == 0) if use_momentum and dampening != 0.0 else None

        def kernel(g, p, b):
            if weight_decay != 0.0:
                g = F.foreach_add(g, p, alpha=weight_decay)
            if use_momentum:
                dtype = b[0].dtype
                b = F.foreach_add_(F.foreach_mul(b, m(dtype)), g, alpha=1.0 - dampening)
                if first is not None:
                    # torch starts the buffer as the raw gradient (no dampening). Without
                    # dampening, blending into init's zero buffer already gives exactly that.
                    b = [torch.where(first, gi, bi) for gi, bi in zip(g, b)]
                g = F.foreach_add_(F.foreach_mul(b, m(dtype)), g) if nesterov else b
            return [F.foreach_mul(g, neg_lr(g[0].dtype)), b]

        trees = (grads, params if weight_decay != 0.0 else None, state.momentum if use_momentum else None)
        updates, buf = _foreach_leaves(kernel, trees, n_out=2, ref=2 if use_momentum else 0)
        return updates, SgdState(count=count + 1, momentum=buf if use_momentum else None)

    def hyperparams(state):
        return _hyper(logged, state.count)

    return GradientTransformation(init, update, hyperparams)


def _per_dtype(x64: torch.Tensor):
    """``at(dtype)``: the float64 step scalar ``x64`` rounded once to the dtype torch's kernels
    compute a ``dtype`` tensor in (the param dtype; float32 for bfloat16 / float16 params,
    whose kernels take a Python scalar as float32), and :func:`hoist`-ed.

    Rounding where torch's kernels round it keeps torch's numbers; hoisting keeps the
    compiled element loops from recomputing it per element.
    """
    rounded: dict = {}

    def at(dtype: torch.dtype) -> torch.Tensor:
        if dtype not in rounded:
            compute = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
            rounded[dtype] = hoist(x64.to(compute))
        return rounded[dtype]

    return at


def _number(value: float, like: torch.Tensor):
    """A constant operand for a foreach op over leaves like ``like``.

    Eager on the CPU: a 0-dim tensor in the op's compute dtype (float64 for float64
    leaves, else float32), the same number the op makes of a Python float, since the
    CPU foreach ops turn a Python number into a tensor once per leaf. Otherwise the number.
    """
    if like.device.type == "cpu" and F.is_plain_eager_tensor(like):
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        return torch.full((), value, dtype=dtype)
    return value


def _foreach_leaves(kernel, trees: tuple, n_out: int, ref: int = 0) -> list:
    """``kernel``'s element math over the leaves of ``trees``, as multi-tensor kernels.

    trees: same-structure trees, paired as ``tree_map`` pairs them (a mismatch raises as
        there); the first gives the results' structure; a None tree is passed as None.
    kernel(*leaf_lists) -> ``n_out`` lists of new leaves (or None). It runs once per
        group of leaves sharing the first tree's device and dtype and the ``ref`` tree's
        dtype, the dtype its scalars are rounded to: one group unless dtypes are mixed.
    Returns ``n_out`` trees (None where the kernel gave None; empty trees when there are
    no leaves, the kernel not run).
    """
    first, treedef = tree_flatten(trees[0])
    cols = [first] + [None if t is None else treedef.flatten_up_to(t) for t in trees[1:]]
    n = len(first)
    if n == 0:
        return [tree_unflatten(treedef, []) for _ in range(n_out)]
    groups: dict = {}
    for i in range(n):
        groups.setdefault((first[i].device, first[i].dtype, cols[ref][i].dtype), []).append(i)
    if len(groups) == 1:
        outs = kernel(*cols)
    else:
        outs = [None] * n_out
        for idx in groups.values():
            parts = kernel(*[None if c is None else [c[i] for i in idx] for c in cols])
            for k, part in enumerate(parts):
                if part is not None:
                    outs[k] = outs[k] or [None] * n
                    for i, leaf in zip(idx, part):
                        outs[k][i] = leaf
    return [None if out is None else tree_unflatten(treedef, out) for out in outs]


def _adam(lr, b1, b2, eps, weight_decay, amsgrad, decoupled, fused) -> GradientTransformation:
    _check_number("lr", lr)
    _check_number("b1", b1, high=1.0)
    _check_number("eps", eps)
    _check_number("weight_decay", weight_decay)
    if not 0.0 <= float(b2) < 1.0:
        raise ValueError(f"b2 must be in [0, 1), got {b2!r}")
    b2, eps, weight_decay = float(b2), float(eps), float(weight_decay)
    logged = {"lr": _hyper_value(lr)} | ({"b1": b1} if callable(b1) else {})
    lr, b1 = logged["lr"], _hyper_value(b1)
    # Whether there is a decay decides the graph; AdamW's amount is an input, Adam's L2 a kernel scalar.
    has_decay = weight_decay != 0.0
    decays = decoupled and has_decay  # AdamW's decay of the param itself
    decay = _hyper_value(weight_decay) if decays else None
    l2 = weight_decay if has_decay and not decoupled else 0.0

    def init(params):
        zeros = lambda: tree_map(torch.zeros_like, params)  # noqa: E731
        return AdamState(
            count=_zero_count(params, lr, b1, decay), mu=zeros(), nu=zeros(), nu_max=zeros() if amsgrad else None
        )

    def step(grads, state, params, new_params: bool):
        """(updates, or the new params if new_params; the new state)."""
        count = state.count
        lr_t = _value64(lr, count)
        b1_t = _value64(b1, count)
        weight = _per_dtype(1.0 - b1_t)
        # torch's non-capturable path: bias corrections and step size as Python floats
        # (float64) from the incremented step, with the CURRENT beta1 raised to it.
        t = (count + 1).to(torch.float64)
        bias_c1 = 1.0 - b1_t**t
        bias_c2 = 1.0 - b2**t
        neg_step_size = -(lr_t / bias_c1)
        bias_c2_sqrt = torch.pow(bias_c2, 0.5)
        decay_t = _value64(decay, count) if decays else None
        keep = 1.0 - lr_t * decay_t if decays else None
        bias_c2_sqrt, neg_step_size, keep = map(_per_dtype, (bias_c2_sqrt, neg_step_size, keep))
        # Eager on the CPU the step size is read as a number for addcdiv (its scalar must
        # be one), which in float32/64 rounds each op as the separate ops do.
        host_step = F.is_plain_eager_tensor(lr_t) and lr_t.device.type == "cpu"

        def fused_kernel(g, p, m, v, v_max):
            """torch's fused kernel on copies: one pass per tensor, where the separate
            kernels make eight; the numbers of ``torch.optim.Adam[W](fused=True)``."""
            new_p, mu, nu = ([x.clone() for x in xs] for xs in (p, m, v))
            nu_max = [x.clone() for x in v_max] if amsgrad else []
            wd = float(decay_t) if decays else l2
            F.fused_adam_(new_p, g, mu, nu, nu_max, float(t), lr=float(lr_t), beta1=float(b1_t), beta2=b2,
                          weight_decay=wd, eps=eps, amsgrad=amsgrad, decoupled=decoupled)
            return [new_p, mu, nu, nu_max if amsgrad else None]

        def kernel(g, p, m, v, v_max):
            dtype = m[0].dtype
            if use_fused and dtype in (torch.float32, torch.float64) and all(
                    type(x) is torch.Tensor and x.dtype == dtype for xs in (g, p) for x in xs):
                return fused_kernel(g, p, m, v, v_max)
            if l2:
                g = F.foreach_add(g, p, alpha=l2)
            mu = F.foreach_lerp(m, g, weight(dtype))
            nu = F.foreach_addcmul_(F.foreach_mul(v, _number(b2, m[0])), g, g, value=1.0 - b2)
            if amsgrad:
                v_max = F.foreach_maximum(v_max, nu)
            denom = F.foreach_div_(F.foreach_sqrt(v_max if amsgrad else nu), bias_c2_sqrt(dtype))
            F.foreach_add_(denom, _number(eps, m[0]))
            if not (decays or new_params):
                # The update is the Adam step; addcdiv's order: (value * exp_avg) / denom.
                return [F.foreach_div_(F.foreach_mul(mu, neg_step_size(dtype)), denom), mu, nu, v_max]
            # torch's new param: p (AdamW: p * (1 - lr * wd), the decay first) + the step.
            if host_step and dtype in (torch.float32, torch.float64):
                value = float(neg_step_size(dtype))
                if decays:
                    new_p = F.foreach_addcdiv_(F.foreach_mul(p, keep(dtype)), mu, denom, value=value)
                else:
                    new_p = F.foreach_addcdiv(p, mu, denom, value=value)
            else:
                new_p = F.foreach_div_(F.foreach_mul(mu, neg_step_size(dtype)), denom)
                new_p = F.foreach_add_(new_p, F.foreach_mul(p, keep(dtype)) if decays else p)
            if new_params:
                return [[n if n.dtype == q.dtype else n.to(q.dtype) for n, q in zip(new_p, p)], mu, nu, v_max]
            # The update that apply_updates turns back into new_p: exactly wherever the
            # step is at most the param's own size (then new_p - p is exact).
            return [F.foreach_sub_(new_p, p), mu, nu, v_max]

        # Eager on the CPU, new params are made by torch's fused kernel (``fused``); compiled,
        # inductor fuses the separate kernels' element math itself.
        use_fused = fused and new_params and host_step
        uses_params = has_decay or new_params
        trees = (grads, params if uses_params else None, state.mu, state.nu, state.nu_max if amsgrad else None)
        out, mu, nu, nu_max = _foreach_leaves(kernel, trees, n_out=4, ref=2)
        return out, AdamState(count=count + 1, mu=mu, nu=nu, nu_max=nu_max if amsgrad else None)

    def update(grads, state, params):
        return step(grads, state, params, new_params=False)

    def apply(grads, state, params):
        return step(grads, state, params, new_params=True)

    def hyperparams(state):
        return _hyper(logged, state.count)

    return GradientTransformation(init, update, hyperparams, apply)


def adam(
    lr: ScalarOrSchedule,
    b1: ScalarOrSchedule = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    fused: bool = True,
) -> GradientTransformation:
    """``torch.optim.Adam``: weight decay is L2, added to the gradient.

    lr, b1: numbers or schedules (b1 is what OneCycleLR cycles); b2, eps: numbers.
    amsgrad: normalise by the running maximum of the second moment.
    fused: in eager steps on the CPU, make the new params with torch's fused kernel, the
    numbers of ``torch.optim.Adam(fused=True)`` (float32 / float64 params); False: the
    separate kernels everywhere, the numbers of torch's default and foreach kernels.
    Compiled steps use the separate kernels' math either way (they differ from the fused
    kernel's in the last bit of some elements).
    """
    return _adam(lr, b1, b2, eps, weight_decay, amsgrad, decoupled=False, fused=fused)


def adamw(
    lr: ScalarOrSchedule,
    b1: ScalarOrSchedule = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    amsgrad: bool = False,
    fused: bool = True,
) -> GradientTransformation:
    """``torch.optim.AdamW``: decoupled weight decay, ``p * (1 - lr * wd)`` before the step.

    Arguments as :func:`adam`; the decay uses the scheduled lr of the step; ``fused``: the
    numbers of ``torch.optim.AdamW(fused=True)`` in eager steps on the CPU.
    """
    return _adam(lr, b1, b2, eps, weight_decay, amsgrad, decoupled=True, fused=fused)


def clip_to_norm(grads, norm: torch.Tensor, max_norm: float):
    """``grads`` scaled by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s rule).

    norm: the gradients' global L2 norm, already computed (a step reports it as a metric).
    The one place the clipping rule lives: :func:`clip_by_global_norm` and the steps'
    shared update (:func:`pimm_fn.steps.common.guarded_update`) both call it.
    """
    coef = hoist(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    if coef.device.type == "cpu" and F.is_plain_eager_tensor(coef) and bool(coef == 1.0):
        return grads  # g * 1 is g, bit for bit: eager code on the CPU skips the pass
    return tree_scale(grads, coef)


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
