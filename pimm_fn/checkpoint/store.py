"""Save, restore and verify one checkpoint file of a whole TrainState.

Only the leaves are stored. The structure (treedef), the model and the optimizer
transform come from the ``like`` state given to :func:`restore`, which is also what makes
mismatches (another model, another optimizer) detectable and reportable.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import optree
import torch

from ..state import TrainState
from ..tree import NAMESPACE
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, _listing
from .extra import _decode_extra, _encode_extra
from .format import FORMAT_NAME, SCHEMA_VERSION, _dtype_name, _host_kind, _parse, _read_tensors, _write_file
from .locate import _existing_checkpoints


def _leaf_key(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def _flatten_state(state: TrainState):
    """(keys, leaves, treedef) of a TrainState in the pimm_fn namespace."""
    if not isinstance(state, TrainState):
        raise TypeError(f"expected a TrainState, got {type(state).__name__}")
    paths, leaves, treedef = optree.tree_flatten_with_path(state, namespace=NAMESPACE)
    keys = ["state/" + _leaf_key(p) for p in paths]
    if len(set(keys)) != len(keys):
        seen, dup = set(), set()
        for k in keys:
            (dup if k in seen else seen).add(k)
        raise CheckpointError(
            "two leaves of the state have the same name once joined with '/' "
            f"(for example a dict with both 1 and '1' as keys): {sorted(dup)[:5]}; rename them"
        )
    return keys, leaves, treedef



# --------------------------------------------------------------------------- save


def refuse_sharded(state: TrainState) -> None:
    """A checkpoint file holds full tensors. A sharded state (``pimm_fn.sharding``) holds
    DTensors whose local rows are one rank's part; written as is, it would restore as
    nothing anyone can use."""
    from torch.distributed.tensor import DTensor

    params = state.params if isinstance(getattr(state, "params", None), Mapping) else {}
    sharded = [k for k, v in params.items() if isinstance(v, DTensor)]
    if sharded:
        raise CheckpointError(
            f"params {sharded[:3]} are DTensors: this is a sharded state (each rank holds its rows). "
            "Save it with pimm_fn.sharding.save(path, state), which writes every rank's rows with "
            "torch.distributed.checkpoint and reshards on restore; fit's Checkpoint callback writes "
            "one file of full tensors and cannot")


def save(path: Union[str, os.PathLike], state: TrainState, extra: Any = None, *, sync_dir: bool = True) -> Path:
    """Write ``state`` (every leaf) and ``extra`` to one checkpoint file, atomically.

    path: the file to write; its folder is created. An existing file is replaced only
        once the new one is complete and fsynced.
    state: the TrainState; model and tx are static and not saved.
    extra: None, or a JSON-able value that may contain tensors anywhere (best metric,
        a torchdata loader ``state_dict``, ...). Restored as saved, tensors on the CPU.
    sync_dir: fsync the folder after the rename (False: the caller does, once for several files).
    Returns the path written.
    """
    if sys.byteorder != "little":
        raise CheckpointError("checkpoints are little-endian; this platform is big-endian")
    refuse_sharded(state)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    keys, leaves, _ = _flatten_state(state)
    leaf_meta: dict = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    for key, leaf in zip(keys, leaves):
        if isinstance(leaf, torch.Tensor):
            leaf_meta[key] = {"kind": "tensor", "dtype": _dtype_name(leaf.dtype), "shape": list(leaf.shape)}
            tensors.append((key, leaf))
        else:
            kind = _host_kind(leaf)
            if kind is None:
                raise CheckpointError(
                    f"{key}: leaf of type {type(leaf).__name__} cannot be checkpointed "
                    "(state leaves must be tensors, ints, floats, bools or strings)"
                )
            leaf_meta[key] = {"kind": kind, "value": leaf}

    extra_tensors: list = []
    encoded_extra = _encode_extra(extra, extra_tensors)
    for i, t in enumerate(extra_tensors):
        key = f"extra/{i}"
        leaf_meta[key] = {"kind": "tensor", "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
        tensors.append((key, t))

    payload = json.dumps(
        {
            "format": FORMAT_NAME,
            "schema": SCHEMA_VERSION,
            "torch": torch.__version__,
            "leaves": leaf_meta,
            "extra": encoded_extra,
        },
        separators=(",", ":"),
    ).encode()

    _write_file(path, tensors, payload, sync_dir=sync_dir)
    return path


def _intact_neighbour(path: Path) -> Optional[Path]:
    """The newest other checkpoint in ``path``'s folder that fully verifies, if any."""
    for cand in _existing_checkpoints(path.parent, exclude=path):
        try:
            _read_tensors(_parse(cand))
            return cand
        except CheckpointError:
            continue
    return None


