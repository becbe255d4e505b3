"""Exact resume: SIGKILL at random steps (one during a checkpoint write) and restart, bitwise equal.

Also the torchtitan check (N steps = N/2 + restart + N/2), TensorBoard files across the
restarts read back with TensorBoard's own reader, and bad checkpoints through ``resume``.
"""
import os
import pickle
import queue
import random
import signal
import subprocess
import sys
import threading

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _fit_helpers import leaves_equal, make_state, step_fn

from pimm_fn import checkpoint as ckpt
from pimm_fn import events as ev
from pimm_fn.callbacks import Checkpoint, on, restore_latest, resume
from pimm_fn.fit import fit

SCRIPT = os.path.join(HERE, "fit_resume_script.py")
TOTAL = 24  # fit_resume_script: 3 epochs x 8 steps


class _Proc:
    """A run script (fit_resume_script.py unless ``script``) in its own process group, its
    output lines in a queue."""

    def __init__(self, run_dir, *args, script=SCRIPT):
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.p = subprocess.Popen([sys.executable, str(script), str(run_dir), *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
        self.lines = queue.Queue()
        self.log = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pred, timeout=240):
        while True:
            line = self.lines.get(timeout=timeout)
            if line is None:
                return None
            self.log.append(line)
            if pred(line):
                return line

    def kill(self):
        os.killpg(self.p.pid, signal.SIGKILL)  # the script and its 2 loader workers
        return self.p.wait(timeout=60)

    def finish(self):
        self.wait_for(lambda line: False)
        return self.p.wait(timeout=240)


def _step_at_least(n):
    return lambda line: line.startswith("STEP ") and int(line.split()[1]) >= n


def _scalars(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_sigkill_at_random_steps_resumes_bitwise(tmp_path):
    rng = random.Random(20240611)
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    ref = _Proc(ref_dir, "--sleep", "0")  # runs alongside the killed sequence

    plan = [("step", rng.randint(6, 7)), ("save", 10), ("step", rng.randint(13, 19))]
    print("kill plan:", plan)
    starts = []
    for kind, at in plan:
        if kind == "save":
            proc = _Proc(run_dir, "--slow-save-at", str(at))
            start = proc.wait_for(lambda line: line.startswith("START"))
            hit = proc.wait_for(lambda line: line.startswith("IN_SAVE"))
        else:
            # The first run writes TensorBoard on its writer thread, as a device run does (a CPU
            # run's default writes on the training thread): both must hold every step once.
            proc = _Proc(run_dir, *(["--tb-thread"] if not starts else []))
            start = proc.wait_for(lambda line: line.startswith("START"))
            hit = proc.wait_for(_step_at_least(at))
        assert hit is not None, f"the run ended before the planned kill ({kind} {at}):\n" + "\n".join(proc.log)
        starts.append(int(start.split()[1]))
        assert proc.kill() == -signal.SIGKILL
        # a kill mid-write leaves only an unfinished temp file; latest is still a complete checkpoint
        latest = ckpt.CheckpointDir(run_dir / "ckpt").latest()
        print(f"killed at {hit!r}; latest checkpoint: {latest.name if latest else None}")
        if kind == "save":
            assert latest is not None and latest.name != f"step_{at}.ckpt"
            assert any(p.name.endswith(".tmp") for p in (run_dir / "ckpt").iterdir())
    last = _Proc(run_dir)
    starts.append(int(last.wait_for(lambda line: line.startswith("START")).split()[1]))
    assert last.finish() == 0, "\n".join(last.log)
    assert ref.finish() == 0, "\n".join(ref.log)
    assert f"DONE {TOTAL} completed" in last.log[-1]
    print("restart steps:", starts)
    assert starts[0] == 0 and all(0 < s < TOTAL for s in starts[1:]), starts
    assert starts[2] == 8  # the kill during the step-10 write fell back to the epoch-end checkpoint
    assert not any(p.name.endswith(".tmp") for p in (run_dir / "ckpt").iterdir())  # cleaned on restart

    a = torch.load(ref_dir / "final.pt", weights_only=True)
    b = torch.load(run_dir / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and any("mu" in k for k in a)
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"params / optimizer state differ after kills: {bad}"

    # TensorBoard: every step once, in order, the seed's tags, values as the uninterrupted run's
    ref_tb, run_tb = _scalars(ref_dir / "tb"), _scalars(run_dir / "tb")
    assert len(list((run_dir / "tb").iterdir())) == len(plan) + 1  # one event file per process
    for tag in ("train_batch/loss", "train_batch/grad_norm", "params/lr"):
        steps = [s for s, _ in run_tb[tag]]
        assert steps == list(range(1, TOTAL + 1)), (tag, steps)
        assert run_tb[tag] == ref_tb[tag], tag
    assert [s for s, _ in run_tb["train/loss"]] == [8, 16, 24]
    assert "train/lr/default" not in run_tb and "train/grad_norm" in run_tb

    log = (run_dir / "train.log").read_text()
    assert log.count(">>> Start training") == len(plan) + 1 and log.count("resuming at") == len(plan)
    assert "Data " in log and "Step " in log and "Remain" in log


@pytest.mark.slow
def test_sigkill_resumes_the_ptv3_backbone_bitwise(tmp_path):
    # The PTv3-class model (drop path drawing random numbers, order shuffles drawn in the
    # loader's 2 workers, layer-wise lr groups) killed twice mid-epoch, on one thread.
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    ref = _Proc(ref_dir, "--sleep", "0", "--model", "ptv3")
    for at in (6, 13):
        proc = _Proc(run_dir, "--model", "ptv3")
        hit = proc.wait_for(_step_at_least(at))
        assert hit is not None, "the run ended before the planned kill:\n" + "\n".join(proc.log)
        assert proc.kill() == -signal.SIGKILL
    last = _Proc(run_dir, "--model", "ptv3")
    start = int(last.wait_for(lambda line: line.startswith("START")).split()[1])
    assert last.finish() == 0, "\n".join(last.log)
    assert ref.finish() == 0, "\n".join(ref.log)
    assert 0 < start < TOTAL and f"DONE {TOTAL} completed" in last.log[-1]
    a = torch.load(ref_dir / "final.pt", weights_only=True)
    b = torch.load(run_dir / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and any("attn.qkv" in k for k in a)
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"params / optimizer state differ after kills: {bad}"


def test_torchtitan_half_restart_half_is_bitwise(tmp_path):
    import fit_resume_script as script

    full = fit(make_state(seed=0), script.build_loader(), step_fn, epochs=script.EPOCHS).state
    assert int(full.step) == TOTAL

    half = TOTAL // 2  # step 12: mid-epoch 1
    first = fit(make_state(seed=0), script.build_loader(), step_fn, epochs=script.EPOCHS,
                callbacks=[on(ev.StepEnd, once=half)(lambda e, s: ev.Stop("half")),
                           Checkpoint(tmp_path, every_epochs=None)])
    assert first.status == "stopped" and int(first.state.step) == half
    # a fresh process would start from here: new state skeleton, new loader, restored from disk
    loader = script.build_loader()
    state = resume(tmp_path, make_state(seed=0), loader=loader)
    assert (state.cursor.epoch, state.cursor.position, int(state.step)) == (1, 4, half)
    second = fit(state, loader, step_fn, epochs=script.EPOCHS)
    assert int(second.state.step) == TOTAL and second.state.rng == full.rng
    assert leaves_equal(second.state, full)


# ------------------------------------------------------------------ bad input through resume


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder with two checkpoints (steps 1 and 2) of the small model."""
    root = tmp_path_factory.mktemp("ck")
    x = torch.randn(16, 4)
    y = torch.randint(0, 3, (16,))
    fit(make_state(), [(x[:8], y[:8]), (x[8:], y[8:])], step_fn, epochs=1,
        callbacks=[Checkpoint(root, every_steps=1, every_epochs=None, keep_last=5)])
    return root


def test_resume_missing_path(tmp_path):
    like = make_state()
    with pytest.raises(FileNotFoundError, match="nope"):
        resume(tmp_path / "nope" / "step_9.ckpt", like, must_exist=True)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resume(tmp_path, like, must_exist=True)
    assert resume(tmp_path / "fresh_run", like) is like  # nothing saved yet: a fresh run
    assert restore_latest(tmp_path / "fresh_run", like) is None


def test_resume_a_missing_file_is_an_error_and_latest_is_the_folder(saved):
    # A mistyped checkpoint file must not quietly start the run over from scratch.
    with pytest.raises(FileNotFoundError, match=r"step_9\.ckpt does not exist(.|\n)*step_2\.ckpt"):
        resume(saved / "step_9.ckpt", make_state())
    # The folder's pointer file resumes what it names.
    assert int(resume(saved / "latest", make_state()).step) == int(resume(saved, make_state()).step) == 2


def test_resume_truncated_checkpoint(saved, tmp_path):
    import shutil

    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    target = root / "step_2.ckpt"
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointCorruptError):
        resume(target, make_state(), must_exist=True)
    # the folder form skips the broken newest file and resumes from the last complete one
    state = resume(root, make_state())
    assert int(state.step) == 1


def test_resume_another_models_checkpoint_lists_keys_and_shapes(saved):
    other = make_state(hidden=8)
    with pytest.raises(ckpt.CheckpointMismatchError) as err:
        resume(saved, other)
    msg = str(err.value)
    assert "fc1.weight" in msg and "(16, 4)" in msg and "(8, 4)" in msg


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_refuses_a_pickle_that_would_run_code(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "step_5.ckpt"
    bad.write_bytes(pickle.dumps({"state_dict": _Evil(str(marker))}))
    with pytest.raises(ckpt.UnsafeCheckpointError):
        resume(bad, make_state(), must_exist=True)
    assert not marker.exists()
