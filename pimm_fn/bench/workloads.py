"""Benchmark workloads: model, pimm_fn state and step, Pointcept-style torch trainer, batches.

Each factory (``mlp``, ``pointseg``, ``cnn``) returns a :class:`pimm_fn.bench.Workload`
and is what ``pimm-fn bench mlp`` (``pimm_fn.bench.workloads:mlp``) and the compile-cache
probe (which rebuilds the workload in a fresh process) build.

The models are the package's own (:mod:`pimm_fn.models`), the optimizer is
``pimm_fn.optim.adamw`` over ``pimm_fn.schedules.one_cycle``:

- mlp: ``MLPClassifier(256, 10, hidden=(512, 512))``, batch 512.
- pointseg: ``PointSegNet(in_channels=3, num_classes=13, width=32, strides=(2, 4, 8))``
  (BatchNorm, voxel max-pool context) on variable-size point batches: 4 clouds of
  1500-2999 points, so every batch total lies in [6000, 11996], ALL ABOVE 4096. Inductor
  specialises a guard at N <= 4096 on the dynamic point dimension; batches crossing it
  would compile one extra graph, so the sizes stay on one side.
- cnn: ``ImageClassifier(3, 10, width=32, depth=3)`` (conv-BN-ReLU, stride-2 blocks),
  batch 128 of 32x32 images.
- ptv3: the PTv3-class backbone as ``experiments/ptv3_seg.py`` sizes it (3 levels, 32-128
  channels, patches 128/64/32, drop path off so every way draws no random numbers) on real
  LiDAR batches of 4 voxelised blocks each (point counts vary; the topology comes with the
  batch from the collate).
- ptv3_deep: the same with two blocks per level (encoder 2/2/2, decoder 2/2): 209 parameter
  tensors, 2.17M parameters, the size of model issue 35's eager-step target names (~200
  tensors), where the per-tensor cost of an update counts most.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..models import ImageClassifier, MLPClassifier, PointSegNet
from ..models.ptv3 import PTv3, PTv3Collate
from ..optim import adamw
from ..schedules import one_cycle
from ..state import TrainState
from ..steps.supervised import supervised
from .result import Workload

MAX_LR = 1e-3
WEIGHT_DECAY = 0.01
CLIP = 1.0
TOTAL_STEPS = 10_000  # the schedule's horizon; benchmarks run far fewer steps
POINT_CLASSES = 13
POINT_GUARD = 4096  # inductor's N <= 4096 guard: keep every batch total on one side of it
POINTS_LO, POINTS_HI, CLOUDS = 1500, 3000, 4  # per-cloud sizes in [lo, hi): totals in [6000, 11996]


def make_optimizer():
    return adamw(one_cycle(TOTAL_STEPS, MAX_LR), weight_decay=WEIGHT_DECAY), "pimm_fn.optim.adamw + schedules.one_cycle"


PTV3_CONFIG = dict(enc_depths=(1, 1, 2), enc_channels=(32, 64, 128), enc_heads=(2, 4, 8), dec_depths=(1, 1),
                   dec_channels=(32, 64), dec_heads=(2, 4), patch_size=(128, 64, 32), drop_path=0.0)
PTV3_DEEP_CONFIG = dict(PTV3_CONFIG, enc_depths=(2, 2, 2), dec_depths=(2, 2))

MODELS = {
    "mlp": (lambda: MLPClassifier(256, 10, hidden=(512, 512)),
            "pimm_fn.models.MLPClassifier(256, 10, hidden=(512, 512))"),
    "pointseg": (lambda: PointSegNet(3, POINT_CLASSES, width=32, strides=(2, 4, 8)),
                 "pimm_fn.models.PointSegNet(3, 13, width=32, strides=(2, 4, 8))"),
    "cnn": (lambda: ImageClassifier(3, 10, width=32, depth=3),
            "pimm_fn.models.ImageClassifier(3, 10, width=32, depth=3)"),
    "ptv3": (lambda: PTv3(4, 3, **PTV3_CONFIG), f"pimm_fn.models.PTv3(4, 3, **{PTV3_CONFIG})"),
    "ptv3_deep": (lambda: PTv3(4, 3, **PTV3_DEEP_CONFIG), f"pimm_fn.models.PTv3(4, 3, **{PTV3_DEEP_CONFIG})"),
}


# --------------------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------------------
def mlp_batches(n=4, batch=512, in_dim=256, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch, in_dim, generator=g), "y": torch.randint(0, classes, (batch,), generator=g)}
            for _ in range(n)]


def point_batch(sizes, classes=POINT_CLASSES, grid_size=0.05, g=None):
    """A Pointcept-style point batch: coord, grid_coord, feat (colour), segment, offset (cumulative ends).

    Each cloud is a 4 m x 4 m x 2 m box of uniform points; ``grid_coord = coord // grid_size``.
    """
    total = int(sum(sizes))
    coord = torch.rand(total, 3, generator=g) * torch.tensor([4.0, 4.0, 2.0])
    return {
        "coord": coord,
        "grid_coord": torch.div(coord, grid_size, rounding_mode="floor").long(),
        "feat": torch.rand(total, 3, generator=g),
        "segment": torch.randint(0, classes, (total,), generator=g),
        "offset": torch.tensor(sizes, dtype=torch.int64).cumsum(0),
    }


def point_batches(n=8, clouds=CLOUDS, lo=POINTS_LO, hi=POINTS_HI, fixed=False, seed=0):
    """n batches of ``clouds`` clouds; sizes in [lo, hi) (every total distinct) or all (lo+hi)//2."""
    if clouds * lo <= POINT_GUARD < clouds * (hi - 1):
        raise ValueError(f"batch totals [{clouds * lo}, {clouds * (hi - 1)}] cross inductor's N <= {POINT_GUARD} "
                         "guard: one extra compile; keep them on one side")
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


