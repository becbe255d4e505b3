"""The compiled step's RNG boundary: every call is seeded from the state's key (a graph that
draws, also one compiled late, replays its draws), and the caller's generator is left as it was."""
import pytest
import torch

from pimm_fn import TrainState, compile_step, optim, steps


class _Net(torch.nn.Module):
    """Dropout only for batches larger than ``big`` (a graph that draws appears late)."""

    def __init__(self, big=None):
        super().__init__()
        self.fc = torch.nn.Linear(6, 12)
        self.out = torch.nn.Linear(12, 3)
        self.big = big

    def forward(self, batch):
        h = torch.relu(self.fc(batch["x"]))
        if self.big is not None and batch["x"].shape[0] > self.big:
            h = torch.nn.functional.dropout(h, 0.5, training=True)
        return {"loss": torch.nn.functional.cross_entropy(self.out(h), batch["y"])}


def _state(big=None):
    torch.manual_seed(0)
    return TrainState.create(_Net(big), optim.sgd(0.1), seed=3)


def _batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 6, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def _caller_stream_after(fn):
    torch.manual_seed(123)
    fn()
    return torch.rand(4)


def _same(a, b):
    return all(torch.equal(a.params[k], b.params[k]) for k in a.params)


def test_a_graph_without_random_ops_leaves_the_callers_stream_alone():
    step = compile_step(steps.supervised())
    s0, b = _state(), _batch(8)
    s1, _ = step(s0, b)
    again, _ = step(s0, b)
    assert _same(s1, again) and s1.rng.counter == s0.rng.counter + 1
    clean = _caller_stream_after(lambda: None)
    assert torch.equal(_caller_stream_after(lambda: step(s1, b)), clean)


def test_a_graph_that_draws_is_seeded_from_the_key_every_call():
    step = compile_step(steps.supervised())
    s0, b = _state(big=4), _batch(8)
    s1, _ = step(s0, b)
    again, _ = step(s0, b)
    assert _same(s1, again)  # the key decides the dropout mask, not the caller's stream
    other, _ = step(s0.replace(rng=s0.rng.replace(counter=7)), b)
    assert not _same(s1, other)
    clean = _caller_stream_after(lambda: None)
    assert torch.equal(_caller_stream_after(lambda: step(s0, b)), clean)


def test_a_drawing_graph_compiled_after_calls_that_drew_nothing_is_seeded_too():
    step = compile_step(steps.supervised())
    s0 = _state(big=8)
    s1, _ = step(s0, _batch(8))  # 8 rows: no dropout
    big = _batch(16, seed=1)
    clean = _caller_stream_after(lambda: None)
    first = {}
    # The recompile for 16 rows draws: seeded like every call, and the caller's stream is kept.
    assert torch.equal(_caller_stream_after(lambda: first.setdefault("s", step(s1, big)[0])), clean)
    assert step.compile_count == 2 and len(step.recompile_reasons) == 1
    again, _ = step(s1, big)
    assert _same(first["s"], again)
    other, _ = step(s1.replace(rng=s1.rng.replace(counter=99)), big)
    assert not _same(first["s"], other)


def test_an_eager_step_seeds_every_call_whatever_its_first_call_drew():
    step = compile_step(steps.supervised(), eager=True)
    s0 = _state(big=8)
    step(s0, _batch(8))  # no dropout this time; eager control flow may draw next time
    big = _batch(16, seed=1)
    clean = _caller_stream_after(lambda: None)
    first = {}
    assert torch.equal(_caller_stream_after(lambda: first.setdefault("s", step(s0, big)[0])), clean)
    assert _same(first["s"], step(s0, big)[0])


# --------------------------------------------------------------------------- host prepare


def _prepare_state():
    from pimm_fn import optim
    from pimm_fn.models import MLPClassifier

    return TrainState.create(MLPClassifier(4, 3, hidden=(8,)), optim.sgd(0.1), seed=3)


def _noisy_inputs(state, batch):
    # host code drawing from torch's generator: the step seeds it from state.rng
    return {"x": batch["x"] + torch.randn_like(batch["x"]), "y": batch["y"]}


def test_prepare_runs_seeded_before_the_core_eager_and_compiled():
    from pimm_fn.compile import Step, compile_step
    from pimm_fn.steps import supervised

    plain = supervised()
    step = Step(plain.core, prepare=_noisy_inputs, name="noisy")
    state = _prepare_state()
    batch = {"x": torch.randn(6, 4), "y": torch.randint(0, 3, (6,))}
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    a, ma = step(state, batch)
    assert torch.equal(torch.rand(2), expected)  # the caller's generator is left alone
    b, mb = step(state, batch)  # same state: same noise, same result
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    assert a.rng == state.rng.next() and a.cursor == state.cursor
    clean, _ = plain(state, batch)  # the noise was really added
    assert not all(torch.equal(a.params[k], clean.params[k]) for k in a.params)
    c, mc = compile_step(step)(state, batch)
    for k in a.params:
        torch.testing.assert_close(c.params[k], a.params[k], rtol=1e-6, atol=1e-6)
    assert c.rng == a.rng


@pytest.mark.parametrize("bad, words", [
    (lambda state, batch: None, "returned None"),
    (lambda state, batch: (state, batch), "returned a TrainState"),
])
def test_prepare_returning_no_batch_is_a_clear_error(bad, words):
    from pimm_fn.compile import Step, compile_step, explain_step
    from pimm_fn.steps import supervised

    step = Step(supervised().core, prepare=bad, name="bad_prepare")
    batch = {"x": torch.randn(6, 4), "y": torch.randint(0, 3, (6,))}
    for run in (step, compile_step(step), lambda s, b: explain_step(step, s, b)):
        with pytest.raises(TypeError, match=words) as err:
            run(_prepare_state(), batch)
        assert "bad_prepare" in str(err.value) and "prepare(state, batch) -> batch'" in str(err.value)


def test_prepare_must_be_callable():
    from pimm_fn.compile import Step

    with pytest.raises(TypeError, match="prepare must be a function"):
        Step(lambda s, b: (s, {}), prepare=3)
