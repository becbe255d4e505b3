"""A training run for the SIGKILL resume test: restores the latest checkpoint, trains to the horizon.

Run as ``python tests/fit_resume_script.py RUN_DIR [--slow-save-at STEP] [--model ptv3]``. It prints
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

from _fit_helpers import dataset, make_state, step_fn

from pimm_fn import events as ev
from pimm_fn.callbacks import Checkpoint, TensorBoard, TextLog, resume
from pimm_fn.fit import fit
from pimm_fn.tree import tree_flatten_with_path

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


def build_ptv3():
    """The PTv3-class backbone (tiny) on synthetic scenes, its topology from the collate in 2
    workers, AdamW + OneCycle with layer-wise lr decay, drop path on: (state, loader, step)."""
    from pimm_fn import recipes
    from pimm_fn.data import SyntheticScenes, build_train_loader
    from pimm_fn.data import transforms as T
    from pimm_fn.models import PTv3, layer_decay_groups
    from pimm_fn.state import TrainState
    from pimm_fn.steps.parallel import data_parallel

    torch.manual_seed(0)
    model = PTv3(3, SyntheticScenes.num_classes, enc_depths=(1, 1), enc_channels=(16, 32), enc_heads=(2, 4),
                 dec_depths=(1,), dec_channels=(16,), dec_heads=(2,), patch_size=(32, 16), drop_path=0.2)
    data = SyntheticScenes(num_scenes=16, seed=3, points=(200, 400))
    loader = build_train_loader(data, batch_size=2, seed=7, num_workers=2, collate_fn=model.collate(),
                                transform=T.compose(T.grid_sample(0.05), T.assemble_feat(("coord",))))
    tx = recipes.adamw_one_cycle(EPOCHS * len(loader), 2e-3, weight_decay=0.05,
                                 groups=layer_decay_groups(model, 2e-3, 0.8))
    return TrainState.create(model, tx, seed=0), loader, data_parallel(clip_grad=1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--slow-save-at", type=int, default=None)
    ap.add_argument("--sleep", type=float, default=0.1)
    ap.add_argument("--model", choices=("mlp", "ptv3"), default="mlp")
    ap.add_argument("--tb-thread", action="store_true", help="TensorBoard on its writer thread (a device run's way)")
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

    if args.model == "ptv3":
        init, loader, step = build_ptv3()
    else:
        init, loader, step = make_state(seed=0), build_loader(), step_fn
    callbacks = [
        report,
        TensorBoard(os.path.join(args.run_dir, "tb"), sync_every=3, background=True if args.tb_thread else None),
        TextLog(args.run_dir),
        Checkpoint(os.path.join(args.run_dir, "ckpt"), every_steps=5, every_epochs=1, keep_last=2),
    ]
    state = resume(os.path.join(args.run_dir, "ckpt"), init, loader=loader, callbacks=callbacks)
    print(f"START {int(state.step)}", flush=True)
    res = fit(state, loader, step, epochs=EPOCHS, callbacks=callbacks)
    paths, leaves, _ = tree_flatten_with_path((res.state.params, res.state.opt_state))
    torch.save({".".join(map(str, p)): t for p, t in zip(paths, leaves)}, os.path.join(args.run_dir, "final.pt"))
    print(f"DONE {int(res.state.step)} {res.status}", flush=True)


if __name__ == "__main__":
    main()
