"""RanksInSync on two ranks: models seeded per rank are caught before the first step, a
step that does not average gradients after it; a data-parallel step passes. Writes
<out>/in_sync_rank<r>.json."""
import json
import sys

import torch

from pimm_fn import TrainState, distributed, optim, steps
from pimm_fn.callbacks import RanksInSync
from pimm_fn.distributed import RankDivergenceError
from pimm_fn.fit import fit
from pimm_fn.models import MLPClassifier


def main(out):
    ctx = distributed.init_from_env()
    g = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own data
    batches = [{"x": torch.randn(8, 4, generator=g), "y": torch.randint(0, 3, (8,), generator=g)} for _ in range(4)]

    def state(seed):
        torch.manual_seed(seed)
        return TrainState.create(MLPClassifier(4, 3, hidden=(8,)), optim.sgd(0.1), seed=0)

    results = {}
    for name, model_seed, step in (
        ("averaged", 0, steps.supervised(grad_transform=distributed.grad_transform())),
        ("seeded_per_rank", ctx.rank, steps.supervised(grad_transform=distributed.grad_transform())),
        ("not_averaged", 0, steps.supervised()),
    ):
        try:
            fit(state(model_seed), batches, step, epochs=1, callbacks=[RanksInSync()])
            results[name] = "ok"
        except RankDivergenceError as err:
            results[name] = str(err)
    with open(f"{out}/in_sync_rank{ctx.rank}.json", "w") as f:
        json.dump(results, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
