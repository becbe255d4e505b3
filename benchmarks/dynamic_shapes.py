"""Measure compiles and step time for variable point counts: auto / mark_dynamic / buckets.

    python benchmarks/dynamic_shapes.py

Not a test: prints a table (the finding is recorded in benchmarks/README.md, "Variable
point counts"). No options.
"""
from __future__ import annotations

import argparse
import time

import torch

from pimm_fn.data.collate import point_collate
from pimm_fn.data.datasets import SyntheticScenes
from pimm_fn.data.dynamic import mark_point_dims_dynamic, pad_points_to_bucket
from pimm_fn.data.transforms import assemble_feat

BUCKETS = (2048, 2560, 3072, 4096)


def _batches(k=12, b=4):
    ds = SyntheticScenes(k * b, seed=3, points=(384, 1000))
    feat = assemble_feat(("coord", "color"))
    return [point_collate([feat(ds[i * b + j], None) for j in range(b)]) for i in range(k)]


def main():
    torch.manual_seed(0)
    w1, w2 = torch.randn(6, 128) * 0.1, torch.randn(128, 4) * 0.1

    def step(feat, segment, mask):
        h = torch.relu(feat @ w1)
        logits = h @ w2
        loss = torch.nn.functional.cross_entropy(logits, segment.clamp(min=0), reduction="none")
        return (loss * mask).sum() / mask.sum()

    batches = _batches()
    rows = []
    for mode in ("eager", "auto", "mark_dynamic", "buckets", "buckets_static"):
        torch._dynamo.reset()
        counter = {"n": 0}

        def backend(gm, example_inputs, counter=counter):
            counter["n"] += 1
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)

        if mode == "eager":
            fn = step
        else:
            # buckets_static: dynamic=False keeps one static graph per bucket; plain
            # "buckets" lets automatic dynamic shapes turn the dim symbolic at bucket 2
            fn = torch.compile(step, backend=backend, fullgraph=True,
                               dynamic=False if mode == "buckets_static" else None)
        t0 = time.perf_counter()
        times = []
        for b in batches:
            if mode.startswith("buckets"):
                b = pad_points_to_bucket(b, BUCKETS)
                mask = b["point_mask"].float()
            else:
                mask = torch.ones(b["coord"].shape[0])
                if mode == "mark_dynamic":
                    b = mark_point_dims_dynamic(b)
                    torch._dynamo.mark_dynamic(mask, 0)
            s = time.perf_counter()
            fn(b["feat"], b["segment"], mask)
            times.append(time.perf_counter() - s)
        total = time.perf_counter() - t0
        # steady state: re-run every batch now that all graphs exist
        s = time.perf_counter()
        for _ in range(5):
            for b in batches:
                if mode.startswith("buckets"):
                    b = pad_points_to_bucket(b, BUCKETS)
                    fn(b["feat"], b["segment"], b["point_mask"].float())
                else:
                    fn(b["feat"], b["segment"], torch.ones(b["coord"].shape[0]))
        steady = (time.perf_counter() - s) / (5 * len(batches))
        rows.append((mode, counter["n"], total, steady * 1e3))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'mode':14s} {'compiles':>8s} {'first pass s':>12s} {'steady ms/step':>15s}")
    for mode, n, total, steady in rows:
        print(f"{mode:14s} {n:8d} {total:12.2f} {steady:15.3f}")
    print("point totals:", sorted(int(b["coord"].shape[0]) for b in batches))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help, not a run
    main()
