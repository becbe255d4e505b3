"""Pieces shared by step functions: the functional forward/backward and metric helpers."""
from __future__ import annotations

from typing import Any, Callable, Collection, Optional, Sequence

import torch
from torch.func import functional_call

from .. import torch_compat
from ..amp import LossScaleConfig, unscale_factor, update_loss_scale
from ..compile import regions as compile_regions
from ..compile.hoist import hoist
from ..optim.base import frozen_names, update_and_apply
from ..optim.transforms import clip_to_norm
from ..tree import all_finite, global_norm, tree_map, tree_scale, tree_where


class MissingLossError(KeyError):
    """The model's output has no ``"loss"`` entry."""

    def __str__(self):  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def module_call(model: torch.nn.Module, params: dict, buffers: dict, args: tuple, kwargs=None):
    """``model(*args)`` through ``functional_call`` with the state's params and buffers.

    The state names tensors as the plain module does; a ``torch.compile``'d module is called
    with its wrapper's names. Inside a graph-tolerant compiled step
    (``compile_step(fullgraph=False)``) the module is called compiled.
    """
    regions = compile_regions.active()
    if regions is not None:
        model = regions.module(model)
    if torch_compat.is_compiled_module(model):
        params = {"_orig_mod." + k: v for k, v in params.items()}
        buffers = {"_orig_mod." + k: v for k, v in buffers.items()}
    return functional_call(model, (params, buffers), args, kwargs)


def call_model(model: torch.nn.Module, params: dict, buffers: dict, batch, autocast=None):
    """``model(batch)`` through :func:`module_call` with the given params and buffers."""
    ctx = autocast.context(next(iter(params.values())).device) if autocast is not None else None
    if ctx is None:
        return module_call(model, params, buffers, (batch,))
    with ctx:
        return module_call(model, params, buffers, (batch,))


def require_loss(out, loss_key: str = "loss") -> torch.Tensor:
    """The scalar loss from a Pointcept-style output dict, with a clear error if absent."""
    if not isinstance(out, dict):
        raise MissingLossError(
            f"the model returned {type(out).__name__}; a step needs model(batch) to return a "
            f"dict with a {loss_key!r} entry (Pointcept's convention) in training"
        )
    if loss_key not in out:
        raise MissingLossError(
            f"the model's output has no {loss_key!r} entry (keys: {sorted(out)}); return the "
            f"training loss as out[{loss_key!r}] or build the step with loss_key=<your key>"
            " (models compute their loss only when the batch holds their labels: is the label key missing?)"
        )
    return out[loss_key]


def check_labels(model, batch) -> None:
    """Raise MissingLossError naming the label key when ``model`` declares one (``label_key``)
    and a training batch lacks it: such a model returns no loss, and the step would fail on that."""
    key = getattr(model, "label_key", None)
    batches = batch if isinstance(batch, (list, tuple)) else (batch,)
    for b in batches:
        if key is not None and isinstance(b, dict) and key not in b:
            raise MissingLossError(
                f"the batch has no {key!r} entry, the labels {type(model).__name__} computes its loss from "
                f"(batch keys: {sorted(b)}); a training batch needs them: keep {key!r} in the dataset's "
                "samples and the collate function (an evaluation batch without labels goes to the model, "
                "not to a training step)"
            )


def value_and_grad(fn: Callable, params: dict, *, frozen: Collection[str] = (),
                   scale: Optional[torch.Tensor] = None):
    """``fn(params) -> (value, aux)`` and the gradient of ``value * scale`` (of ``value``
    when ``scale`` is None) with respect to the params not in ``frozen``.

    Returns ``(value.detach(), aux, grads)``; ``grads`` has a (detached) tensor for every
    param not frozen, zeros where ``value`` does not depend on it. Uses
    ``torch.autograd.grad`` over fresh detached leaves rather than ``torch.func.grad``:
    it lets BatchNorm update its (cloned) running statistics under
    ``torch.compile(fullgraph=True)``. ``params`` is not mutated.
    """
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items() if k not in frozen}
    inputs = {k: leaves[k] if k in leaves else v.detach() for k, v in params.items()} if frozen else leaves
    value, aux = fn(inputs)
    objective = value if scale is None else value * scale
    grads = torch.autograd.grad(objective, list(leaves.values()), allow_unused=True)
    grads = {k: (g if g is not None else torch.zeros_like(params[k])).detach() for k, g in zip(leaves, grads)}
    return value.detach(), aux, grads


