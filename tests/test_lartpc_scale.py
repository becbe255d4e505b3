"""The 1M-event LArTPC stream at scale: SIGKILL mid-epoch resume, and the epoch split over ranks.

1. tests/lartpc_resume_script.py trains a per-voxel MLP (supervised step, AdamW, 2 loader
   workers, one thread) over ``LArTPCEvents(num_events=1_000_000)`` (250,000 steps an epoch)
   and stops after step 20 of the first epoch. It is SIGKILLed twice mid-epoch and
   restarted; its params, optimizer state and cursor must equal an uninterrupted run's
   bitwise, and every step (re-run ones included) must have trained on the events the
   uninterrupted run trained on at that step.
2. Under torchrun (2 ranks, gloo, CPU; this file is the rank script, see ``_rank_main``)
   each rank streams the first K batches of epoch 1 with 2 workers: the ranks' events are
   disjoint, follow torch's DistributedSampler, together make up the first K batches of
   one process with a batch twice as large, and only a few batches of events per rank are
   ever generated (never the 1M-event epoch).
"""
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import pytest
import torch
from test_distributed_torchrun import _env, _free_port
from test_fit_resume import _Proc as _ScriptProc

from pimm_fn.checkpoint import CheckpointDir
from pimm_fn.data import LArTPCEvents, build_train_loader
from pimm_fn.data.sampler import epoch_order

NUM_EVENTS = 1_000_000

# torchrun part: per-rank batch, batches listed, data seed, epoch
B, K, SEED, EPOCH = 4, 6, 5, 1


def _index(name: str) -> int:
    return int(name.rsplit("/", 1)[1])


class CountingEvents(LArTPCEvents):
    """LArTPCEvents that append each index they generate to OUT/gen_rank<r>_<pid>.txt."""

    def __init__(self, out: str, rank: int, **kwargs):
        super().__init__("train", **kwargs)
        self.out, self.rank = out, rank

    def __getitem__(self, i):
        with open(os.path.join(self.out, f"gen_rank{self.rank}_{os.getpid()}.txt"), "a") as f:
            f.write(f"{int(i)}\n")
        return super().__getitem__(i)


