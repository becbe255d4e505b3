"""Checkpoints: save and restore a whole TrainState, atomically, without ever unpickling.

File format (schema 1). A checkpoint is one safetensors file, written by this module
and readable by any safetensors reader:

    8 bytes   little-endian u64 N, the header length
    N bytes   JSON header: {tensor name: {dtype, shape, data_offsets}, "__metadata__": {...}}
    rest      the raw little-endian bytes of every tensor, back to back, in header order

Tensor names are the leaf paths of the TrainState joined with "/" under ``state/``
(``state/params/fc.weight``, ``state/opt_state/0/m/fc.weight``) and ``extra/<i>`` for
tensors inside the ``extra`` argument. ``__metadata__`` holds two strings:
``pimm_fn`` (a JSON payload: format name, schema version, every leaf's kind, dtype and
shape, host leaves' values (RNG key and cursor ints), and ``extra`` encoded as JSON with
tensors replaced by references) and ``pimm_fn_sha256`` (SHA-256 over the payload and the
tensor bytes), so a truncated or bit-flipped file is reported as such instead of
restoring wrong numbers.

Why safetensors + JSON and not ``torch.save``: reading it parses JSON and copies bytes,
so restoring a checkpoint can never run code from the file, by construction rather than
by a pickle allow-list. Pickle files (``torch.save`` output, seed checkpoints) are
refused by :func:`restore`; :func:`import_seed_checkpoint` reads them with
``torch.load(weights_only=True)`` and only unpickles fully when told ``trust_pickle=True``.

Only the leaves are stored. The structure (treedef), the model and the optimizer
transform come from the ``like`` state given to :func:`restore`, which is also what makes
mismatches (another model, another optimizer) detectable and reportable.

Atomicity: a file is written under a temporary name in its own folder, flushed and
fsynced, renamed over the final name with ``os.replace`` and the folder fsynced. A reader
therefore sees either the old complete file or the new complete one. :class:`CheckpointDir`
adds a ``latest`` pointer that is replaced (atomically) only after the checkpoint it names
is durable, so a SIGKILL at any moment leaves a restorable ``latest()``.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import struct
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import optree
import torch

from .atomic import TMP_RE, atomic_replace, atomic_write, fsync_dir
from .state import TrainState
from .tree import NAMESPACE

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "UnsafeCheckpointError",
    "save",
    "restore",
    "verify",
    "CheckpointDir",
    "import_seed_checkpoint",
]

SCHEMA_VERSION = 1
FORMAT_NAME = "pimm_fn.checkpoint"
SUFFIX = ".ckpt"
_META_KEY = "pimm_fn"
_SUM_KEY = "pimm_fn_sha256"
_CHUNK = 16 << 20
_MAX_LISTED = 20

# torch dtype <-> safetensors dtype code. Complex, sparse and quantized tensors are not
# representable in safetensors and are refused at save time with the leaf's name.
_ST_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if hasattr(torch, _name):
        _ST_DTYPE[getattr(torch, _name)] = _code
_DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in _ST_DTYPE}


# --------------------------------------------------------------------------- errors


class CheckpointError(Exception):
    """Base class of every checkpoint error raised by this module."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist (the message lists the ones that do)."""


class CheckpointCorruptError(CheckpointError):
    """The file is truncated, corrupt, or not a pimm_fn checkpoint."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the ``like`` state (missing/unexpected keys, shapes)."""


class UnsafeCheckpointError(CheckpointError):
    """The file is a pickle that would need code execution to load; it was not loaded."""


# --------------------------------------------------------------------------- helpers


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


def _host_kind(value) -> Optional[str]:
    # bool before int: bool is an int subclass, and a restored bool must stay a bool.
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return None


