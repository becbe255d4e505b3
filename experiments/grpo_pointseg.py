"""Point-cloud segmentation fine-tuned with GRPO on the real LiDAR tile (pimm_fn.data.LidarBlocks).

The policy (:class:`pimm_fn.models.policies.PointLabelPolicy`) labels every point of a
cloud; one trajectory is one sampled labelling of one cloud, G labellings per cloud form
a group, and the reward is that labelling's mIoU (or accuracy) against the cloud's
labels. Each point is a step of the trajectory (token-level importance ratios). The net
is first briefly pretrained with the supervised step (``pretrain_steps``; 0 = GRPO from
scratch), then fine-tuned with GRPO; ``evaluate`` reports the validation mIoU of the
argmax labelling.

    python -m pimm_fn.data.fetch lidar            # once: the tile comes from laspy's sdist
    pimm-fn train grpo_pointseg
"""
from __future__ import annotations

import torch

from pimm_fn import optim
from pimm_fn.compile import compile_step
from pimm_fn.data import LidarBlocks, build_eval_loader, build_train_loader
from pimm_fn.data import transforms as T
from pimm_fn.distributed import grad_transform
from pimm_fn.experiment import Run
from pimm_fn.metrics import intersection_and_union, segmentation_scores
from pimm_fn.models.policies import PointLabelPolicy
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised
from pimm_fn.steps.grpo import Rollout, grpo, with_reference

SETTINGS = {
    "epochs": 6,
    "batch_size": 2,          # B clouds per batch
    "group_size": 8,          # G labellings per cloud
    "policy_updates": 2,      # P
    "microbatch_size": 0,     # M (0 = all trajectories at once)
    "lr": 1e-3,
    "pretrain_steps": 40,     # supervised steps before GRPO (0 = from scratch)
    "pretrain_lr": 5e-3,
    "width": 16,
    "grid_size": 0.3,
    "reward": "miou",         # "miou" / "acc" of each labelling, or "point" (per-point hits: dense credit)
    "temperature_note": "",   # (sampling is at temperature 1)
    "kl_coef": 0.0,
    "clip": 0.2,
    "compile": True,
    "seed": 0,
}
# --quick (a smoke test) changes these; an explicit --set wins over them.
QUICK = {"epochs": 1, "pretrain_steps": 2, "group_size": 4, "policy_updates": 2}
# group_size >= 2: advantages are relative within a group (one member: always 0).
MINIMUM = {"epochs": 1, "batch_size": 1, "group_size": 2, "policy_updates": 1, "microbatch_size": 0,
           "pretrain_steps": 0, "width": 1}  # smallest valid values

_KEYS = ("coord", "grid_coord", "feat", "offset")
NUM_CLASSES = LidarBlocks.num_classes


def _transform(grid_size: float, mode: str):
    return T.compose(T.grid_sample(grid_size, mode=mode), T.center_shift(apply_z=False),
                     T.assemble_feat(("coord", "intensity")))


def sample_labellings(policy, batch, group_size: int) -> Rollout:
    """G labellings of every point; trajectory ``b * G + g`` is labelling g restricted to cloud b."""
    inputs = {k: batch[k] for k in _KEYS}
    table = policy(inputs)                                     # [P, K] log-probs
    g = int(group_size)
    u = torch.rand((g,) + tuple(table.shape)).clamp_(1e-10, 1 - 1e-7)
    labels = (table.unsqueeze(0) - torch.log(-torch.log(u))).argmax(-1)  # Gumbel-max, [G, P]
    offset = batch["offset"]
    b = offset.shape[0]
    cloud = torch.searchsorted(offset, torch.arange(table.shape[0]), right=True)  # [P]
    actions = labels.repeat(b, 1)                              # [B*G, P]
    mask = cloud.unsqueeze(0) == torch.arange(b).repeat_interleave(g).unsqueeze(1)
    logp = torch.take_along_dim(table.unsqueeze(0), actions.unsqueeze(-1), dim=-1).squeeze(-1)
    return Rollout(traj={"actions": actions, "logp_old": logp, "mask": mask}, shared=inputs)


