"""Instance segmentation of synthetic multi-object scenes: semantic labels + a vote for each object's centre.

Data: :class:`pimm_fn.data.SyntheticScenes`, 1-4 primitive objects (box / sphere /
cylinder) on a 10 x 10 ground plane, each object an instance (ground: -1). Batches come
from the instance collate (:class:`pimm_fn.data.InstanceCollate`): per-point keys are
concatenated, per-instance keys (here ``instance_center`` [K, 3] of the validation
scenes) stay one tensor per cloud. Features are the coordinates alone (the synthetic
colour is a palette of the class and would give the semantics away).
Model: :class:`InstanceSegNet`, a :class:`pimm_fn.models.PointSegNet` whose per-point
features also feed a small offset head that predicts, for every object point, the vector
to its instance's centre (PointGroup-style centre voting). Loss: cross-entropy + ``offset_weight``
x the L1 offset error over object points. Validation (no clustering needed):
``mIoU`` over every original point; ``centre_err``, the mean distance from a point's
vote (coord + predicted offset) to its instance centre; ``centre_err_rel``, that
distance over the zero-offset baseline (the mean distance from a point to its centre;
< 1 means the head helps); ``centre_hit``, the share of instances whose mean vote lies
within ``hit_radius`` of the true centre.

    pimm-fn train instance_seg [--set epochs=30 --set offset_weight=1.0 ...]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pimm_fn import recipes
from pimm_fn.data import InstanceCollate, SyntheticScenes, build_eval_loader, build_train_loader
from pimm_fn.data import transforms as T
from pimm_fn.data.datasets import SYNTHETIC_CLASSES
from pimm_fn.experiment import Run
from pimm_fn.metrics import intersection_and_union, segmentation_scores
from pimm_fn.models import PointSegNet
from pimm_fn.state import TrainState
from pimm_fn.steps.common import eval_forward

SETTINGS = {
    "epochs": 30,
    "batch_size": 4,
    "train_scenes": 64,
    "val_scenes": 16,
    "lr": 0.005,
    "weight_decay": 0.01,
    "pct_start": 0.1,
    "clip_grad": 1.0,
    "offset_weight": 1.0,
    "grid_size": 0.15,
    "width": 32,
    "hit_radius": 0.25,
    "num_workers": 0,
    "compile": True,
    "seed": 0,
}
# --quick (a smoke test) changes these; an explicit --set wins over them.
QUICK = {"epochs": 2, "train_scenes": 8, "val_scenes": 2}
# smallest valid values
MINIMUM = {"epochs": 1, "batch_size": 1, "train_scenes": 1, "val_scenes": 1, "width": 1, "num_workers": 0}

NUM_CLASSES = len(SYNTHETIC_CLASSES)
_INPUT_KEYS = ("coord", "grid_coord", "feat", "offset")


class InstanceSegNet(PointSegNet):
    """PointSegNet + an offset head: ``model(batch) -> {"seg_logits", "offset_pred", ["loss", ...]}``.

    With ``segment``, ``instance`` and ``instance_centroid`` [N, 3] (each point's instance
    centre) in the batch, ``loss = CE(segment) + offset_weight * L1(offset)`` where the L1
    is the mean over points with ``instance >= 0`` of ``|offset_pred - (centroid - coord)|_1``.
    """

    def __init__(self, *args, offset_weight: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        width = self.head[1].in_features
        self.offset_head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))
        self.offset_weight = float(offset_weight)

    def forward(self, batch: dict) -> dict:
        h = self.features(batch)
        logits = self.head[1](h)
        offset = self.offset_head(h)
        out = {"seg_logits": logits, "offset_pred": offset}
        if "segment" in batch:
            seg = F.cross_entropy(logits.float(), batch["segment"], ignore_index=self.ignore_index)
            target = batch["instance_centroid"] - batch["coord"]
            mask = (batch["instance"] >= 0).to(offset.dtype)
            l1 = ((offset.float() - target).abs().sum(1) * mask).sum() / mask.sum().clamp_min(1.0)
            out.update(loss=seg + self.offset_weight * l1, seg_loss=seg.detach(), offset_loss=l1.detach(),
                       acc=(logits.detach().argmax(-1) == batch["segment"]).float().mean())
        return out


def instance_targets(with_centers: bool):
    """Add each point's instance centre (``instance_centroid`` [N, 3]; a ground point's is
    itself) and, for evaluation, the per-instance ``instance_center`` [K, 3]."""

    def t(sample, g):
        coord, inst = sample["coord"], sample["instance"]
        k = int(inst.max()) + 1 if inst.numel() else 0
        idx = inst.clamp_min(0)
        total = torch.zeros(max(k, 1), 3).index_add_(0, idx, coord)
        count = torch.zeros(max(k, 1)).index_add_(0, idx, (inst >= 0).float())
        center = total / count.clamp_min(1).unsqueeze(1)
        out = {**sample, "instance_centroid": torch.where((inst >= 0).unsqueeze(1), center[idx], coord)}
        if with_centers:
            out["instance_center"] = center[:k]
        return out

    return t


def transform(grid_size: float, mode: str):
    steps = [T.random_rotate(axis="z"), T.random_scale((0.9, 1.1)), T.random_flip(0.5)] if mode == "train" else []
    return T.compose(*steps, T.grid_sample(grid_size, mode=mode), T.center_shift(apply_z=False),
                     T.assemble_feat(("coord",)), instance_targets(with_centers=(mode == "test")))


def evaluate(state: TrainState, loader, hit_radius: float) -> dict:
    inter = union = target = 0
    err_sum = base_sum = 0.0
    n_points = hits = n_inst = 0
    for batch in loader.iter_epoch(0, 0):
        out = eval_forward(state, {k: batch[k] for k in _INPUT_KEYS})
        labels = out["seg_logits"].argmax(-1)
        starts = [0] + batch["offset"][:-1].tolist()
        ends = batch["offset"].tolist()
        # inverse / origin_segment have one row per original point: the instance collate
        # keeps them as one tensor per cloud (their length is not the cloud's point count)
        for b, (a, e) in enumerate(zip(starts, ends)):
            i, u, t = intersection_and_union(labels[a:e][batch["inverse"][b]], batch["origin_segment"][b], NUM_CLASSES)
            inter, union, target = inter + i, union + u, target + t
        vote = batch["coord"] + out["offset_pred"]
        obj = batch["instance"] >= 0
        err_sum += float((vote - batch["instance_centroid"])[obj].norm(dim=1).sum())
        base_sum += float((batch["coord"] - batch["instance_centroid"])[obj].norm(dim=1).sum())
        n_points += int(obj.sum())
        for b, (a, e) in enumerate(zip(starts, ends)):
            inst, v = batch["instance"][a:e], vote[a:e]
            for k, centre in enumerate(batch["instance_center"][b]):
                mine = inst == k
                if mine.any():
                    n_inst += 1
                    hits += int((v[mine].mean(0) - centre).norm() <= hit_radius)
    scores = segmentation_scores(inter, union, target, SYNTHETIC_CLASSES)
    err = err_sum / max(n_points, 1)
    return {"mIoU": scores["mIoU"], "allAcc": scores["allAcc"], "centre_err": err,
            "centre_err_rel": err / max(base_sum / max(n_points, 1), 1e-12),
            "centre_hit": hits / max(n_inst, 1)}


def render(state: TrainState, loader, png) -> None:
    """Top view of a validation scene: predicted classes, and the votes coloured by instance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = next(iter(loader.iter_epoch(0, 0)))
    end = int(batch["offset"][0])
    out = eval_forward(state, {k: batch[k] for k in _INPUT_KEYS})
    coord, pred = batch["coord"][:end], out["seg_logits"].argmax(-1)[:end]
    vote, inst = (coord + out["offset_pred"][:end]), batch["instance"][:end]
    fig, axes = plt.subplots(1, 2, figsize=(10, 5), sharex=True, sharey=True)
    axes[0].scatter(coord[:, 0], coord[:, 1], c=pred.numpy(), cmap="tab10", vmin=0, vmax=9, s=4)
    axes[0].set_title("predicted class (" + ", ".join(SYNTHETIC_CLASSES) + ")")
    obj = inst >= 0
    axes[1].scatter(coord[~obj, 0], coord[~obj, 1], c="lightgray", s=2)
    axes[1].scatter(vote[obj, 0], vote[obj, 1], c=inst[obj].numpy(), cmap="tab10", vmin=0, vmax=9, s=4)
    centres = batch["instance_center"][0]
    axes[1].scatter(centres[:, 0], centres[:, 1], marker="x", c="black", s=60)
    axes[1].set_title("centre votes by true instance (x: true centres)")
    for ax in axes:
        ax.set_aspect("equal")
    fig.suptitle(f"synthetic validation scene, step {int(state.step)}")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def build(settings: dict, ctx) -> Run:
    s = settings
    torch.manual_seed(s["seed"])
    train_loader = build_train_loader(
        SyntheticScenes(s["train_scenes"], seed=s["seed"]), batch_size=s["batch_size"], seed=s["seed"],
        collate_fn=InstanceCollate(), transform=transform(s["grid_size"], "train"), num_workers=s["num_workers"],
        rank=ctx.rank, world_size=ctx.world_size, iters_per_epoch=2 if ctx.quick else None)
    val_loader = build_eval_loader(SyntheticScenes(s["val_scenes"], seed=s["seed"] + 1000, name="synthetic_val"),
                                   batch_size=4, collate_fn=InstanceCollate(),
                                   transform=transform(s["grid_size"], "test"))
    model = InstanceSegNet(in_channels=3, num_classes=NUM_CLASSES, width=s["width"], strides=(2, 4, 8, 16),
                           offset_weight=s["offset_weight"])
    total = len(train_loader) * s["epochs"]
    tx = recipes.adamw_one_cycle(total, s["lr"], weight_decay=s["weight_decay"], pct_start=s["pct_start"])
    state = TrainState.create(model, tx, seed=s["seed"])
    step = recipes.supervised_step(clip_grad=s["clip_grad"], compile=s["compile"])
    return Run(state=state, loader=train_loader, step=step, epochs=s["epochs"],
               evaluate=lambda st: evaluate(st, val_loader, s["hit_radius"]), best_metric="mIoU", best_mode="max",
               render=lambda st, png: render(st, val_loader, png),
               eval_every_epochs=max(1, s["epochs"] // 10))