def _tensor_bytes(t: torch.Tensor, key: str) -> torch.Tensor:
    """The tensor as a flat CPU uint8 view of its bytes (copies only off-CPU or strided)."""
    if t.layout != torch.strided or t.is_quantized:
        raise CheckpointError(f"{key}: {t.layout} / quantized tensors cannot be checkpointed")
    if t.dtype not in _ST_DTYPE:
        raise CheckpointError(f"{key}: dtype {t.dtype} cannot be checkpointed (safetensors has no code for it)")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _encode_extra(obj, tensors: list, where: str = "extra"):
    """JSON-able encoding of ``obj``; tensors are appended to ``tensors`` and referenced."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__tensor__": len(tensors) - 1}
    if obj is None or _host_kind(obj) is not None:
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        raise CheckpointError(
            f"{where}: NamedTuple {type(obj).__name__} in extra cannot be restored without its "
            "class; convert it with ._asdict() or keep it in the TrainState"
        )
    if isinstance(obj, (list, tuple)):
        items = [_encode_extra(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, Mapping):
        # Non-string keys (torchdata uses int worker ids) survive as [key, value] pairs.
        if all(isinstance(k, str) for k in obj) and "__tensor__" not in obj and "__tuple__" not in obj and "__items__" not in obj:
            return {k: _encode_extra(v, tensors, f"{where}[{k!r}]") for k, v in obj.items()}
        for k in obj:
            if not (k is None or _host_kind(k) is not None):
                raise CheckpointError(f"{where}: dict key {k!r} of type {type(k).__name__} cannot be saved")
        return {"__items__": [[k, _encode_extra(v, tensors, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise CheckpointError(
        f"{where}: value of type {type(obj).__name__} cannot be saved in extra "
        "(allowed: tensors, numbers, strings, bools, None, lists, tuples, dicts)"
    )


def _decode_extra(obj, tensors: dict):
    if isinstance(obj, list):
        return [_decode_extra(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[f"extra/{obj['__tensor__']}"]
        if set(obj) == {"__tuple__"}:
            return tuple(_decode_extra(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__items__"}:
            return {k: _decode_extra(v, tensors) for k, v in obj["__items__"]}
        return {k: _decode_extra(v, tensors) for k, v in obj.items()}
    return obj


def _listing(items, limit: int = _MAX_LISTED) -> str:
    items = list(items)
    shown = "\n    ".join(str(i) for i in items[:limit])
    more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
    return "\n    " + shown + more


# --------------------------------------------------------------------------- save


def _refuse_pieces(state: TrainState) -> None:
    """A checkpoint holds full tensors. A sharded state (``pimm_fn.sharding``) holds one
    rank's 1-D pieces; written as is, it would restore as nothing anyone can use."""
    model = getattr(state, "model", None)
    if model is None:
        return
    for name, p in model.named_parameters():
        leaf = state.params.get(name) if isinstance(state.params, Mapping) else None
        if isinstance(leaf, torch.Tensor) and tuple(leaf.shape) != tuple(p.shape):
            raise CheckpointError(
                f"params[{name!r}] has shape {tuple(leaf.shape)} but the model's parameter is "
                f"{tuple(p.shape)}: this looks like a sharded state (one rank's pieces). Save it "
                "with pimm_fn.sharding.save(path, state), which gathers full tensors on every "
                "rank and writes them once; fit's Checkpoint callback does not gather")


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
    _refuse_pieces(state)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    keys, leaves, _ = _flatten_state(state)
    leaf_meta: dict = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    for key, leaf in zip(keys, leaves):
        if isinstance(leaf, torch.Tensor):
            leaf_meta[key] = {"kind": "tensor", "dtype": str(leaf.dtype).removeprefix("torch."), "shape": list(leaf.shape)}
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
        leaf_meta[key] = {"kind": "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
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

    # One pass to get the bytes (a single host copy for GPU tensors), hash, then write.
    blobs = [(k, _tensor_bytes(t, k)) for k, t in tensors]
    digest = hashlib.sha256(payload)
    header: dict = {}
    offset = 0
    for (key, blob), (_, t) in zip(blobs, tensors):
        n = blob.numel()
        header[key] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
        digest.update(blob.numpy())
    header["__metadata__"] = {_META_KEY: payload.decode(), _SUM_KEY: digest.hexdigest()}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # 8-byte aligned data start, as safetensors writers do

    def write(f):
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, blob in blobs:
            if blob.numel():
                f.write(memoryview(blob.numpy()))

    atomic_write(path, write, sync_dir=sync_dir)
    return path


# --------------------------------------------------------------------------- read


def _existing_checkpoints(folder: Path, exclude: Optional[Path] = None) -> list[Path]:
    """Checkpoint-looking files in ``folder``, newest first (temp files excluded)."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        if p.name.endswith(".tmp") or p.name.startswith(".") or not p.is_file():
            continue
        if p.suffix in (SUFFIX, ".pth", ".pt", ".safetensors") and (exclude is None or p.resolve() != exclude.resolve()):
            found.append(p)
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, _step_of(p) or -1), reverse=True)


def _not_found(path: Path) -> CheckpointNotFoundError:
    folder = path.parent
    if not folder.is_dir():
        return CheckpointNotFoundError(f"checkpoint {path} does not exist (nor does its folder {folder})")
    found = _existing_checkpoints(folder)
    if found:
        return CheckpointNotFoundError(
            f"checkpoint {path} does not exist; checkpoints in {folder} (newest first):" + _listing(p.name for p in found)
        )
    return CheckpointNotFoundError(f"checkpoint {path} does not exist, and {folder} holds no checkpoints")


def _looks_like_pickle(first: bytes) -> Optional[str]:
    if first.startswith(b"PK\x03\x04"):
        return "a torch.save (zip + pickle) file"
    if first[:1] == b"\x80" and len(first) > 1 and 2 <= first[1] <= 5:
        return "a pickle file"
    return None


class _Parsed:
    """A checkpoint whose structure has been checked; tensors are read on demand."""

    def __init__(self, path: Path, header: dict, payload: dict, data_start: int, data_len: int, checksum: str, payload_raw: bytes):
        self.path, self.header, self.payload = path, header, payload
        self.data_start, self.data_len, self.checksum, self.payload_raw = data_start, data_len, checksum, payload_raw


def _parse(path: Path) -> _Parsed:
    """Check the file's framing and header (cheap: reads the header only)."""
    if not path.exists():
        raise _not_found(path)
    if path.is_dir():
        found = _existing_checkpoints(path)
        hint = (" It holds:" + _listing(p.name for p in found)) if found else " It holds no checkpoints."
        raise CheckpointNotFoundError(
            f"{path} is a folder, not a checkpoint file; use CheckpointDir({str(path)!r}).latest() to pick one.{hint}"
        )
    size = path.stat().st_size
    with open(path, "rb") as f:
        first = f.read(8)
        kind = _looks_like_pickle(first)
        if kind:
            raise UnsafeCheckpointError(
                f"{path} is {kind}, not a pimm_fn checkpoint. restore() never unpickles, because "
                "loading a pickle can run arbitrary code from the file. For a seed/Pointcept checkpoint "
                "use import_seed_checkpoint(), which loads it with torch.load(weights_only=True)."
            )
        if len(first) < 8:
            raise CheckpointCorruptError(f"{path} is truncated: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", first)
        if n > 1 << 30:
            raise CheckpointCorruptError(f"{path} is corrupt or not a checkpoint: header length {n} is implausible")
        if 8 + n > size:
            raise CheckpointCorruptError(f"{path} is truncated: {size} bytes, but its header alone needs {8 + n}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        meta = header.pop("__metadata__")
        payload_raw = meta[_META_KEY].encode()
        checksum = meta[_SUM_KEY]
        payload = json.loads(payload_raw)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointCorruptError(
            f"{path} is corrupt or not a pimm_fn checkpoint: its header does not parse ({type(e).__name__}: {e})"
        ) from None
    if payload.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{path} is not a pimm_fn checkpoint (format {payload.get('format')!r})")
    schema = payload.get("schema")
    if not isinstance(schema, int) or schema > SCHEMA_VERSION:
        raise CheckpointCorruptError(
            f"{path} has checkpoint schema {schema!r}; this pimm_fn reads schema <= {SCHEMA_VERSION}. "
            "Upgrade pimm_fn to read it."
        )
    end = 0
    for key, entry in header.items():
        try:
            b, e = entry["data_offsets"]
            end = max(end, int(e))
        except (KeyError, TypeError, ValueError):
            raise CheckpointCorruptError(f"{path} is corrupt: bad header entry for {key}") from None
    expected = 8 + n + end
    if size < expected:
        raise CheckpointCorruptError(
            f"{path} is truncated: {size} bytes, but its header describes {expected} (a write that did not finish)"
        )
    if size > expected:
        raise CheckpointCorruptError(f"{path} is corrupt: {size - expected} unexpected bytes after the tensor data")
    return _Parsed(path, header, payload, 8 + n, end, checksum, payload_raw)


def _read_data(parsed: _Parsed) -> bytearray:
    """The tensor bytes, checked against the stored SHA-256."""
    buf = bytearray(parsed.data_len)
    view = memoryview(buf)
    digest = hashlib.sha256(parsed.payload_raw)
    with open(parsed.path, "rb") as f:
        f.seek(parsed.data_start)
        pos = 0
        while pos < parsed.data_len:
            got = f.readinto(view[pos : pos + _CHUNK])
            if not got:
                raise CheckpointCorruptError(f"{parsed.path} is truncated: the file ended while reading tensor data")
            digest.update(view[pos : pos + got])
            pos += got
    if digest.hexdigest() != parsed.checksum:
        raise CheckpointCorruptError(f"{parsed.path} is corrupt: its checksum does not match its contents")
    return buf


def _tensor_from(parsed: _Parsed, buf: bytearray, key: str) -> torch.Tensor:
    entry, meta = parsed.header.get(key), parsed.payload["leaves"][key]
    if entry is None:
        raise CheckpointCorruptError(f"{parsed.path} is corrupt: tensor {key} is listed but has no data")
    dtype = _DTYPE_BY_NAME.get(meta["dtype"])
    if dtype is None or entry["dtype"] != _ST_DTYPE[dtype] or list(entry["shape"]) != list(meta["shape"]):
        raise CheckpointCorruptError(f"{parsed.path} is corrupt: the header of {key} disagrees with its metadata")
    b, e = entry["data_offsets"]
    # clone(): an owned, aligned storage per tensor rather than views into one buffer.
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=e - b, offset=b).clone() if e > b else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(meta["shape"])


def _intact_neighbour(path: Path) -> Optional[Path]:
    """The newest other checkpoint in ``path``'s folder that fully verifies, if any."""
    for cand in _existing_checkpoints(path.parent, exclude=path):
        try:
            _read_data(_parse(cand))
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
    _read_data(_parse(Path(path)))


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
        buf = _read_data(parsed)
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
            elif _DTYPE_BY_NAME.get(meta["dtype"]) != leaf.dtype:
                kinds.append(f"{key[6:]}: checkpoint dtype {meta['dtype']} vs model {str(leaf.dtype).removeprefix('torch.')}")
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
            t = _tensor_from(parsed, buf, key)
            new_leaves.append(t.to(leaf.device) if leaf.device.type != "cpu" else t)
        else:
            new_leaves.append(meta["value"])
    state = optree.tree_unflatten(treedef, new_leaves)
    extra_tensors = {k: _tensor_from(parsed, buf, k) for k in stored if k.startswith("extra/")}
    return state, _decode_extra(parsed.payload.get("extra"), extra_tensors)


# --------------------------------------------------------------------------- folder manager

_STEP_RE = re.compile(r"^step_(\d+)" + re.escape(SUFFIX) + "$")


def _step_of(p: Path) -> Optional[int]:
    m = _STEP_RE.match(p.name)
    return int(m.group(1)) if m else None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointDir:
    """A folder of checkpoints with a ``latest`` pointer, a ``best.ckpt`` and pruning.

    root: the folder (created on first save).
    keep_last: default number of ``step_<n>.ckpt`` files to keep (None keeps all).

    Layout: ``step_<n>.ckpt`` files, ``latest`` (a text file naming the newest committed
    checkpoint, replaced only after that file is durable), ``best.ckpt`` (a hard link to,
    or where links are unsupported a copy of, the checkpoint saved with ``best=True``).
    Files ending in ``.tmp`` are unfinished writes and are never taken for checkpoints.
    """

    LATEST = "latest"
    BEST = "best" + SUFFIX

    def __init__(self, root: Union[str, os.PathLike], keep_last: Optional[int] = None):
        self.root = Path(root)
        self.keep_last = keep_last

    def __repr__(self) -> str:
        return f"CheckpointDir({str(self.root)!r}, keep_last={self.keep_last})"

    def path_for(self, step: int) -> Path:
        """The file name a checkpoint of ``step`` gets."""
        return self.root / f"step_{int(step)}{SUFFIX}"

    def save(
        self,
        state: TrainState,
        step: Optional[int] = None,
        *,
        name: Optional[str] = None,
        extra: Any = None,
        keep_last: Optional[int] = None,
        best: bool = False,
    ) -> Path:
        """Save ``state`` as ``step_<step>.ckpt`` (or ``name``), then move ``latest`` to it.

        step: the number in the file name (e.g. the global batch step); default
            ``int(state.step)``.
        name: a file name instead (``.ckpt`` appended when it has no suffix); not pruned.
        extra: as in :func:`save`.
        keep_last: keep this many step files (default: the folder's ``keep_last``); the
            file ``latest`` names and the best checkpoint are never deleted.
        best: also make this checkpoint ``best.ckpt``.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_dead_tmp()
        if name is not None:
            target = self.root / (name if Path(name).suffix else name + SUFFIX)
            if target.name in (self.LATEST, self.BEST):
                raise ValueError(f"{target.name!r} is reserved by CheckpointDir; pick another name")
        else:
            target = self.path_for(int(state.step) if step is None else step)
        save(target, state, extra, sync_dir=False)
        if best:
            self._set_best(target)
        # The pointer moves only now: target's bytes are fsynced. The renames then reach the
        # disk with one folder fsync. The pointer's own bytes are not fsynced: after a power
        # loss it names the old file or the new one, or reads empty, and latest() then takes
        # the newest complete file; it never names a torn file (latest() checks framing).
        atomic_write(self.root / self.LATEST, lambda f: f.write((target.name + "\n").encode()), durable=False)
        fsync_dir(self.root)
        keep = self.keep_last if keep_last is None else keep_last
        if keep is not None:
            self.prune(keep)
        return target

    def _set_best(self, target: Path) -> None:
        def link_or_copy(tmp: Path) -> None:
            try:
                os.link(target, tmp)  # same inode: no extra disk, survives pruning of target
            except OSError:
                shutil.copyfile(target, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())

        atomic_replace(self.root / self.BEST, link_or_copy, sync_dir=False)  # save() fsyncs the folder

    def _remove_dead_tmp(self) -> None:
        """Delete temp files left by writers that are no longer running (e.g. SIGKILLed)."""
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            m = TMP_RE.match(p.name)
            if m and not _pid_alive(int(m.group("pid"))):
                try:
                    p.unlink()
                except OSError:
                    pass

    def _pointer_target(self) -> Optional[Path]:
        try:
            name = (self.root / self.LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        # Only a plain file name inside root is honoured.
        if not name or "/" in name or "\\" in name or name.startswith("."):
            return None
        return self.root / name

    @staticmethod
    def _complete(p: Path) -> bool:
        try:
            _parse(p)
            return True
        except CheckpointError:
            return False

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint files in the folder, oldest first (``best.ckpt`` excluded)."""
        if not self.root.is_dir():
            return []
        found = [
            p
            for p in self.root.iterdir()
            if p.suffix == SUFFIX and p.name != self.BEST and not p.name.startswith(".") and p.is_file()
        ]
        found = [p for p in found if self._complete(p)]
        return sorted(found, key=lambda p: (p.stat().st_mtime_ns, _step_of(p) or -1))

    def latest(self) -> Optional[Path]:
        """The checkpoint to resume from: what ``latest`` names, else the newest complete file.

        "Complete" is a cheap framing check (header parses, size matches); restore also
        verifies the checksum. Returns None when the folder holds no complete checkpoint.
        """
        target = self._pointer_target()
        if target is not None and target.is_file() and self._complete(target):
            return target
        found = self.checkpoints()
        return found[-1] if found else None

    def best(self) -> Optional[Path]:
        """``best.ckpt`` if one was saved and is complete, else None."""
        p = self.root / self.BEST
        return p if p.is_file() and self._complete(p) else None

    def prune(self, keep_last: int) -> list[Path]:
        """Delete all but the newest ``keep_last`` step files; returns the deleted paths.

        Never deletes the file ``latest`` names nor the one ``best.ckpt`` links to.
        """
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        protected = set()
        target = self._pointer_target()
        if target is not None:
            protected.add(target.name)
        best = self.root / self.BEST
        best_ino = best.stat().st_ino if best.is_file() else None
        steps = sorted(
            (p for p in self.root.iterdir() if _step_of(p) is not None and p.is_file()),
            key=_step_of,
        )
        doomed = steps[: max(0, len(steps) - keep_last)]
        deleted = []
        for p in doomed:
            if p.name in protected:
                continue
            try:
                if best_ino is not None and p.stat().st_ino == best_ino:
                    continue
                p.unlink()
                deleted.append(p)
            except FileNotFoundError:
                pass
        return deleted


# --------------------------------------------------------------------------- seed import


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
            raise CheckpointError(f"{path} is a pimm_fn checkpoint; load it with restore(), not import_seed_checkpoint()")
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

    Adam / AdamW save ``step`` per param; SGD does not, and then the seed's scheduler
    ``last_epoch`` is the count (the seed skips the scheduler on the same inf/NaN steps
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
            from .optim.torch_interop import from_torch_state_dict as importer
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
        ``module.`` is stripped (the seed loader's keywords -> replacement), or a function.
    strict: raise on any missing / unexpected / shape-mismatched key instead of warning.
    resume: also import optimizer, scaler and counters; False imports weights only.
    trust_pickle: unpickle fully (runs code from the file); only for trusted files.
    optimizer_importer: ``f(torch_state_dict, template_opt_state, count=n) -> opt_state``
        in place of :func:`pimm_fn.optim.torch_interop.from_torch_state_dict` (which maps
        torch's param groups, in order, onto the transform's groups; ``like.tx`` must be
        built with the seed's optimizer and groups). ``count`` is None for Adam / AdamW
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
                shape_skipped.append(f"{name}: checkpoint has a {type(value).__name__}, model a tensor {tuple(old.shape)}")
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
        problems.append(f"skipped {len(shape_skipped)} key(s) with another shape, name: checkpoint vs model:" + _listing(shape_skipped))
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
                        int(scaler_sd["_growth_tracker"]), dtype=ls.growth_tracker.dtype, device=ls.growth_tracker.device
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
        state = state.replace(step=torch.tensor(int(ckpt["global_step"]), dtype=like.step.dtype, device=like.step.device))
    return state
