"""TrainState: everything needed to continue a run, and nothing else.

The state is an immutable attrs class registered as an optree pytree (namespace
``pimm_fn``). Tensor leaves: ``step``, ``params``, ``buffers``, ``opt_state`` and the
loss-scale state, all on one device (``state.device``; see ``TrainState.create(device=)``).
Host leaves (plain ints, never passed into a compiled graph, on no device): the RNG key
and the data cursor. Static fields, kept out of the leaves: the model, a structure-only
copy of the user's module (:func:`structure_only`: its weights on ``meta``, so the state
holds one copy of them, its leaves), called only through ``torch.func.functional_call``;
and the optimizer transform.

``replace`` builds the new object with ``object.__new__`` + ``__dict__.update`` because
attrs' frozen ``__init__`` / ``evolve`` go through ``object.__setattr__``, which dynamo
cannot trace on torch 2.13 (see DESIGN.md); this way ``replace`` works inside
``torch.compile(fullgraph=True)``.

Subclasses are supported: ``@attrs.frozen(slots=False) class MyState(TrainState)`` may add
fields; they are leaves like ``extra`` (saved by checkpoints, passed to compiled steps),
and ``replace`` / tree_map / checkpoint restore keep the subclass.
"""
from __future__ import annotations

import copy
import numbers
import weakref
from typing import Any, Optional

import attrs
import optree
import torch

from ._devices import same_device
from .torch_compat import uncompiled_module
from .tree import NAMESPACE, tree_map


def _replace(obj, changes: dict):
    """A copy of the frozen attrs instance ``obj`` (same class) with ``changes``: the one
    replace of :class:`TrainState`, :class:`Cursor` and :class:`RngKey`, traceable by dynamo."""
    fields = obj.__dict__
    for name in changes:
        if name not in fields:
            raise TypeError(
                f"{type(obj).__name__}.replace() got unknown field(s) {sorted(set(changes) - set(fields))}; "
                f"valid fields: {sorted(fields)}"
            )
    new = object.__new__(type(obj))
    new_fields = new.__dict__
    new_fields.update(fields)
    new_fields.update(changes)
    return new


@attrs.frozen(slots=False)
class Cursor:
    """Where the run is in its data: host integers, advanced by ``fit``, not by steps.

    epoch: the epoch being trained (0-based).
    position: batches of this epoch already consumed.
    seed: the run's data seed, kept with its position for the driver that builds the loader
        (``build_train_loader(..., seed=cursor.seed)``): the loaders' order is a pure function
        of (their seed, epoch, rank, world_size), so (seed, epoch, position) positions them
        exactly. fit does not read it; a loader's saved state checks its own seed on resume.
    samples_seen: samples consumed by the run over all ranks.
    """

    epoch: int = 0
    position: int = 0
    seed: int = 0
    samples_seen: int = 0

    def replace(self, **changes) -> "Cursor":
        return _replace(self, changes)


def _check_optimizer(optimizer) -> None:
    if callable(getattr(optimizer, "init", None)):  # (a state built only to restore into needs no update)
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"TrainState.create takes a pimm_fn optimizer, a pure transform such as pimm_fn.optim.adamw(1e-3), "
            f"got torch's {type(optimizer).__name__}, which keeps its state inside and updates the module in "
            "place; a torch optimizer's saved state carries over with pimm_fn.optim.from_torch_state_dict")
    if callable(optimizer):
        name = getattr(optimizer, "__name__", type(optimizer).__name__)
        example = f", e.g. pimm_fn.optim.{name}(1e-3)" if name in ("adam", "adamw", "sgd") else ""
        raise TypeError(f"TrainState.create got the function {name}, not an optimizer: call it{example}")
    raise TypeError(f"TrainState.create needs an optimizer such as pimm_fn.optim.adamw(1e-3), got "
                    f"{type(optimizer).__name__}")


