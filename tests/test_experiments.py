"""Every experiment trains a few steps through the command line and writes its run folder.

Each test runs ``python -m pimm_fn ...`` in a subprocess, as a user would. Experiments
with a ``compile`` setting run eagerly (``--set compile=false``) for speed, except the
default main job, lidar_seg, which runs once compiled. Further: ``--set`` errors are one
line (an unknown key's lists the valid keys); ``--resume`` of a finished run says so and
exits 1; ``eval --checkpoint`` prints the metrics; and a lidar_seg run SIGKILLed mid-training and resumed with
``--resume`` ends bitwise equal to an uninterrupted run.

The data sets must be fetched (``python -m pimm_fn.data.fetch all``); a test whose data
is missing is skipped with the fetch command.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# experiment -> (has a compile setting, renders prediction.png)
EXPERIMENTS = {
    "lidar_seg": (True, True),
    "frog_seg": (True, True),
    "digits_cls": (True, True),
    "multi_dataset_seg": (True, True),
    "instance_seg": (True, True),
    "ptv3_seg": (True, True),
    "particle_seg": (True, True),
    "grpo_pointseg": (True, False),
    "grpo_cartpole": (True, False),
}
RUN_FILES = ("settings.json", "train.log", "summary.json", "curves.png", "checkpoints/latest")


def cli(*args, timeout=300, check=True, env=None) -> subprocess.CompletedProcess:
    """``python -m pimm_fn ARGS`` from the repository root; skips when a data set is missing."""
    proc = subprocess.run([sys.executable, "-m", "pimm_fn", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and "pimm-fn: data set " in out:
        pytest.skip("a data set is not fetched: " + out.strip().splitlines()[-1])
    if check:
        assert proc.returncode == 0, f"pimm-fn {' '.join(map(str, args))} exited {proc.returncode}:\n{out[-4000:]}"
    return proc


def check_run_folder(save: Path, renders: bool) -> dict:
    for name in RUN_FILES + (("prediction.png",) if renders else ()):
        assert (save / name).is_file(), f"{name} missing from the run folder: {sorted(os.listdir(save))}"
    assert list((save / "tensorboard").glob("events.out.tfevents.*")), "no tensorboard events"
    latest = (save / "checkpoints" / (save / "checkpoints" / "latest").read_text().strip())
    assert latest.is_file(), f"checkpoints/latest names {latest}, which does not exist"
    for png in ("curves.png",) + (("prediction.png",) if renders else ()):
        assert (save / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    summary = json.loads((save / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] >= 2, summary
    assert "final_eval" in summary, summary
    assert all(math.isfinite(v) for v in summary["final_eval"].values()), summary["final_eval"]  # no NaN, no inf
    return summary


@pytest.fixture(scope="module")
def lidar_compiled(tmp_path_factory):
    """The default main job, quick and compiled (the first run also warms the inductor cache)."""
    save = tmp_path_factory.mktemp("lidar_compiled")
    t0 = time.perf_counter()
    proc = cli("train", "lidar_seg", "--quick", "--no-progress", "--save-path", save, timeout=900)
    print(f"lidar_seg --quick compiled: {time.perf_counter() - t0:.1f} s")
    return save, proc


def test_lidar_seg_compiled_writes_run_folder(lidar_compiled):
    save, proc = lidar_compiled
    summary = check_run_folder(save, renders=True)
    assert json.loads((save / "settings.json").read_text())["compile"] is True
    assert 0.0 <= summary["final_eval"]["mIoU"] <= 1.0
    assert "pimm-fn: completed at step 4" in proc.stdout, proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr  # the README's main job prints no warning


@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if n != "lidar_seg"])
def test_experiment_quick_through_cli(name, tmp_path):
    has_compile, renders = EXPERIMENTS[name]
    save = tmp_path / name
    t0 = time.perf_counter()
    cli("train", name, "--quick", "--no-progress", "--save-path", save,
        *(("--set", "compile=false") if has_compile else ()))
    print(f"{name} --quick eager: {time.perf_counter() - t0:.1f} s")
    summary = check_run_folder(save, renders)
    assert json.loads((save / "settings.json").read_text())["experiment"] == name
    assert math.isfinite(summary["final_train"]["loss"]), summary["final_train"]


def test_every_experiment_is_covered():
    from pimm_fn.experiment import available_experiments

    assert set(available_experiments()) == set(EXPERIMENTS), "a new experiment needs a line in EXPERIMENTS"


def test_unknown_setting_exits_nonzero_listing_valid_keys():
    proc = cli("train", "lidar_seg", "--set", "epochz=3", check=False, timeout=120)
    assert proc.returncode != 0
    assert "unknown setting 'epochz'" in proc.stderr and "did you mean epochs" in proc.stderr, proc.stderr
    assert "valid keys:" in proc.stderr and "batch_size=4" in proc.stderr, proc.stderr


def test_wrong_type_exits_nonzero_naming_the_type():
    proc = cli("train", "lidar_seg", "--set", "epochs=ten", check=False, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "pimm-fn: setting 'epochs' is int (default 60), got 'ten'; pass an int, e.g. --set epochs=60"
    ), proc.stderr


def test_resume_of_a_finished_run_says_complete(lidar_compiled):
    save, _ = lidar_compiled
    proc = cli("train", "lidar_seg", "--quick", "--no-progress", "--save-path", save, "--resume", check=False)
    assert proc.returncode == 1 and "already complete" in proc.stderr, proc.stdout + proc.stderr


def test_eval_prints_metrics(lidar_compiled):
    save, _ = lidar_compiled
    proc = cli("eval", "lidar_seg", "--checkpoint", save / "checkpoints" / "best.ckpt")
    metrics = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert metrics["step"] in (2, 4)
    assert 0.0 <= metrics["mIoU"] <= 1.0 and 0.0 <= metrics["allAcc"] <= 1.0, metrics


# --------------------------------------------------------------------------- SIGKILL + --resume

# 5 steps per epoch, 20 in all. Two intra-op threads, in PointSegNet's deterministic mode:
# its default pooling (index_add / scatter_reduce, whose backward scatter-adds over voxel
# groups) is not bitwise reproducible on two threads even between two uninterrupted runs
# (parameters drift ~1e-4 in 10 steps), which would hide what this test checks.
RESUME_ARGS = ("--no-progress", "--set", "compile=false", "--set", "epochs=4", "--set", "deterministic=true")
TWO_THREADS = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}


def _last_logged_step(save: Path) -> int:
    log = save / "train.log"
    if not log.is_file():
        return 0
    steps = [int(w.split()[0]) for line in log.read_text().splitlines() for w in line.split("] step ")[1:]]
    return max(steps, default=0)


def _final_state(save: Path):
    from pimm_fn.checkpoint import CheckpointDir, restore
    from pimm_fn.experiment import RunContext, load_experiment

    mod = load_experiment("lidar_seg")
    like = mod.build({**mod.SETTINGS, "compile": False, "epochs": 4, "deterministic": True},
                     RunContext(save_path=save)).state
    state, _ = restore(CheckpointDir(save / "checkpoints").latest(), like)
    return state


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    from pimm_fn.tree import tree_flatten_with_path

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    cli("train", "lidar_seg", "--save-path", straight, *RESUME_ARGS, env=TWO_THREADS)

    cmd = [sys.executable, "-m", "pimm_fn", "train", "lidar_seg", "--save-path", str(killed), *RESUME_ARGS]
    err = open(tmp_path / "killed.stderr", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **TWO_THREADS})
    try:
        deadline = time.monotonic() + 300
        # kill mid-epoch 2: after the epoch-1 checkpoint, steps 7+ in flight
        while not ((killed / "checkpoints" / "latest").is_file() and _last_logged_step(killed) >= 7):
            assert proc.poll() is None, (
                f"the run ended before it could be killed:\n{(tmp_path / 'killed.stderr').read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # the test failed before the kill: leave no stray run behind
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        err.close()
    assert proc.returncode == -signal.SIGKILL
    killed_at = _last_logged_step(killed)
    assert killed_at < 20 and not (killed / "summary.json").exists()

    resumed = cli("train", "lidar_seg", "--save-path", killed, "--resume", *RESUME_ARGS, env=TWO_THREADS)
    assert "resuming from step" in resumed.stdout, resumed.stdout
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 20

    a, b = _final_state(straight), _final_state(killed)
    assert int(a.step) == int(b.step) == 20
    assert a.cursor == b.cursor
    paths_a, leaves_a, _ = tree_flatten_with_path(a)
    paths_b, leaves_b, _ = tree_flatten_with_path(b)
    assert paths_a == paths_b
    for path, va, vb in zip(paths_a, leaves_a, leaves_b):
        if isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), f"{path} differs after SIGKILL at step {killed_at} + resume"
        else:
            assert va == vb, path
    # the resumed run's last checkpoint carries every step's metrics, the killed process's included
    from pimm_fn.checkpoint import CheckpointDir, restore

    _, extra = restore(CheckpointDir(killed / "checkpoints").latest(), b)
    assert extra["history"]["steps"].tolist() == list(range(1, 21))


def test_lidar_full_resolution_eval_batches_blocks_with_the_same_miou(tmp_path):
    # inverse indexes the batch (point_collate shifts it per cloud): 4 validation blocks in
    # one forward score every original point as 4 forwards of one block do.
    from pimm_fn.experiment import RunContext, load_experiment

    mod = load_experiment("lidar_seg")
    scores = {}
    for n in (1, 4):
        try:
            run = mod.build({**mod.SETTINGS, "compile": False, "eval_batch_size": n}, RunContext(save_path=tmp_path))
        except Exception as err:  # the data set is not fetched here
            if "pimm_fn.data.fetch" in str(err):
                pytest.skip(str(err))
            raise
        scores[n] = run.validate(run.state)
    assert scores[4] == pytest.approx(scores[1], abs=1e-4), scores


# --------------------------------------------------------------------------- learning, per experiment

# Each supervised experiment fits one of its own training batches for a short horizon,
# eagerly, in process: the loss must fall below LEARN_MARGIN of the first step's loss.
# A step that does not learn (a zero gradient, a wrong sign, a detached head, a
# collapsed loss weighting) fails this; finiteness alone did not.
LEARN_STEPS = 30
LEARN_MARGIN = 0.7   # loss after LEARN_STEPS on one batch <= 0.7 x the first step's loss


@pytest.mark.parametrize("name", ["lidar_seg", "frog_seg", "frog_seg:model=ptv3", "digits_cls", "multi_dataset_seg",
                                  "instance_seg", "ptv3_seg", "particle_seg"])
def test_experiment_learns_one_batch(name, tmp_path):
    from pimm_fn.experiment import RunContext, experiment_settings, load_experiment

    torch.set_num_threads(1)
    name, _, override = name.partition(":")
    mod = load_experiment(name)
    settings = {**experiment_settings(mod, quick=True), "compile": False, "epochs": LEARN_STEPS}
    if override:
        key, _, value = override.partition("=")
        settings[key] = value
    try:
        run = mod.build(settings, RunContext(save_path=tmp_path, quick=True))
    except Exception as err:  # the data set is not fetched here
        if "pimm_fn.data.fetch" in str(err):
            pytest.skip(str(err))
        raise
    batch = next(iter(run.loader.iter_epoch(0, 0)))
    state, losses = run.state, []
    for _ in range(LEARN_STEPS):
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(map(math.isfinite, losses)), losses
    assert losses[-1] <= LEARN_MARGIN * losses[0], (
        f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {LEARN_STEPS} steps: {losses}"
    )


def test_frog_seg_names_an_unknown_model():
    from pimm_fn.experiment import experiment_settings, load_experiment

    mod = load_experiment("frog_seg")
    settings = {**experiment_settings(mod, quick=True), "model": "ptv2"}
    with pytest.raises(ValueError, match="model must be one of pointseg, ptv3.*--set model=ptv3"):
        mod.make_model(settings, None)


def test_lidar_seg_scales_the_loss_for_every_float16_name(tmp_path):
    from pimm_fn.experiment import RunContext, experiment_settings, load_experiment

    mod = load_experiment("lidar_seg")
    for amp, scaled in (("fp16", True), ("half", True), ("float16", True), ("bfloat16", False), ("", False)):
        settings = {**experiment_settings(mod, quick=True), "compile": False, "amp": amp}
        run = mod.build(settings, RunContext(save_path=tmp_path, quick=True))
        assert (run.state.loss_scale is not None) is scaled, amp
