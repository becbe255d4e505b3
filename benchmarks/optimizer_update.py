"""The eager optimizer update alone: pimm_fn's pure AdamW vs ``torch.optim.AdamW.step``.

    python benchmarks/optimizer_update.py --threads 1 --rounds 11

The tree: the PTv3-class backbone of ``pimm_fn.bench.workloads`` at encoder / decoder
depths (2, 2, 2) / (2, 2) (209 tensors, 2.17 M params) plus 6 small tensors: 215 leaves,
the size of a PTv3 in Pointcept. Fixed gradients (N(0, 1e-3): global norm ~1.5, so a clip
to 1.0 binds). Ways, round-robin with the order rotating per round, each call timed:

- pimm update + apply_updates: ``tx.update`` then ``apply_updates`` (the optax shape);
- pimm update_and_apply: the transform's fused ``apply`` (what the steps use);
- pimm guarded_update: the steps' whole update (finite check, global norm, clip to 1.0,
  AdamW, the skip select);
- torch AdamW.step, single-tensor (CPU default) and foreach; torch clip_grad_norm_ +
  foreach step (the seed's run_step update).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch

from pimm_fn.bench.workloads import PTV3_CONFIG
from pimm_fn.models.ptv3 import PTv3
from pimm_fn.optim import adamw, apply_updates, update_and_apply
from pimm_fn.schedules import one_cycle
from pimm_fn.steps.common import guarded_update


def tree_215():
    torch.manual_seed(0)
    model = PTv3(4, 3, **dict(PTV3_CONFIG, enc_depths=(2, 2, 2), dec_depths=(2, 2)))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    for i in range(215 - len(params)):
        params[f"extra.{i}"] = torch.randn(64)
    grads = {n: torch.randn_like(p) * 1e-3 for n, p in params.items()}
    return params, grads


def ways(params, grads):
    tx = adamw(one_cycle(10_000, 1e-3), weight_decay=0.01)

    def pimm(kind):
        h = {"p": params, "s": tx.init(params)}

        def run():
            if kind == "update":
                u, h["s"] = tx.update(grads, h["s"], h["p"])
                h["p"] = apply_updates(h["p"], u)
            elif kind == "fused":
                h["p"], h["s"] = update_and_apply(tx, grads, h["s"], h["p"])
            else:
                h["p"], h["s"], *_ = guarded_update(tx, h["p"], h["s"], grads, clip_grad=1.0)
        return run

    def torch_way(clip=False, **kw):
        ps = [torch.nn.Parameter(p.clone()) for p in params.values()]
        for p, g in zip(ps, grads.values()):
            p.grad = g.clone()
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw)

        def run():
            if clip:
                torch.nn.utils.clip_grad_norm_(ps, 1.0)
            opt.step()
        return run

    return {"pimm update + apply_updates": pimm("update"), "pimm update_and_apply": pimm("fused"),
            "pimm guarded_update (clip 1.0)": pimm("guarded"),
            "torch AdamW.step single-tensor": torch_way(foreach=False),
            "torch AdamW.step foreach": torch_way(foreach=True),
            "torch clip_grad_norm_ + step foreach": torch_way(clip=True, foreach=True)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--calls", type=int, default=5, help="calls per way per round")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    params, grads = tree_215()
    fns = ways(params, grads)
    for f in fns.values():
        for _ in range(3):
            f()
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(args.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(args.calls):
                t0 = time.perf_counter()
                fns[k]()
                times[k].append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(times["torch AdamW.step single-tensor"])
    print(f"{len(params)} tensors, {sum(p.numel() for p in params.values()) / 1e6:.2f} M params; "
          f"{args.threads} thread(s); load avg {os.getloadavg()}")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"  {k:<38} median {m:7.2f} ms  min {min(v):7.2f} ms  x torch single-tensor {m / base:.2f}")


if __name__ == "__main__":
    main()
