"""A model with graph breaks ("bring your own model"): the three ways pimm_fn can train it.

    python benchmarks/graph_breaks.py [--models tolist,topology_inside] [--rounds 3] [--threads 2]

The model is the PTv3-class backbone (pimm_fn.bench.workloads.ptv3: its config, its real
LiDAR batches) written as users' models are written:

- tolist: a per-cloud context (each cloud's max feature, broadcast back to its points)
  computed mid-forward by a Python loop over ``offset.tolist()``;
- ptv3: the backbone as pimm_fn ships it (the topology built by the collate): no break,
  the reference for the whole-step compile;
- topology_inside: the serialization, patches, neighbour maps and pooling computed by
  the forward from ``grid_coord`` (as Pointcept's PTv3 does): host reads of sizes,
  ``torch.unique``, ``repeat_interleave`` by data-dependent counts.

Ways, same module, same batches, interleaved: the Pointcept-style eager step
(nn.Module + torch.optim.AdamW (foreach) + clip_grad_norm_ + OneCycleLR), pimm_fn's eager
step (``compile_step(eager=True)``), pimm_fn's graph-tolerant step
(``compile_step(fullgraph=False)``) and the whole-step compile (``compile_step()``, on a
model with a break it fails at once and is reported as not compiling). Reports the median step, the ratio to the
Pointcept-style step, compiles and graph breaks, first-call time and the first-step
losses (they agree). Writes benchmarks/results/graph_breaks.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch

from pimm_fn.bench import machine_info
from pimm_fn.bench import workloads as W
from pimm_fn.compile import compile_step
from pimm_fn.models.ptv3 import PTv3
from pimm_fn.state import TrainState
from pimm_fn.steps.supervised import supervised


class PTv3CloudContext(PTv3):
    """PTv3 with a per-cloud context added to the bottleneck by a Python loop over counts read with ``.tolist()``."""

    def forward(self, batch: dict) -> dict:
        levels = batch["topology"]["levels"]
        skips = self.encode(batch, levels)
        # The host read: the bottleneck's per-cloud point counts, as users loop over clouds.
        counts = levels[-1]["cloud_counts"].tolist()
        parts, start = [], 0
        for n in counts:
            part = skips[-1][start:start + n]
            parts.append(part + part.amax(0, keepdim=True))
            start += n
        skips[-1] = torch.cat(parts)
        from pimm_fn.models._common import classification_outputs

        return classification_outputs(self.head(self.decode(skips, levels)), batch, self.label_key, "seg_logits")


def with_cloud_counts(batch: dict) -> dict:
    """The batch with each level's per-cloud point counts of the coarsest level (from the pooling clusters)."""
    levels = batch["topology"]["levels"]
    offset = batch["offset"]
    cloud = torch.repeat_interleave(torch.arange(offset.numel()), torch.diff(offset, prepend=offset.new_zeros(1)))
    for level in levels[:-1]:
        coarse = torch.zeros(int(level["pool"].max()) + 1, dtype=torch.long)
        coarse[level["pool"]] = cloud
        cloud = coarse
    levels = list(levels)
    levels[-1] = dict(levels[-1], cloud_counts=torch.bincount(cloud, minlength=offset.numel()))
    return dict(batch, topology=dict(batch["topology"], levels=levels))


def build(name: str, batches: list):
    torch.manual_seed(0)
    if name == "tolist":
        return PTv3CloudContext(4, 3, **W.PTV3_CONFIG), [with_cloud_counts(b) for b in batches]
    if name == "ptv3":
        return PTv3(4, 3, **W.PTV3_CONFIG), batches
    if name == "topology_inside":
        return PTv3(4, 3, **W.PTV3_CONFIG), [{k: v for k, v in b.items() if k != "topology"} for b in batches]
    raise ValueError(f"unknown model {name!r}: use tolist, ptv3 or topology_inside")


def bench_model(name: str, raw: list, rounds: int, ways_wanted: tuple) -> dict:
    model, batches = build(name, raw)
    torch._dynamo.reset()
    ways, pimm, failed = {}, {}, None
    trainer = W.seed_trainer(_copy(model))
    ways["pointcept_eager"] = lambda b: trainer(b)
    settings = {"pimm_eager": {"eager": True}, "pimm_fullgraph_false": {"fullgraph": False}, "pimm_fullgraph": {}}
    for way in ways_wanted:
        step = compile_step(supervised(clip_grad=W.CLIP), **settings[way])
        pimm[way] = {"step": step, "state": TrainState.create(_copy(model), W.make_optimizer()[0])}

        def run(b, holder=pimm[way]):
            holder["state"], metrics = holder["step"](holder["state"], b)
            return metrics["loss"]

        ways[way] = run
    first_loss, first_s = {}, {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for way, fn in list(ways.items()):
            t = time.perf_counter()
            try:
                first_loss[way] = float(fn(batches[0]))
            except Exception as err:  # a model with breaks does not compile whole
                if way != "pimm_fullgraph":
                    raise
                failed = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                del ways[way], pimm[way]
                continue
            first_s[way] = time.perf_counter() - t
            for b in batches[1:]:  # every size seen once before timing: recompiles happen here
                fn(b)
    times = {way: [] for way in ways}
    for _ in range(rounds):
        for b in batches:
            for way, fn in ways.items():
                t = time.perf_counter()
                fn(b)
                times[way].append((time.perf_counter() - t) * 1e3)
    base = statistics.median(times["pointcept_eager"])
    out = {"model": name, "batches": len(batches), "rounds": rounds,
           "points_per_batch": [int(b["offset"][-1]) for b in batches],
           "warnings": sorted({str(w.message)[:300] for w in caught if "graph break" in str(w.message)}),
           "fullgraph_error": failed}
    for way in ways:
        med = statistics.median(times[way])
        row = {"median_ms": med, "ratio_to_pointcept_eager": base / med, "first_call_s": first_s[way],
               "first_loss": first_loss[way]}
        if way in pimm:
            step = pimm[way]["step"]
            row.update(compiles=step.compile_count, graph_breaks=step.graph_breaks)
        out[way] = row
    return out


def _copy(model):
    import copy

    return copy.deepcopy(model)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="ptv3,tolist,topology_inside")
    ap.add_argument("--ways", default="pimm_eager,pimm_fullgraph_false,pimm_fullgraph",
                    help="pimm_fn ways beside the Pointcept-style eager step")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "graph_breaks.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    raw = W.lidar_ptv3_batches(args.batches)
    results = {"machine": machine_info(), "threads": args.threads, "models": []}
    for name in args.models.split(","):
        r = bench_model(name, raw, args.rounds, tuple(args.ways.split(",")))
        results["models"].append(r)
        print(f"\n{name}: {r['batches']} LiDAR batches "
              f"({min(r['points_per_batch'])}-{max(r['points_per_batch'])} points)")
        if r["fullgraph_error"]:
            print(f"  pimm_fullgraph         does not compile: {r['fullgraph_error'][:150]}")
        for way in ("pointcept_eager", "pimm_eager", "pimm_fullgraph_false", "pimm_fullgraph"):
            row = r.get(way)
            if row is None:
                continue
            extra = f"  compiles {row['compiles']}, breaks {row['graph_breaks']}" if "compiles" in row else ""
            print(f"  {way:22s} {row['median_ms']:8.1f} ms  {row['ratio_to_pointcept_eager']:.2f}x  "
                  f"first call {row['first_call_s']:.1f} s  loss {row['first_loss']:.6f}{extra}")
    results["load_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
