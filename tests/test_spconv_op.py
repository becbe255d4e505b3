"""spconv's SubMConv3d as a custom op (pimm_fn.ops.sparse_conv) inside a compiled step.

Optional: needs spconv (``pip install 'pimm_fn[spconv]'``; scripts/setup.sh tries it).
A two-layer sparse model is trained for three steps over point batches whose sizes all
differ, compiled (fullgraph, through compile_step) and eagerly; both are checked against
the same model written with spconv's own ``spconv.pytorch.SubMConv3d`` modules.
"""
import pytest
import torch
import torch.nn.functional as F

spconv = pytest.importorskip(
    "spconv.pytorch", reason="spconv is not installed (optional: pip install 'pimm_fn[spconv]')")

import spconv as spconv_package

from pimm_fn import optim
from pimm_fn.compile import compile_step, explain_step
from pimm_fn.ops.sparse_conv import SubMConv3d, no_cuda_stream, subm_conv3d
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised

GRID = 8
SIZES = [(70, 45), (30, 90), (64, 64)]  # points per cloud; every total differs
LR = 0.1


class SparseNet(torch.nn.Module):
    """Two submanifold convolutions and a per-point classifier, on pimm_fn's op."""

    def __init__(self, in_channels=4, width=8, classes=3):
        super().__init__()
        self.conv1 = SubMConv3d(in_channels, width, 3)
        self.conv2 = SubMConv3d(width, width, 3, bias=False)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, batch):
        coords = batch["coords"]
        spatial_shape = coords[:, 1:].amax(0) + 1  # a tensor: the op reads it on the host
        batch_size = batch["offset"].shape[0]
        x = F.relu(self.conv1(batch["feat"], coords, spatial_shape, batch_size))
        x = F.relu(self.conv2(x, coords, spatial_shape, batch_size))
        return {"loss": F.cross_entropy(self.head(x), batch["segment"])}


class SpconvNet(torch.nn.Module):
    """The same model on spconv's own modules (its SparseConvTensor, its autograd)."""

    def __init__(self, in_channels=4, width=8, classes=3):
        super().__init__()
        self.conv1 = spconv.SubMConv3d(in_channels, width, 3, bias=True)
        self.conv2 = spconv.SubMConv3d(width, width, 3, bias=False)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, batch):
        coords = batch["coords"]
        shape = (coords[:, 1:].amax(0) + 1).tolist()
        x = spconv.SparseConvTensor(batch["feat"], coords, shape, batch["offset"].shape[0])
        x = self.conv1(x)
        x = x.replace_feature(F.relu(x.features))
        x = self.conv2(x)
        return {"loss": F.cross_entropy(self.head(F.relu(x.features)), batch["segment"])}


