"""A run's report: a JSON-lines metric record, the training-curve PNG and a summary."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from ._validate import check_int
from .callbacks.base import Callback


class MetricsRecord(Callback):
    """Append step metrics (every ``every_steps``) and eval metrics to ``metrics.jsonl``.

    Rows carry the global step; a resumed run may rewrite steps it had already logged
    before a kill, so readers keep the last row per (kind, step) (see :func:`read_records`).
    Steps arrive in blocks (:class:`~pimm_fn.events.StepBlock`): one host sync and one
    write per block.
    """

    def __init__(self, path, every_steps: int = 10):
        self.path = Path(path)
        self.every_steps = check_int("MetricsRecord(every_steps=...)", every_steps, 1)
        self.last_eval: dict = {}

    def _write(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_step_block(self, event, state):
        last = event.rows[-1][0] if event.is_last else None
        picked = [(r[0], r[2]) for r in event.rows if r[0] % self.every_steps == 0 or r[0] == last]
        if not picked:
            return
        values = [[(k, v) for k, v in m.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
                  for _, m in picked]
        flat = [v.detach().reshape(()).double() for row in values for _, v in row]
        numbers = iter(torch.stack(flat).tolist() if flat else [])  # one host sync per block
        lines = []
        for (step, _), row in zip(picked, values):
            out = {"kind": "train", "step": step, "epoch": event.epoch}
            out.update((k, next(numbers)) for k, _ in row)
            lines.append(json.dumps(out))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")

    def on_eval_end(self, event, state):
        self.last_eval = {k: float(v) for k, v in event.metrics.items() if isinstance(v, (int, float))}
        self._write({"kind": event.name, "step": event.step, "epoch": event.epoch, **self.last_eval})


def read_records(path) -> dict:
    """``{kind: [rows sorted by step]}`` from a metrics.jsonl, the last row per step winning."""
    by_kind: dict = {}
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            by_kind.setdefault(row["kind"], {})[row["step"]] = row
    return {k: [rows[s] for s in sorted(rows)] for k, rows in by_kind.items()}


def plot_curves(records: dict, png, keys=("loss",), eval_keys: Optional[tuple] = None) -> Path:
    """Training loss (and any other ``keys``) and eval metrics over steps, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = records.get("train", [])
    evals = {k: rows for k, rows in records.items() if k != "train"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in keys:
        pts = [(r["step"], r[key]) for r in train if key in r]
        if pts:
            axes[0].plot(*zip(*pts), label=key)
    axes[0].set_xlabel("step"), axes[0].set_title("training"), axes[0].legend(loc="best")
    for name, rows in evals.items():
        names = eval_keys or sorted({k for r in rows for k in r if k not in ("kind", "step", "epoch")})
        for key in names:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                axes[1].plot(*zip(*pts), marker="o", label=f"{name}/{key}")
    axes[1].set_xlabel("step"), axes[1].set_title("evaluation")
    if evals:
        axes[1].legend(loc="best", fontsize=8)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def render_point_cloud(coord: torch.Tensor, pred: torch.Tensor, target: torch.Tensor, png,
                       class_names=None, title: str = "") -> Path:
    """A top view of a cloud coloured by prediction beside its ground truth, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xy = coord[:, :2].detach().cpu().numpy()
    fig, axes = plt.subplots(1, 2, figsize=(10, 5), sharex=True, sharey=True)
    n = max(int(pred.max()) if pred.numel() else 0, int(target.max()) if target.numel() else 0) + 1
    for ax, labels, name in ((axes[0], pred, "prediction"), (axes[1], target, "ground truth")):
        lab = labels.detach().cpu().numpy()
        ax.scatter(xy[:, 0], xy[:, 1], c=lab, cmap="tab10", vmin=-1, vmax=max(n, 9), s=4)
        ax.set_title(name), ax.set_aspect("equal")
    if class_names:
        handles = [plt.Line2D([], [], marker="o", ls="", color=plt.get_cmap("tab10")((i + 1) / 10), label=c)
                   for i, c in enumerate(class_names)]
        axes[1].legend(handles=handles, loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png
