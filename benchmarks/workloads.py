"""Benchmark workloads: model, pimm_fn state and step, seed-style torch trainer, batches.

Each factory (``mlp``, ``pointseg``, ``cnn``) returns a :class:`pimm_fn.bench.Workload`
and is importable by ``pimm-fn bench benchmarks.workloads:mlp`` and by the compile-cache
probe (which rebuilds the workload in a fresh process).

STAND-INS: until ``pimm_fn.optim`` / ``pimm_fn.schedules`` / ``pimm_fn.models`` land,
this file defines small stand-ins for AdamW, OneCycle and the three models (marked
``STAND-IN`` below). Each factory uses the real module as soon as it imports.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pimm_fn.bench import Workload
from pimm_fn.optim.base import GradientTransformation
from pimm_fn.state import TrainState
from pimm_fn.steps.supervised import supervised
from pimm_fn.tree import tree_map

MAX_LR = 1e-3
WEIGHT_DECAY = 0.01
CLIP = 1.0
TOTAL_STEPS = 10_000  # the schedule's horizon; benchmarks run far fewer steps


# --------------------------------------------------------------------------------------
# STAND-IN optimizer and schedule (replaced by pimm_fn.optim / pimm_fn.schedules)
# --------------------------------------------------------------------------------------
def _standin_one_cycle(max_lr, total_steps, pct_start=0.3, div_factor=25.0, final_div_factor=1e4):
    """STAND-IN: OneCycleLR's lr (cos annealing, two phases) as a pure function of the count."""
    initial = max_lr / div_factor
    final = initial / final_div_factor
    end1 = float(pct_start * total_steps) - 1
    end2 = float(total_steps - 1)

    def cos(start, end, pct):
        return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)

    def schedule(count):
        t = count.float()
        up = cos(initial, max_lr, torch.clamp(t / end1, 0, 1))
        down = cos(max_lr, final, torch.clamp((t - end1) / (end2 - end1), 0, 1))
        return torch.where(t <= end1, up, down)

    return schedule


def _standin_adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    """STAND-IN: torch.optim.AdamW's update as a pure transform (state: count, mu, nu)."""

    def init(params):
        z = tree_map(torch.zeros_like, params)
        return {"count": torch.zeros((), dtype=torch.int64), "mu": z, "nu": tree_map(torch.zeros_like, params)}

    def update(grads, state, params):
        count = state["count"] + 1
        lr = schedule(state["count"])
        c = count.float()
        bc1 = 1 - b1 ** c
        bc2_sqrt = torch.sqrt(1 - b2 ** c)
        mu = tree_map(lambda m, g: m * b1 + g * (1 - b1), state["mu"], grads)
        nu = tree_map(lambda v, g: v * b2 + g * g * (1 - b2), state["nu"], grads)

        def upd(p, m, v):
            decayed = p * (1 - lr * weight_decay)
            return decayed - (lr / bc1) * m / (torch.sqrt(v) / bc2_sqrt + eps) - p

        updates = tree_map(upd, params, mu, nu)
        return updates, {"count": count, "mu": mu, "nu": nu}

    def hyperparams(state):
        return {"lr": schedule(state["count"])}

    return GradientTransformation(init, update, hyperparams)


def make_optimizer():
    """AdamW + OneCycle, from pimm_fn.optim when it has landed, else the stand-in."""
    try:  # the real modules, once they land
        from pimm_fn.optim import adamw  # type: ignore
        from pimm_fn.schedules import one_cycle  # type: ignore

        return adamw(one_cycle(TOTAL_STEPS, MAX_LR), weight_decay=WEIGHT_DECAY), "pimm_fn.optim.adamw + schedules.one_cycle"
    except Exception as e:  # not landed, or mid-edit in a shared tree: keep benchmarking
        return (_standin_adamw(_standin_one_cycle(MAX_LR, TOTAL_STEPS), weight_decay=WEIGHT_DECAY),
                f"stand-in ({type(e).__name__})")


# --------------------------------------------------------------------------------------
# STAND-IN models (replaced by pimm_fn.models); each returns {"loss": ...} like Pointcept
# --------------------------------------------------------------------------------------
class StandinMLP(nn.Module):
    """STAND-IN MLP classifier on feature vectors."""

    def __init__(self, in_dim=256, hidden=512, classes=10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))

    def forward(self, batch):
        logits = self.net(batch["x"])
        return {"loss": F.cross_entropy(logits, batch["y"]), "logits": logits}


class StandinPointSeg(nn.Module):
    """STAND-IN point segmentation: per-point MLP with BatchNorm, per-cloud mean pool, head."""

    def __init__(self, in_dim=6, classes=13):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(in_dim, 64), nn.BatchNorm1d(64), nn.ReLU(),
                                 nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(256, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, classes))

    def forward(self, batch):
        feat = torch.cat([batch["coord"], batch["feat"]], dim=1)
        h = self.enc(feat)
        idx = batch["batch"]
        n_clouds = batch["offset"].shape[0]
        pooled = torch.zeros(n_clouds, h.shape[1], dtype=h.dtype, device=h.device).index_add(0, idx, h)
        counts = torch.zeros(n_clouds, dtype=h.dtype, device=h.device).index_add(0, idx, torch.ones_like(idx, dtype=h.dtype))
        pooled = pooled / counts[:, None]
        logits = self.head(torch.cat([h, pooled[idx]], dim=1))
        return {"loss": F.cross_entropy(logits, batch["segment"]), "seg_logits": logits}


