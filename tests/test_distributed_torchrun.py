"""Data parallelism on real process groups: torchrun launches tests/dist_scripts/*.

The groups are gloo on the CPU; on a machine with two GPUs the device-aware script
(dp_compiled.py) runs on cuda:0 / cuda:1 over nccl; the other scripts keep their tensors on the CPU (gloo).

Each test starts ``python -m torch.distributed.run --nproc_per_node=2`` (or, for the
no-agent failure case, two plain processes with torchrun's environment) on a free port,
with a timeout, and checks what the ranks wrote. Durations are printed (pytest -s).
"""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "dist_scripts"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def EXPECTED_BACKEND(rank: int) -> tuple:
    """(backend, device) a rank of a two-rank run gets on this machine."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return "cpu:gloo,cuda:nccl", f"cuda:{rank}"
    return "gloo", "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::UserWarning")
    env.update(extra)
    return env


def torchrun(script, *args, timeout=240, nproc=2):
    """Run a script under torchrun; return (returncode, output, seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", str(SCRIPTS / script), *map(str, args)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    took = time.perf_counter() - start
    print(f"\n[{script} {' '.join(map(str, args[1:]))}] {took:.1f} s, rc={proc.returncode}")
    return proc.returncode, proc.stdout + proc.stderr, took


def _ok(rc, out):
    assert rc == 0, out[-4000:]


def test_two_ranks_batch_b_equal_one_process_batch_2b(tmp_path):
    rc, out, _ = torchrun("dp_equivalence.py", tmp_path)
    _ok(rc, out)
    res = json.loads((tmp_path / "results.json").read_text())
    assert (res["world_size"], res["rank"]) == (2, 0)
    for kind in ("sgd", "adamw"):
        r = res[kind]
        assert r["steps"] == 20 and r["samples"] == 160
        assert r["param_moved"] > 0.1  # the runs really trained
        assert r["max_param_diff"] < 1e-5, r
        assert r["max_loss_diff"] < 1e-5, r
    # seed rules across ranks (rank r contributes r / r+1 / -r / 3)
    assert res["reduced"] == {"loss": 0.5, "a_min": 1.0, "b_max": 2.0, "adv_abs_max": 0.0, "count": 6.0}
    assert res["unequal_samples"] == 8.0  # 3 + 5, not 2 x 3
    assert res["inf_skip"] == {"skipped": 1.0, "scale": 32768.0, "unchanged": True}
    assert res["bn_sync"]["True"] == "in sync"
    assert res["bn_sync"]["False"].startswith("diverged") and "bn.running_mean" in res["bn_sync"]["False"]
    assert res["num_batches_tracked"] == 3
    assert res["read_after_main_write"] is True


def test_grpo_two_ranks_equal_one_process_on_the_global_batch(tmp_path):
    # GRPO is a Step: grad_transform all-reduces each update's gradients (before clipping),
    # wrap_step reduces metrics, compile_step compiles it; its rollout runs per rank.
    rc, out, _ = torchrun("dp_grpo.py", tmp_path)
    _ok(rc, out)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"grpo_rank{rank}.json").read_text())
        assert (r["world_size"], r["rank"], r["steps"]) == (2, rank, 4)
        assert r["param_moved"] > 0.05  # the runs really trained
        assert r["max_param_diff"] < 1e-5, r
        assert max(r["max_metric_diff"].values()) < 1e-5, r
        assert r["trajectories"] == 16.0  # 4 events x G=4 over both ranks
        assert r["compile_count"] == 1 and r["compiled_vs_eager"] < 1e-5, r


def test_grpo_ranks_with_unequal_work_train_the_one_process_model(tmp_path):
    # Each rank's gradient is a mean over its own trajectories or tokens; the mean over ranks
    # weights them by those counts (an equal-weight mean was 0.04 off with token reduction).
    rc, out, _ = torchrun("dp_grpo_unequal.py", tmp_path)
    _ok(rc, out)
    one = subprocess.run([sys.executable, str(SCRIPTS / "dp_grpo_unequal.py"), str(tmp_path)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=240)
    _ok(one.returncode, one.stdout + one.stderr)
    for reduction in ("token", "sequence", "constant"):
        a = torch.load(tmp_path / f"grpo_unequal_{reduction}_W1.pt")
        b = torch.load(tmp_path / f"grpo_unequal_{reduction}_W2.pt")
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        assert diff < 1e-5, (reduction, diff)


def test_ranks_in_sync_names_different_starting_weights_and_a_step_that_does_not_average(tmp_path):
    rc, out, _ = torchrun("dp_in_sync.py", tmp_path)
    _ok(rc, out)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"in_sync_rank{rank}.json").read_text())
        assert r["averaged"] == "ok"
        assert r["seeded_per_rank"].startswith("the ranks start step 0 from different weights"), r
        assert r["not_averaged"].startswith("the ranks' weights differ after step 1, the run's first"), r


def test_the_grpo_experiment_trains_one_model_on_two_ranks(tmp_path):
    # Its gradients were not averaged: each rank trained a model of its own, without an error.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           "-m", "pimm_fn", "train", "grpo_cartpole", "--quick", "--set", "compile=false", "--no-progress",
           "--save-path", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    _ok(proc.returncode, proc.stdout + proc.stderr)
    assert "completed at step 3" in proc.stdout, proc.stdout[-2000:]
    # (the old experiment failed here with "RankDivergenceError: the ranks' weights differ after step 1")


