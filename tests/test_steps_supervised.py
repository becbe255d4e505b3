"""The supervised step against the real torch components, purity and compile checks."""
import copy

import pytest
import torch

from pimm_fn import optim, schedules
from pimm_fn.amp import LossScaleConfig
from pimm_fn.compile import compile_step, explain_step
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised
from pimm_fn.steps.common import MissingLossError
from pimm_fn.tree import tree_leaves


class BNNet(torch.nn.Module):
    """A small classifier with BatchNorm and optional dropout, Pointcept output style.

    The linear layer before BatchNorm has no bias: its gradient is pure rounding noise
    (BN removes it), which Adam would amplify into lr-sized eager/compiled differences.
    """

    def __init__(self, dropout=0.0, loss_key="loss"):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(6, 32, bias=False), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
            torch.nn.Dropout(dropout), torch.nn.Linear(32, 4),
        )
        self.loss_key = loss_key

    def forward(self, batch):
        logits = self.body(batch["x"])
        out = {"cls_logits": logits, "acc": (logits.argmax(1) == batch["y"]).float().mean()}
        if "y" in batch:
            out[self.loss_key] = torch.nn.functional.cross_entropy(logits, batch["y"])
        return out


def make_batches(n, batch=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch, 6, generator=g), "y": torch.randint(0, 4, (batch,), generator=g)}
            for _ in range(n)]


TOTAL = 50


def make_tx():
    # OneCycleLR cycles beta1 too (cycle_momentum=True is torch's default).
    lr = schedules.one_cycle(total_steps=TOTAL, max_lr=0.01, pct_start=0.3)
    b1 = schedules.one_cycle_momentum(total_steps=TOTAL, pct_start=0.3)
    return optim.adamw(lr=lr, b1=b1, weight_decay=0.01)


@pytest.fixture(scope="module")
def compiled_adamw_step():
    # One compiled step shared by the tests of this module (compiling costs ~30 s here).
    return compile_step(supervised(clip_grad=1.0))


def snapshot(state):
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in tree_leaves(state)]


def assert_unchanged(state, before):
    after = tree_leaves(state)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), "a step mutated its input state"
        else:
            assert a == b


def test_step_is_pure_eager_and_compiled(compiled_adamw_step):
    torch.manual_seed(0)
    state = TrainState.create(BNNet(), make_tx())
    batch = make_batches(1)[0]
    before = snapshot(state)
    new_eager, _ = supervised(clip_grad=1.0)(state, batch)
    assert_unchanged(state, before)
    new_compiled, _ = compiled_adamw_step(state, batch)
    assert_unchanged(state, before)
    # The new states really moved (the check above is not vacuous).
    assert not torch.equal(new_eager.params["body.0.weight"], state.params["body.0.weight"])
    assert int(new_compiled.buffers["body.1.num_batches_tracked"]) == 1
    assert new_compiled.rng.counter == state.rng.counter + 1
    assert new_compiled.cursor == state.cursor


def test_compiled_eager_and_seed_style_loop_agree(compiled_adamw_step):
    """50 steps: compiled, eager and nn.Module + torch.optim + OneCycleLR + clip agree to 1e-5."""
    torch.manual_seed(1)
    model = BNNet()
    reference = copy.deepcopy(model)
    batches = make_batches(TOTAL, seed=1)

    opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=TOTAL, pct_start=0.3)
    reference.train()
    for b in batches:  # the seed's run_step, mutable
        out = reference(b)
        opt.zero_grad()
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        sched.step()

    eager_step = supervised(clip_grad=1.0)
    s_eager = s_comp = TrainState.create(model, make_tx())
    for b in batches:
        s_eager, _ = eager_step(s_eager, b)
        s_comp, m = compiled_adamw_step(s_comp, b)
    assert compiled_adamw_step.compile_count == 1, compiled_adamw_step.recompile_reasons

    ref_params = dict(reference.named_parameters())
    ref_buffers = dict(reference.named_buffers())
    for name, p in ref_params.items():
        assert (s_eager.params[name] - p.detach()).abs().max() <= 1e-5, name
        assert (s_comp.params[name] - p.detach()).abs().max() <= 1e-5, name
    for name, bf in ref_buffers.items():
        assert torch.allclose(s_comp.buffers[name].float(), bf.float(), atol=1e-5), name
    assert int(s_comp.step) == TOTAL


