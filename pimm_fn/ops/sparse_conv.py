"""spconv's submanifold convolution as a custom op: a step around it compiles with fullgraph.

spconv (a pybind C++ library) reads sizes on the host and builds its neighbour tables with
a hash map, which dynamo cannot trace. Here the whole layer is one op
(``pimm_fn::spconv_subm_conv3d``) registered with :func:`~pimm_fn.ops.external_op`: its
real kernel builds spconv's ``SparseConvTensor`` and runs ``SubMConv3d``'s forward with the
weight it is given, so the parameters live in the step's state like any other; its backward
is a second op that calls spconv's own backward kernel on the neighbour table the forward
returned (no second forward, no second hash-table build).

spconv 2.3.8's CPU backward (``spconv.pytorch.ops.indice_conv_backward``) asks for the
current CUDA stream before it branches to its CPU code, which never uses it; on a CPU
build of torch that raises "Torch not compiled with CUDA enabled". :func:`no_cuda_stream`
answers that lookup with the null stream (0) for the duration of the call, without
touching spconv's files; the backward op uses it whenever its tensors are on the CPU.

Needs ``pip install 'pimm_fn[spconv]'`` (spconv 2.3.8 and cumm; CPU wheels exist).
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Optional, Sequence, Union

import torch

from .custom import external_op

__all__ = ["SubMConv3d", "no_cuda_stream", "subm_conv3d"]

_INDICE_KEY = "pimm_fn_subm"  # where spconv leaves the neighbour table it built
# Reentrant: the backward op enters no_cuda_stream inside a user's own `with no_cuda_stream():`.
_PATCH_LOCK = threading.RLock()


def _spconv():
    try:
        import spconv.pytorch as spconv_torch
    except ImportError as err:
        raise ImportError("pimm_fn.ops.sparse_conv needs spconv: pip install 'pimm_fn[spconv]' "
                          f"(spconv==2.3.8 and cumm; CPU wheels exist) ({err})") from err
    return spconv_torch


@contextlib.contextmanager
def no_cuda_stream(enabled: bool = True):
    """Within the block, spconv's CUDA-stream lookup returns 0 instead of asking CUDA.

    spconv 2.3.8's CPU backward calls ``get_current_stream()`` (``torch.cuda.current_stream()``)
    before its CPU branch, which never uses the stream; on a CPU build of torch (or a
    machine without a GPU) the call raises. Wrap eager spconv backward passes on CPU
    tensors in this (``with no_cuda_stream(): loss.backward()``). Nothing changes while
    ``enabled`` is False (e.g. ``enabled=not tensor.is_cuda``): CUDA tensors need the real stream.
    """
    if not enabled:
        yield
        return
    ops = _spconv().ops  # spconv.pytorch.ops, which imported get_current_stream by name
    with _PATCH_LOCK:  # two threads patching at once could restore each other's stand-in
        original = ops.get_current_stream
        ops.get_current_stream = _null_stream
        try:
            yield
        finally:
            ops.get_current_stream = original


def _null_stream() -> int:
    return 0


@functools.lru_cache(maxsize=None)
def _layer(in_channels: int, out_channels: int, kernel_size: tuple, dilation: tuple):
    """A spconv SubMConv3d holding the layer's configuration; its own weight is never used."""
    spconv = _spconv()
    return spconv.SubMConv3d(in_channels, out_channels, list(kernel_size), dilation=list(dilation), bias=False,
                             indice_key=_INDICE_KEY, algo=spconv.ConvAlgo.Native)


