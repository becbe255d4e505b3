"""explain_step works on every ready-made step and finds 0 graph breaks in each.

The ready-made steps: ``steps.supervised`` (plain, BatchNorm, accumulation, loss scaling),
``distributed.data_parallel`` (single process), ``steps.grpo`` (its rollout is the step's
host ``prepare``, its update core is explained; also data-parallel through ``wrap_step``)
and any of them behind ``compile_step``. Both ``pimm_fn.compile.explain_step`` and
``pimm_fn.bench.graph_breaks`` (its summary).
"""
import pytest
import torch

from pimm_fn import bench, distributed, optim
from pimm_fn.compile import compile_step, explain_step
from pimm_fn.models import ImageClassifier, MLPClassifier
from pimm_fn.state import TrainState
from pimm_fn.steps import grpo, supervised
from pimm_fn.steps.grpo import Rollout, with_reference

OBS, ACTIONS, T, B, G = 3, 4, 6, 3, 4


def _image_batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"image": torch.randn(4, 1, 8, 8, generator=g), "label": torch.randint(0, 3, (4,), generator=g)}


def _vector_batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(8, 5, generator=g), "y": torch.randint(0, 3, (8,), generator=g)}


class _Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(OBS, ACTIONS)

    def log_probs(self, obs):
        return torch.log_softmax(self.lin(obs), -1)


def _sample(policy, batch, group_size):
    obs = batch["x"].repeat_interleave(group_size, 0)
    table = policy(obs)
    actions = torch.distributions.Categorical(logits=table).sample()
    logp = table.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    mask = torch.arange(T) < batch["len"].repeat_interleave(group_size).unsqueeze(1)
    return Rollout(traj={"obs": obs, "actions": actions, "logp_old": logp, "mask": mask})


def _reward(batch, ro):
    return ((ro.traj["actions"] == 1) & ro.traj["mask"]).sum(-1).float().view(-1, G)


def _policy_batch():
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(B, T, OBS, generator=g), "len": torch.tensor([T, 3, 1])}


def _bn_state():
    return TrainState.create(ImageClassifier(1, 3, width=4, depth=2), optim.adamw(lr=1e-2), seed=0)


def _grpo_state():
    return with_reference(TrainState.create(_Policy(), optim.adam(lr=1e-2), seed=0))


GRPO_KW = dict(sample=_sample, reward=_reward, group_size=G, kl_coef=0.05, policy_updates=2, microbatch_size=3)

# name -> (step, state factory, batch factory)
CASES = {
    "supervised_batchnorm": (lambda: supervised(clip_grad=1.0), _bn_state, lambda: _image_batch(0)),
    "supervised_mlp": (lambda: supervised(), lambda: TrainState.create(MLPClassifier(5, 3), optim.sgd(lr=0.1)),
                       lambda: _vector_batch(0)),
    "supervised_accumulate": (lambda: supervised(accumulate=2), _bn_state,
                              lambda: [_image_batch(0), _image_batch(1)]),
    "supervised_loss_scale": (
        lambda: supervised(),
        lambda: TrainState.create(MLPClassifier(5, 3), optim.adam(lr=1e-2), loss_scale=True),
        lambda: _vector_batch(0)),
    "data_parallel_single_process": (lambda: distributed.data_parallel(clip_grad=1.0), _bn_state,
                                     lambda: _image_batch(0)),
    "compiled_supervised": (lambda: compile_step(supervised(clip_grad=1.0)), _bn_state, lambda: _image_batch(0)),
    "grpo": (lambda: grpo(**GRPO_KW), _grpo_state, _policy_batch),
    "grpo_dr_constant": (lambda: grpo(**GRPO_KW, advantage="dr_grpo", reduction="constant", max_length=T),
                         _grpo_state, _policy_batch),
    "grpo_compiled": (lambda: compile_step(grpo(**GRPO_KW)), _grpo_state, _policy_batch),
    "grpo_data_parallel_single_process": (
        lambda: distributed.wrap_step(grpo(**GRPO_KW, grad_transform=distributed.grad_transform())),
        _grpo_state, _policy_batch),
    "grpo_fp16_loss_scale": (
        lambda: grpo(**GRPO_KW, autocast="float16"),
        lambda: with_reference(TrainState.create(_Policy(), optim.adam(lr=1e-2), seed=0, loss_scale=True)),
        _policy_batch),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_explain_step_finds_no_graph_breaks(name):
    make_step, make_state, make_batch = CASES[name]
    step, state, batch = make_step(), make_state(), make_batch()
    before = {k: v.clone() for k, v in state.params.items()}
    explanation = explain_step(step, state, batch)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert not explanation.break_reasons
    assert explanation.graph_count == 1
    # the whole update is in that one graph: something was traced, and it has the optimizer's ops
    assert len(explanation.graphs[0].graph.nodes) > 20
    for k, v in state.params.items():  # explaining never trains the caller's state
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("name", ["grpo", "compiled_supervised"])
def test_bench_graph_breaks_on_grpo_and_compiled_steps(name):
    make_step, make_state, make_batch = CASES[name]
    count, reasons = bench.graph_breaks(make_step(), make_state(), make_batch())
    assert (count, reasons) == (0, [])


def test_explain_step_reports_a_break_in_a_grpo_loss():
    # The check can fail: a host read (.item()) in a custom GRPO loss is a break of the core.
    def leaky_loss(out, chunk, update_index):
        loss = -(out["logp"] * chunk["advantages"].unsqueeze(-1)).mean()
        return loss * float(loss.item() > -1e9), {"loss": loss.detach()}

    step = grpo(sample=_sample, reward=_reward, group_size=G, loss=leaky_loss)
    explanation = explain_step(step, _grpo_state(), _policy_batch())
    assert explanation.graph_break_count > 0 or explanation.break_reasons
    count, reasons = bench.graph_breaks(step, _grpo_state(), _policy_batch())
    assert count > 0 or reasons


def test_benchmark_step_takes_a_grpo_step():
    # GRPO is a Step: benchmark_step explains, compiles (rollout eager) and times it.
    res = bench.benchmark_step(grpo(**GRPO_KW), _grpo_state(), _policy_batch(), steps=2, warmup=1, rounds=1)
    assert res.compile_error is None and res.compiled, res.compile_error
    assert (res.graph_break_count, res.break_reasons) == (0, [])
    assert res.compile_count == 1