@pytest.mark.parametrize("max_lr,total,pct,wd", [(0.05, 20, 0.2, 0.1), (2e-3, 400, 0.4, 1e-4)])
def test_other_hyperparameters_reuse_the_compiled_step_and_follow_torch(compiled_adamw_step, max_lr, total,
                                                                         pct, wd):
    """Another peak lr, run length, warm-up or weight decay is an input of the compiled step:
    no recompile, and its numbers are those of torch.optim.AdamW + OneCycleLR at the new values."""
    torch.manual_seed(2)
    model = BNNet()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=max_lr, weight_decay=wd)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=total, pct_start=pct)
    tx = optim.adamw(lr=schedules.one_cycle(total, max_lr, pct_start=pct),
                     b1=schedules.one_cycle_momentum(total, pct_start=pct), weight_decay=wd)
    state = TrainState.create(model, tx)
    compiled_before = compiled_adamw_step.compile_count
    for b in make_batches(12, seed=3):
        out = reference(b)
        opt.zero_grad()
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        lr_torch = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        state, m = compiled_adamw_step(state, b)
        assert float(m["lr"]) == pytest.approx(lr_torch, rel=1e-6)
    assert compiled_adamw_step.compile_count == max(compiled_before, 1), compiled_adamw_step.recompile_reasons
    for name, p in reference.named_parameters():
        assert (state.params[name] - p.detach()).abs().max() <= 1e-5, name


def test_zero_graph_breaks_and_one_compile_over_changing_lr():
    state = TrainState.create(BNNet(), optim.adamw(lr=schedules.cosine(total_steps=100, base_lr=0.05)))
    batches = make_batches(100, seed=2)
    explanation = explain_step(supervised(clip_grad=1.0), state, batches[0])
    assert explanation.graph_break_count == 0
    assert not explanation.break_reasons
    assert explanation.graph_count == 1
    step = compile_step(supervised(clip_grad=1.0))
    lrs = []
    for b in batches:
        state, m = step(state, b)
        lrs.append(float(m["lr"]))
    assert step.compile_count == 1, step.recompile_reasons
    assert len(set(lrs)) > 50  # the learning rate really changed every step