def _forward_kernel(features: torch.Tensor, coords: torch.Tensor, spatial_shape: torch.Tensor,
                    batch_size: torch.Tensor, weight: torch.Tensor,
                    dilation: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spconv = _spconv()
    out_channels, *kernel, in_channels = weight.shape
    layer = _layer(in_channels, out_channels, tuple(kernel), tuple(dilation))
    sparse = spconv.SparseConvTensor(features.contiguous(), coords.to(torch.int32).contiguous(),
                                     [int(s) for s in spatial_shape.tolist()], int(batch_size))
    with torch.no_grad():
        out = layer._conv_forward(True, sparse, weight.contiguous(), None)  # spconv's forward, our weight
    table = out.indice_dict[_INDICE_KEY]
    return out.features, table.indice_pairs, table.indice_pair_num


def _forward_fake(features, coords, spatial_shape, batch_size, weight, dilation):
    n, taps = features.shape[0], math.prod(weight.shape[1:4])
    # spconv's native neighbour table: [in/out, kernel tap, point] indices and per-tap counts.
    return (features.new_empty((n, weight.shape[0])), coords.new_empty((2, taps, n), dtype=torch.int32),
            coords.new_empty((taps,), dtype=torch.int32))


def _backward_kernel(features: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                     indice_pairs: torch.Tensor, indice_pair_num: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    spconv = _spconv()
    with no_cuda_stream(enabled=not features.is_cuda):
        grad_features, grad_weight = spconv.ops.indice_conv_backward(
            features.contiguous(), weight.contiguous(), grad_out.contiguous(), indice_pairs, indice_pair_num,
            inverse=False, subm=True, algo=spconv.ConvAlgo.Native)
    return grad_features, grad_weight


_subm_backward = external_op("pimm_fn::spconv_subm_conv3d_backward", _backward_kernel,
                             fake=lambda f, w, g, p, n: (torch.empty_like(f), torch.empty_like(w)))


def _save(ctx, inputs, output):
    features, _, _, _, weight, _ = inputs
    _, pairs, pair_num = output
    ctx.save_for_backward(features, weight, pairs, pair_num)  # not the coords: the table replaces them


def _backward(ctx, grad_out, _grad_pairs, _grad_pair_num):
    features, weight, pairs, pair_num = ctx.saved_tensors
    grad_features, grad_weight = _subm_backward(features, weight, grad_out, pairs, pair_num)
    return grad_features, None, None, None, grad_weight, None


_subm_forward = external_op("pimm_fn::spconv_subm_conv3d", _forward_kernel, fake=_forward_fake,
                            backward=_backward, setup_context=_save)


def subm_conv3d(features: torch.Tensor, coords: torch.Tensor, spatial_shape: Union[torch.Tensor, Sequence[int]],
                batch_size: Union[torch.Tensor, int], weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                dilation: Union[int, Sequence[int]] = 1) -> torch.Tensor:
    """spconv's ``SubMConv3d`` as a function: output features [N, Cout] at the input sites.

    features: [N, Cin] float. coords: [N, 4] integer (batch, z, y, x), unique sites.
    spatial_shape: (Z, Y, X) the coords lie within; batch_size: the number of clouds.
        Both may be tensors (read on the host inside the op, so they can be computed in
        the step without a graph break) or Python ints (constants of the compiled graph).
    weight: [Cout, kz, ky, kx, Cin] (spconv's layout: its state dicts load as they are).
    bias: [Cout] or None, added outside the op as spconv adds it in training.
    """
    if weight.dim() != 5:
        raise ValueError(f"subm_conv3d: weight must be [Cout, kz, ky, kx, Cin] (spconv's layout), "
                         f"got shape {tuple(weight.shape)}")
    if math.prod(weight.shape[1:4]) == 1:
        raise ValueError("subm_conv3d: a 1x1x1 submanifold convolution is a linear map of the features; "
                         "use torch.nn.Linear (or features @ weight[:, 0, 0, 0].T) instead")
    if coords.dim() != 2 or coords.shape[1] != 4 or coords.dtype.is_floating_point:
        raise ValueError(f"subm_conv3d: coords must be integer [N, 4] (batch, z, y, x), got "
                         f"{coords.dtype} {tuple(coords.shape)}")
    if not isinstance(spatial_shape, torch.Tensor):
        spatial_shape = torch.tensor(list(spatial_shape), dtype=torch.int64)
    if not isinstance(batch_size, torch.Tensor):
        batch_size = torch.tensor(batch_size, dtype=torch.int64)
    dilation = [dilation] * 3 if isinstance(dilation, int) else list(dilation)
    out = _subm_forward(features, coords, spatial_shape, batch_size, weight, dilation)[0]
    return out if bias is None else out + bias


class SubMConv3d(torch.nn.Module):
    """A submanifold 3D convolution on spconv's kernels whose step compiles whole.

    Same parameters, layout and state-dict keys as ``spconv.pytorch.SubMConv3d`` (weight
    [Cout, kz, ky, kx, Cin], bias [Cout]); ``forward(features, coords, spatial_shape,
    batch_size)`` takes and returns plain tensors instead of a SparseConvTensor.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Union[int, Sequence[int]] = 3,
                 dilation: Union[int, Sequence[int]] = 1, bias: bool = True):
        super().__init__()
        _spconv()  # fail here, with the install command, rather than in the first step
        kernel = [kernel_size] * 3 if isinstance(kernel_size, int) else list(kernel_size)
        self.dilation = [dilation] * 3 if isinstance(dilation, int) else list(dilation)
        self.weight = torch.nn.Parameter(torch.empty(out_channels, *kernel, in_channels))
        self.bias = torch.nn.Parameter(torch.empty(out_channels)) if bias else None
        # torch's convolution default (kaiming-uniform, a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(in_channels * math.prod(kernel))
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, features, coords, spatial_shape, batch_size):
        return subm_conv3d(features, coords, spatial_shape, batch_size, self.weight, self.bias, self.dilation)

    def extra_repr(self) -> str:
        out_channels, *kernel, in_channels = self.weight.shape
        return (f"{in_channels}, {out_channels}, kernel_size={kernel}, dilation={self.dilation}, "
                f"bias={self.bias is not None}")
