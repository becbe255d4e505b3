"""Sharded DCP checkpoints across world sizes: run 20 steps saving at step 10, or resume another
world size's step-10 checkpoint and finish; the resumed run must end where the writer did.

argv: out_dir, tag of this run's files (w1 / w2), tag to resume from (or "-").
The model has a 0-dim param (Replicate()). No BatchNorm here: 2 ranks x batch B then
equal 1 rank x batch 2B (the global batch).
A 1-rank resume also restores the checkpoint into a plain unsharded state
(``sharded=False``) and continues it with ``supervised``, to the same params.
"""
import os
import sys

import _common as C
import torch
from torch.distributed.tensor import DTensor

import pimm_fn.distributed as D
import pimm_fn.sharding as S
from pimm_fn.state import TrainState
from pimm_fn.steps.supervised import supervised

STEPS, HALF, GLOBAL_B = 20, 10, 8


class GainMLP(C.MLP):
    """The MLP with a learned 0-dim output gain: a Replicate() param, whose gradient is
    all-reduced rather than reduce-scattered."""

    def __init__(self):
        super().__init__(hidden=15)
        self.gain = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, batch):
        pred = self.fc2(torch.relu(self.fc1(batch["x"]))) * self.gain
        return {"loss": torch.nn.functional.mse_loss(pred, batch["y"])}


def diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def main():
    ctx = D.init_from_env()
    out, tag, resume_from = C.out_dir(), sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    like = TrainState.create(GainMLP(), C.optimizer("adamw", 0.05), seed=0)
    batches = list(C.loader(C.dataset(STEPS * GLOBAL_B), GLOBAL_B // ctx.world_size, ctx.rank,
                            ctx.world_size).iter_epoch(0))
    step = S.sharded(clip_grad=0.5)
    res = {"world_size": ctx.world_size}
    if resume_from == "-":
        sh = S.shard(like)
        for i, b in enumerate(batches):
            if i == HALF:
                S.save(os.path.join(out, f"{tag}_step{HALF}"), sh, extra={"world_size": ctx.world_size})
            sh, _ = step(sh, b)
        final = S.unshard(sh)
        if ctx.is_main:
            torch.save({"params": final.params, "opt": final.opt_state.mu}, os.path.join(out, f"{tag}_final.pt"))
    else:
        ckpt = os.path.join(out, f"{resume_from}_step{HALF}")
        sh, extra = S.restore(ckpt, like)
        res["restored_step"] = int(sh.step)
        res["saved_world_size"] = extra["world_size"]
        res["dtensor"] = all(isinstance(v, DTensor) for v in sh.params.values())
        res["local_rows"] = {k: v.to_local().shape[0] for k, v in sh.params.items() if v.dim()}
        res["gain_placement"] = str(sh.params["gain"].placements[0])
        for b in batches[HALF:]:
            sh, _ = step(sh, b)
        final = S.unshard(sh)
        ref = torch.load(os.path.join(out, f"{resume_from}_final.pt"))
        res["max_param_diff"] = diff(final.params, ref["params"])
        res["max_mu_diff"] = diff(final.opt_state.mu, ref["opt"])
        if ctx.world_size == 1:  # the same checkpoint into a plain state, trained unsharded
            plain, _ = S.restore(ckpt, like, sharded=False)
            res["plain_is_dtensor"] = any(isinstance(v, DTensor) for v in plain.params.values())
            plain_step = supervised(clip_grad=0.5)
            for b in batches[HALF:]:
                plain, _ = plain_step(plain, b)
            res["plain_max_param_diff"] = diff(plain.params, ref["params"])
        if ctx.is_main:
            C.write_json(os.path.join(out, f"resume_{resume_from}_to_{tag}.json"), res)
    D.shutdown()


if __name__ == "__main__":
    main()
