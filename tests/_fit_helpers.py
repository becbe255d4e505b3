"""Small pure models, steps and loaders for the fit / callback tests (no other engineer's step)."""
from __future__ import annotations

import torch
from torch.func import functional_call, grad_and_value

from pimm_fn.optim.base import GradientTransformation
from pimm_fn.state import TrainState
from pimm_fn.tree import tree_map


def momentum_sgd(lr: float = 0.05, momentum: float = 0.9) -> GradientTransformation:
    """Plain SGD with momentum as a pure transform (state: step count and the momentum buffers)."""

    def init(params):
        return {"count": torch.zeros((), dtype=torch.int64), "mu": tree_map(torch.zeros_like, params)}

    def update(grads, opt_state, params):
        mu = tree_map(lambda m, g: momentum * m + g, opt_state["mu"], grads)
        updates = tree_map(lambda m: -lr * m, mu)
        return updates, {"count": opt_state["count"] + 1, "mu": mu}

    return GradientTransformation(init, update, lambda s: {"lr": torch.tensor(lr)})


class Net(torch.nn.Module):
    def __init__(self, d_in=4, hidden=16, d_out=3, p=0.25):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.drop = torch.nn.Dropout(p)
        self.fc2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def make_state(seed: int = 0, lr: float = 0.05, d_in: int = 4, hidden: int = 16, d_out: int = 3) -> TrainState:
    torch.manual_seed(seed)
    model = Net(d_in, hidden, d_out)
    model.train()
    return TrainState.create(model, momentum_sgd(lr), seed=seed)


def step_fn(state: TrainState, batch):
    """A pure supervised step: dropout seeded from the state's RNG key, as the real step wrapper does."""
    torch.manual_seed(state.rng.step_seed())
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch

    def loss_fn(params):
        logits = functional_call(state.model, (params, state.buffers), (x,))
        return torch.nn.functional.cross_entropy(logits, y)

    grads, loss = grad_and_value(loss_fn)(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = tree_map(lambda p, u: p + u, state.params, updates)
    metrics = {"loss": loss.detach(), "lr/default": torch.tensor(0.05), "grad_norm": torch.stack(
        [g.norm() for g in grads.values()]).norm()}
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1, rng=state.rng.next()), metrics


def dataset(n: int = 48, d_in: int = 4, d_out: int = 3, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randint(0, d_out, (n,), generator=g)
    return x, y


class PermLoader:
    """A conforming loader: a seeded permutation per epoch over tensors, batches of ``batch_size``."""

    world_size = 1

    def __init__(self, x, y, batch_size: int = 8, seed: int = 0, limit=None):
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.limit = limit  # yield only this many batches (an exhausted-early loader)
        self.calls = []

    def __len__(self):
        return len(self.x) // self.batch_size

    def samples_in(self, batch):
        return int(batch["x"].shape[0])

    def iter_epoch(self, epoch, start=0):
        self.calls.append((epoch, start))
        perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
        stop = len(self) if self.limit is None else min(len(self), self.limit)
        for b in range(start, stop):
            idx = perm[b * self.batch_size:(b + 1) * self.batch_size]
            yield {"x": self.x[idx], "y": self.y[idx]}


def leaves_equal(a: TrainState, b: TrainState) -> bool:
    from pimm_fn.tree import tree_leaves

    la, lb = tree_leaves((a.params, a.buffers, a.opt_state)), tree_leaves((b.params, b.buffers, b.opt_state))
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


class Recorder:
    """A callback that records every event it receives."""

    def __init__(self):
        self.events = []

    def __call__(self, event, state):
        self.events.append(event)

    def kinds(self):
        return [type(e).__name__ for e in self.events]