def test_two_rank_checkpoint_restored_on_two_ranks_continues_exactly(tmp_path):
    rc, out, _ = torchrun("dp_resume.py", tmp_path, "full")
    _ok(rc, out)
    assert sorted(p.name for p in (tmp_path / "ckpt_bn").iterdir()) == ["latest", "step_7.ckpt"]
    rc, out, _ = torchrun("dp_resume.py", tmp_path, "resume")
    _ok(rc, out)
    full = torch.load(tmp_path / "full.pt")
    resumed = torch.load(tmp_path / "resume.pt")
    for name in ("bn", "mlp"):
        f, r = full[name], resumed[name]
        assert (f["step"], f["cursor"], f["samples_seen"]) == (20, (2, 0), 160)
        assert (r["step"], r["cursor"], r["samples_seen"]) == (20, (2, 0), 160)
        assert r["losses"] == f["losses"][7:]  # bitwise, step by step
        for k in f["params"]:
            assert torch.equal(f["params"][k], r["params"][k]), (name, k)
        for k in f["buffers"]:
            assert torch.equal(f["buffers"][k], r["buffers"][k]), (name, k)

    # the same 2-rank checkpoint resumed by ONE process with batch 2b (re-sharded cursor:
    # 7 steps x 2 ranks x 4 = 56 samples = 7 new batches of 8, exact) follows the 2-rank run
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPTS / "dp_resume.py"), str(tmp_path), "resume_w1"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    print(f"\n[dp_resume.py resume_w1] {time.perf_counter() - start:.1f} s")
    _ok(proc.returncode, proc.stdout + proc.stderr)
    w1 = torch.load(tmp_path / "resume_w1.pt")["mlp"]
    f = full["mlp"]
    assert (w1["step"], w1["cursor"], w1["samples_seen"]) == (20, (2, 0), 160)
    assert max(abs(a - b) for a, b in zip(w1["losses"], f["losses"][7:])) < 1e-5
    for k in f["params"]:
        assert torch.allclose(f["params"][k], w1["params"][k], atol=1e-5), k


def _launch_plain(out, mode, port, timeout_s):
    """Two ranks with torchrun's environment but no torchrun agent (as a peer on another
    machine: nobody kills the survivors, they must notice themselves)."""
    procs = []
    for r in range(2):
        env = _env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PIMM_FN_DIST_TIMEOUT_S=str(timeout_s))
        log = open(out / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(SCRIPTS / "dp_kill.py"), str(out), mode],
                                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def test_killed_rank_makes_the_others_fail_fast(tmp_path):
    # 1) under torchrun: the agent sees rank 1 die and stops the group
    (tmp_path / "agent").mkdir()
    rc, out, _ = torchrun("dp_kill.py", tmp_path / "agent", "kill", timeout=240)
    ended = time.time()
    died = json.loads((tmp_path / "agent" / "dead.json").read_text())["t"]
    print(f"torchrun exited {ended - died:.1f} s after rank 1's SIGKILL")
    assert rc != 0
    assert "SIGKILL" in out and "rank      : 1" in out, out[-3000:]
    assert not list((tmp_path / "agent").glob("finished_rank*.json"))
    assert ended - died < 60

    # 2) no agent: rank 0 itself raises PeerLostError (SIGKILL: the socket closes) and,
    # 3) when the peer hangs (SIGSTOP), after the collective timeout (5 s here)
    runs = {}
    for mode in ("kill", "stop"):
        (tmp_path / mode).mkdir()
        runs[mode] = _launch_plain(tmp_path / mode, mode, _free_port(), timeout_s=5)
    for mode, (rank0, rank1) in runs.items():
        try:
            rc0 = rank0.wait(timeout=180)
            exited = time.time()
        finally:
            rank1.kill()  # the stopped rank never ends on its own
            rank1.wait(timeout=30)
            rank0.kill()
        log = (tmp_path / mode / "rank0.log").read_text()
        err = json.loads((tmp_path / mode / "error_rank0.json").read_text())
        died = json.loads((tmp_path / mode / "dead.json").read_text())["t"]
        print(f"[{mode}] rank 0 raised {err['t'] - died:.2f} s and exited {exited - died:.1f} s after rank 1 "
              f"{'died' if mode == 'kill' else 'stopped'}: {err['message'][:160]}")
        assert rc0 == 1, log[-3000:]
        assert err["type"] == "PeerLostError" and "rank 0/2: a collective failed" in err["message"]
        assert "PeerLostError" in log or "a collective failed" in log
        if mode == "kill":
            assert err["t"] - died < 5.0  # the closed socket is noticed at once
        else:
            assert 4.0 < err["t"] - died < 30.0  # the collective timeout, not a hang
        assert exited - died < 90


def test_compiled_data_parallel_step_has_zero_graph_breaks(tmp_path):
    rc, out, _ = torchrun("dp_compiled.py", tmp_path, timeout=480)
    _ok(rc, out)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"compiled_rank{rank}.json").read_text())
        print(f"rank {rank}: compile {res['compile_seconds']} s, max |compiled - eager| "
              f"{res['max_diff_vs_eager']:.2e}")
        # nccl when every rank has a GPU, else gloo on the CPU (pimm_fn.distributed.choose_backend)
        assert (res["backend"], res["device"]) == EXPECTED_BACKEND(rank), res
        assert res["state_device"] == res["batch_device"] == res["device"]
        assert res["graph_break_count"] == 0 and res["break_reasons"] == [] and res["graph_count"] == 1
        assert res["compile_count"] == 1  # three steps, one compilation
        assert res["max_diff_vs_eager"] < 1e-4, res
        assert res["samples"] == 8.0 and "loss_scale" in res["metric_keys"]
        assert "switch_at=N" in res["background_unpinned"], res["background_unpinned"]
