"""GRPO data-parallel over ranks that hold unequal work: rank 0 three events of long
trajectories, rank 1 one event of short ones. For every reduction the two ranks must train
the model one process trains on the four events. Run under torchrun (2 ranks) and as one
plain process; each writes <out>/grpo_unequal_<reduction>_W<world>.pt."""
import sys

import torch

from pimm_fn import distributed, optim
from pimm_fn.state import TrainState
from pimm_fn.steps.grpo import Rollout, grpo

OBS, ACTIONS, T, G = 6, 4, 10, 4
SPLIT = (3, 1)  # events on rank 0, rank 1


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(OBS, 16), torch.nn.Tanh(), torch.nn.Linear(16, ACTIONS))

    def log_probs(self, obs):
        return torch.log_softmax(self.net(obs), -1)


def events(i):
    g = torch.Generator().manual_seed(1000 + i)
    return {"obs": torch.randn(4, T, OBS, generator=g), "noise": torch.rand(4, G, T, ACTIONS, generator=g),
            "length": torch.tensor([10, 9, 10, 2])}


def sample(policy, batch, group_size):
    # The noise comes with the events: a rank samples what one process samples for them.
    obs = batch["obs"].repeat_interleave(group_size, 0)
    table = policy(obs)
    u = batch["noise"].reshape(-1, T, ACTIONS).clamp(1e-10, 1 - 1e-7)
    actions = (table - torch.log(-torch.log(u))).argmax(-1)
    logp = table.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    mask = torch.arange(T) < batch["length"].repeat_interleave(group_size).unsqueeze(1)
    return Rollout(traj={"obs": obs, "actions": actions, "logp_old": logp, "mask": mask})


def reward(batch, ro):
    hits = (ro.traj["actions"] == 1) & ro.traj["mask"]
    return hits.sum(-1).float().view(batch["obs"].shape[0], -1)


def main(out):
    ctx = distributed.init_from_env()
    for reduction in ("token", "sequence", "constant"):
        torch.manual_seed(0)
        state = TrainState.create(Policy(), optim.sgd(lr=0.5), seed=0)
        step = grpo(sample=sample, reward=reward, group_size=G, reduction=reduction, policy_updates=2,
                    microbatch_size=4, max_length=T if reduction == "constant" else None,
                    grad_transform=distributed.grad_transform())
        for i in range(3):
            batch = events(i)
            if ctx.world_size == 2:
                lo = sum(SPLIT[:ctx.rank])
                batch = {k: v[lo:lo + SPLIT[ctx.rank]] for k, v in batch.items()}
            state, _ = step(state, batch)
        if ctx.rank == 0:
            torch.save(state.params, f"{out}/grpo_unequal_{reduction}_W{ctx.world_size}.pt")
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
