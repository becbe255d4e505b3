"""Inductor / CPU knobs for the compiled supervised step, measured interleaved in one run.

    python benchmarks/knobs.py [--models mlp,pointseg] [--rounds 4] [--steps 4] [--autotune] [--threads N]

Each knob is a separate ``compile_step(step, options=...)`` of the same step (its own
dynamo cache), all trained from the same state on the same batches, round-robin, so
machine load hits every knob alike. Reported: median step time as a ratio to the
default compile (< 1 helps), and each knob's compile time. Writes
benchmarks/results/knobs.json.
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

KNOBS = {
    "default": {},
    # C++ wrapper instead of the Python wrapper: less per-kernel launch overhead.
    "cpp_wrapper": {"cpp_wrapper": True},
    # Freezing folds parameters into constants; the training step takes params as
    # inputs, so it should change nothing (measured to say so).
    "freezing": {"freezing": True},
    "aggressive_fusion": {"aggressive_fusion": True},
}
AUTOTUNE = {"max_autotune_cpp_gemm": {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--autotune", action="store_true", help="also max-autotune with CPU GEMM templates (slow compile)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "knobs.json"))
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                    help="torch threads (default: 2, or 1 on a 1-core machine)")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    knobs = dict(KNOBS, **(AUTOTUNE if args.autotune else {}))
    report = {"machine": machine_info(), "command": "python benchmarks/knobs.py " + " ".join(argv or sys.argv[1:]),
              "models": {}}
    for name in args.models.split(","):
        wl = W.WORKLOADS[name]()
        batches = list(wl.batches)
        runs = {}
        for k, opts in knobs.items():
            step = compile_step(wl.step, options=opts or None, cache=False)  # time the compile, not a load
            t0 = time.perf_counter()
            try:
                st, _ = step(wl.state, batches[0])
                st, _ = step(st, batches[1 % len(batches)])
                st, _ = step(st, batches[2 % len(batches)])
            except Exception as e:  # a knob that does not compile is a result too
                runs[k] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            runs[k] = {"step": step, "state": st, "times": [], "compile_s": time.perf_counter() - t0}
            print(f"[{name}] {k}: compiled in {runs[k]['compile_s']:.1f} s", flush=True)
        live = [k for k in runs if "step" in runs[k]]
        pos = 3
        for r in range(args.rounds):
            for k in live[r % len(live):] + live[: r % len(live)]:
                run = runs[k]
                for i in range(args.steps):
                    t0 = time.perf_counter()
                    run["state"], _ = run["step"](run["state"], batches[(pos + i) % len(batches)])
                    run["times"].append((time.perf_counter() - t0) * 1e3)
            pos += args.steps
        base = statistics.median(runs["default"]["times"]) if "default" in live else None
        out = {}
        for k, run in runs.items():
            if "error" in run:
                out[k] = run
                continue
            med = statistics.median(run["times"])
            out[k] = {"options": knobs[k], "median_ms": med, "min_ms": min(run["times"]),
                      "ratio_to_default": med / base if base else None, "compile_s": run["compile_s"],
                      "compile_count": run["step"].compile_count}
            print(f"[{name}] {k:<24} median {med:8.2f} ms  min {min(run['times']):8.2f}  "
                  f"x default {out[k]['ratio_to_default']:.2f}  compile {run['compile_s']:.0f} s", flush=True)
        report["models"][name] = out
    report["load_avg_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
