"""What a notebook pays for trying another learning rate, run length or weight decay.

One process compiles ``compile_step(steps.supervised(clip_grad=1.0))`` for a state whose
optimizer is AdamW + OneCycle (peak lr 1e-3, 100 steps, weight decay 0.01), then builds a
new state from the same model for each change below and times that state's first call
(the same compiled step object, as a notebook cell that rebuilds the state and reruns):

    lr       peak lr 3e-3
    epochs   300 steps
    wd       weight decay 0.05
    all      the three together

A second process with the first one's step cache then runs the ``all`` settings: its first
call loads the saved step or compiles it again. Each figure is the first call's wall time
and the compiles it took (``CompiledStep.compile_count``).

mlp: the MLP 64-256-10 step of benchmarks/overhead.py. ptv3_block: the one-block PTv3-shaped
model of benchmarks/compile_time.py on a real LiDAR batch.

    python benchmarks/new_hyperparameters.py --models mlp,ptv3_block --threads 2
    PYTHONPATH=/path/to/an/older/checkout python benchmarks/new_hyperparameters.py ...  # that pimm_fn
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHANGES = {"lr": dict(lr=3e-3), "epochs": dict(total=300), "wd": dict(wd=0.05),
           "all": dict(lr=3e-3, total=300, wd=0.05)}


def _model_and_batch(model: str):
    import torch

    torch.manual_seed(0)
    if model == "mlp":
        sys.path.insert(0, HERE)
        from overhead import mlp_workload

        _, state, pool = mlp_workload()
        return state, pool[0]
    sys.path.insert(0, HERE)
    from compile_time import _ptv3_config_workload

    state, batches = _ptv3_config_workload(model)
    return state, batches[0]


def _state(base, lr=1e-3, total=100, wd=0.01):
    """``base`` (its weights) with a fresh AdamW + OneCycle of these numbers."""
    from pimm_fn import optim, schedules

    tx = optim.adamw(lr=schedules.one_cycle(total, lr), b1=schedules.one_cycle_momentum(total), weight_decay=wd)
    return base.replace(tx=tx, opt_state=tx.init(base.params))


def _first_call(step, state, batch) -> dict:
    before = step.compile_count
    t = time.perf_counter()
    state, metrics = step(state, batch)
    float(metrics["loss"])
    return {"s": round(time.perf_counter() - t, 3), "compiles": step.compile_count - before}


def child(model: str, cache: str, threads: int, changes: list) -> dict:
    import torch

    from pimm_fn import compile_step, steps

    if threads:
        torch.set_num_threads(threads)
    base, batch = _model_and_batch(model)
    step = compile_step(steps.supervised(clip_grad=1.0), cache=cache)
    out = {}
    if "base" in changes:
        out["base"] = _first_call(step, _state(base), batch)
    for name in changes:
        if name != "base":
            out[name] = _first_call(step, _state(base, **CHANGES[name]), batch)
    out["loaded_from_cache"] = step.loaded_from_cache
    return out


def _spawn(model: str, cache: str, threads: int, changes: list) -> dict:
    from pimm_fn.bench.child import run_child  # here: a child importing this file must not import torch

    return run_child(__file__, f"child({model!r}, {cache!r}, {threads!r}, {changes!r})", timeout=3000, label=model)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    import pimm_fn

    print(f"load {os.getloadavg()[0]:.2f}; pimm_fn from {os.path.dirname(pimm_fn.__file__)}", flush=True)
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="pimm_fn_hyper_") as cache:
            same = _spawn(model, cache, args.threads, ["base", "lr", "epochs", "wd", "all"])
            other = _spawn(model, cache, args.threads, ["all"])
        cells = [f"{k} {v['s']:.2f} s ({v['compiles']} compiles)" for k, v in same.items() if isinstance(v, dict)]
        print(f"{model}: same process: {'; '.join(cells)}")
        print(f"{model}: new process, all changed: {other['all']['s']:.2f} s ({other['all']['compiles']} compiles), "
              f"loaded from the step cache: {other['loaded_from_cache']}")
    print(f"load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