def lidar_ptv3_batches(n=8, batch=4, seed=0):
    """n training batches of the real LiDAR tile (4 augmented, voxelised blocks each), with topology."""
    from ..data import LidarBlocks, build_train_loader
    from ..data import transforms as T

    transform = T.compose(T.random_rotate(axis="z"), T.random_flip(0.5), T.grid_sample(0.25, mode="train"),
                          T.center_shift(apply_z=False), T.assemble_feat(("coord", "intensity")))
    spec = PTv3(4, 3, **PTV3_CONFIG).spec
    loader = build_train_loader(LidarBlocks("train"), batch_size=batch, seed=seed, transform=transform,
                                collate_fn=PTv3Collate(spec))
    out = []
    for epoch in range(n):
        out += list(loader.iter_epoch(epoch, 0))
        if len(out) >= n:
            return out[:n]
    return out


def cnn_batches(n=4, batch=128, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"image": torch.randn(batch, 3, 32, 32, generator=g),
             "label": torch.randint(0, classes, (batch,), generator=g)} for _ in range(n)]


# --------------------------------------------------------------------------------------
# factories
# --------------------------------------------------------------------------------------
def _workload(name, batches, device=None):
    # device: where the model, state and batches live (None: the CPU). The model and the
    # batches are made on the CPU first, so every device starts from the same numbers.
    torch.manual_seed(0)
    build, model_src = MODELS[name]
    model = build()
    if device is not None:
        from ..data.device import to_device

        model = model.to(device)
        batches = [to_device(b, device) for b in batches]
    tx, tx_src = make_optimizer()
    state = TrainState.create(model, tx)
    step = supervised(clip_grad=CLIP)
    return Workload(name=name, step=step, state=state, batches=batches, model=model,
                    notes={"model": model_src, "optimizer": tx_src, "device": str(state.device)})


def mlp(n_batches: int = 4, batch: int = 512, device=None):
    return _workload("mlp", mlp_batches(n_batches, batch), device)


def pointseg(n_batches: int = 8, fixed: bool = False, device=None):
    return _workload("pointseg", point_batches(n_batches, fixed=fixed), device)


def pointseg_fixed(n_batches: int = 8, device=None):
    return pointseg(n_batches, fixed=True, device=device)


def cnn(n_batches: int = 4, batch: int = 128, device=None):
    return _workload("cnn", cnn_batches(n_batches, batch), device)


def ptv3(n_batches: int = 8, device=None):
    return _workload("ptv3", lidar_ptv3_batches(n_batches), device)


def ptv3_deep(n_batches: int = 8, device=None):
    return _workload("ptv3_deep", lidar_ptv3_batches(n_batches), device)


WORKLOADS = {"mlp": mlp, "pointseg": pointseg, "pointseg_fixed": pointseg_fixed, "cnn": cnn, "ptv3": ptv3,
             "ptv3_deep": ptv3_deep}


# --------------------------------------------------------------------------------------
# the Pointcept-style eager trainer (Pointcept's run_step, without AMP)
# --------------------------------------------------------------------------------------
def seed_trainer(model: nn.Module, *, fused=False, foreach=True, compile_model=False, compile_optimizer=False):
    """A ``train_step(batch)`` doing what Pointcept's run_step does.

    forward; zero_grad; backward; clip_grad_norm_; AdamW step; OneCycleLR step.
    fused: AdamW(fused=True) instead of foreach. foreach=None: AdamW's own default, as
    Pointcept builds it (on the CPU torch picks the per-tensor loop, foreach only on
    accelerators). compile_model: torch.compile(model).
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
    kw = {"fused": True} if fused else ({} if compile_optimizer or foreach is None else {"foreach": foreach})
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
