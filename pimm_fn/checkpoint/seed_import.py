"""Import a seed / Pointcept checkpoint (a pickle, or its loaded dict) into a TrainState.

Pickles are loaded with ``torch.load(weights_only=True)``: plain tensors and containers
only. A pickle that needs more is refused with :class:`UnsafeCheckpointError`, unless the
caller says ``trust_pickle=True`` (which runs the pickle's code).
"""
from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch

from ..state import TrainState
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, UnsafeCheckpointError, _listing
from .format import _looks_like_pickle, _parse
from .locate import _not_found


def _load_pickle(path: Path, trust_pickle: bool):
    if not path.exists():
        raise _not_found(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) == 8 and not _looks_like_pickle(head):
        try:
            _parse(path)
        except CheckpointError:
            pass
        else:
            raise CheckpointError(
                f"{path} is a pimm_fn checkpoint; load it with restore(), not import_seed_checkpoint()"
            )
    if trust_pickle:
        warnings.warn(f"unpickling {path} with trust_pickle=True: code in the file runs", stacklevel=3)
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights only load failed" not in str(e).lower() and "unsupported" not in str(e).lower():
            raise CheckpointCorruptError(f"{path} is truncated or corrupt: {first}") from None
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:
            names = []
        listed = f" It references: {', '.join(names[:10])}." if names else ""
        raise UnsafeCheckpointError(
            f"refused to load {path}: it is a pickle that needs more than plain tensors and "
            f"containers to load, and unpickling it could run code from the file.{listed} "
            "If you trust where it came from, pass trust_pickle=True (this runs the pickle's "
            "code), or re-save it from a trusted session with only tensors, numbers and "
            f"containers. (torch.load said: {first})"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CheckpointCorruptError(
            f"{path} is truncated or corrupt and cannot be read as a torch checkpoint: {type(e).__name__}: {e}"
        ) from None


def _rename_fn(rename) -> Callable[[str], str]:
    if rename is None:
        return lambda k: k
    if callable(rename):
        return rename
    pairs = list(rename.items())

    def apply(key: str) -> str:
        for old, new in pairs:
            if old in key:
                key = key.replace(old, new)
        return key

    return apply


def _seed_count(ckpt: Mapping, optimizer_sd: Mapping) -> Optional[int]:
    """The update count to give the interop, or None when the torch state carries it.

    Adam / AdamW save ``step`` per param; SGD does not, and then Pointcept's scheduler
    ``last_epoch`` is the count (Pointcept skips the scheduler on the same inf/NaN steps
    as the optimizer, as pimm_fn's count does), else ``global_step``.
    """
    if any(isinstance(e, Mapping) and "step" in e for e in optimizer_sd.get("state", {}).values()):
        return None
    sched = ckpt.get("scheduler")
    if isinstance(sched, Mapping) and sched.get("last_epoch") is not None:
        return int(sched["last_epoch"])
    if ckpt.get("global_step") is not None:
        return int(ckpt["global_step"])
    return None


def _import_optimizer_state(optimizer_sd: Mapping, template: Any, count: Optional[int], importer) -> Any:
    """Adapter to the torch-optim interop; the new opt_state, or None when unavailable.

    ``importer(state_dict, template, count=...)`` wins; by default
    ``pimm_fn.optim.torch_interop.from_torch_state_dict`` is imported lazily, so params /
    buffers / counters still import where that module is missing.
    """
    if importer is None:
        try:
            from ..optim.torch_interop import from_torch_state_dict as importer
        except ImportError as e:
            warnings.warn(
                f"optimizer state not imported ({e}); the optimizer state starts fresh. "
                "Pass optimizer_importer= to convert it yourself.",
                stacklevel=3,
            )
            return None
    return importer(optimizer_sd, template, count=count)


def import_seed_checkpoint(
    path_or_dict: Union[str, os.PathLike, Mapping],
    like: TrainState,
    *,
    rename: Union[Mapping[str, str], Callable[[str], str], None] = None,
    strict: bool = False,
    resume: bool = True,
    trust_pickle: bool = False,
    optimizer_importer: Optional[Callable] = None,
) -> TrainState:
    """Import a seed / Pointcept checkpoint (or a bare state_dict) into a TrainState.

    path_or_dict: a ``.pth`` file (loaded with ``torch.load(weights_only=True)``) or the
        loaded dict: ``state_dict`` (keys may carry DDP's ``module.`` prefix), optionally
        ``optimizer``, ``scheduler``, ``scaler``, ``epoch`` (and ``start_iter``,
        ``global_step``, ``samples_seen`` when present). A mapping of tensors without
        ``state_dict`` is taken as the state_dict itself.
    like: the TrainState to fill (model structure, optimizer, devices, dtypes).
    rename: ``{old: new}`` substring replacements applied in order to every key after
        ``module.`` is stripped (Pointcept's checkpoint-loader keywords -> replacement), or a function.
    strict: raise on any missing / unexpected / shape-mismatched key instead of warning.
    resume: also import optimizer, scaler and counters; False imports weights only.
    trust_pickle: unpickle fully (runs code from the file); only for trusted files.
    optimizer_importer: ``f(torch_state_dict, template_opt_state, count=n) -> opt_state``
        in place of :func:`pimm_fn.optim.torch_interop.from_torch_state_dict` (which maps
        torch's param groups, in order, onto the transform's groups; ``like.tx`` must be
        built with Pointcept's optimizer and groups). ``count`` is None for Adam / AdamW
        (their ``step`` is used), else the scheduler's ``last_epoch`` or ``global_step``.
    The scheduler's own state is not imported: pimm_fn schedules are functions of the
    update count in the optimizer state (its ``last_epoch`` only supplies SGD's count).
    """
    if isinstance(path_or_dict, Mapping):
        ckpt = path_or_dict
        source = "the given dict"
    else:
        source = str(path_or_dict)
        ckpt = _load_pickle(Path(path_or_dict), trust_pickle)
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(f"{source} holds a {type(ckpt).__name__}, not a checkpoint dict")
    if "state_dict" in ckpt:
        sd = ckpt["state_dict"]
    elif ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        sd, ckpt = ckpt, {}
    else:
        raise CheckpointError(
            f"{source} has no 'state_dict' and is not a state_dict itself; its keys: {sorted(map(str, ckpt))[:20]}"
        )

    if not isinstance(sd, Mapping):
        raise CheckpointError(f"{source}: 'state_dict' holds a {type(sd).__name__}, not a mapping of tensors")
    fix = _rename_fn(rename)
    incoming: dict = {}
    for key, value in sd.items():
        new = key[len("module.") :] if key.startswith("module.") else key
        incoming[fix(new)] = value

    params, buffers = dict(like.params), dict(like.buffers)
    loaded, shape_skipped, missing = [], [], []
    for table in (params, buffers):
        for name, old in table.items():
            if name not in incoming:
                missing.append(name)
                continue
            value = incoming[name]
            if not isinstance(value, torch.Tensor):
                shape_skipped.append(
                    f"{name}: checkpoint has a {type(value).__name__}, model a tensor {tuple(old.shape)}"
                )
                continue
            if value.shape != old.shape:
                shape_skipped.append(f"{name}: checkpoint {tuple(value.shape)} vs model {tuple(old.shape)}")
                continue
            # load_state_dict semantics: the model's dtype and device win.
            table[name] = value.detach().to(device=old.device, dtype=old.dtype).clone()
            loaded.append(name)
    unexpected = [k for k in incoming if k not in params and k not in buffers]

    if not loaded:
        raise CheckpointMismatchError(
            f"nothing was loaded from {source}: no checkpoint key matches a model key."
            f"\n  checkpoint keys (after stripping 'module.'): {list(incoming)[:8]}"
            f"\n  model keys: {list(params)[:8]}"
            "\n  Pass rename={'old_prefix.': 'new_prefix.'} to map one onto the other."
        )
    problems = []
    if shape_skipped:
        problems.append(
            f"skipped {len(shape_skipped)} key(s) with another shape, name: checkpoint vs model:"
            + _listing(shape_skipped)
        )
    if missing:
        problems.append(f"{len(missing)} model key(s) not in the checkpoint (kept as initialised):" + _listing(missing))
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint key(s) not in the model (ignored):" + _listing(unexpected))
    if problems:
        msg = f"importing {source}: " + "\n".join(problems)
        if strict:
            raise CheckpointMismatchError(msg + "\n(strict=True; pass strict=False to import the rest)")
        warnings.warn(msg, stacklevel=2)

    state = like.replace(params=params, buffers=buffers)
    if not resume:
        return state

    optimizer_sd = ckpt.get("optimizer")
    if optimizer_sd:
        _check_param_order(source, [k for k in incoming if k in params], list(params))
        count = _seed_count(ckpt, optimizer_sd)
        opt_state = _import_optimizer_state(optimizer_sd, like.opt_state, count, optimizer_importer)
        if opt_state is not None:
            state = state.replace(opt_state=opt_state)

    scaler_sd = ckpt.get("scaler")
    if scaler_sd:
        if like.loss_scale is None:
            warnings.warn(f"{source} has GradScaler state but loss scaling is off in this state; ignored", stacklevel=2)
        else:
            ls = like.loss_scale
            state = state.replace(
                loss_scale=ls._replace(
                    scale=torch.tensor(float(scaler_sd["scale"]), dtype=ls.scale.dtype, device=ls.scale.device),
                    growth_tracker=torch.tensor(
                        int(scaler_sd["_growth_tracker"]),
                        dtype=ls.growth_tracker.dtype,
                        device=ls.growth_tracker.device,
                    ),
                )
            )

    cursor_changes = {}
    for src, dst in (("epoch", "epoch"), ("start_iter", "position"), ("samples_seen", "samples_seen")):
        if ckpt.get(src) is not None:
            cursor_changes[dst] = int(ckpt[src])
    if cursor_changes:
        state = state.replace(cursor=state.cursor.replace(**cursor_changes))
    if ckpt.get("global_step") is not None:
        state = state.replace(
            step=torch.tensor(int(ckpt["global_step"]), dtype=like.step.dtype, device=like.step.device)
        )
    return state


def _check_param_order(source, theirs: list, ours: list) -> None:
    """A torch optimizer's state numbers the params in the order the saving model declared
    them; the moments are matched by that position. A model declaring its submodules in
    another order would hand each param another one's moments (silently when the shapes agree)."""
    shared = set(theirs) & set(ours)
    theirs, ours = [k for k in theirs if k in shared], [k for k in ours if k in shared]
    if theirs != ours:
        at = next(i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b)
        raise CheckpointMismatchError(
            f"{source}: the model declares its parameters in another order than the one that saved the "
            f"checkpoint (position {at}: {ours[at]!r} here, {theirs[at]!r} there), and the optimizer's moments "
            "are stored by position: declare the submodules in the saving model's order, or pass resume=False "
            "to import the weights only")
