"""optim.freeze: a frozen backbone under the supervised step, against torch with requires_grad=False."""

import pytest
import torch
from torch import nn

from pimm_fn import checkpoint as ck
from pimm_fn import optim, schedules
from pimm_fn.compile import compile_step
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised
from pimm_fn.steps.common import forward_backward
from pimm_fn.tree import tree_leaves

pytestmark = pytest.mark.usefixtures("one_thread")

TOTAL = 30
CLIP = 0.25
FROZEN = "backbone."


class Net(nn.Module):
    """A backbone (with BatchNorm, whose running statistics still update when frozen) and a head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(),
                                      nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, batch):
        logits = self.head(self.backbone(batch["x"]))
        return {"loss": nn.functional.cross_entropy(logits, batch["y"])}


def make_model(seed=0):
    torch.manual_seed(seed)
    return Net()


def make_batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(32, 6, generator=g), "y": torch.randint(0, 4, (32,), generator=g)} for _ in range(n)]


BATCHES = make_batches(TOTAL)


def make_tx(grouped=False):
    lr = schedules.one_cycle(total_steps=TOTAL, max_lr=0.01, pct_start=0.3)
    b1 = schedules.one_cycle_momentum(total_steps=TOTAL, pct_start=0.3)
    if not grouped:
        return optim.freeze(optim.adamw(lr=lr, b1=b1, weight_decay=0.05), FROZEN)
    inner = optim.grouped(optim.adamw, [{"keyword": "head.2", "lr": 0.003, "weight_decay": 0.0}],
                          lr_schedule=lambda m: schedules.one_cycle(total_steps=TOTAL, max_lr=m, pct_start=0.3),
                          lr=0.01, b1=b1, weight_decay=0.05)
    return optim.freeze(inner, FROZEN)


def torch_run(model, batches, grouped=False):
    """Pointcept's way: frozen params have requires_grad=False and are not in the optimizer."""
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith(FROZEN))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if grouped:
        groups = [{"params": [p for n, p in named if "head.2" not in n], "lr": 0.01},
                  {"params": [p for n, p in named if "head.2" in n], "lr": 0.003, "weight_decay": 0.0}]
        max_lr = [0.01, 0.003]
    else:
        groups, max_lr = [p for _, p in named], 0.01
    opt = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=TOTAL, pct_start=0.3)
    model.train()
    norms = []
    for b in batches:
        out = model(b)
        opt.zero_grad()
        out["loss"].backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))  # skips grad-less params
        opt.step()
        sched.step()
    return norms


@pytest.fixture(scope="module")
def reference():
    model = make_model()
    norms = torch_run(model, BATCHES)
    return model, norms


@pytest.fixture(scope="module")
def compiled_step():
    return compile_step(supervised(clip_grad=CLIP))


def check_against(state, ref_model, initial, tol):
    for n, p in ref_model.named_parameters():
        if n.startswith(FROZEN):
            assert torch.equal(state.params[n], initial[n]), f"frozen {n} changed"
            assert torch.equal(p.detach(), initial[n])
        else:
            assert (state.params[n] - p.detach()).abs().max() <= tol, n
            assert not torch.equal(state.params[n], initial[n]), f"trainable {n} did not move"
    for n, b in ref_model.named_buffers():
        assert torch.allclose(state.buffers[n].float(), b.float(), atol=1e-5), n


def run(step, state, batches):
    norms = []
    for b in batches:
        state, m = step(state, b)
        norms.append(float(m["grad_norm"]))
    return state, norms


def test_frozen_backbone_matches_torch_requires_grad_false_eager(reference):
    ref_model, ref_norms = reference
    assert min(ref_norms) < CLIP < max(ref_norms)  # clipping binds on some steps, not all
    state = TrainState.create(make_model(), make_tx())
    initial = {k: v.clone() for k, v in state.params.items()}
    # No optimizer state for a frozen param.
    assert not any(k.startswith(FROZEN) for k in state.opt_state.mu)
    assert sorted(state.opt_state.mu) == sorted(k for k in initial if not k.startswith(FROZEN))
    state, norms = run(supervised(clip_grad=CLIP), state, BATCHES)
    # The gradient norm (clipping's) covers the trainable params only, as torch's does.
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    check_against(state, ref_model, initial, tol=1e-6)


