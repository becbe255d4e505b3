"""The default main job: semantic segmentation of a real ASPRS-classified LiDAR tile.

Data: the labelled tile shipped in laspy's source distribution (ground / vegetation /
building, 25,408 points), cut into 10 x 10 ft blocks: 20 for training, 4 for validation
(``python -m pimm_fn.data.fetch lidar`` fetches it once; scripts/setup.sh does).
Model: :class:`pimm_fn.models.PointSegNet` (voxel-context U-Net-lite with BatchNorm).
Training: the compiled supervised step, AdamW with the seed's OneCycle (beta1 cycling)
and per-group settings, gradient clipping. Validation: mIoU over every original point
(predictions on voxels mapped back through ``inverse``), as Pointcept's evaluator does.

    pimm-fn train lidar_seg [--set epochs=60 --set lr=0.005 ...]
"""
from __future__ import annotations

import torch

from pimm_fn import recipes
from pimm_fn.amp import as_autocast
from pimm_fn.data import LidarBlocks, build_eval_loader, build_train_loader
from pimm_fn.data import transforms as T
from pimm_fn.experiment import Run
from pimm_fn.models import PointSegNet
from pimm_fn.state import TrainState

SETTINGS = {
    "epochs": 60,
    "batch_size": 4,
    "eval_batch_size": 4,     # validation blocks per forward (inverse indexes the batch)
    "lr": 0.005,
    "weight_decay": 0.01,
    "head_lr": 0.01,          # a param_dicts group: parameters whose name contains "head"
    "pct_start": 0.1,
    "clip_grad": 1.0,
    "grid_size": 0.25,
    "width": 32,
    "num_workers": 0,
    "compile": True,
    "amp": "",                # "", "bfloat16" or "float16" (float16 turns on loss scaling)
    "deterministic": False,   # sort-based voxel pooling: bitwise repeatable on any thread count
    "seed": 0,
}
# --quick (a smoke test) changes these; an explicit --set wins over them.
QUICK = {"epochs": 2}
MINIMUM = {"epochs": 1, "batch_size": 1, "eval_batch_size": 1, "width": 1, "num_workers": 0}  # smallest valid values

_INPUT_KEYS = ("coord", "grid_coord", "feat", "offset")


def transform(grid_size: float, mode: str):
    """Augment (training) and voxelise; features are xyz + intensity."""
    steps = [T.random_rotate(axis="z"), T.random_scale((0.9, 1.1)), T.random_flip(0.5),
             T.random_jitter(0.01, 0.05)] if mode == "train" else []
    return T.compose(*steps, T.grid_sample(grid_size, mode=mode), T.center_shift(apply_z=False),
                     T.assemble_feat(("coord", "intensity")))


def build(settings: dict, ctx) -> Run:
    s = settings
    torch.manual_seed(s["seed"])
    train_loader = build_train_loader(
        LidarBlocks("train"), batch_size=s["batch_size"], seed=s["seed"],
        transform=transform(s["grid_size"], "train"), num_workers=s["num_workers"],
        rank=ctx.rank, world_size=ctx.world_size, iters_per_epoch=2 if ctx.quick else None,
        device=ctx.device)
    val_loader = build_eval_loader(LidarBlocks("val"), batch_size=s["eval_batch_size"],
                                   transform=transform(s["grid_size"], "test"), device=ctx.device)
    model = PointSegNet(in_channels=4, num_classes=LidarBlocks.num_classes, width=s["width"],
                        deterministic=s["deterministic"])
    total = len(train_loader) * s["epochs"]
    # Pointcept's param_dicts: the head gets its own peak lr; every group cycles beta1.
    tx = recipes.adamw_one_cycle(total, s["lr"], weight_decay=s["weight_decay"], pct_start=s["pct_start"],
                                 groups=[{"keyword": "head", "lr": s["head_lr"], "name": "head"}])
    amp = as_autocast(s["amp"] or None)  # "fp16" / "half" are float16 too (an unknown name fails here)
    half = amp is not None and amp.torch_dtype() == torch.float16
    # On the run's device (ctx.device: cuda:LOCAL_RANK on a GPU machine), as are the batches.
    state = TrainState.create(model, tx, seed=s["seed"], loss_scale=half, device=ctx.device)
    step = recipes.supervised_step(clip_grad=s["clip_grad"], autocast=amp, compile=s["compile"])
    return Run(state=state, loader=train_loader, step=step, epochs=s["epochs"],
               evaluate=recipes.segmentation_eval(val_loader, _INPUT_KEYS, LidarBlocks.num_classes,
                                                  LidarBlocks.class_names),
               best_metric="mIoU", best_mode="max",
               render=lambda st, png: recipes.render_first_cloud(
                   st, val_loader, png, _INPUT_KEYS, LidarBlocks.class_names, "LiDAR validation block"),
               eval_every_epochs=max(1, s["epochs"] // 10))
