"""The GRPO experiments run their quick mode (eager, a few steps) and learn beyond their starting policy."""
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


# Learning against each experiment's own baseline (issue 15 item 3): a short eager run
# from the untrained policy, whose first rollout is the random-policy baseline.
def _rollout_metric(name, tmp_path, key, count, one_batch=False, **overrides):
    torch.set_num_threads(1)
    mod = load_experiment(str(experiments_dir() / f"{name}.py"))
    settings = {**experiment_settings(mod, quick=False), "compile": False, **overrides}
    run = mod.build(settings, RunContext(save_path=Path(tmp_path), quick=False))
    state, values = run.state, []
    batches = iter(run.loader.iter_epoch(0, 0))
    batch = next(batches)
    for _ in range(count):
        state, metrics = run.step(state, batch)
        values.append(float(metrics[key]))
        if not one_batch:
            batch = next(batches)
    return values


def test_grpo_cartpole_learns_beyond_the_random_policy(tmp_path):
    pytest.importorskip("gymnasium", reason="CartPole needs gymnasium (pip install gymnasium)")
    # The untrained policy balances ~22 steps (the random-policy level); 12 rollouts of
    # GRPO took it to ~190 of a 200-step cap when this test was written.
    returns = _rollout_metric("grpo_cartpole", tmp_path, "return_mean", 12, steps=13, events=4, max_steps=200)
    assert returns[0] < 40, returns
    assert sum(returns[-3:]) / 3 >= max(100.0, 3 * returns[0]), returns


@pytest.mark.parametrize("reward", ["miou", "point"])
def test_grpo_pointseg_raises_the_reward_of_its_starting_policy(reward, tmp_path):
    from pimm_fn.data import DatasetMissingError

    # GRPO from scratch (no supervised pretraining) on one batch: the sampled labellings'
    # mIoU went 0.12 -> 0.28 in 30 rollouts when this test was written (the bar: 1.5x);
    # with per-point rewards the right points per labelling went 157 -> 416.
    try:
        rewards = _rollout_metric("grpo_pointseg", tmp_path, "reward_mean", 30, one_batch=True,
                                  pretrain_steps=0, group_size=8, epochs=15, reward=reward)
    except DatasetMissingError as e:
        pytest.skip(f"the LiDAR tile is not fetched: {e}")
    assert sum(rewards[-3:]) / 3 >= 1.5 * rewards[0], rewards
