"""Shared pieces of the scripts torchrun launches in tests/test_distributed*.py."""
import json
import os
import sys

import torch

# one inductor cache with the pytest session (tests/conftest.py sets the same default)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    __import__("tempfile").gettempdir(), "pimm_fn_test_inductor_cache"))
torch.set_num_threads(1)  # two ranks share two cores

from pimm_fn.data.collate import collate
from pimm_fn.data.loaders import build_train_loader

IN, OUT = 8, 4


class MLP(torch.nn.Module):
    """A regression MLP returning the Pointcept-style output dict."""

    def __init__(self, bn: bool = False, hidden: int = 16):
        super().__init__()
        # no bias before BatchNorm: BN cancels it, so its gradient is rounding noise that
        # Adam would amplify into lr-sized steps that differ between eager and compiled
        self.fc1 = torch.nn.Linear(IN, hidden, bias=not bn)
        self.bn = torch.nn.BatchNorm1d(hidden) if bn else torch.nn.Identity()
        self.fc2 = torch.nn.Linear(hidden, OUT)

    def forward(self, batch):
        h = torch.relu(self.bn(self.fc1(batch["x"])))
        pred = self.fc2(h)
        err = (pred - batch["y"]).abs()
        return {"loss": torch.nn.functional.mse_loss(pred, batch["y"]),
                "err_max": err.max(), "err_min": err.min()}


def dataset(n: int, seed: int = 123) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return [{"x": x[i], "y": torch.tanh(x[i] @ w)} for i in range(n)]


def loader(data, batch_size: int, rank: int, world_size: int, seed: int = 7):
    return build_train_loader(data, batch_size=batch_size, seed=seed, rank=rank,
                              world_size=world_size, collate_fn=collate, drop_last=True)


def optimizer(kind: str, lr: float):
    """adamw / sgd from pimm_fn.optim."""
    try:
        from pimm_fn.optim import adamw, sgd
    except ImportError:
        from pimm_fn.optim.transforms import adamw, sgd
    return adamw(lr, weight_decay=0.01) if kind == "adamw" else sgd(lr, momentum=0.9)


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def out_dir() -> str:
    return sys.argv[1]
