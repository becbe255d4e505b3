"""The data-parallel step compiled with fullgraph on gloo (CPU) or nccl (a GPU per rank): 0 graph
breaks, same numbers as eager.

Writes compiled_rank<r>.json. One compiled step function (BatchNorm model, sync_buffers,
clipping, loss scaling); three steps compiled and eager.
"""
import os
import time

import _common as C
import torch

import pimm_fn.distributed as D
from pimm_fn.compile import compile_step, explain_step
from pimm_fn.data import DeviceLoader
from pimm_fn.state import TrainState


def main():
    ctx = D.init_from_env()
    torch.manual_seed(0)
    # On the rank's device (cuda:LOCAL_RANK over nccl when each rank has a GPU, else the CPU
    # over gloo): the state is made there and the loader delivers batches there.
    state0 = TrainState.create(C.MLP(bn=True), C.optimizer("adamw", 0.02), seed=0, loss_scale=True,
                               device=ctx.device)
    step = D.data_parallel(sync_buffers=True, clip_grad=1.0)
    batches = list(DeviceLoader(C.loader(C.dataset(24), 4, ctx.rank, ctx.world_size), ctx.device).iter_epoch(0))[:3]

    explained = explain_step(step, state0, batches[0])
    res = {"rank": ctx.rank, "backend": ctx.backend, "device": str(ctx.device),
           "state_device": str(state0.device), "batch_device": str(batches[0]["x"].device),
           "graph_break_count": explained.graph_break_count,
           "break_reasons": [str(r) for r in explained.break_reasons], "graph_count": explained.graph_count}
    compiled = compile_step(step)
    eager_state = comp_state = state0
    t0 = time.perf_counter()
    diffs = []
    for batch in batches:
        eager_state, em = step(eager_state, batch)
        comp_state, cm = compiled(comp_state, batch)
        diffs.append(max(
            [float((eager_state.params[k] - comp_state.params[k]).abs().max()) for k in eager_state.params]
            + [float((eager_state.buffers[k].float() - comp_state.buffers[k].float()).abs().max())
               for k in eager_state.buffers]
            + [abs(float(em[k]) - float(cm[k])) for k in em]))
    res.update(compile_count=compiled.compile_count, compile_seconds=compiled.compile_seconds,
               loop_seconds=time.perf_counter() - t0, max_diff_vs_eager=max(diffs),
               metric_keys=sorted(cm), samples=float(cm["samples"]))
    # A background compile must switch on every rank at once: unpinned, it is refused.
    try:
        compile_step(step, background=True)(state0, batches[0])
        res["background_unpinned"] = "accepted"
    except ValueError as err:
        res["background_unpinned"] = str(err)
    D.assert_in_sync(comp_state.params)
    D.assert_in_sync(comp_state.buffers, what="buffers")
    C.write_json(os.path.join(C.out_dir(), f"compiled_rank{ctx.rank}.json"), res)
    D.shutdown()


if __name__ == "__main__":
    main()