def test_loss_scale_matches_grad_scaler_with_inf_and_nan():
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 2)
    reference = copy.deepcopy(model)

    class Wrapped(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, b):
            return {"loss": ((self.lin(b["x"]) - b["y"]) ** 2).mean()}

    g = torch.Generator().manual_seed(3)
    batches = []
    for t in range(30):
        x = torch.randn(8, 5, generator=g)
        if t in (4, 5, 17):
            x[0, 0] = float("inf")
        if t == 11:
            x[1, 2] = float("nan")
        batches.append({"x": x, "y": torch.randn(8, 2, generator=g)})

    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    ref_scales, ref_skipped = [], []
    for b in batches:
        opt.zero_grad()
        scale_before = scaler.get_scale()
        scaler.scale(((reference(b["x"]) - b["y"]) ** 2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        ref_scales.append(scale_before)
        ref_skipped.append(scaler.get_scale() < scale_before)

    step = supervised(loss_scale_config=LossScaleConfig(growth_interval=3))
    state = TrainState.create(Wrapped(model), optim.sgd(lr=0.05, momentum=0.9), loss_scale=True)
    scales, skipped = [], []
    for b in batches:
        state, m = step(state, b)
        scales.append(float(m["loss_scale"]))
        skipped.append(bool(m["skipped"]))
    assert scales == ref_scales
    assert skipped == ref_skipped and sum(skipped) == 4
    assert max(scales) > 2.0**16  # growth happened too
    for name, p in reference.named_parameters():
        assert torch.allclose(state.params["lin." + name], p.detach(), atol=1e-6)


def test_nonfinite_without_scaler_skip_or_raise():
    state = TrainState.create(BNNet(), optim.sgd(lr=0.1))
    bad = make_batches(1)[0]
    bad["x"][0, 0] = float("nan")
    new, m = supervised(nonfinite="skip")(state, bad)
    assert float(m["skipped"]) == 1.0
    for k in state.params:
        assert torch.equal(new.params[k], state.params[k])
    # BatchNorm statistics poisoned by the NaN batch are not taken either.
    assert torch.isfinite(new.buffers["body.1.running_mean"]).all()
    with pytest.raises(FloatingPointError, match="non-finite"):
        supervised(nonfinite="raise")(state, bad)


def test_accumulation_equals_one_step_on_concatenated_batch():
    torch.manual_seed(4)

    class Lin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 4)

        def forward(self, b):
            return {"loss": torch.nn.functional.cross_entropy(self.lin(b["x"]), b["y"])}

    model = Lin()
    tx = optim.adamw(lr=0.01)
    parts = make_batches(3, batch=8, seed=4)
    parts[2] = {k: v[:4] for k, v in parts[2].items()}  # unequal micro-batches
    whole = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    s_whole, _ = supervised()(TrainState.create(model, tx), whole)
    acc_step = supervised(accumulate=3, microbatch_weight=lambda b: b["y"].shape[0])
    s_acc, m = acc_step(TrainState.create(model, tx), parts)
    for k in s_whole.params:
        assert torch.allclose(s_whole.params[k], s_acc.params[k], atol=1e-6), k
    with pytest.raises(ValueError, match="3 micro-batches"):
        supervised(accumulate=3)(TrainState.create(model, tx), whole)


def test_missing_loss_is_a_clear_error_eager_and_compiled():
    state = TrainState.create(BNNet(loss_key="nll"), optim.sgd(lr=0.1))
    batch = make_batches(1)[0]
    with pytest.raises(MissingLossError, match="no 'loss' entry.*nll"):
        supervised()(state, batch)
    with pytest.raises(MissingLossError, match="no 'loss' entry"):
        compile_step(supervised())(state, batch)


def test_metrics_are_zero_dim_tensors():
    state = TrainState.create(BNNet(), make_tx(), loss_scale=True)
    _, m = supervised(clip_grad=1.0)(state, make_batches(1)[0])
    for k in ("loss", "acc", "lr", "grad_norm", "skipped", "loss_scale"):
        assert isinstance(m[k], torch.Tensor) and m[k].dim() == 0, k


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_autocast_steps_follow_the_float32_step(dtype):
    """Under CPU autocast the step trains like float32 (low-precision forward, fp32 params)."""
    torch.manual_seed(5)
    model = BNNet()
    batches = make_batches(20, seed=5)
    s32 = slow = TrainState.create(model, optim.adamw(lr=1e-2))
    slow = TrainState.create(model, optim.adamw(lr=1e-2), loss_scale=(dtype == "float16"))
    step32, steplow = supervised(), supervised(autocast=dtype)
    for b in batches:
        s32, m32 = step32(s32, b)
        slow, mlow = steplow(slow, b)
        assert float(mlow["skipped"]) == 0.0
    assert all(v.dtype == torch.float32 for v in slow.params.values())
    assert abs(float(mlow["loss"]) - float(m32["loss"])) < 0.1
    drift = max((slow.params[k] - s32.params[k]).abs().max().item() for k in s32.params)
    assert drift < 0.05, drift


def test_unknown_autocast_dtype_is_a_clear_error():
    state = TrainState.create(BNNet(), optim.sgd(lr=0.1))
    with pytest.raises(ValueError, match="unknown autocast dtype 'int8'"):
        supervised(autocast="int8")(state, make_batches(1)[0])


def test_a_step_leaves_the_callers_rng_stream_alone():
    state = TrainState.create(BNNet(dropout=0.5), optim.sgd(lr=0.1))
    batch = make_batches(1)[0]
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    _, m1 = supervised()(state, batch)
    assert torch.equal(torch.rand(4), expected)
    _, m2 = supervised()(state, batch)  # and the step itself is a function of the state
    assert torch.equal(m1["loss"], m2["loss"])


def test_compiled_step_boundary_keeps_the_rng_contract_and_restores_dynamo_config(compiled_adamw_step):
    # The boundary seeds the generator directly (no torch.manual_seed / fork_rng) and
    # switches dynamo's trace_autograd_ops only while tracing; neither may leak out.
    import torch._dynamo

    state = TrainState.create(BNNet(dropout=0.5), optim.sgd(lr=0.1), seed=3)
    batch = make_batches(1)[0]
    flag = torch._dynamo.config.trace_autograd_ops
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    s1, m1 = compiled_adamw_step(state, batch)   # compiles for this model
    s2, m2 = compiled_adamw_step(state, batch)   # a cache hit: same state + batch, same result
    assert torch.equal(torch.rand(4), expected)
    assert torch._dynamo.config.trace_autograd_ops == flag
    assert torch.equal(m1["loss"], m2["loss"])
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(s1.params), tree_leaves(s2.params)))
    assert s1.rng.counter == state.rng.counter + 1 and s1.cursor == state.cursor


class InputBNNet(torch.nn.Module):
    """BatchNorm straight on the inputs, so its statistics depend on the batches alone; the
    batch's ``loss_weight`` scales the loss (an inf weight: a finite forward, a non-finite step).

    ``momentum=None`` makes the running statistics a cumulative average weighted by
    ``num_batches_tracked``. torch's BatchNorm then reads that count on the host
    (``1 / float(num_batches_tracked)``), which no fullgraph compile can trace, so the
    compiled case uses the default momentum (the count must still stay put).
    """

    def __init__(self, momentum):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(6, momentum=momentum)
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, batch):
        logits = self.fc(self.bn(batch["x"]))
        return {"loss": torch.nn.functional.cross_entropy(logits, batch["y"]) * batch["loss_weight"]}


