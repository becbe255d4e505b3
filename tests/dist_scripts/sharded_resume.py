"""Sharded checkpoints across world sizes: run 20 steps saving at step 10, or resume another
world size's step-10 checkpoint and finish; the resumed run must end where the writer did.

argv: out_dir, tag of this run's files (w1 / w2), tag to resume from (or "-").
No BatchNorm here: 2 ranks x batch B then equal 1 rank x batch 2B (the global batch).
"""
import os
import sys

import torch

import _common as C
import pimm_fn.distributed as D
import pimm_fn.sharding as S
from pimm_fn.state import TrainState

STEPS, HALF, GLOBAL_B = 20, 10, 8


def main():
    ctx = D.init_from_env()
    out, tag, resume_from = C.out_dir(), sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    like = TrainState.create(C.MLP(hidden=15), C.optimizer("adamw", 0.05), seed=0)
    batches = list(C.loader(C.dataset(STEPS * GLOBAL_B), GLOBAL_B // ctx.world_size, ctx.rank,
                            ctx.world_size).iter_epoch(0))
    step = S.sharded(clip_grad=0.5)
    res = {"world_size": ctx.world_size}
    if resume_from == "-":
        sh = S.shard(like)
        for i, b in enumerate(batches):
            if i == HALF:
                S.save(os.path.join(out, f"{tag}_step{HALF}.pimm"), sh, extra={"world_size": ctx.world_size})
            sh, _ = step(sh, b)
        final = S.unshard(sh)
        if ctx.is_main:
            torch.save({"params": final.params, "opt": final.opt_state.mu}, os.path.join(out, f"{tag}_final.pt"))
    else:
        sh, extra = S.restore(os.path.join(out, f"{resume_from}_step{HALF}.pimm"), like)
        res["restored_step"] = int(sh.step)
        res["saved_world_size"] = extra["world_size"]
        res["local_numel"] = {k: v.numel() for k, v in sh.params.items()}
        for b in batches[HALF:]:
            sh, _ = step(sh, b)
        final = S.unshard(sh)
        ref = torch.load(os.path.join(out, f"{resume_from}_final.pt"))
        res["max_param_diff"] = max(float((final.params[k] - ref["params"][k]).abs().max()) for k in ref["params"])
        res["max_mu_diff"] = max(float((final.opt_state.mu[k] - ref["opt"][k]).abs().max()) for k in ref["opt"])
        if ctx.is_main:
            C.write_json(os.path.join(out, f"resume_{resume_from}_to_{tag}.json"), res)
    D.shutdown()


if __name__ == "__main__":
    main()
