"""pimm_fn.recipes and the evaluation pieces experiments share (SegmentationMetric options,
Evaluate.of, Run.evaluator): each recipe equals the composition it names."""

import pytest
import torch

from pimm_fn import metrics as M
from pimm_fn import optim, recipes, schedules
from pimm_fn.callbacks import Evaluate
from pimm_fn.experiment import Run
from pimm_fn.models import PointSegNet
from pimm_fn.state import TrainState


def _lr_b1(tx, params, steps):
    """(lr, b1) hyperparameters over ``steps`` updates of zero gradients."""
    state, out = tx.init(params), []
    for _ in range(steps):
        hp = tx.hyperparams(state)
        out.append({k: float(v) for k, v in hp.items()})
        _, state = tx.update({k: torch.zeros_like(v) for k, v in params.items()}, state, params)
    return out


def test_adamw_one_cycle_is_adamw_with_one_cycle_lr_and_cycled_beta1():
    params = {"w": torch.ones(3), "head.w": torch.ones(2)}
    total = 20
    mine = recipes.adamw_one_cycle(total, 0.1, weight_decay=0.01, pct_start=0.25)
    ref = optim.adamw(lr=schedules.one_cycle(total, 0.1, pct_start=0.25, div_factor=10, final_div_factor=1000),
                      weight_decay=0.01, b1=schedules.one_cycle_momentum(total, pct_start=0.25))
    assert _lr_b1(mine, params, total) == _lr_b1(ref, params, total)
    grouped = recipes.adamw_one_cycle(total, 0.1, weight_decay=0.01, pct_start=0.25,
                                      groups=[{"keyword": "head", "lr": 0.5, "name": "head"}])
    hp = _lr_b1(grouped, params, total)
    peak = max(range(total), key=lambda i: hp[i]["lr/head"])
    assert hp[peak]["lr/head"] == pytest.approx(0.5) and max(h["lr/default"] for h in hp) == pytest.approx(0.1)


def test_segmentation_metric_class_subset_and_present_classes():
    # class 0: 2 points, both right; class 1: 2 points, one right; class 2: absent, predicted once
    out = {"pred": torch.tensor([0, 0, 1, 2]), "target": torch.tensor([0, 0, 1, 1])}
    full = M.SegmentationMetric(3)
    base = full.compute(full.update(full.init(), out))
    sub = M.SegmentationMetric(3, classes=[0, 1], present=True, per_class=False)
    got = sub.compute(sub.update(sub.init(), out))
    iou = [1.0, 0.5, 0.0]
    assert base["mIoU"] == pytest.approx(sum(iou) / 3) and "iou/2" in base
    assert got["mIoU"] == pytest.approx(0.75) and got["mIoU_present"] == pytest.approx(0.75)
    assert got["mAcc"] == pytest.approx(0.75) and got["allAcc"] == pytest.approx(0.75)
    assert not any(k.startswith("iou/") for k in got)
    with pytest.raises(ValueError, match=r"classes \[3\] are not class ids of a 3-class metric"):
        M.SegmentationMetric(3, classes=[0, 3])


def _point_batch(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    coord = torch.rand(n, 3, generator=g)
    return {"coord": coord, "grid_coord": (coord * 20).long(), "feat": coord.clone(),
            "offset": torch.tensor([n]), "segment": torch.randint(0, 3, (n,), generator=g)}


def test_segmentation_eval_scores_the_models_argmax_like_a_hand_loop():
    torch.manual_seed(0)
    state = TrainState.create(PointSegNet(in_channels=3, num_classes=3, width=8), optim.sgd(0.1))
    batches = [_point_batch(seed=i) for i in range(3)]
    keys = ("coord", "grid_coord", "feat", "offset")
    got = recipes.segmentation_eval(batches, keys, 3).metrics(state)
    i = u = t = 0
    from pimm_fn.steps.common import eval_forward

    for b in batches:
        pred = eval_forward(state, {k: b[k] for k in keys})["seg_logits"].argmax(-1)
        di, du, dt = M.intersection_and_union(pred, b["segment"], 3)
        i, u, t = i + di, u + du, t + dt
    want = M.segmentation_scores(i, u, t)
    assert got == pytest.approx(want)


def test_run_evaluator_from_an_evaluate_or_a_function(tmp_path):
    calls = []

    def whole(state):
        calls.append(state)
        return {"score": torch.tensor(0.25), "n": 3}

    state = object()
    run = Run(state=state, loader=[], step=None, epochs=1, evaluate=whole, eval_every_epochs=3)
    ev = run.evaluator()
    assert isinstance(ev, Evaluate) and (ev.every_epochs, ev.name, ev.at_end) == (3, "val", True)
    assert run.validate(state) == {"score": 0.25, "n": 3.0} and calls == [state]
    given = Evaluate(lambda s, b: {"loss": torch.tensor(float(b))}, [1, 2, 3], every_epochs=1, name="x")
    run = Run(state=state, loader=[], step=None, epochs=1, evaluate=given, eval_every_epochs=2)
    assert run.validate(state) == {"loss": 2.0}
    assert (run.evaluator().every_epochs, run.evaluator().name) == (2, "val") and given.name == "x"  # a copy
    with pytest.raises(TypeError, match="Run.evaluate must be an Evaluate or a function"):
        Run(state=state, loader=[], step=None, epochs=1, evaluate=42).evaluator()
    with pytest.raises(TypeError, match="must return a dict of numbers"):
        Evaluate.of(lambda s: 1.0).metrics(state)
