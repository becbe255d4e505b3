"""The checkpoint file format (schema 1): one safetensors file, readable by any safetensors reader.

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

Reading it parses JSON and copies bytes, so it can never run code from the file. Pickle
files are recognised by their first bytes and refused with :class:`UnsafeCheckpointError`.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Optional

import torch

from ..atomic import atomic_write
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, UnsafeCheckpointError, _listing
from .locate import _existing_checkpoints, _not_found

SCHEMA_VERSION = 1
FORMAT_NAME = "pimm_fn.checkpoint"
_META_KEY = "pimm_fn"
_SUM_KEY = "pimm_fn_sha256"
_CHUNK = 16 << 20

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




def _write_file(path: Path, tensors: list, payload: bytes, *, sync_dir: bool = True) -> None:
    """Write ``tensors`` ([(name, tensor)]) and the JSON ``payload`` to ``path``, atomically
    (``sync_dir``: fsync the folder after the rename)."""
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