class StandinCNN(nn.Module):
    """STAND-IN small CNN image classifier (3 conv-BN-ReLU blocks, global pool, linear)."""

    def __init__(self, classes=10):
        super().__init__()
        chans = [3, 32, 64, 128]
        layers = []
        for i in range(3):
            layers += [nn.Conv2d(chans[i], chans[i + 1], 3, padding=1), nn.BatchNorm2d(chans[i + 1]), nn.ReLU()]
            if i < 2:
                layers.append(nn.MaxPool2d(2))
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(128, classes)

    def forward(self, batch):
        h = self.body(batch["img"]).mean(dim=(2, 3))
        logits = self.fc(h)
        return {"loss": F.cross_entropy(logits, batch["label"]), "logits": logits}


# --------------------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------------------
def mlp_batches(n=4, batch=512, in_dim=256, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch, in_dim, generator=g), "y": torch.randint(0, classes, (batch,), generator=g)}
            for _ in range(n)]


def point_batch(sizes, in_dim=6, classes=13, g=None):
    """A Pointcept-style point batch: coord, feat, segment, offset (cumulative), batch index."""
    total = int(sum(sizes))
    offset = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    return {
        "coord": torch.rand(total, 3, generator=g),
        "feat": torch.rand(total, in_dim - 3, generator=g),
        "segment": torch.randint(0, classes, (total,), generator=g),
        "offset": offset,
        "batch": torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)),
    }


def point_batches(n=8, clouds=4, lo=4000, hi=8000, fixed=False, seed=0):
    """n batches of ``clouds`` clouds; variable sizes in [lo, hi) (every total distinct) or all (lo+hi)/2."""
    g = torch.Generator().manual_seed(seed)
    out, seen = [], set()
    while len(out) < n:
        if fixed:
            sizes = [(lo + hi) // 2] * clouds
        else:
            sizes = torch.randint(lo, hi, (clouds,), generator=g).tolist()
            if sum(sizes) in seen:
                continue
            seen.add(sum(sizes))
        out.append(point_batch(sizes, g=g))
    return out


def cnn_batches(n=4, batch=128, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"img": torch.randn(batch, 3, 32, 32, generator=g), "label": torch.randint(0, classes, (batch,), generator=g)}
            for _ in range(n)]


# --------------------------------------------------------------------------------------
# factories
# --------------------------------------------------------------------------------------
def _model(name):
    """The real pimm_fn.models class when it has landed, else the stand-in."""
    try:
        import pimm_fn.models as real  # type: ignore  # noqa: F401
    except ImportError:
        real = None
    # The real models' constructors are not known yet; keep the stand-ins until wired.
    return {"mlp": StandinMLP, "pointseg": StandinPointSeg, "cnn": StandinCNN}[name](), "stand-in"


def _workload(name, batches, *, points=False):
    torch.manual_seed(0)
    model, model_src = _model(name)
    tx, tx_src = make_optimizer()
    state = TrainState.create(model, tx)
    step = supervised(clip_grad=CLIP)
    return Workload(name=name, step=step, state=state, batches=batches, model=model,
                    notes={"model": model_src, "optimizer": tx_src})


def mlp(n_batches: int = 4, batch: int = 512):
    return _workload("mlp", mlp_batches(n_batches, batch))


def pointseg(n_batches: int = 8, fixed: bool = False):
    return _workload("pointseg", point_batches(n_batches, fixed=fixed), points=True)


def pointseg_fixed(n_batches: int = 8):
    return pointseg(n_batches, fixed=True)


def cnn(n_batches: int = 4, batch: int = 128):
    return _workload("cnn", cnn_batches(n_batches, batch))


WORKLOADS = {"mlp": mlp, "pointseg": pointseg, "pointseg_fixed": pointseg_fixed, "cnn": cnn}


# --------------------------------------------------------------------------------------
# the seed-style eager trainer (the seed's run_step, without AMP)
# --------------------------------------------------------------------------------------
def seed_trainer(model: nn.Module, *, fused=False, compile_model=False, compile_optimizer=False):
    """A ``train_step(batch)`` doing what the seed's run_step does.

    forward; zero_grad; backward; clip_grad_norm_; AdamW step; OneCycleLR step.
    fused: AdamW(fused=True) instead of foreach. compile_model: torch.compile(model).
    compile_optimizer: PyTorch's compiled-optimizer recipe (the tutorial "Compiling the
    optimizer with torch.compile"): the lr is a tensor so the scheduler does not
    recompile, and clip + optimizer.step run under torch.compile.
    OneCycleLR's cycle_momentum is off in every way: cycling Adam's beta1 (a Python float)
    would recompile the compiled optimizer every step, and pimm_fn's schedule has no beta cycle.
    """
    params = list(model.parameters())
    lr = torch.tensor(MAX_LR) if compile_optimizer else MAX_LR
    # The recipe's tensor lr is not allowed with an explicit foreach=True (capturable=False);
    # under torch.compile the step is traced and fused whatever the eager implementation.
    kw = {"fused": True} if fused else ({} if compile_optimizer else {"foreach": True})
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, **kw)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=MAX_LR, total_steps=TOTAL_STEPS, cycle_momentum=False)
    fwd = torch.compile(model) if compile_model else model

    def clip_and_step():
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()

    opt_step = torch.compile(clip_and_step, fullgraph=False) if compile_optimizer else clip_and_step

    def train_step(batch):
        out = fwd(batch)
        loss = out["loss"]
        opt.zero_grad()
        loss.backward()
        opt_step()
        sched.step()
        return loss.detach()

    train_step.optimizer = opt
    return train_step
