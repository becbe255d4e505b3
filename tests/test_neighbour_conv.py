"""pimm_fn.ops.neighbour_conv (ops/submanifold.py): the pair-listed sparse convolution as one custom op.

Checked against a per-pair loop in float64 (forward and both gradients), torch's own
``opcheck`` of both ops, a trace with ``fullgraph=True`` (one op, no break), the same bits
on one and two threads, frozen inputs, and the errors for malformed arguments.
"""
import pytest
import torch

from pimm_fn.ops import neighbour_conv

N, CIN, COUT, K = 40, 5, 3, 4


def _pairs(seed: int, repeats: bool):
    """Per tap, random (row, col) pairs in 0..N-1 plus two padding pairs on row N."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = [], []
    for size in (7, 0, 12):
        r = torch.randint(0, N, (size,), generator=g) if repeats else torch.randperm(N, generator=g)[:size]
        c = torch.randint(0, N, (size,), generator=g)
        rows.append(torch.cat([r, torch.tensor([N, N])]))
        cols.append(torch.cat([c, torch.tensor([N, N])]))
    return [3, 0, 2], rows, cols  # taps in any order; tap 1 is the centre or unused


def _reference(x, weight, taps, rows, cols, centre):
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    out = [x.new_zeros(weight.shape[2]) for _ in range(N + 1)]
    if centre is not None:
        out = [x[i] @ weight[centre] for i in range(N)] + [out[N]]
    for k, r, c in zip(taps, rows, cols):
        for i, j in zip(r.tolist(), c.tolist()):
            out[i] = out[i] + padded[j] @ weight[k]
    return torch.stack(out[:N])


@pytest.mark.parametrize("centre", [1, None])
@pytest.mark.parametrize("repeats", [False, True])
def test_forward_and_gradients_equal_a_per_pair_loop(centre, repeats):
    taps, rows, cols = _pairs(0, repeats)
    torch.manual_seed(0)
    x = torch.randn(N, CIN, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(K, CIN, COUT, dtype=torch.float64, requires_grad=True)
    out = neighbour_conv(x, weight, taps, rows, cols, centre=centre)
    expected = _reference(x, weight, taps, rows, cols, centre)
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out.sin().sum(), [x, weight])
    want = torch.autograd.grad(expected.sin().sum(), [x, weight])
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    if centre is None:
        assert not got[1][1].any()  # a tap with no pairs and no centre: zero gradient


def test_both_ops_pass_torch_opcheck():
    taps, rows, cols = _pairs(1, True)
    x = torch.randn(N, CIN, requires_grad=True)
    weight = torch.randn(K, CIN, COUT, requires_grad=True)
    torch.library.opcheck(torch.ops.pimm_fn.neighbour_conv.default, (x, weight, taps, rows, cols, 1))
    grad = torch.randn(N, COUT)
    for need_x, need_w in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(torch.ops.pimm_fn.neighbour_conv_backward.default,
                              (grad, x.detach(), weight.detach(), taps, rows, cols, 1, need_x, need_w))


def test_traced_with_fullgraph_is_one_op_and_equals_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    taps, rows, cols = _pairs(2, False)
    torch.manual_seed(0)
    x = torch.randn(N, CIN, requires_grad=True)
    weight = torch.randn(K, CIN, COUT, requires_grad=True)

    def loss(x, weight, rows, cols):
        return neighbour_conv(x, weight, taps, rows, cols, centre=1).tanh().sum()

    counter = CompileCounterWithBackend("aot_eager")  # the forward traced, the backward op through AOTAutograd
    compiled = torch.compile(loss, fullgraph=True, backend=counter)
    got, want = compiled(x, weight, rows, cols), loss(x, weight, rows, cols)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, [x, weight]), torch.autograd.grad(want, [x, weight])):
        assert torch.equal(a, b)
    assert counter.frame_count == 1
    calls = [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.pimm_fn.neighbour_conv.default) == 1


def test_same_bits_on_one_and_two_threads():
    # The rows a tap shares with others (and repeats within a tap) are summed in pair order
    # on the CPU, whatever the thread count.
    taps, rows, cols = _pairs(3, True)
    torch.manual_seed(0)
    x = torch.randn(N, 64, requires_grad=True)
    weight = torch.randn(K, 64, 64, requires_grad=True)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = neighbour_conv(x, weight, taps, rows, cols, centre=1)
            results.append((out, *torch.autograd.grad(out.square().sum(), [x, weight])))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_frozen_weight_or_input_gets_no_gradient_work():
    taps, rows, cols = _pairs(4, False)
    x = torch.randn(N, CIN, requires_grad=True)
    weight = torch.randn(K, CIN, COUT)
    (grad_x,) = torch.autograd.grad(neighbour_conv(x, weight, taps, rows, cols, 1).sum(), [x])
    assert grad_x.shape == x.shape
    weight.requires_grad_(True)
    (grad_w,) = torch.autograd.grad(neighbour_conv(x.detach(), weight, taps, rows, cols, 1).sum(), [weight])
    assert grad_w.shape == weight.shape


def test_autocast_runs_in_its_dtype_and_gradients_come_back_in_the_inputs():
    taps, rows, cols = _pairs(5, False)
    x = torch.randn(N, CIN, requires_grad=True)
    weight = torch.randn(K, CIN, COUT, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = neighbour_conv(x, weight, taps, rows, cols, 1)
    assert out.dtype == torch.bfloat16
    grad_x, grad_w = torch.autograd.grad(out.float().sum(), [x, weight])
    assert grad_x.dtype == grad_w.dtype == torch.float32
    reference = torch.autograd.grad(neighbour_conv(x, weight, taps, rows, cols, 1).sum(), [weight])[0]
    assert torch.allclose(grad_w, reference, rtol=0.05, atol=0.05 * float(reference.abs().max()))


@pytest.mark.parametrize("weight_shape, lists, match", [
    ((K * CIN, COUT), 3, r"weight must be \[taps, Cin=5, Cout\]"),
    ((K, CIN + 1, COUT), 3, r"weight must be \[taps, Cin=5, Cout\]"),
    ((K, CIN, COUT), 2, "one pair list per tap: 3 taps, 2 row lists"),
])
def test_malformed_arguments_name_the_problem(weight_shape, lists, match):
    taps, rows, cols = _pairs(6, False)
    with pytest.raises(ValueError, match=match):
        neighbour_conv(torch.randn(N, CIN), torch.randn(*weight_shape), taps, rows[:lists], cols, 1)
