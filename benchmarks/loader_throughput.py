"""Loader throughput with 0 and 2 workers: the real LiDAR blocks and the 1M-event LArTPC stream.

    python benchmarks/loader_throughput.py [--rounds 3] [--only lidar|lartpc] [--threads N] [--out PATH]

LiDAR blocks (train transforms): whole epochs; batches/s and points/s per worker count.
LArTPC: ``LArTPCEvents(num_events=1_000_000)`` through ``build_train_loader`` (an epoch of
250,000 batches of 4); each round reads the first ``--lartpc-batches`` batches of a new
epoch: events/s, batches/s and voxels/s over the batches after the first, the first
batch's latency on its own. The epoch-start cost of ordering 1M indices (the permutation,
and the sampler's (index, epoch) list the loader iterates) is timed separately.
Interleaved rounds, medians. With 0 workers the batches are built on the main process's
torch threads (--threads): on a busy 2-core machine 2 threads cost more than 1.
Writes benchmarks/results/loader_throughput.json (or --out).
Not a test.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from pimm_fn.bench import machine_info
from pimm_fn.data import LArTPCEvents, LidarBlocks, build_train_loader
from pimm_fn.data.sampler import ResumableSampler, epoch_order

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

LARTPC_EVENTS = 1_000_000


def one_epoch(loader, epoch: int):
    start = time.perf_counter()
    batches = points = 0
    for batch in loader.iter_epoch(epoch, 0):
        batches += 1
        points += int(batch["offset"][-1])
    return time.perf_counter() - start, batches, points


def lidar(rounds: int, batch_size: int) -> dict:
    from lidar_seg import transform

    data = LidarBlocks("train")
    loaders = {w: build_train_loader(data, batch_size=batch_size, seed=0, transform=transform(0.25, "train"),
                                     num_workers=w) for w in (0, 2)}
    for loader in loaders.values():  # warm up: worker start-up is paid once (persistent workers)
        one_epoch(loader, 0)
    rows = {w: [] for w in loaders}
    for r in range(rounds):
        for w, loader in loaders.items():
            rows[w].append(one_epoch(loader, r + 1))
    result = {}
    print("LiDAR blocks (whole epochs)")
    print(f"{'workers':>8} {'batches/s':>10} {'points/s':>12}")
    for w, runs in rows.items():
        bps = statistics.median(b / t for t, b, _ in runs)
        pps = statistics.median(p / t for t, _, p in runs)
        result[str(w)] = {"batches_per_s": bps, "points_per_s": pps}
        print(f"{w:>8} {bps:>10.1f} {pps:>12.0f}")
    return result


def epoch_start_cost(n: int, repeats: int = 3) -> dict:
    """Seconds to order an epoch of ``n`` indices: the permutation (epoch_order) and the
    sampler's iterator over (index, epoch) pairs (what the loader builds at each epoch start)."""
    perm, sampler_iter = [], []
    sampler = ResumableSampler(n, seed=0, with_epoch=True)
    for e in range(repeats):
        t = time.perf_counter()
        epoch_order(n, seed=0, epoch=e)
        perm.append(time.perf_counter() - t)
        sampler.set_epoch(e, 0)
        t = time.perf_counter()
        next(iter(sampler))
        sampler_iter.append(time.perf_counter() - t)
    return {"permutation_s": statistics.median(perm), "sampler_iter_s": statistics.median(sampler_iter)}


def stream_batches(loader, epoch: int, n: int):
    """Read the first ``n`` batches of ``epoch``: (first-batch seconds, seconds for the rest,
    batches after the first, events after the first, voxels after the first)."""
    start = time.perf_counter()
    it = iter(loader.iter_epoch(epoch, 0))
    next(it)
    first = time.perf_counter()
    batches = events = voxels = 0
    for batch in itertools.islice(it, n - 1):
        batches += 1
        events += int(batch["offset"].shape[0])
        voxels += int(batch["offset"][-1])
    end = time.perf_counter()
    it.close()
    return first - start, end - first, batches, events, voxels


def lartpc(rounds: int, batch_size: int, n_batches: int) -> dict:
    if n_batches < 2:
        raise ValueError(f"--lartpc-batches must be >= 2, got {n_batches}")
    data = LArTPCEvents("train", num_events=LARTPC_EVENTS)
    loaders = {w: build_train_loader(data, batch_size=batch_size, seed=0, num_workers=w) for w in (0, 2)}
    cost = epoch_start_cost(LARTPC_EVENTS)
    for loader in loaders.values():  # warm up: persistent workers start once
        stream_batches(loader, 0, 2)
    rows = {w: [] for w in loaders}
    for r in range(rounds):
        for w, loader in loaders.items():
            rows[w].append(stream_batches(loader, r + 1, n_batches))
    result = {"num_events": LARTPC_EVENTS, "batches_per_epoch": len(loaders[0]), "batches_read": n_batches,
              "epoch_start": cost, "workers": {}}
    print(f"LArTPC stream ({LARTPC_EVENTS:,} events, {len(loaders[0]):,} batches of {batch_size} an epoch; "
          f"first {n_batches} batches of each epoch)")
    print(f"  epoch start: permutation of {LARTPC_EVENTS:,} indices {cost['permutation_s'] * 1e3:.0f} ms, "
          f"sampler (index, epoch) list {cost['sampler_iter_s'] * 1e3:.0f} ms")
    print(f"{'workers':>8} {'events/s':>10} {'batches/s':>10} {'voxels/s':>12} {'first batch s':>14}")
    for w, runs in rows.items():
        eps = statistics.median(e / t for _, t, _, e, _ in runs)
        bps = statistics.median(b / t for _, t, b, _, _ in runs)
        vps = statistics.median(v / t for _, t, _, _, v in runs)
        first = statistics.median(f for f, *_ in runs)
        result["workers"][str(w)] = {"events_per_s": eps, "batches_per_s": bps, "voxels_per_s": vps,
                                     "first_batch_s": first}
        print(f"{w:>8} {eps:>10.1f} {bps:>10.2f} {vps:>12.0f} {first:>14.2f}")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lartpc-batches", type=int, default=60, help="batches read per LArTPC round")
    ap.add_argument("--only", choices=("lidar", "lartpc"), default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the main process (default: torch's); workers use 1 each")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "loader_throughput.json")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = {"machine": machine_info(), "batch_size": args.batch_size}
    if args.only in (None, "lidar"):
        result["workers"] = lidar(args.rounds, args.batch_size)
    if args.only in (None, "lartpc"):
        result["lartpc"] = lartpc(args.rounds, args.batch_size, args.lartpc_batches)
    result["machine"]["load_avg_end"] = list(os.getloadavg())
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
