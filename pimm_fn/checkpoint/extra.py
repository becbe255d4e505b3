"""The ``extra`` argument of ``save``: JSON with tensors replaced by references.

Numbers, strings, bools, None, lists, tuples and dicts (string keys or not) survive a
round trip; tensors are stored as ``extra/<i>`` tensors of the file. Anything else is
refused at save time with its place in ``extra``.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .errors import CheckpointError
from .format import _host_kind


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
        if (all(isinstance(k, str) for k in obj)
                and "__tensor__" not in obj and "__tuple__" not in obj and "__items__" not in obj):
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