def forward_backward(model, params: dict, buffers: dict, batch, *, scale: Optional[torch.Tensor] = None,
                     autocast=None, loss_key: str = "loss", frozen: Collection[str] = ()):
    """Loss, output dict, gradients (of ``loss * scale``, :func:`value_and_grad`) and the
    updated buffers of ``model(batch)``. Neither ``params`` nor ``buffers`` is mutated.

    frozen: param names to compute no gradient for (``requires_grad=False``; the
    optimizer's :func:`pimm_fn.optim.frozen_names`); they are absent from the gradients.
    """
    new_buffers = {k: v.clone() for k, v in buffers.items()}

    def loss_of(inputs):
        out = call_model(model, inputs, new_buffers, batch, autocast)
        if isinstance(out, dict) and loss_key not in out:
            check_labels(model, batch)  # name the missing label rather than the missing loss
        return require_loss(out, loss_key).float(), out

    loss, out, grads = value_and_grad(loss_of, params, frozen=frozen, scale=scale)
    return loss, out, grads, new_buffers


def scalar_metrics(out: dict, skip: Sequence[str] = ()) -> dict:
    """The 0-dim (or 1-element) tensor entries of a model output, detached, as float32."""
    metrics = {}
    if isinstance(out, dict):
        for k, v in out.items():
            # guard_or_true: a point count the compiler holds as unknown (unbacked) counts as
            # "not one element" without a guard, which it could not evaluate.
            if k in skip or not isinstance(v, torch.Tensor) or torch_compat.guard_or_true(v.numel() != 1):
                continue
            metrics[k] = v.detach().float().reshape(())
    return metrics


def update_metrics(out: dict, loss: torch.Tensor, tx, opt_state, grad_norm: torch.Tensor,
                   finite: torch.Tensor, scaler=None, loss_key: str = "loss") -> dict:
    """The metrics every gradient step reports: the model's scalars, ``loss``, the
    optimizer's hyperparameters (lr, ...), ``grad_norm``, ``skipped`` and, with a loss
    scaler, ``loss_scale``."""
    metrics = scalar_metrics(out, skip=(loss_key,))
    metrics["loss"] = loss
    if tx.hyperparams is not None:
        for k, v in tx.hyperparams(opt_state).items():
            metrics[k] = v.detach().float().reshape(())
    metrics["grad_norm"] = grad_norm
    metrics["skipped"] = (~finite).float()
    if scaler is not None:
        metrics["loss_scale"] = scaler.scale
    return metrics


def point_batch_stats(batch) -> dict:
    """``avg_pts`` (points per cloud) for a point batch with an ``offset`` entry."""
    if isinstance(batch, dict) and isinstance(batch.get("offset"), torch.Tensor) and batch["offset"].numel() > 0:
        offset = batch["offset"]
        return {"avg_pts": offset[-1].float() / offset.shape[0]}
    return {}


def applied_buffers(applied: torch.Tensor, new: dict, old: dict) -> dict:
    """The buffers after a step: the updated ones if the step was applied, else ``old`` exactly.

    applied: 0-dim bool (the step's finite check). A skipped step leaves every buffer as
    it was, BatchNorm's ``num_batches_tracked`` included (with ``momentum=None`` it sets
    the running average's weight). An applied step still keeps the old value of any
    buffer that went non-finite (a NaN batch must not poison BN).
    """
    return {k: torch.where(applied & torch.isfinite(new[k]).all(), new[k], old[k]) for k in new}


def check_clip_grad(clip_grad: Optional[float]) -> Optional[float]:
    """``clip_grad`` as a float, or None; refuses 0, negatives and NaN when the step is
    built (a clip of 0 would zero every update without a word)."""
    if clip_grad is None:
        return None
    if isinstance(clip_grad, bool) or not float(clip_grad) > 0:
        raise ValueError(f"clip_grad must be a max gradient norm > 0 or None (no clipping), got {clip_grad!r}")
    return float(clip_grad)


