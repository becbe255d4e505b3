"""CartPole-v1 (gymnasium, no download) trained from scratch with the GRPO step.

Each batch is B start states (env reset seeds drawn from the state's RNG); the policy
plays G episodes from each, so a group shares its start state. Every step of an episode
has its own log-probability; per-step advantages are the group-normalised discounted
returns-to-go (:func:`pimm_fn.rl.step_advantages`). The environment runs on the host in
the step's rollout phase; the P policy updates are the compiled pure core.

    pimm-fn train grpo_cartpole                      # a few minutes on 2 cores
    pimm-fn train grpo_cartpole --set steps=200

The metric to watch is ``return_mean`` (mean episode length of the rollout; 500 is the
cap, 475 the solved level) and ``eval_return`` (greedy episodes on fixed seeds).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from pimm_fn import optim
from pimm_fn.compile import compile_step
from pimm_fn.distributed import grad_transform
from pimm_fn.experiment import Run
from pimm_fn.models.policies import CategoricalMLPPolicy
from pimm_fn.state import TrainState
from pimm_fn.steps.grpo import Rollout, grpo

SETTINGS = {
    "steps": 120,            # rollouts (batches) in the run
    "events": 8,             # B start states per batch
    "group_size": 8,         # G episodes per start state
    "policy_updates": 4,     # P optimizer updates per rollout
    "microbatch_size": 0,    # M trajectories per micro-batch (0 = all)
    "lr": 3e-3,
    "hidden": 64,
    "gamma": 0.99,
    "clip": 0.2,
    "max_steps": 500,        # CartPole-v1's time limit
    "compile": True,
    "seed": 0,
    "eval_episodes": 8,
}
# --quick (a smoke test) changes these; an explicit --set wins over them.
QUICK = {"steps": 3, "events": 2, "group_size": 4, "policy_updates": 2, "max_steps": 40, "eval_episodes": 1}
# group_size >= 2: advantages are relative within a group (one member: always 0).
MINIMUM = {"steps": 1, "events": 1, "group_size": 2, "policy_updates": 1, "microbatch_size": 0, "hidden": 1,
           "max_steps": 1, "eval_episodes": 1}  # smallest valid values


class EpisodeSampler:
    """``sample(policy, batch, G)``: play B * G CartPole episodes with the current policy.

    Keeps its gymnasium environments between calls (they hold no state a resume needs:
    every episode starts from ``reset(seed=...)`` with a seed drawn from torch's generator,
    which the step seeded from the TrainState's RNG key).
    """

    def __init__(self, max_steps: int = 500):
        self.max_steps = int(max_steps)
        self._envs: list = []

    def _env_list(self, n: int) -> list:
        import gymnasium as gym

        while len(self._envs) < n:
            self._envs.append(gym.make("CartPole-v1", max_episode_steps=self.max_steps))
        return self._envs[:n]

    def __call__(self, policy, batch, group_size: int) -> Rollout:
        b, g = int(batch["events"]), int(group_size)
        n = b * g
        envs = self._env_list(n)
        seeds = torch.randint(0, 2**31 - 1, (b,)).repeat_interleave(g).tolist()
        obs = np.stack([env.reset(seed=s)[0] for env, s in zip(envs, seeds)]).astype(np.float32)
        cap = self.max_steps
        obs_buf = torch.zeros(n, cap, 4)
        act_buf = torch.zeros(n, cap, dtype=torch.int64)
        lp_buf = torch.zeros(n, cap)
        rew_buf = torch.zeros(n, cap)
        alive = np.ones(n, dtype=bool)
        t = 0
        while alive.any() and t < cap:
            idx = np.nonzero(alive)[0]
            o = torch.from_numpy(obs[idx])
            table = policy(o)
            u = torch.rand(table.shape).clamp_(1e-10, 1 - 1e-7)
            a = (table - torch.log(-torch.log(u))).argmax(-1)  # Gumbel-max sample
            ti = torch.from_numpy(idx)
            obs_buf[ti, t] = o
            act_buf[ti, t] = a
            lp_buf[ti, t] = table.gather(-1, a[:, None])[:, 0]
            for j, i in enumerate(idx):
                o2, r, term, trunc, _ = envs[i].step(int(a[j]))
                rew_buf[i, t] = float(r)
                obs[i] = o2
                if term or trunc:
                    alive[i] = False
            t += 1
        # Pad the horizon to a power of two (>= 16): few distinct shapes for the compiled core.
        horizon = min(cap, max(16, 1 << math.ceil(math.log2(max(t, 1)))))
        lengths = (rew_buf != 0).sum(1)
        mask = torch.arange(horizon)[None] < lengths[:, None]
        traj = {"obs": obs_buf[:, :horizon], "actions": act_buf[:, :horizon],
                "logp_old": lp_buf[:, :horizon], "mask": mask}
        returns = rew_buf.sum(1)
        return Rollout(traj=traj, rewards=rew_buf[:, :horizon].reshape(b, g, horizon),
                       metrics={"return_mean": returns.mean(), "return_max": returns.max(),
                                "return_min": returns.min()})


class RolloutLoader:
    """A data-free loader: every batch asks for ``events`` start states (seeds come from the state)."""

    def __init__(self, batches: int, events: int):
        self.batches, self.events = int(batches), int(events)

    def __len__(self):
        return self.batches

    def iter_epoch(self, epoch: int, start: int = 0):
        for _ in range(start, self.batches):
            yield {"events": self.events}

    def samples_in(self, batch) -> int:
        return int(batch["events"])


def greedy_return(state: TrainState, episodes: int = 8, max_steps: int = 500, seed: int = 10_000) -> float:
    """Mean return of greedy (argmax) episodes on fixed seeds, with the state's params."""
    import gymnasium as gym
    from torch.func import functional_call

    model = state.model
    total = 0.0
    for k in range(episodes):
        env = gym.make("CartPole-v1", max_episode_steps=max_steps)
        o, _ = env.reset(seed=seed + k)
        done, ret = False, 0.0
        while not done:
            with torch.no_grad():
                logits = functional_call(model, (state.params, state.buffers),
                                         ({"obs": torch.as_tensor(o)[None]},))["logits"]
            o, r, term, trunc, _ = env.step(int(logits.argmax(-1)))
            ret += float(r)
            done = term or trunc
        total += ret
    return total / episodes


def build(settings: dict, ctx) -> Run:
    s = settings
    torch.manual_seed(s["seed"])
    policy = CategoricalMLPPolicy(4, 2, hidden=(s["hidden"], s["hidden"]))
    tx = optim.adam(lr=s["lr"])
    state = TrainState.create(policy, tx, seed=s["seed"])
    step = grpo(
        sample=EpisodeSampler(s["max_steps"]), group_size=s["group_size"], advantage="step",
        gamma=s["gamma"], policy_updates=s["policy_updates"], microbatch_size=s["microbatch_size"],
        clip_low=s["clip"], clip_high=s["clip"], reduction="token",
        grad_transform=grad_transform(),  # under torchrun: every rank applies the mean gradient
    )
    if s["compile"]:
        step = compile_step(step)  # the rollout stays eager on the host; the update core compiles
    return Run(
        state=state, loader=RolloutLoader(s["steps"], s["events"]), step=step, epochs=1,
        evaluate=lambda st: {"eval_return": greedy_return(st, s["eval_episodes"], s["max_steps"])},
        best_metric="eval_return", best_mode="max",
    )
