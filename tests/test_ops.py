"""pimm_fn.ops: external_op (custom ops over opaque kernels) and segment_csr.

The compiled-step checks share one compiled step (the module fixture): a point model that
calls a numpy kernel registered with external_op (forward and backward ops) and pools
with segment_csr's four reductions, compiled through compile_step over batches whose
point counts all differ, against the same step run eagerly.
"""
import contextlib
import io
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pimm_fn import optim
from pimm_fn.compile import compile_step, explain_step
from pimm_fn.ops import external_op, segment_csr, segment_max_csr, segment_min_csr
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised

DOC = Path(__file__).resolve().parent.parent / "docs" / "external_kernels.md"
REDUCTIONS = ("sum", "mean", "max", "min")


# --- two numpy kernels, opaque to dynamo ----------------------------------------------

def _np_scale_backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, xv, wv = grad.numpy(), x.numpy(), w.numpy()
    return torch.from_numpy(g * wv), torch.from_numpy((g * xv).sum(0))


np_scale_backward = external_op("pimm_fn_test::np_scale_backward", _np_scale_backward,
                                fake=lambda g, x, w: (torch.empty_like(x), torch.empty_like(w)))


def _np_scale_grads(ctx, grad):
    x, w = ctx.inputs  # the default setup_context saved them
    return np_scale_backward(grad, x, w)


