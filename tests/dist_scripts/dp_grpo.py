"""GRPO data-parallel on gloo: 2 ranks x B/2 events equal 1 process x B events.

Writes grpo_rank<r>.json. The GRPO step is a Step like any other: built with
``grad_transform=D.grad_transform()`` (each update's gradients averaged over ranks inside
the shared guarded update, before clipping) and wrapped with ``D.wrap_step`` (metrics
reduced). Its host rollout (``prepare``) runs per rank on that rank's events.

The sampler draws its Gumbel noise from the batch (one fixed tensor per event) instead of
torch's generator: each rank's generator is seeded with its rank folded in, so a sampler
using it would draw other trajectories than the 1-process run, and the two runs would be
different experiments. With the noise in the data, the only difference left is the one
under test: where the gradients are summed.
"""
import os

import _common as C
import torch

import pimm_fn.distributed as D
from pimm_fn import optim
from pimm_fn.compile import compile_step
from pimm_fn.state import TrainState
from pimm_fn.steps.grpo import Rollout, grpo, with_reference

OBS, ACT, T, EVENTS, G, STEPS = 3, 4, 5, 4, 4, 4


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(OBS, ACT)

    def log_probs(self, obs):
        return torch.log_softmax(self.lin(obs), -1)


def sample(policy, batch, group_size):
    obs = batch["obs"].repeat_interleave(group_size, 0)             # [N, T, OBS]
    table = policy(obs)
    u = batch["noise"].reshape(-1, T, ACT)                          # [N, T, ACT], from the data
    actions = (table - torch.log(-torch.log(u))).argmax(-1)
    return Rollout(traj={"obs": obs, "actions": actions,
                         "logp_old": table.gather(-1, actions.unsqueeze(-1)).squeeze(-1)})


def reward(batch, ro):
    return (ro.traj["actions"] == 1).float().mean(-1).view(-1, G)


def global_batches():
    g = torch.Generator().manual_seed(3)
    return [{"obs": torch.randn(EVENTS, T, OBS, generator=g),
             "noise": torch.rand(EVENTS, G, T, ACT, generator=g).clamp(1e-6, 1 - 1e-6)}
            for _ in range(STEPS)]


def shard(batch, rank, world):
    n = EVENTS // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def state0():
    torch.manual_seed(0)
    return with_reference(TrainState.create(Policy(), optim.adam(lr=0.05), seed=0))


STEP_KW = dict(sample=sample, reward=reward, group_size=G, policy_updates=2, microbatch_size=2,
               kl_coef=0.05, clip_grad=0.5)


def run(step, state, batches):
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


def main():
    ctx = D.init_from_env()
    batches = global_batches()
    local = [shard(b, ctx.rank, ctx.world_size) for b in batches]
    dp_step = D.wrap_step(grpo(**STEP_KW, grad_transform=D.grad_transform()),
                          count_fn=lambda ro: ro.traj["actions"].shape[0])  # the core's batch: a Rollout
    dp_state, dp_metrics = run(dp_step, state0(), local)
    # the same data-parallel GRPO step behind compile_step: its rollout eager, its core compiled
    compiled = compile_step(dp_step)
    comp_state, comp_metrics = run(compiled, state0(), local[:2])
    eager2, _ = run(dp_step, state0(), local[:2])
    # the 1-process reference over the global batch: a plain GRPO step, no collectives
    ref_state, ref_metrics = run(grpo(**STEP_KW), state0(), batches)
    start = state0()
    res = {
        "rank": ctx.rank, "world_size": ctx.world_size, "steps": len(dp_metrics),
        "max_param_diff": max(float((dp_state.params[k] - ref_state.params[k]).abs().max()) for k in ref_state.params),
        "param_moved": max(float((dp_state.params[k] - start.params[k]).abs().max()) for k in start.params),
        "max_metric_diff": {k: max(abs(a[k] - b[k]) for a, b in zip(dp_metrics, ref_metrics))
                            for k in ("loss", "reward_mean", "grad_norm", "rl_kl")},
        "trajectories": dp_metrics[0]["samples"],
        "compile_count": compiled.compile_count,
        "compiled_vs_eager": max(float((comp_state.params[k] - eager2.params[k]).abs().max()) for k in start.params),
    }
    D.assert_in_sync(dp_state.params)
    C.write_json(os.path.join(C.out_dir(), f"grpo_rank{ctx.rank}.json"), res)
    D.shutdown()


if __name__ == "__main__":
    main()