def _warn_requires_grad_off(model: torch.nn.Module, optimizer) -> None:
    # torch's optimizers skip a parameter with requires_grad=False (Pointcept freezes a
    # backbone that way); pimm_fn trains what state.params holds unless the optimizer freezes it.
    off = [k for k, p in model.named_parameters() if not p.requires_grad]
    if not off:
        return
    from .optim.base import frozen_names

    trained = sorted(set(off) - frozen_names(optimizer, [k for k, _ in model.named_parameters()]))
    if trained:
        from .user_warning import warn

        shown = ", ".join(repr(k) for k in trained[:4]) + (f" ... ({len(trained)} in all)" if len(trained) > 4 else "")
        n = len(trained)
        warn(f"{n} parameter{'s' if n > 1 else ''} of {type(model).__name__} {'have' if n > 1 else 'has'} "
             f"requires_grad=False ({shown}), but pimm_fn "
             "trains every parameter in state.params: to keep them fixed as torch would, build the optimizer "
             "with pimm_fn.optim.freeze(tx, names); to train them, set requires_grad back to True",
             UserWarning)


@attrs.frozen(slots=False)
class RngKey:
    """A counter-based RNG key held on the host (JAX-style: each step consumes one key).

    The step wrapper seeds torch's generator from ``(seed, counter)`` before a step runs
    and hands back the key with ``counter + 1``, so dropout and sampling are a pure
    function of the state: the same state and batch give the same result, eager or
    compiled, and a restored state continues the exact random stream.
    """

    seed: int = 0
    counter: int = 0

    def step_seed(self) -> int:
        """The 63-bit seed for the step that consumes this key (splitmix64 mix)."""
        z = (self.seed * 0x9E3779B97F4A7C15 + self.counter + 1) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF

    def next(self) -> "RngKey":
        return _replace(self, {"counter": self.counter + 1})

    def replace(self, **changes) -> "RngKey":
        return _replace(self, changes)


