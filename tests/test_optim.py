"""Functional optimizers against torch.optim + OneCycleLR + clip_grad_norm_ on one model."""
import copy

import pytest
import torch
from torch import nn

from pimm_fn.optim import (
    AdamState,
    GroupedState,
    SgdState,
    adam,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    from_torch_state_dict,
    grouped,
    sgd,
    to_torch_state_dict,
    update_and_apply,
)
from pimm_fn.schedules import cosine, one_cycle, one_cycle_momentum
from pimm_fn.tree import tree_where

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 200
TOL = 1e-5
CLIP = 1.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        return self.block(torch.relu(self.stem(x)))


def make_model():
    torch.manual_seed(0)
    return Net()


def make_batches(n):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, 6, generator=g)
        out.append((x, 3.0 * torch.tanh(x @ w) + 0.1 * torch.randn(32, 4, generator=g)))
    return out


BATCHES = make_batches(STEPS)

# name -> (torch optimizer class, its kwargs, our factory, our kwargs, keyword group settings)
CONFIGS = {
    "adamw": (
        torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05),
        adamw, dict(lr=0.01, weight_decay=0.05), dict(lr=0.002, weight_decay=0.0),
    ),
    "adam": (
        torch.optim.Adam, dict(lr=0.01, weight_decay=1e-3),
        adam, dict(lr=0.01, weight_decay=1e-3), dict(lr=0.003, weight_decay=1e-2),
    ),
    "sgd_momentum": (
        torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-4),
        sgd, dict(lr=0.05, weight_decay=1e-4), dict(lr=0.02, weight_decay=1e-3),
    ),
    "sgd_nesterov": (
        torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
        sgd, dict(lr=0.05, nesterov=True, weight_decay=1e-4), dict(lr=0.02, weight_decay=1e-3),
    ),
}


def one_cycle_kw():
    return dict(pct_start=0.3, anneal_strategy="cos", div_factor=10.0, final_div_factor=100.0)


def build_torch(name, model, total=STEPS):
    """The seed's optimizer: default group first, then the 'block' group; OneCycleLR per group."""
    cls, kw, _, _, block = CONFIGS[name]
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if "block" not in n], "lr": kw["lr"]},
        {"params": [p for n, p in named if "block" in n], **block},
    ]
    opt = cls(groups, **kw)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[kw["lr"], block["lr"]], total_steps=total, **one_cycle_kw()
    )
    return opt, sched


def build_ours(name, total=STEPS):
    _, _, factory, kw, block = CONFIGS[name]
    cycled = "b1" if factory in (adam, adamw) else "momentum"
    kw = {**kw, cycled: one_cycle_momentum(total, pct_start=0.3, anneal_strategy="cos")}
    return chain(
        clip_by_global_norm(CLIP),
        grouped(
            factory,
            [{"keyword": "block", **block}],
            lr_schedule=lambda lr: one_cycle(total, lr, **one_cycle_kw()),
            **kw,
        ),
    )


def torch_steps(model, opt, sched, batches):
    """Run the seed's step; return the pre-clip gradient norms."""
    norms = []
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
    return norms


def grad_fn(model):
    def loss(params, x, y):
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    return torch.func.grad(loss)


def our_steps(model, update, params, opt_state, batches):
    grad = grad_fn(model)
    for x, y in batches:
        grads = grad(params, x, y)
        updates, opt_state = update(grads, opt_state, params)
        params = apply_updates(params, updates)
    return params, opt_state