def _batch(i, sizes):
    gen = torch.Generator().manual_seed(10 + i)
    coords = []
    for b, n in enumerate(sizes):
        cells = torch.randperm(GRID ** 3, generator=gen)[:n]  # unique voxels per cloud
        zyx = torch.stack([cells // GRID ** 2, cells // GRID % GRID, cells % GRID], 1)
        coords.append(torch.cat([torch.full((n, 1), b), zyx], 1))
    n = sum(sizes)
    return {"coords": torch.cat(coords).int(), "feat": torch.randn(n, 4, generator=gen),
            "segment": torch.randint(0, 3, (n,), generator=gen), "offset": torch.tensor(sizes).cumsum(0)}


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(0)
    model = SparseNet()
    batches = [_batch(i, s) for i, s in enumerate(SIZES)]
    out = {"model": model, "batches": batches}
    for mode in ("eager", "compiled"):
        step = compile_step(supervised(), eager=(mode == "eager"))
        state = TrainState.create(model, optim.sgd(lr=LR))
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        out[mode] = (step, state, losses)
    # the reference: spconv's modules with the same initial weights, torch autograd, SGD by hand
    reference = SpconvNet()
    reference.load_state_dict(model.state_dict())
    params = dict(reference.named_parameters())
    losses = []
    for batch in batches:
        loss = reference(batch)["loss"]
        with no_cuda_stream():  # spconv's CPU backward asks for a CUDA stream (see the module)
            grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads):
                p -= LR * g
        losses.append(loss.detach())
    out["spconv"] = (params, losses)
    # explain last: it resets dynamo, which would make the compiled step compile again
    out["explain"] = explain_step(supervised(), TrainState.create(model, optim.sgd(lr=LR)), batches[0])
    return out


def test_op_forward_and_gradients_equal_spconv_submconv3d_bitwise():
    torch.manual_seed(1)
    batch = _batch(0, (50, 40))
    ours, theirs = SubMConv3d(4, 6, 3), spconv.SubMConv3d(4, 6, 3, bias=True)
    ours.load_state_dict(theirs.state_dict())  # same layout and keys
    feat = batch["feat"].requires_grad_(True)
    shape = (batch["coords"][:, 1:].amax(0) + 1).tolist()
    expected = theirs(spconv.SparseConvTensor(feat, batch["coords"], shape, 2)).features
    got = ours(feat, batch["coords"], shape, 2)
    assert torch.equal(got, expected)
    g = torch.randn_like(got)
    with no_cuda_stream():
        want = torch.autograd.grad(expected, (feat, theirs.weight, theirs.bias), g)
    have = torch.autograd.grad(got, (feat, ours.weight, ours.bias), g)
    for a, b in zip(have, want):
        assert torch.equal(a, b)


def test_no_cuda_stream_nests_and_restores():
    # the backward op enters the block again inside a user's own: it must not deadlock
    batch = _batch(3, (25,))
    conv = SubMConv3d(4, 3, 3)
    feat = batch["feat"].requires_grad_(True)
    ops = spconv.ops
    original = ops.get_current_stream
    with no_cuda_stream():
        out = conv(feat, batch["coords"], [GRID] * 3, 1)
        (grad,) = torch.autograd.grad(out.sum(), feat)
        assert ops.get_current_stream() == 0
    assert grad.shape == feat.shape and ops.get_current_stream is original


def test_op_passes_torch_opcheck():
    batch = _batch(1, (20, 25))
    weight = torch.randn(5, 3, 3, 3, 4, requires_grad=True)
    op = torch.ops.pimm_fn.spconv_subm_conv3d
    args = (batch["feat"].requires_grad_(True), batch["coords"], torch.tensor([GRID] * 3), torch.tensor(2), weight,
            [1, 1, 1])
    results = torch.library.opcheck(op, args)
    assert set(results.values()) == {"SUCCESS"}, results


def test_compiled_step_equals_eager_step(runs):
    _, eager, eager_losses = runs["eager"]
    _, compiled, losses = runs["compiled"]
    for a, b in zip(losses, eager_losses):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in eager.params:
        torch.testing.assert_close(compiled.params[key], eager.params[key], rtol=1e-5, atol=1e-6)


def test_steps_equal_spconv_modules_in_eager(runs):
    params, ref_losses = runs["spconv"]
    # the first forward runs on the same weights through the same spconv kernels: bitwise
    assert torch.equal(runs["eager"][2][0], ref_losses[0])
    for mode in ("eager", "compiled"):
        _, state, losses = runs[mode]
        for a, b in zip(losses, ref_losses):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for key, value in params.items():
            torch.testing.assert_close(state.params[key], value.detach(), rtol=1e-5, atol=1e-6)


def test_compiled_step_compiles_once_and_has_no_graph_break(runs):
    step, _, _ = runs["compiled"]
    assert step.compile_count == 1, step.recompile_reasons
    explanation = runs["explain"]
    assert explanation.graph_break_count == 0 and not explanation.break_reasons, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.skipif(torch.cuda.is_available() or spconv_package.__version__ != "2.3.8",
                    reason="documents spconv 2.3.8's CUDA-stream lookup, which fails only without CUDA")
def test_spconv_cpu_backward_needs_the_stream_workaround():
    batch = _batch(2, (30,))
    conv = spconv.SubMConv3d(4, 2, 3)
    feat = batch["feat"].requires_grad_(True)
    out = conv(spconv.SparseConvTensor(feat, batch["coords"], [GRID] * 3, 1)).features.sum()
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        torch.autograd.grad(out, feat, retain_graph=True)
    with no_cuda_stream():
        (grad,) = torch.autograd.grad(out, feat)
    assert grad.shape == feat.shape
    assert spconv.ops.get_current_stream.__name__ == "get_current_stream"  # restored after the block


@pytest.mark.parametrize("kwargs, match", [
    ({"weight": torch.randn(4, 3, 3, 4)}, r"weight must be \[Cout, kz, ky, kx, Cin\]"),
    ({"weight": torch.randn(4, 1, 1, 1, 4)}, "1x1x1 submanifold convolution is a linear map"),
    ({"coords": torch.zeros(5, 3, dtype=torch.int32)}, r"coords must be integer \[N, 4\]"),
    ({"coords": torch.zeros(5, 4)}, r"coords must be integer \[N, 4\]"),
])
def test_subm_conv3d_errors_name_the_problem(kwargs, match):
    args = {"features": torch.randn(5, 4), "coords": torch.zeros(5, 4, dtype=torch.int32), "spatial_shape": [4, 4, 4],
            "batch_size": 1, "weight": torch.randn(4, 3, 3, 3, 4)}
    with pytest.raises(ValueError, match=match):
        subm_conv3d(**{**args, **kwargs})


def test_docs_spconv_recipe_runs_as_written():
    """docs/external_kernels.md's spconv block runs as written (the others: tests/test_ops.py)."""
    import contextlib
    import io
    import re
    import sys
    import types
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent / "docs" / "external_kernels.md"
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S) if "sparse_conv" in b]
    assert len(blocks) == 1, "the doc lost its spconv recipe"
    module = types.ModuleType("external_kernels_spconv")  # as a script's __main__: dynamo looks it up
    sys.modules[module.__name__] = module
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(blocks[0], f"{doc.name}[spconv recipe]", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    assert "compiled 1 time(s), graph breaks: 0" in out.getvalue()
