"""One step's time and peak memory on a GPU: pimm_fn compiled vs seed-style eager vs torch.compile(model).

    python benchmarks/gpu_steps.py                       # the three models on cuda
    python benchmarks/gpu_steps.py --models mlp --rounds 2 --steps 5
    python benchmarks/gpu_steps.py --device cpu --quick  # the same code path on the CPU (a smoke test)

The workloads are pimm_fn.bench.workloads' (mlp, pointseg on variable-size point batches,
cnn), made on the CPU and moved to the device, so every way starts from the same weights
and batches. Ways (the same ones benchmarks/run_steps.py names):

    seed_eager      the seed's run_step: nn.Module + AdamW(foreach) + clip_grad_norm_ + OneCycleLR
    compile_model   the same with torch.compile(model)
    pimm_compiled   pimm_fn's supervised step under compile_step (fullgraph)
    pimm_graphs     the same with mode="reduce-overhead" (CUDA graphs); static shapes only
                    (mlp, cnn): pointseg's point counts vary, so it has no row

Timing: after warm-up (compiles included there; the first call's seconds are reported),
``--rounds`` rounds run every way for ``--steps`` steps in turn (the order rotates), each
round timed between two ``torch.cuda.synchronize`` calls; the figure is the median over
rounds of the per-step time. Peak memory: ``torch.cuda.max_memory_allocated`` over one
extra, untimed step, minus what was allocated before (pimm_fn.bench.PeakMemory).
``--budget-s`` stops before a model that would start after the budget is spent (its row
says so), so a caller's time limit is never hit mid-model. Prints a table; writes JSON
to ``--out`` after every model. Exit status: 0 when every model ran, 1 when one failed,
2 when the device is cuda and there is none.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch

from pimm_fn.bench import PeakMemory, machine_info
from pimm_fn.bench import workloads as W
from pimm_fn.compile import compile_step

WAYS = ("seed_eager", "compile_model", "pimm_compiled", "pimm_graphs")
STATIC = ("mlp", "cnn")  # batch shapes fixed: CUDA graphs apply


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_ways(wl, names):
    ways = {}
    for name in names:
        if name == "pimm_graphs" and wl.name not in STATIC:
            continue
        if name.startswith("pimm"):
            step = compile_step(wl.step, mode="reduce-overhead" if name == "pimm_graphs" else None)
            holder = {"state": wl.state}

            def run(batch, step=step, holder=holder):
                holder["state"], _ = step(holder["state"], batch)

            ways[name] = (run, step)
        else:
            ts = W.seed_trainer(copy.deepcopy(wl.model), compile_model=(name == "compile_model"))
            ways[name] = (lambda batch, ts=ts: ts(batch), None)
    return ways


def bench_model(name, args, device):
    wl = W.WORKLOADS[name](device=device)
    batches = list(wl.batches)
    ways = build_ways(wl, args.ways)
    n_warm = 4 if name == "pointseg" else 2  # variable sizes: the dynamic recompile happens in warm-up
    rows = {}
    for wn, (run, counter) in ways.items():
        _sync(device)
        t0 = time.perf_counter()
        run(batches[0])
        _sync(device)
        first = time.perf_counter() - t0
        for i in range(1, n_warm):
            run(batches[i % len(batches)])
        rows[wn] = {"first_call_s": first, "round_ms": [],
                    "compiles_after_warmup": None if counter is None else counter.compile_count}
        print(f"  [{name}] warm {wn}: first call {first:.1f} s", flush=True)
    pos = n_warm
    names = list(ways)
    for r in range(args.rounds):
        for wn in names[r % len(names):] + names[: r % len(names)]:
            run, _ = ways[wn]
            _sync(device)
            t0 = time.perf_counter()
            for i in range(args.steps):
                run(batches[(pos + i) % len(batches)])
            _sync(device)
            rows[wn]["round_ms"].append((time.perf_counter() - t0) * 1e3 / args.steps)
        pos += args.steps
    for wn, (run, counter) in ways.items():
        mem = PeakMemory(device)
        with mem:
            run(batches[pos % len(batches)])
        row = rows[wn]
        row.update(step_ms=statistics.median(row["round_ms"]), min_ms=min(row["round_ms"]),
                   peak_mib=None if mem.peak_bytes is None else mem.peak_bytes / 2**20, memory_method=mem.method)
        if counter is not None:
            row["recompiles_in_timing"] = counter.compile_count - row["compiles_after_warmup"]
    base = rows.get("seed_eager", {}).get("step_ms")
    for row in rows.values():
        row["vs_seed_eager"] = row["step_ms"] / base if base else None
    return rows


def table(results) -> str:
    lines = [f"{'model':<9} {'way':<14} {'step ms':>9} {'x seed':>7} {'first s':>8} {'peak MiB':>9} {'recomp':>6}"]
    for model, rows in results.items():
        if "error" in rows or "skipped" in rows:
            lines.append(f"{model:<9} {rows.get('error') or rows['skipped']}")
            continue
        for way, r in rows.items():
            ratio = "-" if r["vs_seed_eager"] is None else f"{r['vs_seed_eager']:.2f}"
            peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
            rec = r.get("recompiles_in_timing", "-")
            lines.append(f"{model:<9} {way:<14} {r['step_ms']:>9.3f} {ratio:>7} {r['first_call_s']:>8.1f} "
                         f"{peak:>9} {rec!s:>6}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="mlp,pointseg,cnn")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="steps per way per round")
    ap.add_argument("--quick", action="store_true", help="2 rounds x 3 steps")
    ap.add_argument("--budget-s", type=float, default=None, help="start no model after this many seconds")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu_steps.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 3
    args.ways = [w for w in args.ways.split(",") if w]
    unknown = sorted(set(args.ways) - set(WAYS))
    if unknown:
        ap.error(f"unknown ways {unknown}; choose from {', '.join(WAYS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_steps: no CUDA device (torch.cuda.is_available() is False); pass --device cpu for a "
              "CPU smoke run", flush=True)
        return 2
    start = time.perf_counter()
    results, failed = {}, False
    out = {"machine": machine_info(), "device": str(device), "rounds": args.rounds, "steps": args.steps,
           "models": results}
    for name in [m for m in args.models.split(",") if m]:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            results[name] = {"skipped": f"not run: the {args.budget_s:g} s budget was spent"}
            continue
        print(f"[{name}] {W.MODELS[name][1]} on {device}", flush=True)
        try:
            results[name] = bench_model(name, args, device)
        except Exception as err:  # one model failing must not hide the others
            traceback.print_exc()
            first_line = str(err).splitlines()[0][:200] if str(err) else ""
            results[name] = {"error": f"failed: {type(err).__name__}: {first_line}"}
            failed = True
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(table(results), flush=True)
    print(f"(total {time.perf_counter() - start:.0f} s; JSON in {args.out})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
