"""2 ranks sharded (compiled) vs 1 rank unsharded, BatchNorm model, 20 AdamW steps + clipping.

BatchNorm normalises with per-rank batch statistics, so the one-process reference that sees
the same global batch is ``supervised(accumulate=2)`` over [rank 0's batch, rank 1's batch]:
the same mean gradient. Also records the state's layout on every rank (DTensor params and
AdamW moments, Shard(0), uneven local rows), the graph-break counter and dynamo's explain,
and checks sharded == data_parallel (params and synced buffers), the bytes each rank
holds, the compile (fullgraph, 1 compile) and that a non-finite gradient on one rank
skips the step on both. Writes sharded_results.json.
"""
import os
import time

import _common as C
import torch
from torch.distributed.tensor import DTensor

import pimm_fn.distributed as D
import pimm_fn.sharding as S
from pimm_fn.compile import compile_step, explain_step
from pimm_fn.state import TrainState
from pimm_fn.steps.supervised import supervised

STEPS, B, HIDDEN = 20, 4, 15  # 15: fc1.weight has 120 elements, bn 15 -> padded pieces


def fresh():
    torch.manual_seed(0)
    return TrainState.create(C.MLP(bn=True, hidden=HIDDEN), C.optimizer("adamw", 0.05), seed=0)


def main():
    t0 = time.perf_counter()
    ctx = D.init_from_env()
    data = C.dataset(STEPS * B * 2)
    batches = list(C.loader(data, B, ctx.rank, ctx.world_size).iter_epoch(0))
    full0 = fresh()
    sh = S.shard(full0)
    step = compile_step(S.sharded(clip_grad=0.5, sync_buffers=True))
    for b in batches:
        sh, m = step(sh, b)
    # the state stays DTensors: params Shard(0) of their own shape (uneven rows: fc1 15 -> 8 + 7),
    # AdamW's moments with the same placement and local rows
    layout = {}
    for k, p in sh.params.items():
        mu, nu = sh.opt_state.mu[k], sh.opt_state.nu[k]
        layout[k] = {"dtensor": all(isinstance(t, DTensor) for t in (p, mu, nu)),
                     "placement": str(p.placements[0]), "shape": list(p.shape),
                     "local": list(p.to_local().shape),
                     "moments_match": all(t.placements == p.placements and t.to_local().shape == p.to_local().shape
                                          for t in (mu, nu))}
    graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    per_rank = [None] * ctx.world_size
    torch.distributed.all_gather_object(per_rank, {"layout": layout, "bytes": S.state_bytes(sh)})
    res = {"rank": ctx.rank, "steps": len(batches), "compile_count": step.compile_count,
           "layout": [r["layout"] for r in per_rank], "graph_breaks": graph_breaks,
           "bytes_full": S.state_bytes(full0), "bytes_sharded": [r["bytes"] for r in per_rank]}
    full = S.unshard(sh)

    dp, dp_step = fresh(), D.data_parallel(clip_grad=0.5, sync_buffers=True)
    for b in batches:
        dp, _ = dp_step(dp, b)
    res["vs_data_parallel_params"] = max(float((full.params[k] - dp.params[k]).abs().max()) for k in dp.params)
    res["vs_data_parallel_buffers"] = max(float((full.buffers[k].float() - dp.buffers[k].float()).abs().max())
                                          for k in dp.buffers)
    # a non-finite gradient on rank 1 only: both ranks skip, their pieces stay as they were
    xs = torch.randn(B, C.IN)
    if ctx.rank == 1:
        xs[0, 0] = float("inf")
    after, m = step(sh, {"x": xs, "y": torch.zeros(B, C.OUT)})
    res["inf_skipped"] = float(m["skipped"])
    res["inf_unchanged"] = all(torch.equal(after.params[k], sh.params[k]) for k in sh.params)
    res["inf_compile_count"] = step.compile_count
    # dynamo's own account of the sharded step (collectives and DTensor conversions inside):
    # graph breaks and their reasons; run last, explaining resets dynamo
    ex = explain_step(S.sharded(clip_grad=0.5, sync_buffers=True), sh, batches[0])
    res["explain"] = {"graphs": ex.graph_count, "graph_breaks": ex.graph_break_count,
                      "break_reasons": [str(r) for r in ex.break_reasons]}
    if ctx.is_main:
        ref, ref_step = fresh(), supervised(clip_grad=0.5, accumulate=2)
        halves = zip(C.loader(data, B, 0, 2).iter_epoch(0), C.loader(data, B, 1, 2).iter_epoch(0))
        for b0, b1 in halves:
            ref, _ = ref_step(ref, [b0, b1])
        res["vs_one_rank_params"] = max(float((full.params[k] - ref.params[k]).abs().max()) for k in ref.params)
        res["param_moved"] = max(float((ref.params[k] - full0.params[k]).abs().max()) for k in ref.params)
        res["seconds"] = time.perf_counter() - t0
        C.write_json(os.path.join(C.out_dir(), "sharded_results.json"), res)
    D.shutdown()


if __name__ == "__main__":
    main()
