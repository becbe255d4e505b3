"""The JAX way of benchmarks/run_steps.py computes what the torch ways compute.

Run by tests/test_bench_jax.py in a subprocess of its own: importing JAX starts its
threads, and a pytest process that later forks data-loader workers would then warn of
(and risk) a deadlock. Skipped (with the reason) when jax/optax are absent: they are the
optional ``bench`` extra, not test dependencies. Small models, three steps each.
"""
import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("jax", reason="the JAX benchmark way needs the bench extra: pip install -e '.[bench]'")
pytest.importorskip("optax", reason="the JAX benchmark way needs the bench extra: pip install -e '.[bench]'")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import jax_ways as J
from pimm_fn.bench import workloads as W
from pimm_fn.compile import compile_step
from pimm_fn.models import ImageClassifier, MLPClassifier, PointSegNet
from pimm_fn.schedules import one_cycle
from pimm_fn.state import TrainState
from pimm_fn.steps.supervised import supervised


def test_one_cycle_matches_pimm_fn_schedule():
    import jax.numpy as jnp

    ours, ref = J.one_cycle(W.TOTAL_STEPS, W.MAX_LR), one_cycle(W.TOTAL_STEPS, W.MAX_LR)
    for c in (0, 1, 7, 1000, 2998, 2999, 3000, 3001, 6000, 9998, 9999, 10_000, 25_000):
        want = float(ref(torch.tensor(c)))
        got = float(ours(jnp.asarray(c, jnp.int32)))
        # float32 (cos + 1) loses digits near the end of the cycle: ~1e-11 absolute there (1e-8 of max_lr)
        assert got == pytest.approx(want, rel=2e-5, abs=1e-7 * W.MAX_LR), c


CASES = {
    "mlp": (lambda: MLPClassifier(32, 10, hidden=(64, 64)), lambda: W.mlp_batches(3, batch=64, in_dim=32)),
    "cnn": (lambda: ImageClassifier(3, 10, width=8, depth=3), lambda: W.cnn_batches(3, batch=8)),
    # totals in [600, 998]: all padded to one 1024 bucket, so one compile for three sizes
    "pointseg": (lambda: PointSegNet(3, W.POINT_CLASSES, width=8, strides=(2, 4)),
                 lambda: W.point_batches(3, clouds=2, lo=300, hi=500)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_jax_losses_match_the_torch_step(name):
    build, make_batches = CASES[name]
    torch.manual_seed(0)
    model, batches = build(), make_batches()
    tx, _ = W.make_optimizer()
    state = TrainState.create(model, tx)
    step = compile_step(supervised(clip_grad=W.CLIP), eager=True)
    torch_losses = []
    for b in batches:
        state, m = step(state, b)
        torch_losses.append(float(m["loss"]))

    trainer = J.trainer_for(model, total_steps=W.TOTAL_STEPS, max_lr=W.MAX_LR, weight_decay=W.WEIGHT_DECAY, clip=W.CLIP)
    for b in batches:
        trainer.run(b, record=True)
    cmp = J.compare_losses(torch_losses, trainer.losses)
    assert cmp["first_ok"], cmp
    # Later steps go through the gradients, clip, AdamW and the schedule: float32 round-off only
    # (measured: <= 5e-7 on all three).
    assert max(cmp["abs_diff"]) < 1e-4, cmp
    assert trainer.compile_count == 1  # point batches of three sizes share one padded bucket
    if name == "pointseg":  # BatchNorm statistics over the real points only (padding masked out)
        got = trainer.state[1]["stem"]
        assert torch.allclose(torch.tensor(np.asarray(got["mean"])), state.buffers["stem.1.running_mean"], atol=1e-4)
        assert torch.allclose(torch.tensor(np.asarray(got["var"])), state.buffers["stem.1.running_var"], atol=1e-4)
