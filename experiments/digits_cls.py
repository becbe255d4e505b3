"""Image classification of scikit-learn's 8 x 8 handwritten digits (10 classes).

Data: :class:`pimm_fn.data.DigitsImages`, 1,797 real scanned digits (1,438 training,
every 5th image, 359, for validation), ``image`` [1, 8, 8] in [0, 1] and ``label``;
``python -m pimm_fn.data.fetch digits`` fetches them once. Batches come from the image
collate (``image`` [B, 1, 8, 8], ``label`` [B]). Training augments with a random shift of
up to one pixel. Model: :class:`pimm_fn.models.ImageClassifier` (conv-BN-ReLU blocks,
global average pooling). Training: the supervised step (compiled by default), AdamW
with a cosine schedule under a linear warm-up. Validation: top-1 accuracy.

    pimm-fn train digits_cls [--set epochs=15 --set width=32 ...]
"""
from __future__ import annotations

import torch

from pimm_fn import optim, recipes, schedules
from pimm_fn.data import DigitsImages, build_eval_loader, build_train_loader, image_collate
from pimm_fn.experiment import Run
from pimm_fn.metrics import accuracy_counts
from pimm_fn.models import ImageClassifier
from pimm_fn.state import TrainState
from pimm_fn.steps.common import eval_forward

SETTINGS = {
    "epochs": 15,
    "batch_size": 64,
    "lr": 0.003,
    "weight_decay": 0.01,
    "warmup_pct": 0.05,
    "width": 32,
    "depth": 3,
    "shift": 1,               # random shift in pixels (0 = no augmentation)
    "num_workers": 0,
    "compile": True,
    "seed": 0,
}
# --quick (a smoke test) changes these; an explicit --set wins over them.
QUICK = {"epochs": 2}
MINIMUM = {"epochs": 1, "batch_size": 1, "width": 1, "depth": 1, "shift": 0, "num_workers": 0,
           "warmup_pct": 0}  # smallest valid values


def random_shift(pixels: int):
    """Shift the image by up to ``pixels`` in x and y, filling with 0 (background)."""

    def t(sample, g):
        if pixels <= 0:
            return sample
        img = sample["image"]
        dy, dx = (int(v) for v in torch.randint(-pixels, pixels + 1, (2,), generator=g))
        p = pixels
        padded = torch.nn.functional.pad(img, (p, p, p, p))
        h, w = img.shape[-2:]
        return {**sample, "image": padded[:, p + dy:p + dy + h, p + dx:p + dx + w].contiguous()}

    return t


def evaluate(state: TrainState, loader) -> dict:
    """Top-1 accuracy (and the mean cross-entropy) over the validation images."""
    correct = total = 0
    loss_sum = 0.0
    for batch in loader.iter_epoch(0, 0):
        logits = eval_forward(state, {"image": batch["image"]})["cls_logits"]
        c, n = accuracy_counts(logits, batch["label"])
        correct, total = correct + int(c), total + int(n)
        loss_sum += float(torch.nn.functional.cross_entropy(logits, batch["label"], reduction="sum"))
    return {"acc": correct / total, "val_loss": loss_sum / total}


def render(state: TrainState, loader, png) -> None:
    """The first 24 validation digits with predicted (and, when wrong, true) labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = next(iter(loader.iter_epoch(0, 0)))
    pred = eval_forward(state, {"image": batch["image"]})["cls_logits"].argmax(-1)
    fig, axes = plt.subplots(3, 8, figsize=(10, 4.2))
    for i, ax in enumerate(axes.flat):
        ax.imshow(batch["image"][i, 0].cpu().numpy(), cmap="gray_r", vmin=0, vmax=1)
        ok = int(pred[i]) == int(batch["label"][i])
        ax.set_title(f"{int(pred[i])}" + ("" if ok else f" (true {int(batch['label'][i])})"),
                     color="black" if ok else "red", fontsize=9)
        ax.axis("off")
    fig.suptitle(f"validation digits: predicted label, step {int(state.step)}")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def build(settings: dict, ctx) -> Run:
    s = settings
    torch.manual_seed(s["seed"])
    train_loader = build_train_loader(
        DigitsImages("train"), batch_size=s["batch_size"], seed=s["seed"], collate_fn=image_collate,
        transform=random_shift(s["shift"]), num_workers=s["num_workers"], rank=ctx.rank,
        world_size=ctx.world_size, iters_per_epoch=2 if ctx.quick else None, device=ctx.device)
    val_loader = build_eval_loader(DigitsImages("val"), batch_size=256, collate_fn=image_collate, device=ctx.device)
    model = ImageClassifier(in_channels=1, num_classes=DigitsImages.num_classes, width=s["width"], depth=s["depth"])
    total = len(train_loader) * s["epochs"]
    warmup = max(1, int(total * s["warmup_pct"]))
    lr = schedules.linear_warmup(schedules.cosine(total, s["lr"], eta_min=s["lr"] / 100), warmup, 0.1)
    tx = optim.adamw(lr=lr, weight_decay=s["weight_decay"])
    state = TrainState.create(model, tx, seed=s["seed"], device=ctx.device)  # where the loaders put the batches
    step = recipes.supervised_step(compile=s["compile"])
    return Run(state=state, loader=train_loader, step=step, epochs=s["epochs"],
               evaluate=lambda st: evaluate(st, val_loader), best_metric="acc", best_mode="max",
               render=lambda st, png: render(st, val_loader, png), eval_every_epochs=1)
