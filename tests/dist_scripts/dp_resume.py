"""Checkpoint on 2 ranks, restore, continue; compare with the uninterrupted run.

argv: OUT_DIR PHASE where PHASE is
  full       2 ranks: 20 steps (2 epochs of 10), rank 0 saves at step SAVE_AT; writes full.pt
  resume     2 ranks: every rank restores the step-SAVE_AT checkpoint, runs to 20; resume.pt
  resume_w1  1 process, batch 2b: restores the 2-rank checkpoint (re-sharded cursor); resume_w1.pt
Two models train side by side on the same batches: "bn" (BatchNorm, sync_buffers) and
"mlp" (no BatchNorm). Only "mlp" is resumed on 1 process: BatchNorm normalises with the
per-rank batch's statistics, so 2 x b and 1 x 2b differ by design (docs/distributed.md).
"""
import os
import sys

import _common as C
import torch

import pimm_fn.distributed as D
from pimm_fn.checkpoint import CheckpointDir, restore
from pimm_fn.state import TrainState

B, EPOCH_STEPS, EPOCHS, SAVE_AT = 4, 10, 2, 7


def fresh(name):
    torch.manual_seed(0)
    return TrainState.create(C.MLP(bn=(name == "bn")), C.optimizer("adamw", 0.02), seed=0, data_seed=7)


def train(states, step, loader, ctx, ckpts=None):
    """Advance every state on the same batches (their cursors move together)."""
    losses = {name: [] for name in states}
    while next(iter(states.values())).cursor.epoch < EPOCHS:
        c = next(iter(states.values())).cursor
        for batch in loader.iter_epoch(c.epoch, c.position):
            for name, state in states.items():
                state, m = step(state, batch)
                c = state.cursor
                c = c.replace(position=c.position + 1, samples_seen=c.samples_seen + int(m["samples"]))
                if c.position == len(loader):
                    c = c.replace(epoch=c.epoch + 1, position=0)
                states[name] = state = state.replace(cursor=c)
                losses[name].append(float(m["loss"]))
                if ckpts is not None and int(state.step) == SAVE_AT:
                    # rank 0 writes; the others wait inside on_main until the file is complete
                    D.on_main(ckpts[name].save, state, extra=D.dist_meta(B, ctx))
            if c.position == 0:
                break
    return states, losses


def main():
    out, phase = C.out_dir(), sys.argv[2]
    ctx = D.init_from_env()
    names = ("mlp",) if phase == "resume_w1" else ("bn", "mlp")
    ckpts = {n: CheckpointDir(os.path.join(out, "ckpt_" + n)) for n in names}
    batch = B * 2 if phase == "resume_w1" else B
    data = C.dataset(EPOCH_STEPS * B * 2)
    loader = C.loader(data, batch, ctx.rank, ctx.world_size, seed=7)
    step = D.data_parallel(sync_buffers=True, clip_grad=1.0)
    if phase == "full":
        states, losses = train({n: fresh(n) for n in names}, step, loader, ctx, ckpts)
    else:
        states, cursors = {}, {}
        for n in names:
            state, extra = restore(ckpts[n].latest(), fresh(n))
            assert int(state.step) == SAVE_AT, int(state.step)
            cursors[n] = (state.cursor.epoch, state.cursor.position)
            cursor = D.reshard_cursor(state.cursor, extra, batch_size=batch, epoch_len=len(loader))
            states[n] = state.replace(cursor=cursor)
        states, losses = train(states, step, loader, ctx)
    for state in states.values():
        D.assert_in_sync(state.params)
        D.assert_in_sync(state.buffers, what="buffers")
    if ctx.is_main:
        torch.save({n: {"params": s.params, "buffers": s.buffers, "losses": losses[n],
                        "step": int(s.step), "samples_seen": s.cursor.samples_seen,
                        "cursor": (s.cursor.epoch, s.cursor.position)} for n, s in states.items()},
                   os.path.join(out, f"{phase}.pt"))
    D.shutdown()


if __name__ == "__main__":
    main()
