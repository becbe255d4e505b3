"""The CNN layout finding (issue 13, item 3): pimm_fn's compiled step vs torch.compile(model)
+ compiled optimizer vs the seed-style eager step, on ImageClassifier with channels-last
(default) or NCHW activations.

Interleaved rounds in one process, one thread, timed in *process CPU time* per step (less
disturbed than wall time when other jobs share the cores). Prints medians and the median
of the per-round ratios.

    python benchmarks/cnn_layout.py            # channels-last (the model's default)
    python benchmarks/cnn_layout.py --nchw     # the old layout
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from pimm_fn.bench import workloads as W
from pimm_fn.compile import compile_step
from pimm_fn.models import ImageClassifier


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--nchw", action="store_true", help="ImageClassifier(channels_last=False)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    W.MODELS["cnn"] = (lambda: ImageClassifier(3, 10, width=32, depth=3, channels_last=not args.nchw),
                       "ImageClassifier(3, 10, width=32, depth=3)")
    wl = W.cnn()
    batches = list(wl.batches)
    step, holder = compile_step(wl.step), [wl.state]

    def pimm(batch):
        holder[0], _ = step(holder[0], batch)

    ways = {"pimm_compiled": pimm,
            "compile_model_opt": W.seed_trainer(copy.deepcopy(wl.model), compile_model=True, compile_optimizer=True),
            "seed_eager": W.seed_trainer(copy.deepcopy(wl.model))}
    for run in ways.values():  # warm-up: compiles
        for i in range(4):
            run(batches[i % len(batches)])
    cpu_ms = {k: [] for k in ways}
    for _ in range(args.rounds):
        for k, run in ways.items():
            t = time.process_time()
            for i in range(args.steps):
                run(batches[i % len(batches)])
            cpu_ms[k].append((time.process_time() - t) / args.steps * 1e3)
    print(f"layout: {'NCHW' if args.nchw else 'channels-last'}; load average {os.getloadavg()}")
    for k, v in cpu_ms.items():
        print(f"  {k:18s} median CPU ms/step {statistics.median(v):7.2f}  min {min(v):7.2f}")
    pairs = list(zip(cpu_ms["pimm_compiled"], cpu_ms["compile_model_opt"], cpu_ms["seed_eager"]))
    print(f"  pimm / compile_model_opt: {statistics.median(p / o for p, o, _ in pairs):.3f}")
    print(f"  seed / pimm (speedup):    {statistics.median(s / p for p, _, s in pairs):.3f}")


if __name__ == "__main__":
    main()