@attrs.frozen(slots=False, eq=False)
class TrainState:
    """The immutable training state. Create it with :meth:`TrainState.create`.

    step: 0-dim int64 tensor, the number of step calls applied to this state (a step
        skipped for non-finite gradients still counts here; the optimizer's own count,
        which drives schedules, lives in ``opt_state`` and does not advance).
    params / buffers: dicts name -> tensor, named as ``named_parameters`` /
        ``named_buffers`` name them.
    opt_state: the optimizer transform's state (a pytree of tensors).
    loss_scale: :class:`pimm_fn.amp.LossScaleState` or None when loss scaling is off.
    rng: :class:`RngKey`; cursor: :class:`Cursor`.
    model / tx: static; a structure-only copy of the module (:func:`structure_only`:
        parameters and buffers on ``meta``, train/eval flags as the module had them; a
        ``torch.compile``'d module stays compiled, its tensors named as the plain
        module's) and the :class:`pimm_fn.optim.GradientTransformation`. Call the model
        with ``functional_call(state.model, (state.params, state.buffers), args)``, or
        ``state.eval_model`` for eval mode.
    extra: a dict of further tensor pytrees a step function keeps in the state (for
        example GRPO's frozen reference-policy params). Empty for supervised training.
    """

    step: torch.Tensor
    params: dict
    buffers: dict
    opt_state: Any
    loss_scale: Any
    rng: RngKey
    cursor: Cursor
    model: Any = attrs.field(repr=False)
    tx: Any = attrs.field(repr=False)
    extra: dict = attrs.field(factory=dict)

    def replace(self, **changes) -> "TrainState":
        """A new state with ``changes``; traceable inside ``torch.compile(fullgraph=True)``.

        New ``params`` must name the same tensors as the old (the optimizer state is keyed by
        them), unless the same call replaces ``opt_state`` too (model surgery that keeps step,
        rng and cursor)."""
        params = changes.get("params")
        if isinstance(params, dict) and "opt_state" not in changes and isinstance(self.params, dict) \
                and params.keys() != self.params.keys():
            missing, extra = sorted(self.params.keys() - params.keys()), sorted(params.keys() - self.params.keys())
            raise ValueError(
                f"TrainState.replace(params=...) names other parameters than the state: missing {missing[:5]}, "
                f"not in the state {extra[:5]} (first five of each); keep every key (the optimizer state is "
                "keyed by them), replace opt_state in the same call, or build a new state with TrainState.create")
        return _replace(self, changes)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("__slots__"):
            raise TypeError(
                f"{cls.__name__}: a TrainState subclass keeps its fields in __dict__ (replace() copies "
                "it, traceably); declare it with @attrs.frozen(slots=False)")
        _register(cls)

    @property
    def eval_model(self) -> torch.nn.Module:
        """``model`` in eval mode: a second structure-only copy (see :func:`eval_module`)."""
        return eval_module(self.model)

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        optimizer,
        *,
        loss_scale=None,
        seed: int = 0,
        data_seed: Optional[int] = None,
        extra: Optional[dict] = None,
        device=None,
    ) -> "TrainState":
        """Build the initial state from a module and a transform.

        The params and buffers are detached copies and ``state.model`` is a structure-only
        copy of ``model``: later changes to ``model`` do not touch the state, the state
        never writes into ``model``, and ``model`` may be deleted to free its weights.
        loss_scale: None (off), True (the default dynamic scale: init 2**16, growth 2
            every 2000 finite steps, backoff 0.5) or a ready ``LossScaleState``.
        seed: the RNG key's seed; data_seed: the cursor's seed (defaults to ``seed``).
        device: where the state lives. None: the model's device (all its parameters and
            buffers must be on one). Given: the state's copies are made there (the model
            itself is not moved). Every tensor of the state (step, params, buffers,
            optimizer state, loss scale, ``extra``) is on this one device; the RNG key and
            cursor are host integers on any device, so a checkpoint resumes bitwise
            wherever it is restored.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TrainState.create needs an nn.Module, got {type(model).__name__}")
        _check_optimizer(optimizer)
        for label, value in (("seed", seed), ("data_seed", data_seed)):
            integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            if not integer and (value is not None or label == "seed"):
                raise TypeError(f"TrainState.create: {label} must be an int, got {value!r}")
        if not (loss_scale is None or isinstance(loss_scale, bool) or hasattr(loss_scale, "_fields")):
            raise TypeError(f"TrainState.create: loss_scale must be None, True, False or a LossScaleState, "
                            f"got {loss_scale!r}")
        # A torch.compile'd module: the state names its tensors as the plain module does
        # (no "_orig_mod." prefix), so checkpoints load into the plain model.
        plain = uncompiled_module(model)
        device = model_device(plain) if device is None else torch.device(device)
        params = {k: _copy_to(v, device) for k, v in plain.named_parameters()}
        if not params:
            raise ValueError(f"{type(plain).__name__} has no parameters to train")
        buffers = {k: _copy_to(v, device) for k, v in plain.named_buffers()}
        _warn_requires_grad_off(plain, optimizer)
        opt_state = optimizer.init(params)
        if loss_scale is True:
            from .amp import init_loss_scale

            loss_scale = init_loss_scale(device=device)
        elif loss_scale is False:
            loss_scale = None
        elif loss_scale is not None:  # a ready LossScaleState (a NamedTuple of tensors)
            loss_scale = tree_map(lambda t: t.to(device), loss_scale)
        extra = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, dict(extra or {}))
        state = cls(
            step=torch.zeros((), dtype=torch.int64, device=device),
            params=params,
            buffers=buffers,
            opt_state=opt_state,
            loss_scale=loss_scale,
            rng=RngKey(seed=int(seed), counter=0),
            cursor=Cursor(seed=int(seed if data_seed is None else data_seed)),
            model=structure_only(model),
            tx=optimizer,
            extra=extra,
        )
        check_one_device(state, device)
        return state

    @property
    def device(self) -> torch.device:
        """The device the state's tensors live on (that of its parameters)."""
        return next(iter(self.params.values())).device


def _copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A copy in every case: the state never shares storage with the module.
    t = t.detach()
    return t.clone() if t.device == device else t.to(device, copy=True)


