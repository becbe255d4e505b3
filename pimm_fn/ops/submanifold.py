"""A sparse convolution over listed neighbour pairs, as one op the compiler runs but does not trace.

``neighbour_conv(x, weight, taps, rows, cols, centre)`` adds ``x[c] @ weight[k]`` into row
``r`` of the output for every pair ``(r, c)`` of tap ``k``, plus ``x @ weight[centre]`` for
every row: a submanifold convolution once the pairs are listed (PTv3's positional encoding,
:func:`~pimm_fn.models.serialization.neighbour_pairs`). Row / column ``N`` (``x.shape[0]``)
is a padding pair's: it reads a zero row and writes a row that is dropped.

Why an op: written in torch ops, every tap is a gather, a matmul and an add into rows, in the
forward and twice in the backward; traced into a compiled step that is hundreds of nodes per
convolution, each a C++ kernel for inductor to schedule and gcc to compile. As one
:func:`~pimm_fn.ops.external_op` the compiler sees two calls (forward and backward), and the
kernels below run the same library calls eagerly: one gather of every tap's columns, one
matmul per tap into one buffer, an ``index_add_`` into the rows. Measured in
benchmarks/README.md ("Sparse convolutions as ops").

The additions into a row follow the pairs' order (the centre first, then the taps in order),
on every thread count: ``index_add_`` on the CPU adds its source rows one after another. On
CUDA, where it adds with atomics, each tap gets its own call, so the sums are repeatable
there too as long as no row repeats within a tap (true of
:func:`~pimm_fn.models.serialization.neighbour_pairs`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .custom import external_op

__all__ = ["neighbour_conv"]


def _tap_products(values: torch.Tensor, weight: torch.Tensor, taps: Sequence[int], sizes: Sequence[int],
                  transpose: bool) -> torch.Tensor:
    """``values`` (every tap's rows, in tap order) times each tap's weight, into one buffer."""
    out = values.new_empty(values.shape[0], weight.shape[1] if transpose else weight.shape[2])
    weights = weight.transpose(1, 2).unbind(0) if transpose else weight.unbind(0)
    for k, rows, into in zip(taps, values.split(sizes), out.split(sizes)):
        torch.mm(rows, weights[k], out=into)
    return out


def _add_rows(out: torch.Tensor, index: Sequence[torch.Tensor], values: torch.Tensor, sizes: Sequence[int]) -> None:
    """``out[index[i]] += values`` of list i, lists in order.

    One ``index_add_`` on the CPU (it adds row after row: pair order). On CUDA it adds with
    atomics, so a row that two lists write would sum in any order: one call per list there,
    within which no row repeats but the padding row (dropped).
    """
    if out.is_cuda:
        for rows, part in zip(index, values.split(sizes)):
            out.index_add_(0, rows, part)
    else:
        out.index_add_(0, torch.cat(index), values)


def _padded(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, x.shape[1])])


def _forward_kernel(x: torch.Tensor, weight: torch.Tensor, taps: list[int], rows: list[torch.Tensor],
                    cols: list[torch.Tensor], centre: Optional[int]) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):  # in the dtype it was given, traced or not
        sizes = [len(c) for c in cols]
        products = _tap_products(_padded(x).index_select(0, torch.cat(cols)), weight, taps, sizes, False)
        out = _padded(x @ weight[centre]) if centre is not None else x.new_zeros(x.shape[0] + 1, weight.shape[2])
        _add_rows(out, rows, products, sizes)
        return out[:-1]


def _backward_kernel(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, taps: list[int],
                     rows: list[torch.Tensor], cols: list[torch.Tensor], centre: Optional[int], need_x: bool,
                     need_w: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(x.device.type, enabled=False):
        sizes = [len(c) for c in cols]
        grad_rows = _padded(grad).index_select(0, torch.cat(rows))
        grad_x, grad_w = x.new_empty(0), weight.new_empty(0)  # an op returns tensors: empty for "not needed"
        if need_x:
            grad_x = (_padded(grad @ weight[centre].T) if centre is not None
                      else x.new_zeros(x.shape[0] + 1, x.shape[1]))
            _add_rows(grad_x, cols, _tap_products(grad_rows, weight, taps, sizes, True), sizes)
            grad_x = grad_x[:-1]
        if need_w:
            x_cols = _padded(x).index_select(0, torch.cat(cols))
            grad_w = torch.zeros_like(weight)  # taps without pairs get a zero gradient
            if centre is not None:
                torch.mm(x.T, grad, out=grad_w[centre])
            grad_ws = grad_w.unbind(0)
            for k, xs, gs in zip(taps, x_cols.split(sizes), grad_rows.split(sizes)):
                torch.mm(xs.T, gs, out=grad_ws[k])
        return grad_x, grad_w


def _backward_fake(grad, x, weight, taps, rows, cols, centre, need_x, need_w):
    return x.new_empty(x.shape if need_x else (0,)), weight.new_empty(weight.shape if need_w else (0,))


_backward_op = external_op("pimm_fn::neighbour_conv_backward", _backward_kernel, fake=_backward_fake)


def _save(ctx, inputs, output):
    x, weight, taps, rows, cols, centre = inputs
    ctx.taps, ctx.centre, ctx.pairs = taps, centre, len(rows)
    ctx.save_for_backward(x, weight, *rows, *cols)


def _backward(ctx, grad):
    x, weight, *index = ctx.saved_tensors
    rows, cols = index[:ctx.pairs], index[ctx.pairs:]
    need_x, need_w = ctx.needs_input_grad[:2]
    grad_x, grad_w = _backward_op(grad, x, weight, ctx.taps, rows, cols, ctx.centre, need_x, need_w)
    none = [None] * ctx.pairs
    return grad_x if need_x else None, grad_w if need_w else None, None, none, none, None


_forward_op = external_op(
    "pimm_fn::neighbour_conv", _forward_kernel, backward=_backward, setup_context=_save,
    fake=lambda x, weight, taps, rows, cols, centre: x.new_empty(x.shape[0], weight.shape[2]))


def neighbour_conv(x: torch.Tensor, weight: torch.Tensor, taps: Sequence[int], rows: Sequence[torch.Tensor],
                   cols: Sequence[torch.Tensor], centre: Optional[int] = None) -> torch.Tensor:
    """The convolution over listed pairs: [N, Cin] -> [N, Cout], differentiable in ``x`` and ``weight``.

    weight: [K, Cin, Cout], one matrix per tap. taps: the weight index of each pair list.
    rows, cols: per tap, the output row and input row of each of its pairs (int64, values
        in 0..N, N for a padding pair).
    centre: the tap every row pairs with itself (no list needed), or None.

    Under autocast, ``x`` and ``weight`` are cast to its dtype first, as a matmul would be.
    """
    if weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"neighbour_conv: weight must be [taps, Cin={x.shape[1]}, Cout], got {tuple(weight.shape)}")
    if not len(taps) == len(rows) == len(cols):
        raise ValueError(f"neighbour_conv: one pair list per tap: {len(taps)} taps, {len(rows)} row lists and "
                         f"{len(cols)} column lists")
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    return _forward_op(x, weight, list(taps), list(rows), list(cols), centre)
