"""Where a PTv3-class model's topology is computed: in the loader's collate or inside the step.

    python benchmarks/ptv3_topology.py [--batches 8] [--threads 2]

The topology (serialization orders, padded patches, 3x3x3 neighbour maps, pooling
clusters of every level: pimm_fn.models.serialization.build_topology) either comes with
the batch, built by the collate (in the loader's workers), or is computed by the model's
forward from ``grid_coord`` and ``offset``. For both, on the same real LiDAR batches
(pimm_fn.bench.workloads.ptv3's model and data): the topology's own cost per batch, the
eager step, and the compiled step (first call = compile, compiles over all batches,
steady step), inside-the-step also with dynamo's capture flags for data-dependent
sizes. Writes benchmarks/results/ptv3_topology.json.
"""
from __future__ import annotations

import argparse
import json
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
from pimm_fn.models.serialization import build_topology
from pimm_fn.steps.supervised import supervised


def median_ms(fn, items, repeat=2):
    times = []
    for _ in range(repeat):
        for item in items:
            t = time.perf_counter()
            fn(item)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def run_compiled(wl, batches, flags=None):
    """First call (compile) time, compiles over all batches, steady step time; or the failure."""
    torch._dynamo.reset()
    step = compile_step(supervised(clip_grad=W.CLIP), cache=False)  # the first call times the compile
    patch = torch._dynamo.config.patch(**(flags or {}))
    try:
        with patch:
            t = time.perf_counter()
            state, _ = step(wl.state, batches[0])
            first = time.perf_counter() - t
            for b in batches[1:]:
                state, _ = step(state, b)
            steady = median_ms(lambda b: step(state, b), batches)
    except Exception as err:  # the measurement is whether it compiles
        return {"compiles": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    return {"compiles": True, "first_call_s": first, "compile_count": step.compile_count, "step_ms": steady,
            "recompile_reasons": step.recompile_reasons[:3]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ptv3_topology.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    wl = W.ptv3(args.batches)
    model = wl.model
    loader_batches = wl.batches
    inside_batches = [{k: v for k, v in b.items() if k != "topology"} for b in loader_batches]
    spec = model.spec
    res = {"machine": machine_info(), "load_avg_before": load_before, "threads": torch.get_num_threads(),
           "points": [int(b["coord"].shape[0]) for b in loader_batches]}
    res["topology_ms"] = median_ms(lambda b: build_topology(b["grid_coord"], b["offset"], spec), loader_batches)
    eager = supervised(clip_grad=W.CLIP)
    res["eager_step_ms"] = {"loader": median_ms(lambda b: eager(wl.state, b), loader_batches),
                            "inside": median_ms(lambda b: eager(wl.state, b), inside_batches)}
    print(f"topology {res['topology_ms']:.1f} ms/batch; eager step {res['eager_step_ms']}", flush=True)
    res["compiled"] = {"loader": run_compiled(wl, loader_batches)}
    print("compiled, loader placement:", res["compiled"]["loader"], flush=True)
    res["compiled"]["inside"] = run_compiled(wl, inside_batches)
    print("compiled, inside:", res["compiled"]["inside"], flush=True)
    flags = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}
    res["compiled"]["inside_capture_flags"] = run_compiled(wl, inside_batches, flags)
    print("compiled, inside with capture flags:", res["compiled"]["inside_capture_flags"], flush=True)
    res["load_avg_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2, default=str)
    print(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main()