def detached(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(params, model):
    return max((params[n] - p.detach()).abs().max().item() for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def torch_runs():
    """Per config: (the torch-trained model, its pre-clip grad norms per step)."""
    out = {}
    for name in CONFIGS:
        model = make_model()
        opt, sched = build_torch(name, model)
        norms = torch_steps(model, opt, sched, BATCHES)
        out[name] = (model, norms)
    return out


@pytest.fixture(scope="module")
def compiled_updates():
    """One fullgraph-compiled update per config, shared by the tests below."""
    return {
        name: torch.compile(build_ours(name).update, fullgraph=True, dynamic=False)
        for name in CONFIGS
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_torch_optim_eager(name, torch_runs):
    ref, norms = torch_runs[name]
    # The setting must exercise clipping both ways, or the clip comparison means nothing.
    assert min(norms) < CLIP < max(norms), (min(norms), max(norms))
    tx = build_ours(name)
    model = make_model()
    params = detached(model)
    out, state = our_steps(model, tx.update, params, tx.init(params), BATCHES)
    assert max_diff(out, ref) <= TOL
    # The run moved the params far more than the tolerance.
    assert max_diff(params, ref) > 100 * TOL
    assert int(state[1].groups["default"].count) == STEPS


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_torch_optim_compiled(name, torch_runs, compiled_updates):
    ref, _ = torch_runs[name]
    update = compiled_updates[name]
    model = make_model()
    params = detached(model)
    tx = build_ours(name)
    grad = grad_fn(model)
    state = tx.init(params)
    # The first call compiles; after it, a changing count must not recompile (no Python
    # scalar may leak into a guard).
    x, y = BATCHES[0]
    grads = grad(params, x, y)
    updates, state = update(grads, state, params)
    params = apply_updates(params, updates)
    with torch._dynamo.config.patch(error_on_recompile=True):
        params, state = our_steps(model, update, params, state, BATCHES[1:])
    assert max_diff(params, ref) <= TOL


def test_amsgrad_and_constant_lr_match_torch():
    model_t, model = make_model(), make_model()
    opt = torch.optim.AdamW(model_t.parameters(), lr=0.01, weight_decay=0.1, amsgrad=True)
    for x, y in BATCHES[:80]:
        opt.zero_grad()
        nn.functional.mse_loss(model_t(x), y).backward()
        opt.step()
    tx = adamw(0.01, weight_decay=0.1, amsgrad=True)
    params = detached(model)
    out, _ = our_steps(model, tx.update, params, tx.init(params), BATCHES[:80])
    assert max_diff(out, model_t) <= TOL


def test_sgd_dampening_matches_torch():
    # With dampening the first step must take the raw gradient as the buffer, as torch does.
    model_t, model = make_model(), make_model()
    opt = torch.optim.SGD(model_t.parameters(), lr=0.05, momentum=0.9, dampening=0.5)
    for x, y in BATCHES[:30]:
        opt.zero_grad()
        nn.functional.mse_loss(model_t(x), y).backward()
        opt.step()
    tx = sgd(0.05, momentum=0.9, dampening=0.5)
    params = detached(model)
    out, _ = our_steps(model, tx.update, params, tx.init(params), BATCHES[:30])
    assert max_diff(out, model_t) <= TOL


def test_hyperparams_report_each_group():
    tx = build_ours("adamw")
    params = detached(make_model())
    state = tx.init(params)
    hp = tx.hyperparams(state)
    assert set(hp) == {"lr/default", "lr/block", "b1/default", "b1/block"}
    assert float(hp["lr/default"]) == pytest.approx(0.01 / 10, rel=1e-6)
    assert float(hp["lr/block"]) == pytest.approx(0.002 / 10, rel=1e-6)
    assert float(hp["b1/block"]) == pytest.approx(0.95, rel=1e-6)
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in hp.values())
    tx = sgd(0.1, momentum=0.9)
    assert set(tx.hyperparams(tx.init(params))) == {"lr"}


def test_groups_follow_first_keyword_match():
    names = ["stem.weight", "block.0.weight", "block.0.norm.weight", "head.norm.bias"]
    params = {n: torch.zeros(2) for n in names}
    tx = grouped(sgd, [{"keyword": "norm", "lr": 0.0}, {"keyword": "block", "lr": 1.0}], lr=0.5)
    state = tx.init(params)
    assert list(state.groups) == ["default", "norm", "block"]
    assert list(state.groups["norm"].momentum or {}) == []  # no momentum buffers for sgd(m=0)
    grads = {n: torch.ones(2) for n in names}
    updates, _ = tx.update(grads, state, params)
    # The 'norm' group (lr 0) wins over 'block' for block.0.norm.weight: first match.
    assert {n: float(u[0]) for n, u in updates.items()} == {
        "stem.weight": -0.5, "block.0.weight": -1.0, "block.0.norm.weight": 0.0, "head.norm.bias": 0.0,
    }
    assert list(updates) == names  # updates come back in the params' order


def test_keyword_matching_no_parameter_is_a_clear_error():
    params = detached(make_model())
    tx = grouped(adamw, [{"keyword": "blok", "lr": 1e-3}], lr=1e-2)
    with pytest.raises(ValueError, match=r"(?s)'blok' matches no parameter.*'stem\.weight'"):
        tx.init(params)
    shadowed = grouped(adamw, [{"keyword": "block"}, {"keyword": "block.0", "name": "b0"}], lr=1e-2)
    with pytest.raises(ValueError, match=r"'block\.0'.*already claimed.*'block'"):
        shadowed.init(params)
    with pytest.raises(ValueError, match=r"has no argument.*'momentum'.*b1"):
        grouped(adamw, [{"keyword": "block", "momentum": 0.9}], lr=1e-2)
    with pytest.raises(ValueError, match="keyword"):
        grouped(adamw, [{"lr": 0.1}], lr=1e-2)


def test_update_is_pure_and_a_skipped_step_keeps_the_schedule_position():
    tx = build_ours("sgd_momentum")
    model = make_model()
    params = detached(model)
    state = tx.init(params)
    params, state = our_steps(model, tx.update, params, state, BATCHES[:3])
    grads = grad_fn(model)(params, *BATCHES[3])
    before = copy.deepcopy((grads, state, params))
    updates, new_state = tx.update(grads, state, params)
    torch.testing.assert_close((grads, state, params), before, rtol=0, atol=0)  # inputs untouched
    kept = tree_where(torch.tensor(False), new_state, state)
    assert int(kept[1].groups["block"].count) == 3
    assert float(tx.hyperparams(kept)["lr/block"]) == float(tx.hyperparams(state)["lr/block"])
    assert float(tx.hyperparams(new_state)["lr/block"]) != float(tx.hyperparams(state)["lr/block"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("factory, torch_cls", [(adamw, torch.optim.AdamW), (adam, torch.optim.Adam)],
                         ids=["adamw", "adam"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_eager_apply_gives_torch_bits_fused_or_not(factory, torch_cls, amsgrad, fused, dtype):
    """Eager on the CPU, ``apply`` with ``fused=True`` (the default) gives the params and moments of
    ``torch.optim.Adam[W](fused=True)`` bit for bit, and with ``fused=False`` those of torch's
    per-tensor default, under OneCycleLR with its momentum cycle, in float32 and float64; its
    inputs are never written."""
    model = make_model().to(dtype)
    params = detached(model)
    ref = [nn.Parameter(p.clone()) for p in params.values()]
    impl = {"fused": True} if fused else {"foreach": False}
    opt = torch_cls(ref, lr=0.01, weight_decay=0.05, amsgrad=amsgrad, **impl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=STEPS, **one_cycle_kw(),
                                                cycle_momentum=True, base_momentum=0.85, max_momentum=0.95)
    b1 = one_cycle_momentum(STEPS, 0.85, 0.95, pct_start=0.3, anneal_strategy="cos")
    tx = factory(one_cycle(STEPS, 0.01, **one_cycle_kw()), b1=b1, weight_decay=0.05, amsgrad=amsgrad, fused=fused)
    state = tx.init(params)
    g = torch.Generator().manual_seed(4)
    for _ in range(8):
        grads = {n: torch.randn(p.shape, generator=g).to(dtype) for n, p in params.items()}
        for p, grad in zip(ref, grads.values()):
            p.grad = grad.clone()
        opt.step()
        sched.step()
        before = copy.deepcopy((grads, state, params))
        params, new_state = update_and_apply(tx, grads, state, params)
        torch.testing.assert_close((grads, state), before[:2], rtol=0, atol=0)  # inputs untouched
        state = new_state
    for p, (name, got) in zip(ref, params.items()):
        torch_state = opt.state[p]
        assert torch.equal(got, p.detach()), name
        assert torch.equal(state.mu[name], torch_state["exp_avg"]), name
        assert torch.equal(state.nu[name], torch_state["exp_avg_sq"]), name
        if amsgrad:
            assert torch.equal(state.nu_max[name], torch_state["max_exp_avg_sq"]), name


def test_fused_and_separate_kernels_differ_only_in_round_off():
    """The two eager forms are different kernels (so the option is real), equal to round-off."""
    g = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(200_000, generator=g)}
    runs = []
    for fused in (True, False):
        tx = adamw(1e-3, weight_decay=0.05, fused=fused)
        p, state = params, tx.init(params)
        for _ in range(3):
            p, state = update_and_apply(tx, {"w": torch.randn(200_000, generator=g.manual_seed(6))}, state, p)
        runs.append(p["w"])
    assert not torch.equal(*runs)
    torch.testing.assert_close(*runs, rtol=1e-6, atol=1e-9)


def test_clip_matches_clip_grad_norm():
    g = torch.Generator().manual_seed(3)
    grads = {"a": torch.randn(5, 7, generator=g), "b": torch.randn(3, generator=g)}
    norm = float(torch.cat([t.flatten() for t in grads.values()]).norm())
    for max_norm in (0.5, 100.0):
        params = [nn.Parameter(torch.zeros_like(t)) for t in grads.values()]
        for p, t in zip(params, grads.values()):
            p.grad = t.clone()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        out, _ = clip_by_global_norm(max_norm).update(grads, (), None)
        for p, got in zip(params, out.values()):
            assert torch.equal(p.grad, got)
        got_norm = float(torch.cat([t.flatten() for t in out.values()]).norm())
        assert got_norm == pytest.approx(min(norm, max_norm), rel=1e-5)


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_torch_state_dict_round_trip(name):
    k, m = 60, 40
    batches = BATCHES[: k + m]
    # Reference: k + m uninterrupted torch steps.
    ref = make_model()
    opt, sched = build_torch(name, ref, total=k + m)
    torch_steps(ref, opt, sched, batches)

    # torch -> here: k torch steps, convert, m steps here.
    model = make_model()
    opt, sched = build_torch(name, model, total=k + m)
    torch_steps(model, opt, sched, batches[:k])
    tx = build_ours(name, total=k + m)
    params = detached(model)
    state = from_torch_state_dict(opt.state_dict(), tx.init(params), count=sched.last_epoch)
    out, _ = our_steps(model, tx.update, params, state, batches[k:])
    assert max_diff(out, ref) <= TOL

    # here -> torch: k steps here, convert into a fresh torch optimizer + scheduler, m torch steps.
    model = make_model()
    params = detached(model)
    params, state = our_steps(model, tx.update, params, tx.init(params), batches[:k])
    opt, sched = build_torch(name, model, total=k + m)
    opt.load_state_dict(to_torch_state_dict(state, opt, tx))
    sched.last_epoch = k  # the scheduler resumes where the transform's count is
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    torch_steps(model, opt, sched, batches[k:])
    assert max_diff(detached(model), ref) <= TOL


def test_torch_interop_structure_and_errors():
    model = make_model()
    opt, sched = build_torch("adamw", model)
    torch_steps(model, opt, sched, BATCHES[:5])
    tx = build_ours("adamw")
    params = detached(model)
    state = from_torch_state_dict(opt.state_dict(), tx.init(params))
    sub = state[1].groups["block"]
    assert isinstance(sub, AdamState) and int(sub.count) == 5
    assert torch.equal(sub.mu["block.2.bias"], opt.state[model.block[2].bias]["exp_avg"])
    # And back: the same tensors under torch's indices.
    sd = to_torch_state_dict(state, opt, tx)
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in opt.state_dict()["param_groups"]]
    for idx, entry in opt.state_dict()["state"].items():
        assert torch.equal(sd["state"][idx]["exp_avg_sq"], entry["exp_avg_sq"])
        assert float(sd["state"][idx]["step"]) == 5.0

    # Mismatches fail loudly.
    with pytest.raises(ValueError, match="2 param groups but this state has 1"):
        single = adamw(0.01)
        from_torch_state_dict(opt.state_dict(), single.init(params))
    sopt, ssched = build_torch("sgd_momentum", model)
    torch_steps(model, sopt, ssched, BATCHES[:2])
    stx = build_ours("sgd_momentum")
    with pytest.raises(ValueError, match="does not save its step count"):
        from_torch_state_dict(sopt.state_dict(), stx.init(params))
    sstate = from_torch_state_dict(sopt.state_dict(), stx.init(params), count=2)
    assert isinstance(sstate[1].groups["default"], SgdState)
    assert isinstance(sstate[1], GroupedState)


@pytest.mark.parametrize("make, says", [
    (lambda: adamw(1e-3, b1=1.0), r"b1 must be in \[0.0, 1.0\), got 1.0"),
    (lambda: adam(1e-3, b1=-0.1), r"b1 must be in \[0.0, 1.0\)"),
    (lambda: sgd(0.1, momentum=-1), "momentum must be >= 0.0"),
    (lambda: adamw(one_cycle(10, -0.1)), "lr must be >= 0.0 throughout: its schedule gives -0.004.* at step 0"),
    (lambda: sgd(cosine(10, -1.0)), "lr must be >= 0.0 throughout"),
])
def test_out_of_range_hyperparameters_are_refused_as_torch_refuses_them(make, says):
    # torch.optim checks lr >= 0 and 0 <= beta1 < 1; a schedule of negative learning rates
    # would silently ascend the loss.
    with pytest.raises(ValueError, match=says):
        make()


def test_a_schedule_that_returns_a_number_is_named():
    with pytest.raises(TypeError, match="lr: a schedule returns a 0-dim tensor of the step, got float"):
        adamw(lambda count: 1e-3)
