"""docs/writing_a_step.md runs as written: its python blocks, in order, in one namespace.

The blocks run once per module (the fixture); the tests then check what they left behind:
each variant's reward over its short run (DAPO written whole, Dr. GRPO from the ready-made
step) and that the DAPO step really drops groups whose rewards are all equal.
"""
import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "writing_a_step.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def tutorial():
    """The namespace the tutorial's blocks leave behind, and what they printed."""
    assert len(BLOCKS) >= 5, "the tutorial lost its code blocks"
    namespace = {"__name__": "writing_a_step"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, code in enumerate(BLOCKS):
            exec(compile(code, f"{DOC.name}[block {i}]", "exec"), namespace)
    return namespace, out.getvalue()


def test_tutorial_code_runs_as_written(tutorial):
    _, printed = tutorial
    assert "graph breaks: 0" in printed
    # the variant itself is small: the whole-step section's code, without blank lines
    whole_step = [line for line in BLOCKS[2].splitlines() if line.strip()]
    assert len(whole_step) < 100


def _assert_rises(rewards):
    # 25 steps of a noisy policy gradient: compare the last 5 steps' mean with the start
    # (measured: ~2 -> ~6; a variant that does not learn stays near 1.6, the random rate).
    assert len(rewards) == 25
    late = sum(rewards[-5:]) / 5
    assert late > rewards[0] + 1.5, (rewards[0], late)


def test_dapo_variant_reward_rises(tutorial):
    ns, printed = tutorial
    assert "DAPO reward" in printed
    _assert_rises(ns["dapo_rewards"])
    assert ns["dapo"].compile_count == 1  # the whole DAPO core compiled once, fullgraph
    assert ns["dapo"].step.prepare is ns["rollout"]  # the rollout is the step's host prepare


def test_dr_grpo_variant_reward_rises(tutorial):
    ns, printed = tutorial
    assert "Dr. GRPO reward" in printed
    step = ns["dr_grpo"]
    assert step.advantage == "dr_grpo" and step.weight_by == "trajectories"
    _assert_rises(ns["dr_rewards"])


def test_dapo_step_masks_groups_with_equal_rewards(tutorial):
    ns, _ = tutorial
    G, B = ns["G"], ns["B"]
    state = ns["TrainState"].create(ns["Policy"](), ns["optim"].adam(lr=3e-2), seed=1)
    from pimm_fn.compile import seeded_rng

    with seeded_rng(state.rng.step_seed()):  # as the step runs its prepare
        ro = ns["rollout"](state, ns["make_batch"](7))
    rewards = ro["rewards"].clone()
    assert bool(ns["informative_groups"](rewards).all())  # a fresh policy: every group varies
    rewards[0] = 3.0  # group 0: all equal, so no signal
    equal = {**ro, "rewards": rewards}
    dropped = {k: v[G:] for k, v in ro.items() if k != "rewards"}
    dropped["rewards"] = rewards[1:]

    inner = state.replace(rng=None, cursor=None)
    _, m_equal = ns["dapo_update"](inner, equal)
    _, m_dropped = ns["dapo_update"](inner, dropped)
    # masked out of the loss *and* of the token count: as if the group were never sampled
    kept_tokens = ro["mask"][G:].sum()
    assert m_equal["count"] == kept_tokens < ro["mask"].sum()
    torch.testing.assert_close(m_equal["loss"], m_dropped["loss"], atol=1e-6, rtol=0)
    assert float(m_equal["groups_kept"]) == (B - 1) / B

    # every group equal: nothing to learn, and no NaN from an empty token mean
    flat = {**ro, "rewards": torch.ones_like(rewards)}
    new, m_flat = ns["dapo_update"](inner, flat)
    assert m_flat["count"] == 0 and float(m_flat["loss"]) == 0.0
    for k, v in state.params.items():
        assert torch.equal(new.params[k], v), k