def test_frozen_backbone_matches_torch_compiled(reference, compiled_step):
    ref_model, _ = reference
    state = TrainState.create(make_model(), make_tx())
    initial = {k: v.clone() for k, v in state.params.items()}
    state, _ = run(compiled_step, state, BATCHES)
    assert compiled_step.compile_count == 1, compiled_step.recompile_reasons
    check_against(state, ref_model, initial, tol=1e-5)


def test_frozen_backbone_with_param_groups_matches_torch():
    ref_model = make_model()
    torch_run(ref_model, BATCHES, grouped=True)
    state = TrainState.create(make_model(), make_tx(grouped=True))
    assert list(state.opt_state.groups) == ["default", "head.2"]
    assert sorted(state.opt_state.groups["default"].mu) == ["head.0.bias", "head.0.weight"]
    initial = {k: v.clone() for k, v in state.params.items()}
    state, _ = run(supervised(clip_grad=CLIP), state, BATCHES)
    check_against(state, ref_model, initial, tol=1e-6)
    assert set(state.tx.hyperparams(state.opt_state)) == {"lr/default", "lr/head.2", "b1/default", "b1/head.2"}


def test_checkpoint_round_trip_continues_bitwise(tmp_path):
    step = supervised(clip_grad=CLIP)
    whole, _ = run(step, TrainState.create(make_model(), make_tx()), BATCHES[:8])
    half, _ = run(step, TrainState.create(make_model(), make_tx()), BATCHES[:4])
    path = ck.save(tmp_path / "half.ckpt", half)
    restored, _ = ck.restore(path, TrainState.create(make_model(seed=5), make_tx()))
    resumed, _ = run(step, restored, BATCHES[4:8])
    assert not any(k.startswith(FROZEN) for k in restored.opt_state.mu)
    for a, b in zip(tree_leaves((resumed.params, resumed.opt_state, resumed.buffers)),
                    tree_leaves((whole.params, whole.opt_state, whole.buffers))):
        assert torch.equal(a, b)


def test_torch_optimizer_state_round_trip():
    """The state lines up with a torch optimizer built over the requires_grad params."""
    ref = make_model()
    for n, p in ref.named_parameters():
        p.requires_grad_(not n.startswith(FROZEN))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.01)
    for b in BATCHES[:3]:
        opt.zero_grad()
        ref(b)["loss"].backward()
        opt.step()
    tx = optim.freeze(optim.adamw(0.01), FROZEN)
    params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    state = optim.from_torch_state_dict(opt.state_dict(), tx.init(params))
    assert int(state.count) == 3
    assert torch.equal(state.mu["head.2.bias"], opt.state[ref.head[2].bias]["exp_avg"])
    back = optim.to_torch_state_dict(state, opt, tx)
    assert torch.equal(back["state"][0]["exp_avg_sq"], opt.state_dict()["state"][0]["exp_avg_sq"])