def _rank_main(out: str) -> None:
    """One rank under torchrun: list the first K batches of epoch EPOCH, and a mid-epoch restart."""
    import pimm_fn.distributed as D

    torch.set_num_threads(1)  # two ranks share two cores
    ctx = D.init_from_env()
    start = time.perf_counter()
    loader = build_train_loader(CountingEvents(out, ctx.rank, num_events=NUM_EVENTS), batch_size=B, seed=SEED,
                                rank=ctx.rank, world_size=ctx.world_size, num_workers=2)
    names = [b["name"] for b in itertools.islice(loader.iter_epoch(EPOCH, 0), K)]
    # a restart at batch K - 2 of the same epoch (fresh loader, as a resumed process builds)
    again = build_train_loader(CountingEvents(out, ctx.rank, num_events=NUM_EVENTS), batch_size=B, seed=SEED,
                               rank=ctx.rank, world_size=ctx.world_size, num_workers=2)
    resumed = [b["name"] for b in itertools.islice(again.iter_epoch(EPOCH, K - 2), 2)]
    took = time.perf_counter() - start
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, [_index(n) for batch in names for n in batch])
    res = {"rank": ctx.rank, "world_size": ctx.world_size, "len": len(loader), "names": names,
           "resumed": resumed, "seconds": took,
           "disjoint": len(set().union(*map(set, gathered))) == sum(len(g) for g in gathered)}
    tmp = os.path.join(out, f"rank{ctx.rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, os.path.join(out, f"rank{ctx.rank}.json"))
    D.shutdown()


ROOT = HERE.parent
SCRIPT = HERE / "lartpc_resume_script.py"


class _Proc(_ScriptProc):
    """lartpc_resume_script.py in its own process group, its output lines in a queue."""

    def __init__(self, run_dir, *args):
        super().__init__(run_dir, *args, script=SCRIPT)

    def steps(self) -> list:
        """(step, position, names) of the STEP lines seen so far."""
        rows = []
        for line in self.log:
            if line.startswith("STEP "):
                _, step, pos, names = line.split(" ", 3)
                rows.append((int(step), int(pos), names.split(",")))
        return rows


def _step_at_least(n):
    return lambda line: line.startswith("STEP ") and int(line.split()[1]) >= n


def _latest_step(run_dir) -> int:
    """The step of the newest complete checkpoint of a run (-1: none yet)."""
    path = CheckpointDir(Path(run_dir) / "ckpt").latest()
    return -1 if path is None else int(path.stem.split("_")[1])


@pytest.mark.slow
def test_sigkill_mid_epoch_on_the_million_event_stream_resumes_bitwise(tmp_path):
    import lartpc_resume_script as script

    t0 = time.perf_counter()
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    everyone = []
    try:
        ref = _Proc(ref_dir, "--sleep", "0")  # runs alongside the killed sequence
        everyone.append(ref)
        procs, starts = [], []
        for at in (7, 15):
            proc = _Proc(run_dir)
            everyone.append(proc)
            start = proc.wait_for(lambda line: line.startswith("START"))
            begin = int(start.split()[1])
            # kill once past step `at` and a newer checkpoint than the one it resumed from
            # is durable (saves are written in the background): every restart is mid-epoch
            hit = proc.wait_for(
                lambda line, at=at, begin=begin: _step_at_least(at)(line) and _latest_step(run_dir) > begin
            )
            assert hit is not None, "the run ended before the planned kill:\n" + "\n".join(proc.log)
            assert proc.kill() == -signal.SIGKILL
            starts.append(begin)
            procs.append(proc)
        last = _Proc(run_dir)
        everyone.append(last)
        starts.append(int(last.wait_for(lambda line: line.startswith("START")).split()[1]))
        assert last.finish() == 0, "\n".join(last.log)
        assert ref.finish() == 0, "\n".join(ref.log)
        procs.append(last)
    finally:  # a failed wait leaves no training process (or its workers) behind
        for proc in everyone:
            if proc.p.poll() is None:
                proc.kill()
    print(f"\nrestart steps {starts}; {time.perf_counter() - t0:.1f} s")
    stop = script.STOP_AT
    assert last.log[-1] == f"DONE {stop} stopped" and ref.log[-1] == f"DONE {stop} stopped"
    # both restarts were mid-epoch, from a checkpoint of the run (every CKPT_EVERY steps)
    assert starts[0] == 0 and 0 < starts[1] < starts[2] < stop, starts
    assert all(s % script.CKPT_EVERY == 0 for s in starts), starts

    # the uninterrupted run's batches: the first 20 of the sampler's epoch-0 order
    order = epoch_order(NUM_EVENTS, seed=script.SEED, epoch=0)
    ref_steps = ref.steps()
    assert [(s, p) for s, p, _ in ref_steps] == [(s, s - 1) for s in range(1, stop + 1)]
    expected = {s: [f"lartpc[train]/{i}" for i in order[(s - 1) * script.BATCH:s * script.BATCH]]
                for s in range(1, stop + 1)}
    assert {s: names for s, _, names in ref_steps} == expected

    # every step any killed or resumed process ran (re-runs after a restart included) saw them
    for proc, begin in zip(procs, starts):
        rows = proc.steps()
        assert rows and rows[0][0] == begin + 1, (begin, rows[:1])  # continues right after its checkpoint
        for step, pos, names in rows:
            assert pos == step - 1 and names == expected[step], (step, pos, names)
    assert [s for s, _, _ in last.steps()] == list(range(starts[-1] + 1, stop + 1))

    a = torch.load(ref_dir / "final.pt", weights_only=True)
    b = torch.load(run_dir / "final.pt", weights_only=True)
    # AdamW's state: the count and both moments of each of the 4 params
    assert a.keys() == b.keys() and sum(k.startswith("params.") for k in a) == 4
    assert sum(k.startswith("opt_state.") for k in a) == 9
    assert a["cursor"].tolist() == [0, stop, stop * script.BATCH]
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"params / optimizer state / cursor differ after the kills: {bad}"


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_torchrun_splits_the_million_event_epoch_across_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(Path(__file__).resolve()), str(tmp_path)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    took = time.perf_counter() - start
    print(f"\n[torchrun {Path(__file__).name}] {took:.1f} s, rc={proc.returncode}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    print("per-rank listing seconds:", [round(r["seconds"], 2) for r in res])

    # one process, batch 2B, same seed: its first K batches (events generated here too)
    single = build_train_loader(LArTPCEvents("train", num_events=NUM_EVENTS), batch_size=2 * B, seed=SEED,
                                num_workers=0)
    single_names = [b["name"] for b in itertools.islice(single.iter_epoch(EPOCH, 0), K)]
    ds_len = LArTPCEvents("train", num_events=NUM_EVENTS)  # for the sampler's len only
    for r, rank in enumerate(res):
        assert (rank["rank"], rank["world_size"]) == (r, 2)
        assert rank["len"] == NUM_EVENTS // 2 // B  # 125,000 steps an epoch per rank
        assert rank["disjoint"]
        # rank r's batch k: every other event of the one-process batch k, from the r-th
        assert rank["names"] == [batch[r::2] for batch in single_names]
        # the order torch's DistributedSampler gives rank r in this epoch
        sampler = torch.utils.data.DistributedSampler(ds_len, num_replicas=2, rank=r, shuffle=True, seed=SEED,
                                                      drop_last=True)
        sampler.set_epoch(EPOCH)
        dist_order = list(itertools.islice(iter(sampler), K * B))
        assert [_index(n) for batch in rank["names"] for n in batch] == dist_order
        # a fresh loader started at batch K - 2 gives batches K - 2 and K - 1 again
        assert rank["resumed"] == rank["names"][K - 2:]
    ranks = [{_index(n) for batch in rank["names"] for n in batch} for rank in res]
    assert not ranks[0] & ranks[1]
    assert ranks[0] | ranks[1] == {_index(n) for batch in single_names for n in batch}

    # only the first few batches of each rank were ever generated (K listed + the workers'
    # prefetch), and only that rank's events: nothing close to the 1M-event epoch
    for r in (0, 1):
        generated = [int(line) for f in tmp_path.glob(f"gen_rank{r}_*.txt") for line in f.read_text().split()]
        own = epoch_order(NUM_EVENTS, seed=SEED, epoch=EPOCH, rank=r, world_size=2)[:(K + 8) * B]
        print(f"rank {r}: {len(generated)} events generated, {len(set(generated))} distinct")
        assert K * B <= len(generated) <= 2 * (K + 8) * B, len(generated)
        assert set(generated) <= set(own), sorted(set(generated) - set(own))[:10]


if __name__ == "__main__":  # a rank under torchrun (test_torchrun_splits_the_million_event_epoch_across_ranks)
    _rank_main(sys.argv[1])