def make_reward(kind: str):
    """``reward(batch, rollout)``: each labelling's mIoU or accuracy on its cloud, ``[B, G]``;
    or with ``"point"``, ``[B, G, P]`` per-point hits (0 off the cloud and at ignored
    points), which the step turns into per-point advantages (``advantage="step"``, gamma 0)."""
    if kind not in ("miou", "acc", "point"):
        raise ValueError(f"reward must be 'miou', 'acc' or 'point', got {kind!r}")

    def reward(batch, ro: Rollout) -> torch.Tensor:
        actions, mask = ro.traj["actions"], ro.traj["mask"]
        target = batch["segment"]
        n = actions.shape[0]
        b = batch["offset"].shape[0]
        if kind == "point":  # [B, G, P]: 1 where a point's sampled label is right
            hit = (actions == target.unsqueeze(0)) & mask & (target != -1).unsqueeze(0)
            return hit.float().view(b, n // b, -1)
        valid = mask & (target != -1).unsqueeze(0)             # [N, P]
        out = torch.zeros(n)
        for i in range(n):
            pred, tgt = actions[i][valid[i]], target[valid[i]]
            if kind == "acc":
                out[i] = (pred == tgt).float().mean() if tgt.numel() else 0.0
                continue
            inter, union, _ = intersection_and_union(pred, tgt, NUM_CLASSES)
            present = union > 0
            out[i] = (inter[present].float() / union[present].float()).mean() if present.any() else 0.0
        return out.view(b, n // b)

    return reward


def evaluate_miou(state: TrainState, loader) -> dict:
    """Validation scores of the argmax labelling (mIoU, mAcc, allAcc)."""
    from torch.func import functional_call

    inter = union = tgt = 0
    for batch in loader.iter_epoch(0, 0):
        with torch.no_grad():
            out = functional_call(state.model, (state.params, state.buffers), ({k: batch[k] for k in _KEYS},))
        i, u, t = intersection_and_union(out["logits"].argmax(-1), batch["segment"], NUM_CLASSES)
        inter, union, tgt = inter + i, union + u, tgt + t
    scores = segmentation_scores(inter, union, tgt, LidarBlocks.class_names)
    return {"val_mIoU": scores["mIoU"], "val_allAcc": scores["allAcc"]}


def pretrain(state: TrainState, loader, steps: int) -> TrainState:
    """A few eager supervised steps (cross-entropy on the labels) before GRPO."""
    step, done = supervised(), 0
    epoch = 0
    while done < steps:
        for batch in loader.iter_epoch(epoch, 0):
            state, _ = step(state, batch)
            done += 1
            if done >= steps:
                break
        epoch += 1
    return state


def build(settings: dict, ctx) -> Run:
    s = settings
    torch.manual_seed(s["seed"])
    train = LidarBlocks("train")

    def train_loader(rank=0, world_size=1):
        return build_train_loader(train, batch_size=s["batch_size"], seed=s["seed"],
                                  transform=_transform(s["grid_size"], "train"),
                                  iters_per_epoch=2 if ctx.quick else None, rank=rank, world_size=world_size)

    # Under torchrun each rank rolls out its own share of the blocks (the pretraining
    # below sees them all on every rank, so every rank starts from the same policy).
    loader = train_loader(ctx.rank, ctx.world_size)
    val_loader = build_eval_loader(LidarBlocks("val"), batch_size=s["batch_size"],
                                   transform=_transform(s["grid_size"], "test"))
    # LayerNorm: the policy's log-probs do not depend on batch statistics, so the first
    # update on a rollout is exactly on-policy.
    policy = PointLabelPolicy(in_channels=4, num_classes=NUM_CLASSES, width=s["width"], norm="layer")
    if s["pretrain_steps"]:
        pre = TrainState.create(policy, optim.adamw(lr=s["pretrain_lr"], weight_decay=0.01), seed=s["seed"])
        pre = pretrain(pre, train_loader(), s["pretrain_steps"])
        with torch.no_grad():
            for k, v in policy.named_parameters():
                v.copy_(pre.params[k])
    total = len(loader) * s["epochs"] * s["policy_updates"]  # the schedule counts optimizer updates
    from pimm_fn import schedules

    tx = optim.adamw(lr=schedules.cosine(total, s["lr"]), weight_decay=0.0)
    state = TrainState.create(policy, tx, seed=s["seed"])
    if s["kl_coef"]:
        state = with_reference(state)
    per_point = s["reward"] == "point"  # per-point rewards: each point's own advantage (gamma 0)
    step = grpo(sample=sample_labellings, reward=make_reward(s["reward"]), group_size=s["group_size"],
                advantage="step" if per_point else "grpo", gamma=0.0 if per_point else 1.0,
                policy_updates=s["policy_updates"], microbatch_size=s["microbatch_size"],
                clip_low=s["clip"], clip_high=s["clip"], kl_coef=s["kl_coef"],
                grad_transform=grad_transform())  # under torchrun: every rank applies the mean gradient
    if s["compile"]:
        step = compile_step(step)  # the rollout stays eager on the host; the update core compiles
    return Run(state=state, loader=loader, step=step, epochs=s["epochs"],
               evaluate=lambda st: evaluate_miou(st, val_loader), best_metric="val_mIoU", best_mode="max")
