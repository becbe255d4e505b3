"""Variable-size point batches under the compiled step: bounded compilations."""
import torch

from pimm_fn import optim
from pimm_fn.compile import compile_step
from pimm_fn.data import SyntheticScenes, build_train_loader
from pimm_fn.data import transforms as T
from pimm_fn.models import PointSegNet
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised


def test_300_steps_with_point_counts_varying_50_percent_compile_at_most_3_times():
    # Scenes of 500..1500 points (+-50% around 1000), two per batch: every batch's total differs.
    data = SyntheticScenes(num_scenes=40, seed=7, points=(500, 1500))
    loader = build_train_loader(data, batch_size=2, seed=0,
                                transform=T.compose(T.grid_sample(0.05), T.assemble_feat(("coord",))))
    model = PointSegNet(in_channels=3, num_classes=SyntheticScenes.num_classes, width=8, strides=(2, 4))
    state = TrainState.create(model, optim.adamw(lr=1e-3))
    step = compile_step(supervised(clip_grad=1.0))
    sizes = set()
    epoch = 0
    steps = 0
    while steps < 300:
        for batch in loader.iter_epoch(epoch, 0):
            sizes.add(int(batch["offset"][-1]))
            state, metrics = step(state, batch)
            steps += 1
            if steps == 300:
                break
        epoch += 1
    assert len(sizes) > 100, "the test must really vary the point count"
    assert step.compile_count == 1, step.recompile_reasons  # point dims unbacked from the first call
    assert torch.isfinite(metrics["loss"])
    assert int(state.step) == 300


class _SizeReader(torch.nn.Module):
    """A model that branches on its point count: it cannot trace with an unknown size."""

    label_key = "segment"

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, batch):
        x = batch["feat"]
        if x.shape[0] > 50:  # a host decision on the size
            x = x * 0.5
        logits = self.lin(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, batch["segment"].clamp_min(0)), "seg_logits": logits}


def test_a_model_that_reads_its_point_count_falls_back_to_guarded_sizes_with_a_warning():
    import pytest

    def batch(n):
        return {"coord": torch.rand(n, 3), "feat": torch.rand(n, 3), "segment": torch.randint(0, 4, (n,)),
                "offset": torch.tensor([n // 2, n])}

    state = TrainState.create(_SizeReader(), optim.sgd(lr=0.1))
    step = compile_step(supervised())
    with pytest.warns(RuntimeWarning, match="needs the value of a point count"):
        state, _ = step(state, batch(80))
    for n in (90, 120, 64):
        state, metrics = step(state, batch(n))
    assert torch.isfinite(metrics["loss"]) and int(state.step) == 4
    # Every size is on the same side of the guard; after another step over the same core
    # code in this process, dynamo's automatic-dynamic history may add one compile ("unknown").
    assert step.compile_count <= 2, step.recompile_reasons


class _PointPolicy(torch.nn.Module):
    """Per-point labels from a point's features: one shared [P, A] table per cloud."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))

    def log_probs(self, feat):
        return torch.log_softmax(self.net(feat), -1)


def _sample_labellings(policy, batch, group_size):
    from pimm_fn.steps.grpo import Rollout

    table = policy(batch["feat"])                                    # [P, A]
    u = torch.rand((group_size,) + tuple(table.shape)).clamp_(1e-10, 1 - 1e-7)
    actions = (table.unsqueeze(0) - torch.log(-torch.log(u))).argmax(-1)  # [G, P]
    logp = torch.gather(table.unsqueeze(0).expand(group_size, -1, -1), -1, actions.unsqueeze(-1)).squeeze(-1)
    rewards = (actions == batch["label"]).float().mean(-1).view(1, group_size)
    return Rollout(traj={"actions": actions, "logp_old": logp}, shared=batch["feat"], rewards=rewards)


def test_grpo_over_a_shared_point_table_compiles_once_more_as_the_point_count_varies():
    # Each trajectory labels every point of a cloud from one shared [P, A] table. torch
    # 2.13's take_along_dim pinned P to its traced value, so every new point count
    # recompiled (grpo_pointseg hit the recompile limit after 8 batches).
    from pimm_fn.steps.grpo import grpo

    torch.manual_seed(0)
    state = TrainState.create(_PointPolicy(), optim.adam(lr=1e-2), seed=0)
    step = compile_step(grpo(sample=_sample_labellings, group_size=4, policy_updates=2))
    for points in (40, 57, 73, 91, 120, 133, 150, 171, 190, 205):
        feat = torch.randn(points, 3)
        state, metrics = step(state, {"feat": feat, "label": (feat[:, 0] > 0).long()})
    assert step.compile_count <= 2, step.recompile_reasons
    assert torch.isfinite(metrics["loss"])
    assert int(state.step) == 10
