"""Loader throughput with 0 and 2 workers on the real LiDAR blocks (train transforms).

    python benchmarks/loader_throughput.py [--epochs 3]

Prints batches/s and points/s per worker count (interleaved rounds, medians) and writes
benchmarks/results/loader_throughput.json. Not a test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pimm_fn.bench import machine_info  # noqa: E402
from pimm_fn.data import LidarBlocks, build_train_loader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
from lidar_seg import transform  # noqa: E402


def one_epoch(loader, epoch: int):
    start = time.perf_counter()
    batches = points = 0
    for batch in loader.iter_epoch(epoch, 0):
        batches += 1
        points += int(batch["offset"][-1])
    return time.perf_counter() - start, batches, points


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args(argv)
    data = LidarBlocks("train")
    loaders = {w: build_train_loader(data, batch_size=args.batch_size, seed=0, transform=transform(0.25, "train"),
                                     num_workers=w) for w in (0, 2)}
    for w, loader in loaders.items():  # warm up: worker start-up is paid once (persistent workers)
        one_epoch(loader, 0)
    rows = {w: [] for w in loaders}
    for r in range(args.rounds):
        for w, loader in loaders.items():
            rows[w].append(one_epoch(loader, r + 1))
    result = {"machine": machine_info(), "batch_size": args.batch_size, "workers": {}}
    print(f"{'workers':>8} {'batches/s':>10} {'points/s':>12}")
    for w, runs in rows.items():
        bps = statistics.median(b / t for t, b, _ in runs)
        pps = statistics.median(p / t for t, _, p in runs)
        result["workers"][str(w)] = {"batches_per_s": bps, "points_per_s": pps}
        print(f"{w:>8} {bps:>10.1f} {pps:>12.0f}")
    out = Path(__file__).resolve().parent / "results" / "loader_throughput.json"
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
