"""GRPO step (rollout + P policy updates): compiled vs eager pimm_fn, vs a seed-style mutable loop.

    python benchmarks/grpo_step.py [--quick] [--rounds 5] [--steps 5]

The workload: a token policy (MLP 16 -> 64 -> 64 -> 8 actions) over B inputs x G
trajectories x T steps, rewards from a hidden rule, GRPO advantages, P=4 updates with the
clipped surrogate (token ratios, sequence reduction) and Adam. Three ways, timed
interleaved in one process (round-robin with a rotating order; median and min of the
per-round means per step):

* ``pimm_compiled``: ``compile_step(pimm_fn.steps.grpo(...))`` -- eager host rollout +
  the update core compiled with fullgraph;
* ``pimm_eager``: the same step, uncompiled;
* ``seed_loop``: what the seed's GRPOTrainer does: an ``nn.Module``, ``torch.optim.Adam``
  (fused, the fastest eager torch.optim here), ``loss.backward()`` / ``optimizer.step()``
  per update, the same sampling and loss math.

Prints a table and writes benchmarks/results/grpo_step.json. Ratios are time / seed_loop.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pimm_fn import optim, rl
from pimm_fn.compile import compile_step
from pimm_fn.state import TrainState
from pimm_fn.steps.grpo import Rollout, grpo

OBS, ACT, HID = 16, 8, 64


class TokenPolicy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(OBS, HID), torch.nn.Tanh(), torch.nn.Linear(HID, HID),
                                       torch.nn.Tanh(), torch.nn.Linear(HID, ACT))

    def log_probs(self, obs):
        return torch.log_softmax(self.net(obs), -1)


RULE = torch.randn(OBS, ACT, generator=torch.Generator().manual_seed(0))


def make_batches(n, b, t):
    g = torch.Generator().manual_seed(1)
    return [{"obs": torch.randn(b, t, OBS, generator=g)} for _ in range(n)]


def sample(policy, batch, group_size):
    obs = batch["obs"].repeat_interleave(group_size, 0)
    table = policy(obs)
    u = torch.rand(table.shape).clamp_(1e-10, 1 - 1e-7)
    actions = (table - torch.log(-torch.log(u))).argmax(-1)
    logp = table.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    return Rollout(traj={"obs": obs, "actions": actions, "logp_old": logp})


def make_reward(g):
    def reward(batch, ro):
        hits = ro.traj["actions"] == (ro.traj["obs"] @ RULE).argmax(-1)
        return hits.float().mean(-1).view(-1, g)
    return reward


class SeedLoop:
    """The seed's shape: mutable module + torch.optim, backward() and step() per update."""

    def __init__(self, g, p, lr):
        torch.manual_seed(0)
        self.model = TokenPolicy()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr, fused=True)
        self.g, self.p, self.reward = g, p, make_reward(g)

    def __call__(self, batch):
        with torch.no_grad():
            ro = sample(self.model.log_probs, batch, self.g)
            rewards = self.reward(batch, ro)
        rl.validate_rewards(rewards)
        adv = rl.grpo_advantages(rewards).reshape(-1)
        outs = []
        for _ in range(self.p):
            table = self.model.log_probs(ro.traj["obs"])
            logp = table.gather(-1, ro.traj["actions"].unsqueeze(-1)).squeeze(-1)
            loss, m = rl.grpo_loss(logp, ro.traj["logp_old"], None, adv)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            outs.append(m)
        return rl.combine_updates(outs)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--events", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--horizon", type=int, default=64)
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "grpo_step.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.events, args.horizon = 2, 2, 4, 16
    torch.set_num_threads(args.threads)
    b, g, t, p = args.events, args.group, args.horizon, args.updates
    batches = make_batches(args.steps, b, t)
    lr = 1e-3

    def pimm_state():
        torch.manual_seed(0)
        return TrainState.create(TokenPolicy(), optim.adam(lr=lr), seed=0)

    step = grpo(sample=sample, reward=make_reward(g), group_size=g, policy_updates=p)
    ways = {"pimm_compiled": compile_step(step), "pimm_eager": step}
    states = {k: pimm_state() for k in ways}
    seed = SeedLoop(g, p, lr)

    t0 = time.perf_counter()
    states["pimm_compiled"], _ = ways["pimm_compiled"](states["pimm_compiled"], batches[0])  # compile
    compile_s = time.perf_counter() - t0
    for k in ways:  # warm-up
        states[k], _ = ways[k](states[k], batches[0])
    seed(batches[0])

    per_round = {k: [] for k in ("pimm_compiled", "pimm_eager", "seed_loop")}
    names = list(per_round)
    for r in range(args.rounds):
        # rotate the order every round: a burst of load from other processes on a shared
        # machine does not always land on the same way
        for name in names[r % 3:] + names[:r % 3]:
            start = time.perf_counter()
            for bt in batches:
                if name == "seed_loop":
                    seed(bt)
                else:
                    states[name], _ = ways[name](states[name], bt)
            per_round[name].append((time.perf_counter() - start) / len(batches) * 1e3)
    med = {k: statistics.median(v) for k, v in per_round.items()}
    best = {k: min(v) for k, v in per_round.items()}
    result = {
        "workload": {"events": b, "group_size": g, "horizon": t, "policy_updates": p, "obs": OBS,
                     "hidden": HID, "actions": ACT, "tokens_per_rollout": b * g * t},
        "ms_per_step_median": med,
        "ms_per_step_rounds": per_round,
        "ratio_to_seed_loop": {k: med[k] / med["seed_loop"] for k in med},
        "ms_per_step_min": best,
        "ratio_to_seed_loop_of_min": {k: best[k] / best["seed_loop"] for k in best},
        "compiled_vs_eager": med["pimm_compiled"] / med["pimm_eager"],
        "compile_seconds": compile_s,
        "compile_count": ways["pimm_compiled"].compile_count,
        "threads": args.threads, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "load_avg_at_end": os.getloadavg(),
        "command": "python benchmarks/grpo_step.py" + (" --quick" if args.quick else ""),
    }
    print(f"GRPO step: B={b} G={g} T={t} P={p} ({b * g * t} tokens/rollout), {args.rounds} rounds x {args.steps} steps")
    print(f"{'way':<15}{'median ms':>10}{'vs seed':>10}{'min ms':>10}{'vs seed':>10}")
    for k in per_round:
        print(f"{k:<15}{med[k]:>10.2f}{result['ratio_to_seed_loop'][k]:>10.3f}"
              f"{best[k]:>10.2f}{result['ratio_to_seed_loop_of_min'][k]:>10.3f}")
    print(f"compiled / eager: {result['compiled_vs_eager']:.3f}; compile {compile_s:.1f} s; "
          f"load average {result['load_avg_at_end'][0]:.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