@external_op("pimm_fn_test::np_scale", fake=lambda x, w: torch.empty_like(x), backward=_np_scale_grads)
def np_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, C] * w [C], computed by numpy."""
    return torch.from_numpy(x.numpy() * w.numpy())


@external_op("pimm_fn_test::np_exp", fake=torch.empty_like,
             backward=lambda ctx, grad: grad * ctx.output)  # traceable torch: no op needed
def np_exp(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.exp(x.numpy()))


def test_external_op_forward_and_gradients_match_torch():
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out = np_exp(np_scale(x, w))
    ref = torch.exp(x * w)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w), g)
    want = torch.autograd.grad(ref, (x, w), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda a, b: np_exp(np_scale(a, b)), (x, w))


def test_external_op_passes_torch_opcheck():
    # schema, fake kernel against the real one, autograd registration, AOT dispatch with
    # dynamic shapes: what the compiler relies on.
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    for op, args in ((np_scale, (x, w)),
                     (np_exp, (x,)),
                     (np_scale_backward, (torch.randn(5, 3), x.detach(), w.detach()))):
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, (op, results)


def test_external_op_returns_a_callable_op_under_torch_ops():
    x, w = torch.randn(2, 3), torch.randn(3)
    assert torch.equal(torch.ops.pimm_fn_test.np_scale(x, w), np_scale(x, w))


def test_external_op_default_context_holds_non_tensor_inputs_and_every_output():
    def backward(ctx, grad_scaled, grad_shifted):
        x, k = ctx.inputs
        scaled, shifted = ctx.output
        assert isinstance(k, int) and torch.equal(scaled, x * k) and torch.equal(shifted, x + k)
        return grad_scaled * k + grad_shifted, None

    @external_op("pimm_fn_test::scale_shift", fake=lambda x, k: (torch.empty_like(x), torch.empty_like(x)),
                 backward=backward)
    def scale_shift(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x * k, x + k

    x = torch.randn(4, requires_grad=True)
    scaled, shifted = scale_shift(x, 3)
    (gx,) = torch.autograd.grad((2 * scaled + shifted).sum(), x)
    assert torch.equal(gx, torch.full((4,), 7.0))


def test_external_op_setup_context_saves_only_what_it_is_given():
    saved = {}

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        saved["inputs"] = len(inputs)

    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        assert not hasattr(ctx, "inputs")  # the default layout is not built with a custom setup
        return grad * w, None

    @external_op("pimm_fn_test::times", fake=lambda x, w: torch.empty_like(x), backward=backward, setup_context=setup)
    def times(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3)
    (gx,) = torch.autograd.grad(times(x, w).sum(), x)
    assert torch.equal(gx, w) and saved["inputs"] == 2


def _plain(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@pytest.mark.parametrize("name, match", [
    ("no_namespace", "needs exactly one namespace"),
    ("a::b::c", "needs exactly one namespace"),
    ("my-lib::k", "must be a Python identifier"),
    ("mylib::1k", "must be a Python identifier"),
    ("mylib::", "must be a Python identifier"),
    ("class::k", "must be a Python identifier"),
    ("aten::my_kernel", "belongs to torch"),
])
def test_external_op_rejects_bad_names(name, match):
    with pytest.raises(ValueError, match=match):
        external_op(name, _plain, fake=torch.empty_like)


def test_external_op_rejects_a_name_that_is_not_a_string():
    with pytest.raises(TypeError, match="namespace::op_name"):
        external_op(42, _plain, fake=torch.empty_like)


def test_external_op_requires_a_fake_kernel():
    with pytest.raises(TypeError, match="fake must be a function"):
        external_op("pimm_fn_test::no_fake", _plain, fake=None)


def test_external_op_rejects_a_backward_that_is_not_callable():
    with pytest.raises(TypeError, match="backward must be a function"):
        external_op("pimm_fn_test::bad_backward", _plain, fake=torch.empty_like, backward="grad")


def test_external_op_rejects_setup_context_without_backward():
    with pytest.raises(ValueError, match="setup_context was given without backward"):
        external_op("pimm_fn_test::setup_only", _plain, fake=torch.empty_like, setup_context=lambda c, i, o: None)


def test_external_op_rejects_a_kernel_that_is_not_callable():
    with pytest.raises(TypeError, match="the kernel must be a function"):
        external_op("pimm_fn_test::not_fn", "kernel", fake=torch.empty_like)


def test_external_op_rejects_unknown_mutated_arguments():
    with pytest.raises(ValueError, match=r"mutates_args names \['y'\]"):
        external_op("pimm_fn_test::mutates_y", _plain, fake=torch.empty_like, mutates_args=("y",))
    with pytest.raises(TypeError, match="sequence of argument names"):
        external_op("pimm_fn_test::mutates_str", _plain, fake=torch.empty_like, mutates_args="x")


def test_external_op_names_the_missing_annotation():
    def kernel(x):
        return x.clone()

    with pytest.raises(ValueError, match="type annotations.*Parameter x must have a type annotation"):
        external_op("pimm_fn_test::unannotated", kernel, fake=torch.empty_like)


def test_external_op_mutating_kernel():
    @external_op("pimm_fn_test::add_into", fake=lambda acc, x: None, mutates_args=("acc",))
    def add_into(acc: torch.Tensor, x: torch.Tensor) -> None:
        acc.add_(x)

    acc = torch.zeros(3)
    add_into(acc, torch.ones(3))
    assert torch.equal(acc, torch.ones(3))


def test_external_op_name_taken_by_another_function_is_an_error():
    def first(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def second(x: torch.Tensor) -> torch.Tensor:
        return x + 2

    external_op("pimm_fn_test::taken", first, fake=torch.empty_like)
    with pytest.raises(ValueError, match="already registered by .*first.*another name"):
        external_op("pimm_fn_test::taken", second, fake=torch.empty_like)


def test_external_op_registering_the_same_function_again_replaces_it():
    # A notebook cell run twice defines a new function object with the same qualified name.
    def make(offset):
        def kernel(x: torch.Tensor) -> torch.Tensor:
            return x + offset
        return kernel

    external_op("pimm_fn_test::rerun", make(1), fake=torch.empty_like)
    op = external_op("pimm_fn_test::rerun", make(2), fake=torch.empty_like)
    assert torch.equal(op(torch.zeros(1)), torch.full((1,), 2.0))


def test_external_op_refuses_to_change_a_registered_signature():
    def make(two_args):
        if two_args:
            def kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return x + y
        else:
            def kernel(x: torch.Tensor) -> torch.Tensor:
                return x.clone()
        return kernel

    external_op("pimm_fn_test::resigned", make(False), fake=torch.empty_like)
    with pytest.raises(ValueError, match="signature cannot change"):
        external_op("pimm_fn_test::resigned", make(True), fake=lambda x, y: torch.empty_like(x))


def test_external_op_refuses_a_name_torch_already_has():
    torch.library.custom_op("pimm_fn_test_raw::kernel", _plain, mutates_args=())
    with pytest.raises(ValueError, match="already an operator"):
        external_op("pimm_fn_test_raw::kernel", _plain, fake=torch.empty_like)


# --- segment_csr against a per-segment Python reference --------------------------------

def _reference(src, indptr, reduce):
    rows = []
    for i in range(indptr.numel() - 1):
        seg = src[int(indptr[i]):int(indptr[i + 1])]
        if seg.shape[0] == 0:
            rows.append(src.new_zeros(src.shape[1:]))
        elif reduce == "sum":
            rows.append(seg.sum(0))
        elif reduce == "mean":
            rows.append(seg.mean(0))
        elif reduce == "max":
            rows.append(seg.max(0).values)
        else:
            rows.append(seg.min(0).values)
    return torch.stack(rows)


# empty segments first, in the middle and last; one-row segments; rows outside [indptr[0], indptr[-1])
INDPTRS = {
    "dense": [0, 3, 7, 8, 12],
    "empty_segments": [0, 0, 4, 4, 4, 9, 12, 12],
    "rows_outside": [2, 5, 5, 10],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduce", REDUCTIONS)
@pytest.mark.parametrize("layout", sorted(INDPTRS))
def test_segment_csr_matches_a_per_segment_reference(layout, reduce, dtype):
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(12, 3, 2, generator=gen, dtype=dtype, requires_grad=True)
    indptr = torch.tensor(INDPTRS[layout])
    out = segment_csr(src, indptr, reduce)
    ref = _reference(src, indptr, reduce)
    assert out.shape == (indptr.numel() - 1, 3, 2) and out.dtype == dtype
    torch.testing.assert_close(out, ref)
    g = torch.randn(out.shape, generator=gen, dtype=dtype)
    (got,) = torch.autograd.grad(out, src, g)
    (want,) = torch.autograd.grad(ref, src, g)
    torch.testing.assert_close(got, want)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda s: segment_csr(s, indptr, reduce), (src,))


def test_segment_csr_int32_offsets_and_add_alias():
    src = torch.randn(7, 2)
    indptr = torch.tensor([0, 2, 7], dtype=torch.int32)
    torch.testing.assert_close(segment_csr(src, indptr, "add"), _reference(src, indptr.long(), "sum"))


def test_segment_csr_all_segments_empty_and_no_rows():
    src = torch.randn(0, 3, requires_grad=True)
    indptr = torch.zeros(4, dtype=torch.long)
    for reduce in REDUCTIONS:
        out = segment_csr(src, indptr, reduce)
        assert torch.equal(out, torch.zeros(3, 3))
        (g,) = torch.autograd.grad(out.sum(), src)
        assert g.shape == (0, 3)


def test_segment_max_and_min_return_the_first_arg_and_send_the_gradient_there():
    # ties: torch_scatter's arg (the first row reaching the extreme) takes all the gradient
    src = torch.tensor([[1.0], [3.0], [3.0], [-2.0], [-2.0], [5.0]], requires_grad=True)
    indptr = torch.tensor([0, 3, 3, 6])
    values, arg = segment_max_csr(src, indptr)
    assert values.flatten().tolist() == [3.0, 0.0, 5.0]
    assert arg.flatten().tolist() == [1, 6, 5]  # an empty segment's arg is src.shape[0]
    (g,) = torch.autograd.grad(values.sum(), src)
    assert g.flatten().tolist() == [0, 1, 0, 0, 0, 1]
    values, arg = segment_min_csr(src, indptr)
    assert values.flatten().tolist() == [1.0, 0.0, -2.0] and arg.flatten().tolist() == [0, 6, 3]


def test_segment_csr_integer_src():
    src = torch.tensor([[4], [-7], [2], [9]])
    indptr = torch.tensor([0, 3, 3, 4])
    assert segment_csr(src, indptr, "max").flatten().tolist() == [4, 0, 9]
    assert segment_csr(src, indptr, "min").flatten().tolist() == [-7, 0, 9]
    assert segment_csr(src, indptr, "mean").flatten().tolist() == [0, 0, 9]  # -1/3 rounds toward zero
    assert segment_csr(src, indptr, "sum").dtype == torch.int64


@pytest.mark.parametrize("args, error, match", [
    ((torch.randn(4), torch.tensor([0, 4]), "prod"), ValueError, "reduce must be one of"),
    ((torch.randn(4), torch.tensor([[0, 4]]), "sum"), ValueError, "1-D int64 or int32"),
    ((torch.randn(4), torch.tensor([0.0, 4.0]), "sum"), ValueError, "1-D int64 or int32"),
    ((torch.randn(4), torch.tensor([], dtype=torch.long), "sum"), ValueError, "at least one entry"),
    ((torch.randn(4), torch.tensor([0, 3, 2]), "sum"), ValueError, "non-decreasing"),
    ((torch.randn(4), torch.tensor([0, 5]), "max"), ValueError, "src has 4 rows"),
    ((torch.randn(4), torch.tensor([-1, 2]), "mean"), ValueError, "must lie in"),
    ((torch.tensor(1.0), torch.tensor([0, 1]), "sum"), ValueError, "0-dim"),
    (([1.0, 2.0], torch.tensor([0, 2]), "sum"), TypeError, "must be tensors"),
])
def test_segment_csr_errors_name_the_problem(args, error, match):
    with pytest.raises(error, match=match):
        segment_csr(*args)


# --- both inside one compiled pimm_fn step ---------------------------------------------

class PoolNet(torch.nn.Module):
    """Per-point features through a numpy kernel, pooled per cloud with all four reductions."""

    def __init__(self, in_channels=3, width=8, classes=4):
        super().__init__()
        self.embed = torch.nn.Linear(in_channels, width)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.head = torch.nn.Linear(width * 5, classes)

    def forward(self, batch):
        x = torch.tanh(self.embed(batch["feat"]))
        x = np_scale(x, self.scale)
        offset = batch["offset"]
        indptr = F.pad(offset, (1, 0))
        pooled = torch.cat([segment_csr(x, indptr, r) for r in REDUCTIONS], 1)  # [clouds, 4 * width]
        cloud = torch.searchsorted(offset, torch.arange(x.shape[0]), right=True)
        logits = self.head(torch.cat([x, pooled[cloud]], 1))
        return {"loss": F.cross_entropy(logits, batch["segment"])}


def _point_batch(i, sizes):
    gen = torch.Generator().manual_seed(100 + i)
    n = sum(sizes)
    return {"feat": torch.randn(n, 3, generator=gen), "segment": torch.randint(0, 4, (n,), generator=gen),
            "offset": torch.tensor(sizes).cumsum(0)}


SIZES = [(40, 25, 31), (17, 60, 9), (33, 33, 50)]  # every total differs


@pytest.fixture(scope="module")
def pool_runs():
    torch.manual_seed(0)
    model = PoolNet()
    batches = [_point_batch(i, s) for i, s in enumerate(SIZES)]
    runs = {}
    for mode in ("eager", "compiled"):
        step = compile_step(supervised(), eager=(mode == "eager"))
        state = TrainState.create(model, optim.adamw(lr=1e-2))
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        runs[mode] = (step, state, losses)
    # explain last: it resets dynamo, which would make the compiled step compile again
    runs["explain"] = explain_step(supervised(), TrainState.create(model, optim.adamw(lr=1e-2)), batches[0])
    return runs


def test_compiled_step_with_external_op_and_segment_csr_equals_eager(pool_runs):
    _, eager_state, eager_losses = pool_runs["eager"]
    _, state, losses = pool_runs["compiled"]
    for a, b in zip(losses, eager_losses):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in eager_state.params:
        torch.testing.assert_close(state.params[key], eager_state.params[key], rtol=1e-5, atol=1e-6)
    assert int(state.step) == len(SIZES)


def test_compiled_step_compiles_once_over_varying_point_counts(pool_runs):
    step, _, _ = pool_runs["compiled"]
    assert step.compile_count == 1, step.recompile_reasons


def test_step_with_external_op_and_segment_csr_has_no_graph_break(pool_runs):
    explanation = pool_runs["explain"]
    assert explanation.graph_break_count == 0 and not explanation.break_reasons, explanation.break_reasons
    assert explanation.graph_count == 1


def test_docs_example_runs_as_written():
    """docs/external_kernels.md: its python blocks (all but the spconv recipe) run in order."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    runnable = [b for b in blocks if "sparse_conv" not in b]  # the spconv recipe: tests/test_spconv_op.py
    assert len(runnable) >= 2, "the doc lost its code blocks"
    # A module of its own, as a script's __main__ would be: dynamo looks the ops' module up by name.
    module = types.ModuleType("external_kernels_doc")
    sys.modules[module.__name__] = module
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            for i, code in enumerate(runnable):
                exec(compile(code, f"{DOC.name}[block {i}]", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    assert "compiled 1 time(s)" in out.getvalue() and "graph breaks: 0" in out.getvalue()
