"""Per-rank bytes of params + optimizer state, sharded (pimm_fn.sharding: DTensor Shard(0)
params and AdamW moments) vs replicated (data parallel), at world 1, 2 and 4 under
torchrun (gloo, CPU).

    PYTHONPATH=. python benchmarks/sharded_memory.py [--worlds 1 2 4] [--json benchmarks/results/sharded_memory.json]

Each world size is one torchrun launch; every rank builds an MLP (AdamW), shards the state,
runs 2 sharded steps (so the numbers are of a state that trained) and reports the sum of its
DTensors' local tensors' nbytes (``to_local()``: the rows this rank holds). The full params
gathered for the forward and the gradients are transient (freed after the step) and not
counted: this is the resident training state.
The peak RSS column (whole process: torch itself, the full model object, the transient
full params and gradients of a step) shows what sharding does not shrink.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (1024, 2048, 2048, 10)  # ~6.3M params


def worker(out_path, sizes=SIZES):
    torch.set_num_threads(1)
    import pimm_fn.distributed as D
    import pimm_fn.sharding as S
    from pimm_fn.optim import adamw
    from pimm_fn.state import TrainState

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

        def forward(self, batch):
            h = batch["x"]
            for i, layer in enumerate(self.layers):
                h = layer(h) if i == len(self.layers) - 1 else torch.relu(layer(h))
            return {"loss": torch.nn.functional.cross_entropy(h, batch["y"])}

    ctx = D.init_from_env()
    torch.manual_seed(0)
    full = TrainState.create(MLP(), adamw(1e-3, weight_decay=0.01), seed=0)
    replicated = S.state_bytes(full)
    sh = S.shard(full)
    del full  # the state's module is structure only: no full copy of the weights stays resident
    step = S.sharded(clip_grad=1.0)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(2):
        batch = {"x": torch.randn(8, sizes[0], generator=g), "y": torch.randint(0, sizes[-1], (8,), generator=g)}
        sh, m = step(sh, batch)
    mine = S.state_bytes(sh)
    from torch.distributed.tensor import DTensor

    leaves = (list(sh.params.values()) + [sh.opt_state.mu[k] for k in sh.params]
              + [sh.opt_state.nu[k] for k in sh.params])
    mine["all_dtensor"] = all(isinstance(t, DTensor) for t in leaves)
    mine["local_rows"] = {k: v.to_local().shape[0] for k, v in sh.params.items() if v.dim()}
    import resource

    mine["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    rows = [None] * ctx.world_size
    if ctx.is_distributed:
        torch.distributed.all_gather_object(rows, mine)
    else:
        rows = [mine]
    if ctx.is_main:
        with open(out_path, "w") as f:
            json.dump({"world_size": ctx.world_size, "replicated": replicated, "per_rank": rows,
                       "loss": float(m["loss"])}, f)
    D.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "sharded_memory.json"))
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="MLP layer widths")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, tuple(args.sizes))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in args.worlds:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            path = os.path.join(tmp, f"w{w}.json")
            subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={w}",
                            f"--master_port={port}", os.path.abspath(__file__), "--worker", path,
                            "--sizes", *map(str, args.sizes)],
                           check=True, env=env, cwd=ROOT)
            with open(path) as f:
                results.append(json.load(f))
    base = results[0]["per_rank"][0]["total"] * results[0]["world_size"]
    lines = [f"model: MLP {'-'.join(map(str, args.sizes))}, AdamW; bytes per rank (max over ranks)",
             f"{'world':>5} {'params MiB':>11} {'opt MiB':>9} {'total MiB':>10} {'replicated MiB':>15} "
             f"{'x 1-rank':>9} {'1/world':>8} {'peak RSS MiB':>13} {'DTensor':>8}"]
    for r in results:
        worst = max(r["per_rank"], key=lambda x: x["total"])
        lines.append(f"{r['world_size']:>5} {worst['params'] / 2**20:>11.2f} {worst['opt_state'] / 2**20:>9.2f} "
                     f"{worst['total'] / 2**20:>10.2f} {r['replicated']['total'] / 2**20:>15.2f} "
                     f"{worst['total'] / base:>9.3f} {1 / r['world_size']:>8.3f} "
                     f"{max(x['peak_rss'] for x in r['per_rank']) / 2**20:>13.0f} "
                     f"{str(all(x['all_dtensor'] for x in r['per_rank'])):>8}")
    text = "\n".join(lines)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from overhead import write_results

    write_results({"sizes": list(args.sizes), "results": results}, text, args.json)


if __name__ == "__main__":
    sys.exit(main())