def model_device(model: torch.nn.Module) -> torch.device:
    """The one device of ``model``'s parameters and buffers; ValueError naming them if several."""
    where: dict = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        where.setdefault(t.device, []).append(name)
    if not where:
        return torch.device("cpu")
    if len(where) > 1:
        listing = "; ".join(f"{d}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                            for d, names in where.items())
        raise ValueError(
            f"{type(model).__name__} has tensors on {len(where)} devices ({listing}); a TrainState "
            "lives on one device: move the model with model.to(device) first, or pass "
            "TrainState.create(..., device=...)"
        )
    return next(iter(where))


def check_one_device(state: "TrainState", device: torch.device) -> None:
    """Raise ValueError naming the state's tensors that are not on ``device``."""
    want = torch.device(device)
    off = []
    fields = {f: getattr(state, f) for f in _leaf_fields(type(state)) if f not in ("rng", "cursor")}
    accessors, leaves, _ = optree.tree_flatten_with_accessor(fields, none_is_leaf=False, namespace=NAMESPACE)
    for accessor, leaf in zip(accessors, leaves):
        if isinstance(leaf, torch.Tensor) and not same_device(leaf.device, want):
            path = accessor.codify("")  # "['opt_state'].mu['w']": the field reads as an attribute
            field = path[2:path.index("']")]
            off.append(f"state.{field}{path[len(field) + 4:]} on {leaf.device}")
    if off:
        raise ValueError(
            f"the state's tensors must all be on {want}, but {len(off)} are not ({'; '.join(off[:4])}"
            f"{' ...' if len(off) > 4 else ''}): an optimizer's init or an extra entry made them "
            "elsewhere; create them like the params (torch.zeros_like(p)) or pass device= to TrainState.create"
        )


def structure_only(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with its parameters and buffers on ``meta``: the structure,
    hyperparameters and train/eval flags, none of the weights (which the state holds once,
    as its leaves). ``model`` itself is not touched.

    The copy is ``copy.deepcopy`` with every parameter and buffer mapped to an empty
    ``meta`` tensor of its shape, dtype and ``requires_grad``, so tied weights stay tied. A
    tensor the module keeps outside its parameters and buffers (a constant its forward
    reads) is copied as it is: ``functional_call`` supplies only parameters and buffers.
    A ``torch.compile``'d module comes back compiled (same settings), around the copy.
    """
    plain = uncompiled_module(model)
    memo: dict = {}
    for t in (*plain.parameters(), *plain.buffers()):
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
    try:
        return copy.deepcopy(model, memo)
    except Exception as err:
        raise TypeError(
            f"TrainState keeps a structure-only copy of the model (copy.deepcopy with the weights on "
            f"meta), and {type(plain).__name__} could not be copied: {type(err).__name__}: {err}. Keep "
            "objects that cannot be deep-copied (open files, locks, loaders) out of the module"
        ) from err


# model -> its eval-mode structure copy; weak keys: the entry goes with the last state.
_EVAL_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def eval_module(model: torch.nn.Module) -> torch.nn.Module:
    """A structure-only copy of ``model`` with every submodule in eval mode, made once per model.

    Eval mode is a second handle rather than ``model.eval()`` / ``model.train()`` around
    the call: the state's module is shared by every state derived from it and by compiled
    steps that guard on its flags, so flipping them would be a mutation another thread or
    a compiled step could observe. The copy holds no weights, so it costs no memory.
    """
    copied = _EVAL_COPIES.get(model)
    if copied is None:
        copied = _EVAL_COPIES[model] = structure_only(model).eval()
    return copied


_STATIC_FIELDS = ("model", "tx")
_LEAF_FIELDS: dict = {}  # TrainState class -> its leaf field names, in declaration order


def _leaf_fields(cls) -> tuple:
    names = _LEAF_FIELDS.get(cls)
    if names is None:  # read on first use: attrs declares a subclass's fields after __init_subclass__
        names = _LEAF_FIELDS[cls] = tuple(f.name for f in attrs.fields(cls) if f.name not in _STATIC_FIELDS)
    return names


def _register(cls) -> None:
    def flatten(s):
        names = _leaf_fields(type(s))
        return tuple(getattr(s, f) for f in names), (s.model, s.tx), names

    def unflatten(static, children):
        new = object.__new__(cls)
        new.__dict__.update(zip(_leaf_fields(cls), children))
        new.__dict__["model"], new.__dict__["tx"] = static
        return new

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)


_register(TrainState)
optree.register_pytree_node(
    Cursor,
    lambda c: ((c.epoch, c.position, c.seed, c.samples_seen), None, ("epoch", "position", "seed", "samples_seen")),
    lambda _, ch: Cursor(*ch),
    namespace=NAMESPACE,
)
optree.register_pytree_node(
    RngKey,
    lambda r: ((r.seed, r.counter), None, ("seed", "counter")),
    lambda _, ch: RngKey(*ch),
    namespace=NAMESPACE,
)
