"""Where the PTv3-class step's time goes, eager (Pointcept-style) and compiled (pimm_fn).

    python benchmarks/ptv3_profile.py [--batches 4] [--threads 2]

Profiles both steps on the same real LiDAR batches (pimm_fn.bench.workloads.ptv3) with
torch.profiler and sums self CPU time by kind of work: GEMMs (mm, addmm, bmm, linear),
attention (scaled_dot_product_attention and its flash/math kernels), gathers and scatters
(index_select, gather, index, scatter, index_add, embedding), inductor's generated kernels
(fused elementwise, norms, reductions: in the compiled step), the rest of aten (eager
elementwise, norms, reductions, copies) and the optimizer. The compiler speeds up only
what it fuses; GEMMs, attention and gathers run the same library kernels either way, so
their share of the eager step bounds the speed-up any compile can give (Amdahl).
The profiler's own cost per op inflates the eager step's many small ops, so the totals are
above the unprofiled step times and only shares within one profile mean anything; the
GEMM + attention + gather share is, if anything, understated. Writes
benchmarks/results/ptv3_profile.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch
from torch.profiler import ProfilerActivity, profile

from pimm_fn.bench import machine_info
from pimm_fn.bench import workloads as W
from pimm_fn.compile import compile_step
from pimm_fn.steps.supervised import supervised

KINDS = (
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn", "onednn",
              "aten::_weight_int", "extern_kernels.mm", "extern_kernels.addmm", "extern_kernels.bmm")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("gather/scatter", ("index_select", "aten::gather", "aten::index", "scatter", "index_add", "index_put",
                        "embedding")),
    ("optimizer", ("_foreach", "Optimizer.step", "fused_adam")),
    # Inductor's generated C++ kernels are not profiler events: their time is the self time
    # of the compiled-region events around them.
    ("compiled region (inductor's fused kernels)", ("cpp_fused", "graph_", "kernel_cpp", "CompiledFunction",
                                                    "inductor", "Compiled Region", "CompiledFxGraph",
                                                    "TorchDynamo", "Torch-Compiled")),
)


def kind_of(name: str) -> str:
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return "other aten (elementwise, norms, reductions, copies)" if name.startswith("aten::") else "other"


def profile_steps(run, batches) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches:
            run(b)
    by_kind: dict = collections.Counter()
    for evt in prof.key_averages():
        by_kind[kind_of(evt.key)] += evt.self_cpu_time_total / 1e3  # ms
    total = sum(by_kind.values())
    return {"total_ms_per_step": total / len(batches),
            "ms_per_step": {k: v / len(batches) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ptv3_profile.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    wl = W.ptv3(args.batches)
    trainer = W.seed_trainer(wl.model)
    step = compile_step(supervised(clip_grad=W.CLIP))
    holder = {"state": wl.state}

    def pimm(b):
        holder["state"], _ = step(holder["state"], b)

    for b in wl.batches:  # warm: compile, first-touch allocations
        trainer(b)
        pimm(b)
    out = {"machine": machine_info(), "threads": args.threads, "compiles": step.compile_count,
           "pointcept_eager": profile_steps(trainer, wl.batches), "pimm_compiled": profile_steps(pimm, wl.batches)}
    eager = out["pointcept_eager"]["ms_per_step"]
    fixed = sum(eager.get(k, 0.0) for k in ("gemm", "attention", "gather/scatter"))
    out["eager_share_library_kernels"] = fixed / out["pointcept_eager"]["total_ms_per_step"]
    out["amdahl_bound"] = out["pointcept_eager"]["total_ms_per_step"] / fixed
    for way in ("pointcept_eager", "pimm_compiled"):
        print(f"{way}: {out[way]['total_ms_per_step']:.1f} ms/step (profiled self time)")
        for k, v in out[way]["ms_per_step"].items():
            print(f"  {k:52s} {v:8.1f} ms")
    print(f"GEMM + attention + gathers: {100 * out['eager_share_library_kernels']:.0f}% of the eager step; "
          f"a compile that made everything else free would be {out['amdahl_bound']:.2f}x")
    out["load_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
