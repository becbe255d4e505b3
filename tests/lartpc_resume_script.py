"""A training run on the 1M-event LArTPC stream for the SIGKILL mid-epoch resume test.

Run as ``python tests/lartpc_resume_script.py RUN_DIR [--sleep S]``. It restores the latest
checkpoint in RUN_DIR/ckpt (none: a fresh run), trains a per-voxel MLP with the supervised
step and AdamW over ``LArTPCEvents(num_events=1_000_000)`` through ``build_train_loader``
with 2 workers (one epoch is 250,000 steps of 4 events) and stops after step STOP_AT of
that first epoch. Checkpoints every CKPT_EVERY steps (background writes).

Prints ``START n`` (the step it resumed at), then ``STEP n POSITION NAME,NAME,...`` after
each step (flushed: the names of the step's events, so the test can compare the batches
of a resumed run with those of an uninterrupted one), and ``DONE n STATUS`` at the end,
after writing RUN_DIR/final.pt (params + optimizer state as plain tensors).
"""
import argparse
import os
import time

import torch

torch.set_num_threads(1)

from pimm_fn import events as ev
from pimm_fn.callbacks import Checkpoint, on, resume
from pimm_fn.data import LArTPCEvents, build_train_loader
from pimm_fn.fit import fit
from pimm_fn.optim import adamw
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised
from pimm_fn.tree import tree_flatten_with_path

NUM_EVENTS, BATCH, SEED = 1_000_000, 4, 11
STOP_AT, CKPT_EVERY = 20, 4


class VoxelMLP(torch.nn.Module):
    """Per-voxel classifier on (log energy, position in the volume): the batch-dict contract."""

    label_key = "segment"

    def __init__(self, num_classes: int = LArTPCEvents.num_classes, hidden: int = 32, grid: int = 768):
        super().__init__()
        self.grid = float(grid)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, num_classes))

    def forward(self, batch):
        x = torch.cat([torch.log1p(batch["feat"]), batch["coord"] / self.grid], dim=1)
        logits = self.net(x)
        out = {"seg_logits": logits}
        if "segment" in batch:
            out["loss"] = torch.nn.functional.cross_entropy(logits, batch["segment"], ignore_index=-1)
        return out


def build():
    """(fresh state, loader, step) of the run."""
    loader = build_train_loader(LArTPCEvents("train", num_events=NUM_EVENTS, seed=0), batch_size=BATCH,
                                seed=SEED, num_workers=2, iters_per_epoch=None)
    torch.manual_seed(0)
    state = TrainState.create(VoxelMLP(), adamw(3e-3, weight_decay=0.01), seed=0, data_seed=SEED)
    return state, loader, supervised(clip_grad=1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--sleep", type=float, default=0.1, help="seconds after each step (room for the kill)")
    args = ap.parse_args()

    def report(event, state):
        if isinstance(event, ev.StepEnd):
            print(f"STEP {event.step} {event.position} {','.join(event.batch['name'])}", flush=True)
            time.sleep(args.sleep)

    # a step-count condition, not once=STOP_AT: a run restored at or past it stops too
    stop = on(ev.StepEnd, when=lambda e: e.step >= STOP_AT)(lambda e, s: ev.Stop(f"step {STOP_AT}"))
    init, loader, step = build()
    callbacks = [report, stop,
                 Checkpoint(os.path.join(args.run_dir, "ckpt"), every_steps=CKPT_EVERY, every_epochs=None,
                            keep_last=2)]
    state = resume(os.path.join(args.run_dir, "ckpt"), init, loader=loader, callbacks=callbacks)
    print(f"START {int(state.step)}", flush=True)
    if int(state.step) >= STOP_AT:
        res_state, status = state, "stopped"
    else:
        res = fit(state, loader, step, epochs=1, callbacks=callbacks)
        res_state, status = res.state, res.status
    paths, leaves, _ = tree_flatten_with_path({"params": res_state.params, "opt_state": res_state.opt_state})
    final = {".".join(map(str, p)): t for p, t in zip(paths, leaves)}
    final["cursor"] = torch.tensor([res_state.cursor.epoch, res_state.cursor.position, res_state.cursor.samples_seen])
    torch.save(final, os.path.join(args.run_dir, "final.pt"))
    print(f"DONE {int(res_state.step)} {status}", flush=True)


if __name__ == "__main__":
    main()
