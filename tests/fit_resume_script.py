"""A training run for the SIGKILL resume test: restores the latest checkpoint, trains to the horizon.

Run as ``python tests/fit_resume_script.py RUN_DIR [--slow-save-at STEP]``. It prints
``STEP n`` after each step (flushed) so the test can kill it at a chosen step; with
``--slow-save-at`` it prints ``IN_SAVE n`` once the checkpoint file of step n is written
under its temporary name but not yet renamed, then sleeps, so the kill lands mid-write.
At the end it writes RUN_DIR/final.pt (params + optimizer state, plain tensors).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)

from _fit_helpers import dataset, make_state, step_fn  # noqa: E402

from pimm_fn import events as ev  # noqa: E402
from pimm_fn.callbacks import Checkpoint, TensorBoard, TextLog, resume  # noqa: E402
from pimm_fn.fit import fit  # noqa: E402
from pimm_fn.tree import tree_flatten_with_path  # noqa: E402

EPOCHS, BATCH, N = 3, 8, 64  # 8 steps per epoch, 24 in all


class Samples(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = dataset(N)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def build_loader():
    from pimm_fn.data.loaders import build_train_loader

    return build_train_loader(Samples(), batch_size=BATCH, seed=7, num_workers=2,
                              collate_fn=torch.utils.data.default_collate)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--slow-save-at", type=int, default=None)
    ap.add_argument("--sleep", type=float, default=0.1)
    args = ap.parse_args()
    saving = {"step": None}

    if args.slow_save_at is not None:
        real_fsync = os.fsync

        def fsync(fd):
            name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
            if saving["step"] == args.slow_save_at and name.endswith(".tmp") and "step_" in name:
                print(f"IN_SAVE {saving['step']}", flush=True)
                time.sleep(60)
            return real_fsync(fd)

        os.fsync = fsync

    def report(event, state):
        if isinstance(event, ev.StepEnd):
            print(f"STEP {event.step}", flush=True)
            time.sleep(args.sleep)
        elif isinstance(event, ev.SaveRequested):
            saving["step"] = event.step

    loader = build_loader()
    callbacks = [
        report,
        TensorBoard(os.path.join(args.run_dir, "tb"), sync_every=3),
        TextLog(args.run_dir),
        Checkpoint(os.path.join(args.run_dir, "ckpt"), every_steps=5, every_epochs=1, keep_last=2),
    ]
    state = resume(os.path.join(args.run_dir, "ckpt"), make_state(seed=0), loader=loader, callbacks=callbacks)
    print(f"START {int(state.step)}", flush=True)
    res = fit(state, loader, step_fn, epochs=EPOCHS, callbacks=callbacks)
    paths, leaves, _ = tree_flatten_with_path((res.state.params, res.state.opt_state))
    torch.save({".".join(map(str, p)): t for p, t in zip(paths, leaves)}, os.path.join(args.run_dir, "final.pt"))
    print(f"DONE {int(res.state.step)} {res.status}", flush=True)


if __name__ == "__main__":
    main()
