"""pimm_fn's eager step against the Pointcept-style step it replaces (issue 35 item 1).

    python benchmarks/eager_step.py --threads 1 --rounds 16
    python benchmarks/eager_step.py --threads 2 --rounds 48 --ways seed_default,pimm_eager

On the PTv3-class backbone with two blocks per level (``ptv3_deep``: 209 parameter tensors,
2.17M parameters) and real LiDAR batches, four ways train from the same weights
(``--ways`` runs a subset):

- ``seed_default``: Pointcept's step as Pointcept builds it: nn.Module forward, zero_grad,
  backward, ``clip_grad_norm_``, ``torch.optim.AdamW`` with its own default implementation
  (on the CPU the per-tensor loop; foreach only on accelerators), OneCycleLR;
- ``seed_foreach``: the same with ``AdamW(foreach=True)``;
- ``pimm_eager``: ``compile_step(supervised(clip_grad=1.0), eager=True)`` with
  ``pimm_fn.optim.adamw`` over ``schedules.one_cycle`` (its eager update on torch's fused
  AdamW kernel);
- ``pimm_separate``: the same with ``adamw(..., fused=False)``, the separate foreach kernels.

A round runs every way over all batches (the order rotates per round). Each way's time
per step is read on two clocks: the training thread's CPU time (what the step itself
costs; other processes on the machine move it far less than wall time) and wall time.
Printed per clock: each way's median and fastest round, and pimm_fn's speedup over each
baseline as the ratio of medians, the median of the rounds' paired ratios and the ratio
of the fastest rounds. Speed is measured here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch

from pimm_fn.bench import machine_info
from pimm_fn.bench import workloads as W
from pimm_fn.compile import compile_step
from pimm_fn.optim import adamw
from pimm_fn.schedules import one_cycle
from pimm_fn.state import TrainState

WAYS = ("seed_default", "seed_foreach", "pimm_eager", "pimm_separate")
CLOCKS = {"thread_cpu": time.thread_time, "wall": time.perf_counter}


def build(batches: int, names=WAYS) -> tuple[dict, list]:
    """The ways in ``names`` (in WAYS' order), each a ``run(batch)``, and the batches."""
    wl = W.ptv3_deep(batches)
    step = compile_step(wl.step, eager=True)

    def pimm(state):
        holder = [state]

        def run(batch):
            holder[0], _ = step(holder[0], batch)
        return run

    makers = {
        "seed_default": lambda: W.seed_trainer(copy.deepcopy(wl.model), foreach=None),
        "seed_foreach": lambda: W.seed_trainer(copy.deepcopy(wl.model)),
        "pimm_eager": lambda: pimm(wl.state),
        "pimm_separate": lambda: pimm(TrainState.create(copy.deepcopy(wl.model), adamw(
            one_cycle(W.TOTAL_STEPS, W.MAX_LR), weight_decay=W.WEIGHT_DECAY, fused=False))),
    }
    return {w: makers[w]() for w in WAYS if w in names}, list(wl.batches)


def measure(ways: dict, batches: list, rounds: int) -> dict:
    for run in ways.values():  # warm: first calls, allocator, lazy imports
        for b in batches[:2]:
            run(b)
    per_step = {(c, w): [] for c in CLOCKS for w in ways}
    names = list(ways)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = {c: clock() for c, clock in CLOCKS.items()}
            for b in batches:
                ways[name](b)
            for c, clock in CLOCKS.items():
                per_step[(c, name)].append((clock() - start[c]) / len(batches) * 1e3)
    return per_step


def report(per_step: dict) -> str:
    lines = []
    for c in CLOCKS:
        lines.append(f"{c}: ms per step, median (fastest round)")
        ran = [w for w in WAYS if (c, w) in per_step]
        for w in ran:
            xs = per_step[(c, w)]
            lines.append(f"  {w:<14}{statistics.median(xs):9.1f} ({min(xs):.1f})")
        for way, base in (("pimm_eager", "seed_default"), ("pimm_eager", "seed_foreach"),
                          ("pimm_separate", "seed_default"), ("pimm_eager", "pimm_separate")):
            if way not in ran or base not in ran:
                continue
            ours, theirs = per_step[(c, way)], per_step[(c, base)]
            ratios = [a / b for a, b in zip(theirs, ours)]
            medians = statistics.median(theirs) / statistics.median(ours)
            lines.append(f"  {way} speedup over {base}: medians {medians:.3f}, paired {statistics.median(ratios):.3f}, "
                         f"fastest {min(theirs) / min(ours):.3f}; faster in {sum(r > 1 for r in ratios)} of "
                         f"{len(ratios)} rounds")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--ways", default=",".join(WAYS),
                    help="comma-separated subset of " + ", ".join(WAYS) + " (fewer ways: more rounds in the same time)")
    args = ap.parse_args(argv)
    ways_run = args.ways.split(",")
    unknown = sorted(set(ways_run) - set(WAYS))
    if unknown:
        ap.error(f"unknown ways {unknown}; choose from {', '.join(WAYS)}")
    torch.set_num_threads(args.threads)
    info = machine_info()
    load = os.getloadavg()
    ways, batches = build(args.batches, ways_run)
    per_step = measure(ways, batches, args.rounds)
    print(f"{info['cpu']}, torch {info['torch']}, {args.threads} thread(s), {args.rounds} rounds of "
          f"{len(batches)} batches; load average before {load}, after {os.getloadavg()}")
    print(report(per_step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
