"""torch 2.13's nested compile regions lose the gradient inside a pimm_fn step (issue 36 item 2).

Every pimm_fn step traces ``torch.autograd.grad``; in torch 2.13 a reused
``torch.compiler.nested_compile_region`` makes its outputs without autograd history there,
so everything before it gets no gradient. PTv3's repeated blocks are therefore not
compiled as regions (benchmarks/README.md, "Repeated blocks compiled once"). Pinned on a
three-call toy: when a torch upgrade fixes it this strict xfail fails, and the regions
can be measured for real.
"""
import pytest
import torch

from pimm_fn import torch_compat


def _chained(x, ws, f):
    leaves = [w.detach().requires_grad_(True) for w in ws]
    y = x
    for w in leaves:
        y = f(y, w)
    loss = y.sum()
    return loss.detach(), torch.autograd.grad(loss, leaves, allow_unused=True)


def _layer(x, w):
    return torch.tanh(x @ w)


@pytest.mark.filterwarnings("ignore:invoke_subgraph traced multiple backward graphs")
@pytest.mark.xfail(strict=True, reason="torch 2.13: a reused nested compile region cuts the traced "
                   "autograd graph (its outputs are made without history), so torch.autograd.grad "
                   "traced in the same graph returns None for everything before it")
def test_torch_keeps_the_gradient_through_a_reused_region():
    region = torch.compiler.nested_compile_region(_layer)
    g = torch.Generator().manual_seed(0)
    x, ws = torch.randn(8, 4, generator=g), [torch.randn(4, 4, generator=g) for _ in range(3)]
    _, expected = _chained(x, ws, _layer)
    torch_compat.reset_dynamo()
    with torch_compat.step_tracing_config():  # trace_autograd_ops, as compile_step traces a step
        _, grads = torch.compile(_chained, fullgraph=True)(x, ws, region)
    assert all(g is not None and torch.allclose(g, e, atol=1e-5) for g, e in zip(grads, expected))
