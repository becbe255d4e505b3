"""4 ranks, compiled sharded step vs data_parallel, on a BatchNorm MLP whose 5 hidden rows
split 2, 2, 1, 0: rank 3 holds empty shards of fc1 / bn (a DTensor with 0 local rows).
Writes sharded_world4.json (every rank's local rows, compile count, max param diff)."""
import os

import _common as C
import torch

import pimm_fn.distributed as D
import pimm_fn.sharding as S
from pimm_fn.compile import compile_step
from pimm_fn.state import TrainState

STEPS, B = 10, 4


def fresh():
    torch.manual_seed(0)
    return TrainState.create(C.MLP(bn=True, hidden=5), C.optimizer("adamw", 0.05), seed=0)


def main():
    ctx = D.init_from_env()
    batches = list(C.loader(C.dataset(STEPS * B * ctx.world_size), B, ctx.rank, ctx.world_size).iter_epoch(0))
    sh, step = S.shard(fresh()), compile_step(S.sharded(clip_grad=0.5, sync_buffers=True))
    for b in batches:
        sh, _ = step(sh, b)
    full = S.unshard(sh)
    dp, dp_step = fresh(), D.data_parallel(clip_grad=0.5, sync_buffers=True)
    for b in batches:
        dp, _ = dp_step(dp, b)
    mine = {"rows": {k: v.to_local().shape[0] for k, v in sh.params.items()}, "compile_count": step.compile_count,
            "vs_data_parallel_params": max(float((full.params[k] - dp.params[k]).abs().max()) for k in dp.params),
            "moved": max(float((dp.params[k] - fresh().params[k]).abs().max()) for k in dp.params)}
    ranks = [None] * ctx.world_size
    torch.distributed.all_gather_object(ranks, mine)
    if ctx.is_main:
        C.write_json(os.path.join(C.out_dir(), "sharded_world4.json"), {"steps": len(batches), "ranks": ranks})
    D.shutdown()


if __name__ == "__main__":
    main()
