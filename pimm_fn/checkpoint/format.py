"""The checkpoint file format: one safetensors file, written and read by the safetensors
library, so any safetensors reader opens it.

Tensor names are the leaf paths of the TrainState joined with "/" under ``state/``
(``state/params/fc.weight``, ``state/opt_state/0/m/fc.weight``) and ``extra/<i>`` for
tensors inside the ``extra`` argument. The header's ``__metadata__`` holds two strings:
``pimm_fn`` (a JSON payload: format name, schema version, every leaf's kind, dtype and
shape, host leaves' values (RNG key and cursor ints), and ``extra`` encoded as JSON with
tensors replaced by references) and ``pimm_fn_sha256``, so a truncated or bit-flipped
file is reported as such instead of restoring wrong numbers.

The checksum is SHA-256 over the payload, then every tensor's bytes in the order the
payload lists the tensors (schema 2). The library lays tensors out in its own order, so
the sum does not depend on the layout. Schema 1 files (pimm_fn's own writer) laid the
tensors out in payload order, so the same rule verifies them: both are read.

Reading parses JSON and copies bytes, so it can never run code from the file. Pickle
files are recognised by their first bytes and refused with :class:`UnsafeCheckpointError`.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..atomic import atomic_replace, fsync_file
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, UnsafeCheckpointError, _listing
from .locate import _existing_checkpoints, _not_found

SCHEMA_VERSION = 2
FORMAT_NAME = "pimm_fn.checkpoint"
_META_KEY = "pimm_fn"
_SUM_KEY = "pimm_fn_sha256"

# Complex, sparse and quantized tensors (and dtypes safetensors has no code for) are
# refused at save time with the leaf's name.
_SAVEABLE = frozenset(
    getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                 "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
)


def _dtype_name(dtype: torch.dtype) -> str:
    """The dtype as the payload names it ("float32")."""
    return str(dtype).removeprefix("torch.")


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


def _for_file(t: torch.Tensor, key: str) -> torch.Tensor:
    """The tensor as a dense contiguous CPU tensor (copies only off-CPU or strided)."""
    if t.layout != torch.strided or t.is_quantized:
        raise CheckpointError(f"{key}: {t.layout} / quantized tensors cannot be checkpointed")
    if t.dtype not in _SAVEABLE:
        raise CheckpointError(f"{key}: dtype {t.dtype} cannot be checkpointed (safetensors has no code for it)")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def _bytes_of(t: torch.Tensor):
    """A zero-copy uint8 view of a contiguous CPU tensor's bytes, for hashing."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _write_file(path: Path, tensors: list, payload: bytes, *, sync_dir: bool = True) -> None:
    """Write ``tensors`` ([(name, tensor)]) and the JSON ``payload`` to ``path``, atomically
    (``sync_dir``: fsync the folder after the rename)."""
    data: dict = {}
    storages: set = set()
    digest = hashlib.sha256(payload)
    for key, t in tensors:
        t = _for_file(t, key)
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:
            # The library refuses tensors that share memory (tied weights, a leaf that is
            # another's view); the file holds each leaf's own bytes, as restore returns them.
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        data[key] = t
        digest.update(_bytes_of(t))
    metadata = {_META_KEY: payload.decode(), _SUM_KEY: digest.hexdigest()}

    def fill(tmp: Path) -> None:
        save_file(data, tmp, metadata=metadata)
        fsync_file(tmp)

    atomic_replace(path, fill, sync_dir=sync_dir)


def _looks_like_pickle(first: bytes) -> Optional[str]:
    if first.startswith(b"PK\x03\x04"):
        return "a torch.save (zip + pickle) file"
    if first[:1] == b"\x80" and len(first) > 1 and 2 <= first[1] <= 5:
        return "a pickle file"
    return None


class _Parsed:
    """A checkpoint whose structure has been checked; tensors are read on demand."""

    def __init__(self, path: Path, header: dict, payload: dict, checksum: str, payload_raw: bytes):
        self.path, self.header, self.payload = path, header, payload
        self.checksum, self.payload_raw = checksum, payload_raw


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
    return _Parsed(path, header, payload, checksum, payload_raw)




def _read_tensors(parsed: _Parsed) -> dict:
    """Every tensor of the file, in memory of its own, checked against the stored SHA-256."""
    try:
        # pread, not mmap: restored tensors own their memory and do not change, or fault,
        # when the file is later pruned or overwritten.
        with safe_open(str(parsed.path), framework="pt", backend="pread") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{parsed.path} is corrupt: the safetensors reader refused it ({e})") from None
    digest = hashlib.sha256(parsed.payload_raw)
    listed = [key for key, meta in parsed.payload["leaves"].items() if meta.get("kind") == "tensor"]
    for key in listed:
        t = tensors.get(key)
        if t is None:
            raise CheckpointCorruptError(f"{parsed.path} is corrupt: tensor {key} is listed but has no data")
        meta = parsed.payload["leaves"][key]
        if _dtype_name(t.dtype) != meta["dtype"] or list(t.shape) != list(meta["shape"]):
            raise CheckpointCorruptError(f"{parsed.path} is corrupt: the header of {key} disagrees with its metadata")
        digest.update(_bytes_of(t))
    if digest.hexdigest() != parsed.checksum:
        raise CheckpointCorruptError(f"{parsed.path} is corrupt: its checksum does not match its contents")
    if len(tensors) != len(listed):
        unlisted = sorted(set(tensors) - set(listed))
        raise CheckpointCorruptError(f"{parsed.path} is corrupt: tensors not in its metadata: {unlisted[:5]}")
    return tensors
