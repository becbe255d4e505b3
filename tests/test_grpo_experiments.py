"""The GRPO experiments build and run their quick mode (eager, a few steps)."""
import math
from pathlib import Path

import pytest
import torch

from pimm_fn.experiment import RunContext, experiment_settings, experiments_dir, load_experiment


def _run_quick(name, tmp_path, **overrides):
    mod = load_experiment(str(experiments_dir() / f"{name}.py"))
    settings = {**experiment_settings(mod, quick=True), "compile": False, **overrides}
    run = mod.build(settings, RunContext(save_path=Path(tmp_path), quick=True))
    state, metrics, steps = run.state, None, 0
    for batch in run.loader.iter_epoch(0, 0):
        state, metrics = run.step(state, batch)
        steps += 1
    assert steps >= 2
    assert int(state.step) == steps
    for key in ("loss", "reward_mean", "reward_std", "rl_pg_loss_update0", "rl_clip_frac_last"):
        assert torch.isfinite(metrics[key]), key
    # P updates per rollout: the optimizer's count advanced P times per step
    assert int(state.opt_state.count) == steps * 2
    scores = run.validate(state)
    assert scores and all(math.isfinite(float(v)) for v in scores.values()), scores  # v == v passed inf
    return metrics, scores


def test_grpo_cartpole_quick(tmp_path):
    pytest.importorskip("gymnasium", reason="CartPole needs gymnasium (pip install gymnasium)")
    metrics, scores = _run_quick("grpo_cartpole", tmp_path)
    assert float(metrics["return_mean"]) >= 8  # CartPole episodes last at least ~8 steps
    assert "eval_return" in scores


def test_grpo_pointseg_quick(tmp_path):
    from pimm_fn.data import DatasetMissingError

    try:
        metrics, scores = _run_quick("grpo_pointseg", tmp_path)
    except DatasetMissingError as e:
        pytest.skip(f"the LiDAR tile is not fetched: {e}")
    assert 0.0 <= float(metrics["reward_mean"]) <= 1.0  # an mIoU
    assert 0.0 <= scores["val_mIoU"] <= 1.0