def guarded_update(tx, params: dict, opt_state, grads: dict, *, loss: Optional[torch.Tensor] = None,
                   scaler=None, scaler_config: LossScaleConfig = LossScaleConfig(),
                   clip_grad: Optional[float] = None, grad_transform: Optional[Callable] = None,
                   grad_check: Optional[Callable] = None):
    """The update kernel: one optimizer update behind the engine's guards. Every step
    (supervised, GRPO, sharded, a user's own) applies its gradients through this, so
    gradient transforms, the finite guard, clipping and loss scaling live in one place.

    In order: unscale by the loss scale (``scaler``: the state's LossScaleState, or None),
    ``grad_transform`` (e.g. the data-parallel all-reduce, or the sharded step's
    reduce-scatter), the global norm and finite check over the gradients (and ``loss``),
    global-norm clipping to ``clip_grad``, the optimizer ``tx``
    (:func:`pimm_fn.optim.update_and_apply`); gradients of params ``tx`` freezes
    (:func:`pimm_fn.optim.freeze`) are dropped first, or may be absent;
    where the check failed the old params and optimizer state are kept and the scale backs
    off (``torch.amp.GradScaler``'s rule). ``grad_check``: ``grads -> (global norm, all
    finite)`` in place of the local ones, for gradients sharded over ranks (every rank must
    clip and skip alike). Returns ``(params, opt_state, finite, grad_norm, new_scaler)``;
    ``finite`` is the 0-dim bool a step also gates its buffers with.
    Inside ``compile_step(fullgraph=False)`` it runs as one compiled graph.
    """
    regions = compile_regions.active()
    update = _guarded_update if regions is None else regions.update(_guarded_update)
    return update(tx, params, opt_state, grads, loss=loss, scaler=scaler, scaler_config=scaler_config,
                  clip_grad=clip_grad, grad_transform=grad_transform, grad_check=grad_check)


def _guarded_update(tx, params, opt_state, grads, *, loss, scaler, scaler_config, clip_grad, grad_transform,
                    grad_check):
    frozen = frozen_names(tx, params)
    if frozen:  # params the optimizer never changes: out of the norm, the finite check and clipping
        grads = {k: g for k, g in grads.items() if k not in frozen}
    if scaler is not None:
        grads = tree_scale(grads, hoist(unscale_factor(scaler)))
    if grad_transform is not None:
        grads = grad_transform(grads)
    if grad_check is None:
        grad_norm = global_norm(grads)
        finite = all_finite(grads, norm=grad_norm)
    else:
        grad_norm, finite = grad_check(grads)
    if loss is not None:
        finite = finite & torch.isfinite(loss)
    finite = hoist(finite)  # read by every leaf's select below
    if clip_grad is not None:
        grads = clip_to_norm(grads, grad_norm, clip_grad)
    new_params, new_opt = update_and_apply(tx, grads, opt_state, params)
    params = tree_where(finite, new_params, params)
    opt_state = tree_where(finite, new_opt, opt_state)
    new_scaler = update_loss_scale(scaler, finite, scaler_config) if scaler is not None else None
    return params, opt_state, finite, grad_norm, new_scaler


def weighted_sum(trees: Sequence[Any], weights: Sequence[torch.Tensor]):
    """``sum_i w_i * tree_i`` leafwise."""
    total = tree_map(lambda t: t * weights[0], trees[0])
    for tree, w in zip(trees[1:], weights[1:]):
        total = tree_map(lambda a, t, w=w: a + t * w, total, tree)
    return total


def eval_forward(state, batch):
    """``model(batch)`` with the state's params in eval mode (BatchNorm uses running stats),
    under no grad. Eval mode comes from ``state.eval_model``, a second structure-only copy:
    the state's own module is never switched (see :func:`pimm_fn.state.eval_module`)."""
    with torch.no_grad():
        return module_call(state.eval_model, state.params, state.buffers, (batch,))
