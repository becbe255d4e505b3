"""A user's own model with graph breaks: compile_step(fullgraph=False), explain_step's
report of every break, and a torch.compile'd model inside the state."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from pimm_fn import checkpoint
from pimm_fn.compile import compile_step, explain_step
from pimm_fn.optim import adamw
from pimm_fn.schedules import one_cycle
from pimm_fn.state import TrainState
from pimm_fn.steps.supervised import supervised
from pimm_fn.torch_compat import is_compiled_module

torch.set_num_threads(1)


class CloudContextNet(nn.Module):
    """Per-point MLP, then a per-cloud context by a Python loop over ``offset.tolist()``
    (a host read mid-forward), dropout, then a head."""

    def __init__(self, c=16, classes=4, dropout=0.2):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(3, c), nn.LayerNorm(c), nn.GELU())
        self.mix = nn.Sequential(nn.Linear(2 * c, c), nn.GELU(), nn.Dropout(dropout))
        self.head = nn.Linear(c, classes)

    def forward(self, batch):
        x = self.stem(batch["feat"])
        parts, start = [], 0
        for end in batch["offset"].tolist():
            part = x[start:end]
            parts.append(part.amax(0, keepdim=True).expand(end - start, -1))
            start = end
        x = self.mix(torch.cat([x, torch.cat(parts)], 1))
        logits = self.head(x)
        return {"loss": nn.functional.cross_entropy(logits, batch["segment"]), "seg_logits": logits}


def make_batch(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    return {"feat": torch.randn(n, 3, generator=g), "segment": torch.randint(0, 4, (n,), generator=g),
            "offset": torch.tensor(sizes).cumsum(0)}


BATCHES = [make_batch(s, i) for i, s in enumerate([(30, 50, 40), (45, 25, 60), (35, 55, 20), (50, 40, 30)])]


def fresh_state(model_class=None, **settings):
    torch.manual_seed(0)
    model = (model_class or CloudContextNet)(**settings)
    return TrainState.create(model, adamw(one_cycle(100, 1e-2), weight_decay=0.01), seed=3)


def run(step, state, batches):
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"])
    return state, torch.stack(losses)


@pytest.fixture(scope="module")
def regions():
    """One graph-tolerant step, compiled on its first call, shared by the tests."""
    step = compile_step(supervised(clip_grad=1.0), fullgraph=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, losses = run(step, fresh_state(), BATCHES)
    return step, state, losses, [str(w.message) for w in caught]


def test_fullgraph_false_trains_a_model_with_a_host_read_like_the_eager_step(regions):
    # Without dropout: compiled dropout draws its masks differently from eager dropout.
    step = regions[0]
    state, losses = run(step, fresh_state(dropout=0.0), BATCHES)
    eager = compile_step(supervised(clip_grad=1.0), eager=True)
    eager_state, eager_losses = run(eager, fresh_state(dropout=0.0), BATCHES)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-5)
    for k in state.params:
        torch.testing.assert_close(state.params[k], eager_state.params[k], rtol=1e-4, atol=1e-5)
    assert int(state.step) == len(BATCHES) and state.rng.counter == len(BATCHES)
    assert step.compile_count >= 2  # the model's pieces and the update region


def test_fullgraph_false_warns_how_many_breaks_it_compiled_around(regions):
    step, _, _, messages = regions
    said = [m for m in messages if "fullgraph=False" in m]
    assert len(said) == 1 and f"{step.graph_breaks} graph break" in said[0] and "explain_step" in said[0]
    assert step.graph_breaks >= 1


def test_fullgraph_false_is_pure_seeded_and_resumes_bitwise(regions, tmp_path):
    step = regions[0]
    start = fresh_state()
    before = {k: v.clone() for k, v in start.params.items()}
    straight, straight_losses = run(step, start, BATCHES)
    for k, v in start.params.items():  # the input state is never written
        assert torch.equal(v, before[k])
    again, again_losses = run(step, start, BATCHES)  # dropout: same state, same masks
    assert torch.equal(straight_losses, again_losses)
    half, _ = run(step, start, BATCHES[:2])
    checkpoint.save(tmp_path / "half.ckpt", half)
    restored, _ = checkpoint.restore(tmp_path / "half.ckpt", fresh_state())
    resumed, tail_losses = run(step, restored, BATCHES[2:])
    assert torch.equal(tail_losses, straight_losses[2:])
    for k in straight.params:
        assert torch.equal(resumed.params[k], straight.params[k]), k


def test_fullgraph_false_refuses_the_step_cache_and_cuda_graphs():
    with pytest.raises(ValueError, match=r"fullgraph=False\) cannot use the step cache"):
        compile_step(supervised(), fullgraph=False, cache=True)
    with pytest.raises(ValueError, match="CUDA graphs replay one whole-step graph"):
        compile_step(supervised(), fullgraph=False, mode="reduce-overhead")


# --------------------------------------------------------------------------------------
# explain_step: every break, with file:line and a fix
# --------------------------------------------------------------------------------------
@torch._dynamo.disable
def opaque_kernel(x):
    """Stands for a C++/CUDA extension call dynamo cannot trace."""
    return x * 2


class BreakyNet(CloudContextNet):
    def forward(self, batch):
        x = self.stem(batch["feat"])
        cells, inverse = torch.unique(batch["segment"], return_inverse=True)  # data-dependent size
        x = x + torch.zeros(cells.shape[0], x.shape[1]).index_add(0, inverse, x)[inverse]
        x = opaque_kernel(x)  # external op
        parts, start = [], 0
        for end in batch["offset"].tolist():  # host read
            parts.append(x[start:end].amax(0, keepdim=True).expand(end - start, -1))
            start = end
        logits = self.head(self.mix(torch.cat([x, torch.cat(parts)], 1)))
        return {"loss": nn.functional.cross_entropy(logits, batch["segment"])}


def _model_breaks(explanation):
    return [b for b in explanation.breaks if b.location.startswith(__file__)]


def test_explain_step_lists_every_break_with_its_place_kind_and_fix():
    import time

    start = time.perf_counter()
    ex = explain_step(supervised(), fresh_state(BreakyNet), BATCHES[0])
    took = time.perf_counter() - start
    mine = _model_breaks(ex)
    kinds = {b.kind for b in mine}
    assert {"host read", "data-dependent size", "external op"} <= kinds, str(ex)
    for b in mine:
        line = int(b.location.rsplit(":", 1)[1])
        assert b.code and b.code in open(__file__).read().splitlines()[line - 1], b
        assert b.hint and b.reason
    host = next(b for b in mine if b.kind == "host read")
    assert "tolist" in host.code
    assert "external_op" in next(b for b in mine if b.kind == "external op").hint
    assert ex.graph_break_count == len(ex.breaks) >= 3 and ex.graph_count >= 2
    assert "graph break(s)" in str(ex) and host.location in str(ex)
    assert took < 60, took  # one traced call, not a trace per break


def test_explain_step_does_not_depend_on_the_recompile_limit():
    state = fresh_state(BreakyNet)
    wide = explain_step(supervised(), state, BATCHES[0])
    with torch._dynamo.config.patch(recompile_limit=1):
        narrow = explain_step(supervised(), state, BATCHES[0])
    assert [(b.location, b.kind) for b in wide.breaks] == [(b.location, b.kind) for b in narrow.breaks]


def test_explain_step_reports_a_frame_dynamo_skipped():
    # The host read sits inside functional_call's re-parametrisation context, which dynamo
    # cannot resume after: it runs that frame uncompiled, and the report says so.
    ex = explain_step(supervised(), fresh_state(), BATCHES[0])
    host = [b for b in _model_breaks(ex) if b.kind == "host read"]
    assert host and any(b.skipped for b in host), str(ex)
    assert ex.skipped


# --------------------------------------------------------------------------------------
# a torch.compile'd model inside the state
# --------------------------------------------------------------------------------------
class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))  # a top-level parameter too
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 4))

    def forward(self, batch):
        logits = self.body(batch["feat"] @ self.weight)
        return {"loss": nn.functional.cross_entropy(logits, batch["segment"])}


def test_a_compiled_model_checkpoints_under_the_plain_names(tmp_path):
    torch.manual_seed(1)
    plain = Plain()
    compiled = torch.compile(plain, backend="eager")
    state = TrainState.create(compiled, adamw(1e-2))
    assert set(state.params) == {k for k, _ in plain.named_parameters()}
    assert set(state.buffers) == {k for k, _ in plain.named_buffers()}
    assert is_compiled_module(state.model) and state.model is not compiled  # a structure-only copy, still compiled
    step = supervised()
    batch = {"feat": torch.randn(16, 3), "segment": torch.randint(0, 4, (16,))}
    trained, metrics = step(state, batch)
    reference, ref_metrics = step(TrainState.create(plain, adamw(1e-2)), batch)
    torch.testing.assert_close(metrics["loss"], ref_metrics["loss"])
    for k in trained.params:
        torch.testing.assert_close(trained.params[k], reference.params[k])
    checkpoint.save(tmp_path / "c.ckpt", trained)
    restored, _ = checkpoint.restore(tmp_path / "c.ckpt", TrainState.create(Plain(), adamw(1e-2)))
    fresh = Plain()
    fresh.load_state_dict({**restored.params, **restored.buffers})
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, trained.params.get(k, trained.buffers.get(k))), k