def _corrupt_with_hint(err: CheckpointCorruptError, path: Path) -> CheckpointCorruptError:
    good = _intact_neighbour(path)
    hint = (
        f" The previous checkpoint {good} is intact; restore that one."
        if good is not None
        else " No other intact checkpoint was found in its folder."
    )
    out = CheckpointCorruptError(str(err) + hint)
    out.detail, out.intact = str(err), good  # for callers that word their own message (the CLI)
    return out


def verify(path: Union[str, os.PathLike]) -> None:
    """Raise a :class:`CheckpointError` unless ``path`` is a complete, uncorrupted checkpoint."""
    _read_tensors(_parse(Path(path)))


def restore(path: Union[str, os.PathLike], like: TrainState) -> tuple[TrainState, Any]:
    """Read a checkpoint written by :func:`save` into the structure of ``like``.

    path: the checkpoint file.
    like: a TrainState of the same model and optimizer (e.g. a fresh ``TrainState.create``);
        it supplies the structure, model and tx, and each restored tensor goes to the
        device of ``like``'s tensor at the same place.
    Returns (state, extra); extra as passed to ``save``, its tensors on the CPU.
    Raises CheckpointNotFoundError, CheckpointCorruptError (truncated / corrupt; names an
    intact neighbour), UnsafeCheckpointError (a pickle), CheckpointMismatchError.
    """
    path = Path(path)
    try:
        parsed = _parse(path)
        tensors = _read_tensors(parsed)
    except CheckpointCorruptError as e:
        raise _corrupt_with_hint(e, path) from None

    keys, like_leaves, treedef = _flatten_state(like)
    stored = parsed.payload["leaves"]
    stored_state = {k: v for k, v in stored.items() if k.startswith("state/")}
    missing = [k for k in keys if k not in stored_state]
    unexpected = [k for k in stored_state if k not in set(keys)]
    shapes, kinds = [], []
    for key, leaf in zip(keys, like_leaves):
        meta = stored_state.get(key)
        if meta is None:
            continue
        if isinstance(leaf, torch.Tensor):
            if meta["kind"] != "tensor":
                kinds.append(f"{key[6:]}: checkpoint has a {meta['kind']}, model has a tensor")
            elif list(meta["shape"]) != list(leaf.shape):
                shapes.append(f"{key[6:]}: checkpoint {tuple(meta['shape'])} vs model {tuple(leaf.shape)}")
            elif meta["dtype"] != _dtype_name(leaf.dtype):
                kinds.append(f"{key[6:]}: checkpoint dtype {meta['dtype']} vs model {_dtype_name(leaf.dtype)}")
        elif meta["kind"] != _host_kind(leaf):
            kinds.append(f"{key[6:]}: checkpoint has a {meta['kind']}, model has a {type(leaf).__name__}")
    if missing or unexpected or shapes or kinds:
        parts = [f"{path} does not fit this state (another model or optimizer?)."]
        if missing:
            parts.append(f"Missing in the checkpoint ({len(missing)}):" + _listing(k[6:] for k in missing))
        if unexpected:
            parts.append(f"Unexpected in the checkpoint ({len(unexpected)}):" + _listing(k[6:] for k in unexpected))
        if shapes:
            parts.append(f"Shape mismatches ({len(shapes)}), name: checkpoint shape vs model shape:" + _listing(shapes))
        if kinds:
            parts.append(f"Type mismatches ({len(kinds)}):" + _listing(kinds))
        if not shapes and not kinds and all(k[6:].startswith("extra/") for k in missing + unexpected):
            # Only state.extra differs: the run kept something beside its params (GRPO's
            # reference policy under extra/grpo_ref, with kl_coef > 0).
            parts.append(
                "Only state.extra differs: build the state to restore into as the saved run built it "
                "(a GRPO run with a KL term: pimm_fn.steps.grpo.with_reference(like)).")
        else:
            parts.append(
                "To load only the weights of a different model, use import_seed_checkpoint() "
                "with a state_dict, which skips mismatches with a warning."
            )
        err = CheckpointMismatchError("\n".join(parts))
        # the differences one by one, for callers that word their own message (the CLI)
        err.differences = ([f"{k[6:]}: missing in the checkpoint" for k in missing]
                           + [f"{k[6:]}: not in the model" for k in unexpected] + shapes + kinds)
        raise err

    new_leaves = []
    for key, leaf in zip(keys, like_leaves):
        meta = stored_state[key]
        if isinstance(leaf, torch.Tensor):
            t = tensors[key]
            new_leaves.append(t.to(leaf.device) if leaf.device.type != "cpu" else t)
        else:
            new_leaves.append(meta["value"])
    state = optree.tree_unflatten(treedef, new_leaves)
    extra_tensors = {k: tensors[k] for k in stored if k.startswith("extra/")}
    return state, _decode_extra(parsed.payload.get("extra"), extra_tensors)

