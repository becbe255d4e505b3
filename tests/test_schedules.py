"""Every schedule against its torch scheduler, or the seed's formula, at every step."""
import math
import warnings

import pytest
import torch

from pimm_fn import schedules as S

REL = 1e-12  # float64 tensor math against torch's Python floats: a few ulps at most


def ours(schedule, steps):
    return [float(schedule(torch.tensor(s, dtype=torch.int64))) for s in steps]


def assert_close(got, want, what):
    assert len(got) == len(want)
    for s, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= REL * abs(w), f"{what}: step {s}: got {g!r}, torch/seed {w!r}"


def torch_trace(make_scheduler, n_groups, steps, opt_cls=torch.optim.SGD, **opt_kw):
    """Per-group (lr, momentum-or-beta1) lists a torch scheduler yields at steps 0..steps-1."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(n_groups)]
    opt = opt_cls([{"params": [p]} for p in params], lr=0.1, **opt_kw)
    sched = make_scheduler(opt)
    lrs = [[] for _ in range(n_groups)]
    moms = [[] for _ in range(n_groups)]
    for step in range(steps):
        for i, g in enumerate(opt.param_groups):
            lrs[i].append(g["lr"])
            moms[i].append(g["betas"][0] if "betas" in g else g.get("momentum"))
        if step == steps - 1:
            break  # OneCycleLR with pct_start=1 divides by zero one step past the end
        opt.step()  # no grads: a no-op that keeps torch's order-of-calls check quiet
        sched.step()
    return lrs, moms


ONE_CYCLE_CASES = [
    # total_steps, pct_start, anneal, three_phase, div, final_div
    (300, 0.3, "cos", False, 25.0, 1e4),
    (300, 0.3, "linear", False, 25.0, 1e4),
    (1000, 0.05, "cos", False, 10.0, 1000.0),  # PTv3's setting
    (301, 0.25, "cos", True, 25.0, 1e4),
    (301, 0.25, "linear", True, 25.0, 1e4),
    (7, 0.5, "cos", False, 25.0, 1e4),
    (1, 0.3, "cos", False, 25.0, 1e4),
]


@pytest.mark.parametrize("total,pct,anneal,three,div,fdiv", ONE_CYCLE_CASES)
def test_one_cycle_matches_torch_per_group_with_momentum(total, pct, anneal, three, div, fdiv):
    max_lrs = [0.006, 0.0006]
    common = dict(pct_start=pct, anneal_strategy=anneal, three_phase=three)
    lrs, moms = torch_trace(
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=max_lrs, total_steps=total, div_factor=div, final_div_factor=fdiv,
            base_momentum=0.8, max_momentum=0.97, **common
        ),
        2, total, momentum=0.9,
    )
    for i, max_lr in enumerate(max_lrs):
        sched = S.one_cycle(total, max_lr, div_factor=div, final_div_factor=fdiv, **common)
        assert_close(ours(sched, range(total)), lrs[i], f"one_cycle group {i}")
    mom = S.one_cycle_momentum(total, base_momentum=0.8, max_momentum=0.97, **common)
    assert_close(ours(mom, range(total)), moms[0], "one_cycle_momentum")


def test_one_cycle_beta1_cycling_matches_torch_adam():
    total = 200
    _, betas = torch_trace(
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=total),
        1, total, opt_cls=torch.optim.AdamW,
    )
    assert_close(ours(S.one_cycle_momentum(total), range(total)), betas[0], "beta1")


@pytest.mark.parametrize("warmup_steps,total", [(37, 500), (2, 10), (100, 100)])
def test_one_cycle_pct_start_above_one_is_a_step_count(warmup_steps, total):
    lrs, moms = torch_trace(
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.01, total_steps=total, pct_start=warmup_steps / total
        ),
        1, total, momentum=0.9,
    )
    assert_close(ours(S.one_cycle(total, 0.01, pct_start=warmup_steps), range(total)), lrs[0], "lr")
    mom = S.one_cycle_momentum(total, pct_start=warmup_steps)
    assert_close(ours(mom, range(total)), moms[0], "momentum")
    # The peak is reached at step warmup_steps - 1, as a step count should mean.
    values = ours(S.one_cycle(total, 0.01, pct_start=warmup_steps), range(total))
    assert max(range(total), key=values.__getitem__) == warmup_steps - 1


def test_one_cycle_holds_its_final_value_past_the_horizon():
    for anneal in ("cos", "linear"):
        sched = S.one_cycle(50, 0.1, anneal_strategy=anneal)
        final = ours(sched, [49])[0]
        assert final == pytest.approx(0.1 / 25 / 1e4, rel=1e-6)
        assert ours(sched, [50, 51, 10_000]) == [final] * 3


@pytest.mark.parametrize("total,eta_min", [(100, 0.0), (257, 1e-5), (1, 0.0)])
def test_cosine_matches_torch(total, eta_min):
    lrs, _ = torch_trace(
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=eta_min),
        1, total + 1,
    )
    # base lr 0.1 is the optimizer's lr in torch_trace; steps 0..T inclusive.
    assert_close(ours(S.cosine(total, 0.1, eta_min), range(total + 1)), lrs[0], "cosine")
    assert ours(S.cosine(total, 0.1, eta_min), [total + 1, 3 * total]) == ours(
        S.cosine(total, 0.1, eta_min), [total]
    ) * 2


@pytest.mark.parametrize(
    "total,milestones,gamma", [(100, (0.6, 0.9), 0.1), (333, (0.2, 0.5, 0.7), 0.3), (10, (0.7,), 0.5)]
)
def test_multistep_matches_torch(total, milestones, gamma):
    lrs, _ = torch_trace(
        lambda opt: torch.optim.lr_scheduler.MultiStepLR(
            opt, milestones=[int(r * total) for r in milestones], gamma=gamma
        ),
        1, total + 1,
    )
    assert_close(ours(S.multistep(total, 0.1, milestones, gamma), range(total + 1)), lrs[0], "multistep")


# The seed's LambdaLR formulas (seed-behaviour.md item 23), written out independently.
def seed_multistep_warmup(s, base, T, milestones, gamma, wr, ws):
    k = sum(1 for r in milestones if s >= int(r * T))
    factor = gamma**k
    if wr > 0 and s <= wr * T:  # the seed divides by zero for wr = 0; here: no warm-up
        factor *= 1 - (1 - s / (wr * T)) * (1 - ws)
    return base * factor


@pytest.mark.parametrize(
    "total,milestones,gamma,wr,ws",
    [(1000, (0.6, 0.9), 0.1, 0.05, 1e-6), (200, (0.3, 0.8), 0.5, 0.2, 1e-3), (40, (0.5,), 0.1, 0.0, 1e-6)],
)
def test_multistep_with_warmup_matches_seed_formula(total, milestones, gamma, wr, ws):
    base = 0.02
    want = [seed_multistep_warmup(s, base, total, milestones, gamma, wr, ws) for s in range(total + 1)]
    sched = S.multistep_with_warmup(total, base, milestones, gamma, warmup_rate=wr, warmup_scale=ws)
    got = ours(sched, range(total + 1))
    assert_close(got, want, "multistep_with_warmup")
    if wr > 0:
        assert got[0] == pytest.approx(base * ws, rel=1e-6)  # the warm-up starts at scale ws


@pytest.mark.parametrize("total,power", [(500, 0.9), (37, 2.0)])
def test_poly_matches_seed_formula(total, power):
    want = [0.05 * (1 - s / (total + 1)) ** power for s in range(total + 1)]
    assert_close(ours(S.poly(total, 0.05, power), range(total + 1)), want, "poly")


@pytest.mark.parametrize("total,gamma", [(500, 0.01), (64, 0.5)])
def test_exp_matches_seed_formula(total, gamma):
    want = [0.05 * gamma ** (s / total) for s in range(total + 1)]
    assert_close(ours(S.exp(total, 0.05, gamma), range(total + 1)), want, "exp")


def test_linear_warmup_matches_torch_linear_lr():
    lrs, _ = torch_trace(
        lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=25), 1, 60
    )
    assert_close(ours(S.linear_warmup(0.1, 25, 0.01), range(60)), lrs[0], "linear_warmup")
    # Over another schedule it multiplies: the warm-up of a cosine.
    cos = S.cosine(60, 0.1)
    warmed = ours(S.linear_warmup(cos, 10, 0.0), range(60))
    plain = ours(cos, range(60))
    assert warmed[0] == 0.0 and warmed[5] == pytest.approx(plain[5] * 0.5, rel=1e-6)
    assert warmed[10:] == pytest.approx(plain[10:], rel=1e-7)


def test_constant():
    assert ours(S.constant(3e-4), [0, 7, 10**9]) == [3e-4] * 3
    assert S.constant(1.0)(torch.tensor(0)).dtype == torch.float64


FACTORIES = {
    "one_cycle": lambda T: S.one_cycle(T, 0.1),
    "one_cycle_momentum": lambda T: S.one_cycle_momentum(T),
    "cosine": lambda T: S.cosine(T, 0.1),
    "multistep": lambda T: S.multistep(T, 0.1),
    "multistep_with_warmup": lambda T: S.multistep_with_warmup(T, 0.1),
    "poly": lambda T: S.poly(T, 0.1),
    "exp": lambda T: S.exp(T, 0.1, 0.1),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("total", [0, -5])
def test_non_positive_total_steps_says_the_loader_is_empty(name, total):
    with pytest.raises(ValueError, match=r"(?s)total_steps must be positive.*loader yields no batches"):
        FACTORIES[name](total)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="anneal_strategy"):
        S.one_cycle(10, 0.1, anneal_strategy="cosine")
    with pytest.raises(ValueError, match="exceeds total_steps"):
        S.one_cycle(10, 0.1, pct_start=20)
    with pytest.raises(ValueError, match="fractions"):
        S.multistep(100, 0.1, milestones=(60, 90))
    with pytest.raises(TypeError, match="integer"):
        S.cosine(10.5, 0.1)


def test_schedules_compile_fullgraph_and_agree_with_eager():
    scheds = [
        S.one_cycle(100, 0.01, pct_start=0.05, three_phase=True),
        S.one_cycle_momentum(100),
        S.cosine(100, 0.1, 1e-4),
        S.multistep_with_warmup(100, 0.1),
        S.poly(100, 0.1),
        S.exp(100, 0.1, 0.01),
        S.linear_warmup(S.multistep(100, 0.1), 10, 0.1),
    ]

    def all_values(count):
        return torch.stack([s(count) for s in scheds])

    compiled = torch.compile(all_values, fullgraph=True, dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in [0, 1, 4, 5, 30, 60, 99, 100, 150]:
            count = torch.tensor(step, dtype=torch.int64)
            eager = all_values(count)
            got = compiled(count)
            assert got.dtype == torch.float64
            # inductor's float64 cos / pow may differ from eager's in the last float64 bits.
            torch.testing.assert_close(got, eager, rtol=1e-12, atol=0)
    assert not math.isnan(float(got.sum()))


@pytest.mark.parametrize("name", ["multistep", "multistep_with_warmup", "poly", "exp"])
def test_schedules_take_the_length_first_and_name_the_old_order(name):
    extra = (0.5,) if name == "exp" else ()
    one = getattr(S, name)(100, 0.1, *extra)
    assert float(one(torch.tensor(0))) == pytest.approx(
        0.1 * (1e-6 if name == "multistep_with_warmup" else 1.0), rel=1e-5)
    with pytest.raises(TypeError, match=r"old order \(base_lr, total_steps\).*" + name + r"\(100, 0.1"):
        getattr(S, name)(0.1, 100, *extra)
