"""Malformed batches are named on the host before a step (or the compiler) sees them."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fit_helpers import make_state, step_fn

from pimm_fn import TrainState, compile_step, optim, steps
from pimm_fn.data import validate_batch
from pimm_fn.fit import fit
from pimm_fn.models import MLPClassifier


def _points(sizes=(5, 7), short=0):
    n = sum(sizes)
    offset = torch.tensor(sizes).cumsum(0)
    return {"coord": torch.randn(n, 3), "feat": torch.randn(n, 4), "offset": offset,
            "segment": torch.zeros(n - short, dtype=torch.int64)}


def test_validate_batch_names_the_key_and_passes_good_batches():
    validate_batch({"x": torch.randn(32, 4), "y": torch.zeros(32, dtype=torch.int64)})
    validate_batch(_points())
    validate_batch({"tokens": torch.zeros(3, 5), "mask": torch.ones(2)})  # unknown kinds pass
    with pytest.raises(ValueError, match="batch key 'y' has 30 rows, 'x' has 32"):
        validate_batch({"x": torch.randn(32, 4), "y": torch.zeros(30, dtype=torch.int64)})
    with pytest.raises(ValueError, match="segment has 9 rows, coord has 12"):
        validate_batch(_points(short=3))
    bad = _points()
    bad["coord"][6, 1] = float("nan")
    with pytest.raises(ValueError, match="cloud 1 .*NaN"):
        validate_batch(bad)


def test_a_compiled_step_rejects_a_malformed_first_batch_before_tracing():
    torch.manual_seed(0)
    state = TrainState.create(MLPClassifier(4, 3, hidden=(8,)), optim.sgd(0.1), seed=0)
    step = compile_step(steps.supervised())
    with pytest.raises(ValueError, match="step 'supervised' is malformed: batch key 'y' has 30 rows, 'x' has 32"):
        step(state, {"x": torch.randn(32, 4), "y": torch.zeros(30, dtype=torch.int64)})
    assert step.compile_count == 0


def test_fit_names_a_malformed_first_batch_before_the_step_runs():
    calls = []

    def counting(state, batch):
        calls.append(1)
        return step_fn(state, batch)

    batches = [{"x": torch.randn(8, 4), "y": torch.zeros(6, dtype=torch.int64)}]
    with pytest.raises(ValueError, match="batch 0 of epoch 0 is malformed: batch key 'y' has 6 rows, 'x' has 8"):
        fit(make_state(), batches, counting, epochs=1)
    assert calls == []


def test_non_finite_inputs_after_the_first_batch_skip_their_update_by_default():
    torch.manual_seed(0)
    state = TrainState.create(MLPClassifier(4, 3, hidden=(8,)), optim.sgd(0.1), seed=0)
    good = [{"x": torch.randn(8, 4), "y": torch.randint(0, 3, (8,))} for _ in range(3)]
    bad = {"x": good[1]["x"].clone(), "y": good[1]["y"]}
    bad["x"][2, 0] = float("nan")
    step = steps.supervised()
    res = fit(state, [good[0], bad, good[2]], step, epochs=1)
    assert res.history.values("skipped").tolist() == [0.0, 1.0, 0.0]
    after_good = step(state, good[0])[0]
    after_bad = fit(state, [good[0], bad], step, epochs=1).state
    assert all(torch.equal(after_good.params[k], after_bad.params[k]) for k in state.params)


def test_a_batch_without_the_models_labels_is_named_as_such():
    from pimm_fn.steps.common import MissingLossError

    torch.manual_seed(0)
    state = TrainState.create(MLPClassifier(4, 3, hidden=(8,)), optim.sgd(0.1), seed=0)
    unlabelled = {"x": torch.randn(8, 4)}
    step = compile_step(steps.supervised())
    with pytest.raises(MissingLossError, match="the batch has no 'y' entry, the labels MLPClassifier computes"):
        step(state, unlabelled)
    assert step.compile_count == 0  # named on the host, before any trace
    with pytest.raises(MissingLossError, match="no 'y' entry"):
        steps.supervised()(state, unlabelled)  # eager too