def test_update_path_keeps_frozen_bitwise_and_ignores_their_gradients():
    params = {"backbone.w": torch.tensor([-0.0, 0.0, 1.5, float("nan")]), "head.w": torch.ones(3)}
    grads = {"backbone.w": torch.full((4,), 7.0), "head.w": torch.ones(3)}
    for inner in (optim.adamw(0.1, weight_decay=0.5), optim.sgd(0.1, momentum=0.9, weight_decay=0.5),
                  optim.chain(optim.clip_by_global_norm(1.0), optim.adam(0.1))):
        tx = optim.freeze(inner, ["backbone"])
        state = tx.init(params)
        updates, _ = tx.update(grads, state, params)
        assert torch.signbit(updates["backbone.w"]).all() and (updates["backbone.w"] == 0).all()  # -0.0
        new = optim.apply_updates(params, updates)
        assert torch.equal(torch.signbit(new["backbone.w"]), torch.signbit(params["backbone.w"]))
        torch.testing.assert_close(new["backbone.w"], params["backbone.w"], rtol=0, atol=0, equal_nan=True)
        fused, _ = optim.update_and_apply(tx, {"head.w": grads["head.w"]}, state, params)  # no frozen grad needed
        assert fused["backbone.w"] is params["backbone.w"]
        assert not torch.equal(fused["head.w"], params["head.w"])
        torch.testing.assert_close(fused["head.w"], new["head.w"])
    assert optim.frozen_names(tx, params) == {"backbone.w"}
    assert optim.frozen_names(optim.adamw(0.1), params) == frozenset()
    # A freeze inside a freeze: both sets count, and neither needs its gradients.
    three = {**params, "neck.w": torch.full((2,), 2.0)}
    nested = optim.freeze(optim.freeze(optim.adamw(0.1), "neck."), "backbone.")
    assert optim.frozen_names(nested, three) == {"backbone.w", "neck.w"}
    new, _ = optim.update_and_apply(nested, {"head.w": grads["head.w"]}, nested.init(three), three)
    assert new["neck.w"] is three["neck.w"] and new["backbone.w"] is three["backbone.w"]
    with pytest.raises(KeyError, match=r"no gradient for trainable param\(s\) 'head\.w'"):
        optim.update_and_apply(nested, {}, nested.init(three), three)


def test_steps_compute_no_gradient_for_frozen_params():
    model = make_model()
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    frozen = optim.frozen_names(make_tx(), params)
    assert frozen == {n for n in params if n.startswith(FROZEN)}
    _, _, grads, _ = forward_backward(model, params, buffers, BATCHES[0], frozen=frozen)
    assert sorted(grads) == sorted(set(params) - frozen)
    _, _, all_grads, _ = forward_backward(model, params, buffers, BATCHES[0])
    for k, g in grads.items():
        assert torch.equal(g, all_grads[k])


def test_frozen_choices_and_clear_errors():
    names = ["backbone.0.weight", "backbone.1.bias", "head.0.weight", "head.0.bias"]
    params = {n: torch.zeros(2) for n in names}
    backbone = {"backbone.0.weight", "backbone.1.bias"}
    assert optim.resolve_frozen("backbone", names) == backbone
    assert optim.resolve_frozen(["backbone.0", "bias"], names) == {
        "backbone.0.weight", "backbone.1.bias", "head.0.bias"}
    assert optim.resolve_frozen(lambda n: n.startswith("backbone."), names) == backbone
    assert optim.resolve_frozen({n: n in backbone for n in names}, names) == backbone
    with pytest.raises(ValueError, match=r"(?s)keyword 'backbon\.' matches no parameter.*'head\.0\.weight'"):
        optim.freeze(optim.adamw(0.1), "backbon.").init(params)
    typo = r"(?s)does not have: 'backbone\.0\.wieght'.*did you mean 'backbone\.0\.weight'"
    with pytest.raises(ValueError, match=typo):
        optim.resolve_frozen({"backbone.0.wieght": True, **{n: False for n in names}}, names)
    with pytest.raises(ValueError, match=r"no entry for 3 param\(s\)"):
        optim.resolve_frozen({"backbone.0.weight": True}, names)
    with pytest.raises(TypeError, match="Python bools"):
        optim.resolve_frozen({n: 1 for n in names}, names)
    with pytest.raises(ValueError, match="freezes no parameter"):
        optim.resolve_frozen(lambda n: False, names)
    with pytest.raises(ValueError, match="freezes no parameter"):
        optim.resolve_frozen({n: False for n in names}, names)
    with pytest.raises(ValueError, match="freezes every parameter"):
        optim.resolve_frozen(["backbone", "head"], names)
    with pytest.raises(ValueError, match="non-empty"):
        optim.resolve_frozen(["backbone", ""], names)
    with pytest.raises(TypeError, match="predicate on param names"):
        optim.resolve_frozen(3, names)
