"""2 ranks x batch b vs 1 process x batch 2b, plus metric, count, skip and BN-sync checks.

Launched by tests/test_distributed_torchrun.py under torchrun; writes results.json.
"""
import os
import time

import _common as C
import torch

import pimm_fn.distributed as D
from pimm_fn.state import TrainState
from pimm_fn.steps.supervised import supervised

STEPS, B = 20, 4


def run_dp(kind, ctx, data):
    torch.manual_seed(0)
    state = TrainState.create(C.MLP(), C.optimizer(kind, 0.05), seed=0)
    step = D.data_parallel(clip_grad=0.5)
    losses, samples = [], 0
    for batch in C.loader(data, B, ctx.rank, ctx.world_size).iter_epoch(0):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        samples += int(m["samples"])
    D.assert_in_sync(state.params)
    return state, losses, samples


def run_single(kind, data):
    torch.manual_seed(0)
    state = TrainState.create(C.MLP(), C.optimizer(kind, 0.05), seed=0)
    step = supervised(clip_grad=0.5)
    losses = []
    for batch in C.loader(data, 2 * B, 0, 1).iter_epoch(0):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return state, losses


def main():
    t0 = time.perf_counter()
    ctx = D.init_from_env()
    assert ctx.world_size == 2 and ctx.backend == "gloo" and str(ctx.device) == "cpu", ctx
    res = {"rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank}
    data = C.dataset(STEPS * B * ctx.world_size)

    for kind in ("sgd", "adamw"):
        dp_state, dp_losses, samples = run_dp(kind, ctx, data)
        assert len(dp_losses) == STEPS, len(dp_losses)
        if ctx.is_main:
            ref_state, ref_losses = run_single(kind, data)
            res[kind] = {
                "steps": len(dp_losses),
                "samples": samples,
                "max_param_diff": max(float((dp_state.params[k] - ref_state.params[k]).abs().max())
                                      for k in ref_state.params),
                "max_loss_diff": max(abs(a - b) for a, b in zip(dp_losses, ref_losses)),
                "param_moved": max(float((ref_state.params[k] - TrainState.create(
                    C.MLP(), C.optimizer(kind, 0.05)).params[k]).abs().max()) for k in ref_state.params),
            }

    # metric key rules: _min -> MIN, _max / abs_max -> MAX, count -> SUM, others mean
    r = float(ctx.rank)
    m, _ = D.reduce_metrics({"loss": torch.tensor(r), "a_min": torch.tensor(r + 1), "b_max": torch.tensor(r + 1),
                             "adv_abs_max": torch.tensor(-r), "count": torch.tensor(3.0)})
    res["reduced"] = {k: float(v) for k, v in m.items()}

    # samples counted from the real per-rank batch sizes (3 on rank 0, 5 on rank 1)
    state = TrainState.create(C.MLP(), C.optimizer("sgd", 0.05), seed=0)
    step = D.data_parallel()
    xs = torch.randn(3 + 2 * ctx.rank, C.IN)
    _, m = step(state, {"x": xs, "y": torch.zeros(xs.shape[0], C.OUT)})
    res["unequal_samples"] = float(m["samples"])

    # a non-finite gradient on rank 1 only: every rank skips, the loss scale backs off on both
    torch.manual_seed(0)  # same initial params on every rank (the randn above drew per-rank sizes)
    state = TrainState.create(C.MLP(), C.optimizer("sgd", 0.05), seed=0, loss_scale=True)
    xs = torch.randn(4, C.IN)
    if ctx.rank == 1:
        xs[0, 0] = float("inf")
    new, m = step(state, {"x": xs, "y": torch.zeros(4, C.OUT)})
    D.assert_in_sync(new.params)
    res["inf_skip"] = {"skipped": float(m["skipped"]), "scale": float(new.loss_scale.scale),
                       "unchanged": all(torch.equal(new.params[k], state.params[k]) for k in state.params)}

    # BatchNorm running statistics: diverge per rank without sync, agree with sync_buffers
    out = {}
    for sync in (False, True):
        torch.manual_seed(0)
        state = TrainState.create(C.MLP(bn=True), C.optimizer("sgd", 0.05), seed=0)
        step = D.data_parallel(sync_buffers=sync)
        for batch in list(C.loader(data, B, ctx.rank, ctx.world_size).iter_epoch(0))[:3]:
            state, _ = step(state, batch)
        try:
            D.assert_in_sync(state.buffers, what="buffers")
            out[str(sync)] = "in sync"
        except D.RankDivergenceError as e:
            out[str(sync)] = "diverged: " + str(e)[:120]
    res["bn_sync"] = out
    res["num_batches_tracked"] = int(state.buffers["bn.num_batches_tracked"])

    # rank 0 writes, every rank reads after it (on_main's broadcast is the barrier)
    path = D.on_main(lambda: (C.write_json(os.path.join(C.out_dir(), "main_only.json"), {"w": 1}),
                              os.path.join(C.out_dir(), "main_only.json"))[1])
    res["read_after_main_write"] = os.path.exists(path)
    res["seconds"] = time.perf_counter() - t0
    if ctx.is_main:
        C.write_json(os.path.join(C.out_dir(), "results.json"), res)
    D.shutdown()


if __name__ == "__main__":
    main()