@pytest.mark.parametrize("mode, momentum", [("eager", None), ("eager", 0.1), ("compiled", 0.1)])
def test_skipped_step_leaves_every_buffer_as_before(mode, momentum, compiled_adamw_step):
    step = supervised(clip_grad=1.0) if mode == "eager" else compiled_adamw_step
    torch.manual_seed(5)
    model = InputBNNet(momentum)
    reference = copy.deepcopy(model.bn)  # the real BatchNorm, fed only the applied batches
    state = TrainState.create(model, optim.sgd(lr=0.1))
    batches = [{**b, "loss_weight": torch.tensor(1.0)} for b in make_batches(4, seed=5)]
    batches[1]["x"][3, 2] = float("nan")  # non-finite forward: BN's batch statistics are NaN
    batches[2]["loss_weight"] = torch.tensor(float("inf"))  # finite BN forward, inf loss and gradients

    state, m = step(state, batches[0])
    assert float(m["skipped"]) == 0.0
    reference(batches[0]["x"])
    applied = {k: v.clone() for k, v in state.buffers.items()}
    assert int(applied["bn.num_batches_tracked"]) == 1
    for bad in batches[1:3]:
        state, m = step(state, bad)
        assert float(m["skipped"]) == 1.0
        for k, v in applied.items():
            assert torch.equal(state.buffers[k], v), f"a skipped step changed buffer {k}"
    state, m = step(state, batches[3])
    assert float(m["skipped"]) == 0.0
    reference(batches[3]["x"])
    assert int(state.buffers["bn.num_batches_tracked"]) == int(reference.num_batches_tracked) == 2
    # momentum=None: the running mean is the plain average of the two applied batches' means.
    # (a skipped step that advanced the count would weight the second batch 1/3, not 1/2)
    torch.testing.assert_close(state.buffers["bn.running_mean"], reference.running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state.buffers["bn.running_var"], reference.running_var, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True])
def test_clip_grad_must_be_a_positive_norm(bad):
    """A clip of 0 would silently zero every update; each step builder refuses it."""
    from pimm_fn.sharding import sharded
    from pimm_fn.steps.grpo import grpo
    with pytest.raises(ValueError, match="clip_grad must be a max gradient norm > 0"):
        supervised(clip_grad=bad)
    with pytest.raises(ValueError, match="clip_grad must be a max gradient norm > 0"):
        sharded(clip_grad=bad)
    with pytest.raises(ValueError, match="clip_grad must be a max gradient norm > 0"):
        grpo(sample=lambda policy, batch, g: None, reward=lambda *a: None, group_size=2, clip_grad=bad)


def test_old_loss_scale_keyword_of_a_step_builder_names_the_new_one():
    # The builder's setting is loss_scale_config; loss_scale is the state's switch.
    from pimm_fn.steps.grpo import grpo

    with pytest.raises(TypeError, match=r"supervised\(loss_scale_config=LossScaleConfig"):
        supervised(loss_scale=LossScaleConfig(growth_interval=3))
    with pytest.raises(TypeError, match=r"grpo\(loss_scale_config=.*TrainState.create\(\.\.\., loss_scale=True\)"):
        grpo(sample=lambda p, b, g: None, reward=None, group_size=2, loss_scale=LossScaleConfig())
    step = supervised(loss_scale_config=LossScaleConfig(growth_interval=3))
    assert callable(step)


def test_a_step_compiles_again_after_dynamo_is_reset_and_leaves_no_tracing_setting_behind():
    # torch.compiler.reset() (a notebook's "start over") drops dynamo's compile callbacks,
    # through which a step enters its tracing settings; the next call registers them again.
    import torch._dynamo
    import torch.fx.experimental._config as shape_config

    state = TrainState.create(BNNet(), optim.sgd(lr=0.1), seed=3)
    batch = make_batches(1)[0]
    step = compile_step(supervised())
    _, before = step(state, batch)
    torch.compiler.reset()
    _, after = step(state, batch)  # traces torch.autograd.grad again: needs trace_autograd_ops
    assert step.compile_count == 2 and torch.equal(before["loss"], after["loss"])
    assert torch._dynamo.config.trace_autograd_ops is False and shape_config.use_duck_shape is True
    # a user's own compile outside a step call gets none of the step's settings
    seen = {}

    def probe(x):
        seen["flag"] = torch._dynamo.config.trace_autograd_ops
        return x + 1

    torch.compile(probe, backend="eager", fullgraph=True)(torch.ones(2))
    assert seen["flag"] is False
