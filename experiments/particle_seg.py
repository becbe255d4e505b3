"""Particle imaging: semantic segmentation of generated LArTPC events, as pimm's users train it.

Data: :class:`pimm_fn.data.LArTPCEvents`, PILArNet-like events generated on the fly from
(seed, index) on a 768^3 voxel grid with an energy per voxel and the five PILArNet classes
(shower, track, Michel electron, delta ray, low-energy deposit). Training reads a new
event every time (a million-event epoch cut into ``steps_per_epoch`` steps); validation is
a fixed set of held-out events (the other seed stream). Model: the PTv3-class backbone
(:class:`pimm_fn.models.PTv3`), features = position in the detector + log energy.
Training as pimm's configs: AdamW, OneCycle with layer-wise lr decay, cross-entropy plus
Lovasz-softmax, bf16 autocast where the CPU has bf16 instructions, the whole step
compiled. Validation: mIoU and the IoU of each of the five classes.

    pimm-fn train particle_seg [--set epochs=3 --set amp=bfloat16 ...]
"""
from __future__ import annotations

import torch

from pimm_fn import recipes
from pimm_fn.data import LArTPCEvents, build_eval_loader, build_train_loader
from pimm_fn.experiment import Run
from pimm_fn.models.ptv3 import PTv3, layer_decay_groups
from pimm_fn.state import TrainState

SETTINGS = {
    "epochs": 3,
    "steps_per_epoch": 100,
    "batch_size": 4,          # events per batch (pimm trains 48 per batch on GPUs)
    "val_events": 48,
    "lr": 0.003,
    "layer_decay": 0.9,
    "weight_decay": 0.05,
    "pct_start": 0.1,
    "clip_grad": 1.0,
    "channels": [32, 64, 128],
    "depths": [1, 1, 2],
    "dec_depths": [1, 1],
    "patch_size": [128, 64, 32],
    "drop_path": 0.1,
    "lovasz": True,           # cross-entropy + Lovasz-softmax, as pimm's configs
    "amp": "auto",            # "auto": bfloat16 where the CPU has bf16 instructions; "", "bfloat16"
    "num_workers": 0,
    "compile": True,
    "seed": 0,
}
QUICK = {"epochs": 1, "steps_per_epoch": 2, "val_events": 8, "batch_size": 2}
MINIMUM = {"epochs": 1, "steps_per_epoch": 1, "batch_size": 1, "val_events": 1, "num_workers": 0}

_INPUT_KEYS = ("coord", "grid_coord", "feat", "offset", "topology")


def features(sample, generator=None):
    """Position in the detector (scaled to [-1, 1]) and log(1 + energy / MeV) per voxel."""
    out = dict(sample)
    out["feat"] = torch.cat([sample["coord"] / 384.0 - 1.0, torch.log1p(sample["energy"])], dim=1)
    return out


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def make_model(s: dict) -> PTv3:
    return recipes.ptv3_unet(4, LArTPCEvents.num_classes, channels=s["channels"], depths=s["depths"],
                             dec_depths=s["dec_depths"], patch_size=s["patch_size"], drop_path=s["drop_path"],
                             loss="ce+lovasz" if s["lovasz"] else "ce")


def build(settings: dict, ctx) -> Run:
    s = settings
    torch.manual_seed(s["seed"])
    model = make_model(s)
    train_loader = build_train_loader(
        LArTPCEvents("train", seed=s["seed"]), batch_size=s["batch_size"], seed=s["seed"], transform=features,
        collate_fn=model.collate(), num_workers=s["num_workers"], rank=ctx.rank, world_size=ctx.world_size,
        iters_per_epoch=s["steps_per_epoch"], device=ctx.device)
    val_loader = build_eval_loader(LArTPCEvents("val", num_events=s["val_events"], seed=s["seed"]),
                                   batch_size=s["batch_size"], transform=features, collate_fn=model.collate(),
                                   device=ctx.device)
    total = s["steps_per_epoch"] * s["epochs"]
    tx = recipes.adamw_one_cycle(total, s["lr"], weight_decay=s["weight_decay"], pct_start=s["pct_start"],
                                 groups=layer_decay_groups(model, s["lr"], s["layer_decay"]))
    amp = s["amp"]
    if amp == "auto":
        amp = "bfloat16" if cpu_has_bf16() or str(ctx.device).startswith("cuda") else ""
    state = TrainState.create(model, tx, seed=s["seed"], device=ctx.device)
    step = recipes.supervised_step(clip_grad=s["clip_grad"], autocast=amp or None, compile=s["compile"])
    return Run(state=state, loader=train_loader, step=step, epochs=s["epochs"],
               evaluate=recipes.segmentation_eval(val_loader, _INPUT_KEYS, LArTPCEvents.num_classes,
                                                  LArTPCEvents.class_names),
               best_metric="mIoU", best_mode="max",
               render=lambda st, png: recipes.render_first_cloud(
                   st, val_loader, png, _INPUT_KEYS, LArTPCEvents.class_names, "LArTPC validation event (PTv3)"),
               eval_every_epochs=1)
