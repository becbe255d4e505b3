"""Edges where pimm_fn's optimizer pieces once parted from torch's: each case failed on the old code."""
import pytest
import torch

from pimm_fn import TrainState, optim, schedules
from pimm_fn.amp import LossScaleConfig, LossScaleState, update_loss_scale
from pimm_fn.checkpoint.errors import CheckpointMismatchError
from pimm_fn.checkpoint.seed_import import import_seed_checkpoint


def test_the_loss_scale_stops_growing_at_float32s_range_as_gradscaler_does():
    # GradScaler keeps the scale where a growth would overflow; an inf scale would skip every step.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120, growth_interval=1)
    state = LossScaleState(torch.tensor(2.0**120), torch.tensor(0, dtype=torch.int32))
    config = LossScaleConfig(growth_interval=1)
    p = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([p], lr=0.0)
    for _ in range(12):
        scaler.scale(p * 1.0).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        state = update_loss_scale(state, torch.tensor(True), config)
        assert float(state.scale) == scaler.get_scale()
        assert int(state.growth_tracker) == int(scaler._growth_tracker)
    assert torch.isfinite(state.scale)


def test_one_cycle_with_a_warm_up_of_zero_steps_starts_at_its_peak():
    # pct_start * total_steps == 1 (e.g. `pimm-fn train lidar_seg --set epochs=2`): torch divides by zero.
    lr = schedules.one_cycle(10, 0.1, pct_start=0.1)
    values = [float(lr(torch.tensor(s))) for s in range(10)]
    assert values[0] == pytest.approx(0.1) and all(a >= b for a, b in zip(values, values[1:]))
    momentum = schedules.one_cycle_momentum(10, pct_start=0.1)
    assert float(momentum(torch.tensor(0))) == pytest.approx(0.85)
    optim.adamw(lr=lr)  # its schedule check passes (it read NaN before)


class _Seed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 2)


class _Reordered(_Seed):
    def __init__(self):
        torch.nn.Module.__init__(self)
        self.head = torch.nn.Linear(8, 2)
        self.enc = torch.nn.Linear(4, 8)


def _seed_checkpoint():
    seed = _Seed()
    opt = torch.optim.AdamW(seed.parameters(), lr=1e-3)
    seed.head(seed.enc(torch.randn(3, 4))).sum().backward()
    opt.step()
    return {"state_dict": seed.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}


def test_a_seed_checkpoint_into_a_model_declaring_its_params_in_another_order_is_refused():
    # The optimizer's moments are stored by position: they would go to other params (a crash in
    # the fused kernel, or silently swapped moments where the shapes agree).
    like = TrainState.create(_Reordered(), optim.adamw(1e-3))
    with pytest.raises(CheckpointMismatchError, match="another order.*resume=False"):
        import_seed_checkpoint(_seed_checkpoint(), like)
    weights_only = import_seed_checkpoint(_seed_checkpoint(), like, resume=False)
    assert weights_only.params["enc.weight"].shape == (8, 4)
    same_order = import_seed_checkpoint(_seed_checkpoint(), TrainState.create(_Seed(), optim.adamw(1e-3)))
    assert int(same_order.opt_state.count) == 1


def test_torch_moments_of_another_shape_are_refused_by_position():
    w, b = torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([w, b], lr=1e-2)
    (w.sum() + b.sum()).backward()
    opt.step()
    params = {"b": torch.zeros(3), "w": torch.zeros(6, 5)}  # another order than torch's
    with pytest.raises(ValueError, match="exp_avg of param 0 has shape"):
        optim.from_torch_state_dict(opt.state_dict(), optim.adamw(1e-2).init(params))


def _pointcept_multistep_with_warmup(milestones, total, gamma, warmup_rate, warmup_scale=1e-6):
    # The seed's LambdaLR factor: milestones compared as the unrounded r * total.
    marks = [r * total for r in milestones]

    def factor(s):
        f = 1.0
        for m in marks:
            if s < m:
                break
            f *= gamma
        w = 1 - (1 - s / warmup_rate / total) * (1 - warmup_scale) if s <= warmup_rate * total else 1.0
        return w * f
    return factor


@pytest.mark.parametrize("total, milestones, warmup_rate", [(7, (0.6, 0.9), 0.3), (10, (0.7, 0.9), 0.3),
                                                            (200, (0.6, 0.9), 0.05)])
def test_multistep_with_warmup_equals_the_seeds_lambda_to_the_bit(total, milestones, warmup_rate):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(opt, _pointcept_multistep_with_warmup(milestones, total, 0.1,
                                                                                        warmup_rate))
    ours = schedules.multistep_with_warmup(total, 0.1, milestones, 0.1, warmup_rate)
    for s in range(total):
        assert float(ours(torch.tensor(s))) == opt.param_groups[0]["lr"], s
        opt.step()
        lambda_lr.step()


@pytest.mark.parametrize("make, torch_opt, kw", [
    (lambda: optim.sgd(lr=1.0, momentum=0.9), torch.optim.SGD, dict(lr=1.0, momentum=0.9)),
    (lambda: optim.adam(lr=1e-3, fused=False), torch.optim.Adam, dict(lr=1e-3)),
])
def test_bfloat16_params_take_the_step_scalars_as_torch_does(make, torch_opt, kw):
    # torch computes a bf16 tensor times a Python number in float32: momentum 0.9 is not 0.8984.
    tx, params = make(), {"w": torch.zeros(4, dtype=torch.bfloat16)}
    state = tx.init(params)
    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = torch_opt([w], **kw)
    for _ in range(40):
        params, state = optim.update_and_apply(tx, {"w": torch.ones(4, dtype=torch.bfloat16)}, state, params)
        w.grad = torch.ones(4, dtype=torch.bfloat16)
        opt.step()
    assert torch.equal(params["w"], w.detach())


def test_nonfinite_raise_skips_a_loss_scale_overflow_as_documented():
    from pimm_fn import compile_step, steps

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, batch):
            return {"loss": (self.lin(batch["x"]) ** 2).mean() * batch["k"]}

    scaled = TrainState.create(Net(), optim.adamw(1e-3), loss_scale=True)
    step = compile_step(steps.supervised(nonfinite="raise"), eager=True)
    batch = {"x": torch.randn(4, 3), "k": torch.tensor(1e36)}  # the scaled gradients overflow
    new, metrics = step(scaled, batch)
    assert float(metrics["skipped"]) == 1.0 and float(new.loss_scale.scale) < float(scaled.loss_scale.scale)
    with pytest.raises(FloatingPointError, match="non-finite"):  # without a loss scale it raises
        step(TrainState.create(Net(), optim.adamw(1e-3)), {"x": torch.randn(4, 3), "k": torch.tensor(float("nan"))})
