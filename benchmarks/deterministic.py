"""The cost of PointSegNet's deterministic mode: step time with sort-based vs scatter pooling.

    python benchmarks/deterministic.py [--quick] [--threads 2] [--rounds 5] [--large]

The workload is pimm_fn/bench/workloads.py's pointseg (``PointSegNet(3, 13, width=32,
strides=(2, 4, 8))``, AdamW + OneCycle, clip 1.0) on 8 point batches of 4 clouds of
1500-2999 points (``--large``: 6000-9999 points per cloud, 24k-40k per batch), every
batch total distinct. Four ways, in one process: the two eager ways timed interleaved, then
the two compiled ways (alternating order; median and min over rounds of the mean step
time, so a change of the shared machine's load hits both sides of a ratio alike):

* ``default`` / ``deterministic``: ``PointSegNet(..., deterministic=False / True)``,
* each eager (``supervised(...)`` called as is) and compiled
  (``compile_step(..., dynamic=True)``, fullgraph, one graph for every point count).

Also checks what the mode is for: two runs of the same steps from the same state give
the same bits (``bitwise``) or not. Prints a table and writes
benchmarks/results/deterministic_<threads>threads.json with ``uptime``'s load average
before, between the eager and compiled halves, and after. On a shared 2-core machine
two torch threads slow down many-fold whenever another job takes a core (every parallel
region waits for the descheduled thread): compare the ratios, not the absolute times,
and read ``--threads 1`` for the cost of the algorithms themselves.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pimm_fn.bench import machine_info
from pimm_fn.bench.workloads import CLIP, POINT_CLASSES, make_optimizer, point_batches
from pimm_fn.compile import compile_step
from pimm_fn.models import PointSegNet
from pimm_fn.state import TrainState
from pimm_fn.steps.supervised import supervised
from pimm_fn.tree import tree_leaves

RESULTS = Path(__file__).resolve().parent / "results"


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: %.2f, %.2f, %.2f" % os.getloadavg()


def make_state(deterministic: bool) -> TrainState:
    torch.manual_seed(0)
    model = PointSegNet(3, POINT_CLASSES, width=32, strides=(2, 4, 8), deterministic=deterministic)
    return TrainState.create(model, make_optimizer()[0])


def run(step, state, batches):
    for b in batches:
        state, metrics = step(state, b)
    float(metrics["loss"])  # one host sync at the end of the pass
    return state


def same_bits(a: TrainState, b: TrainState) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tree_leaves((a.params, a.buffers, a.opt_state)),
                                                 tree_leaves((b.params, b.buffers, b.opt_state))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--large", action="store_true", help="24k-40k points per batch")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 4 batches (a smoke run)")
    ap.add_argument("--out", type=Path, default=None, help="default: results/deterministic_<threads>threads.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    lo, hi = (6000, 10000) if args.large else (1500, 3000)
    batches = point_batches(4 if args.quick else 8, lo=lo, hi=hi)
    load_before = uptime()
    t_start = time.perf_counter()

    ways = {}
    for det in (False, True):
        name = "deterministic" if det else "default"
        ways[f"{name} eager"] = (det, supervised(clip_grad=CLIP))
        ways[f"{name} compiled"] = (det, compile_step(supervised(clip_grad=CLIP), dynamic=True))
    compile_s, first = {}, {}
    per_round = {w: [] for w in ways}
    bitwise = {w: True for w in ways}
    uptimes = {}
    # Eager ways first, then compiled: default and deterministic alternate within a kind,
    # so a change in the machine's load hits both sides of each ratio alike.
    for kind in ("eager", "compiled"):
        pair = [w for w in ways if w.endswith(kind)]
        for way in pair:  # warm-up pass: compiles, and the first run's bits
            det, step = ways[way]
            t0 = time.perf_counter()
            first[way] = run(step, make_state(det), batches)
            compile_s[way] = time.perf_counter() - t0
        for r in range(rounds):
            for way in (pair if r % 2 == 0 else pair[::-1]):
                det, step = ways[way]
                state = make_state(det)
                t0 = time.perf_counter()
                state = run(step, state, batches)
                per_round[way].append((time.perf_counter() - t0) * 1e3 / len(batches))
                bitwise[way] &= same_bits(state, first[way])
        uptimes[kind] = uptime()

    rows = {}
    for way, times in per_round.items():
        det, step = ways[way]
        rows[way] = {"median_ms": statistics.median(times), "min_ms": min(times), "rounds_ms": times,
                     "first_pass_s": compile_s[way], "bitwise_repeatable": bitwise[way],
                     "compiles": getattr(step, "compile_count", None)}
    for kind in ("eager", "compiled"):
        base = rows[f"default {kind}"]["median_ms"]
        rows[f"deterministic {kind}"]["cost_vs_default"] = rows[f"deterministic {kind}"]["median_ms"] / base
    load_after = uptime()

    points = [int(b["offset"][-1]) for b in batches]
    print(f"PointSegNet(3, 13, width=32, strides=(2, 4, 8)), {len(batches)} batches of "
          f"{min(points)}-{max(points)} points, {args.threads} threads, {rounds} rounds")
    print(f"before:         {load_before}\nafter eager:    {uptimes['eager']}\nafter compiled: {load_after}")
    print("| way | median ms/step | min ms/step | vs default | bitwise repeatable | compiles |")
    print("|---|---|---|---|---|---|")
    for way, row in rows.items():
        cost = f"{row['cost_vs_default']:.2f}x" if "cost_vs_default" in row else "1.00x"
        print(f"| {way} | {row['median_ms']:.1f} | {row['min_ms']:.1f} | {cost} | {row['bitwise_repeatable']} "
              f"| {row['compiles'] if row['compiles'] is not None else '-'} |")
    report = {
        "command": "python benchmarks/deterministic.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": "pimm_fn.models.PointSegNet(3, 13, width=32, strides=(2, 4, 8))",
        "points_per_batch": points, "threads": args.threads, "rounds": rounds,
        "uptime_before": load_before, "uptime_after_eager": uptimes["eager"], "uptime_after": load_after,
        "wall_s": time.perf_counter() - t_start,
        "machine": machine_info(), "results": rows,
    }
    out = args.out or RESULTS / f"deterministic_{args.threads}threads.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
