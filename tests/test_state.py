"""TrainState: one copy of the weights, eval mode without mutation, subclasses, replace."""
import gc
import threading
import types
import warnings

import attrs
import optree
import pytest
import torch
from torch import nn

from pimm_fn import checkpoint as ck
from pimm_fn.optim import adamw, sgd
from pimm_fn.state import TrainState, structure_only
from pimm_fn.steps import supervised
from pimm_fn.steps.common import eval_forward
from pimm_fn.tree import NAMESPACE, tree_leaves, tree_map


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, batch):
        logits = self.fc2(torch.relu(self.bn(self.fc1(batch["x"]))))
        out = {"logits": logits}
        if "y" in batch:
            out["loss"] = nn.functional.cross_entropy(logits, batch["y"])
        return out


def _batch(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 6, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def _real_tensors(root) -> dict:
    """storage pointer -> bytes of every non-meta tensor reachable from ``root`` (through
    containers, instances, closures; not through classes, modules or function globals)."""
    found, seen, todo = {}, set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
            todo.extend(vars(obj).values())  # a Parameter's attributes; not its grad_fn graph
            continue
        if isinstance(obj, types.FunctionType):
            todo.extend(c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None)
            todo.extend(obj.__defaults__ or ())
            continue
        todo.extend(gc.get_referents(obj))
    return found


def _nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor))


def test_the_state_holds_one_copy_of_the_weights():
    model = Net()
    weights = _nbytes([*model.parameters(), *model.buffers()])
    state = TrainState.create(model, sgd(0.1))
    del model
    gc.collect()
    resident = _real_tensors(state)
    leaves = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
    # nothing but the state's own leaves, and the optimizer's numbers (pimm_fn.hyper: lr, momentum)
    hyper = _real_tensors(state.tx)
    assert sum(hyper.values()) <= 64 and set(hyper).isdisjoint(_real_tensors(leaves))
    assert sum(resident.values()) == _nbytes(leaves) + sum(hyper.values())
    assert _nbytes([*state.params.values(), *state.buffers.values()]) == weights
    assert _real_tensors(state.model) == {}  # the module is structure only
    assert all(t.device.type == "meta" for t in (*state.model.parameters(), *state.model.buffers()))


def test_the_users_module_is_untouched_and_the_step_reads_the_state():
    model = Net()
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    state = TrainState.create(model, adamw(1e-2))
    assert state.model is not model and model.fc1.weight.device.type == "cpu"
    trained, metrics = supervised()(state, _batch())
    for k, v in model.state_dict().items():
        assert v.data_ptr() == before[k][0] and torch.equal(v, before[k][1])
    # the same numbers as a step over a state whose module is the live one
    live = state.replace(model=model)
    reference, ref_metrics = supervised()(live, _batch())
    torch.testing.assert_close(metrics["loss"], ref_metrics["loss"], rtol=0, atol=0)
    for k in trained.params:
        assert torch.equal(trained.params[k], reference.params[k])


def test_tied_weights_stay_tied_and_constants_stay_real():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight
            self.offset = torch.full((4,), 0.5)  # a plain attribute the forward reads

        def forward(self, batch):
            logits = self.head(self.embed(batch["t"]) + self.offset)
            return {"loss": nn.functional.cross_entropy(logits, batch["t"])}

    model = Tied()
    state = TrainState.create(model, sgd(0.1))
    assert list(state.params) == ["embed.weight"]
    assert state.model.head.weight is state.model.embed.weight and state.model.head.weight.is_meta
    assert torch.equal(state.model.offset, model.offset)
    new, metrics = supervised()(state, {"t": torch.tensor([0, 1, 2, 3])})
    assert torch.isfinite(metrics["loss"]) and not torch.equal(new.params["embed.weight"], model.embed.weight)


def test_a_module_that_cannot_be_copied_is_named():
    class Locked(Net):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()

    with pytest.raises(TypeError, match="Locked could not be copied"):
        TrainState.create(Locked(), sgd(0.1))


def test_eval_forward_switches_no_module():
    torch.manual_seed(0)
    model = Net()
    state = TrainState.create(model, sgd(0.1))
    state, _ = supervised()(state, _batch())  # running statistics move away from their init
    evaluating = state.eval_model  # built once, from the train handle as it is now
    seen = []

    def hook(module, args):
        seen.append(module.training)

    state.model.bn.register_forward_pre_hook(hook)
    evaluating.bn.register_forward_pre_hook(hook)
    out = eval_forward(state, {"x": _batch(1)["x"]})
    assert seen == [False]  # the eval handle ran, in eval mode
    assert state.model.training and state.model.bn.training  # the train handle: not called, not flipped
    assert not state.eval_model.training and not state.eval_model.bn.training
    assert state.eval_model is state.replace(step=state.step + 1).eval_model  # one eval copy per module
    model.load_state_dict({**state.params, **state.buffers})
    expected = model.eval()(_batch(1))["logits"]
    torch.testing.assert_close(out["logits"], expected, rtol=0, atol=0)


def test_structure_only_keeps_a_compiled_module_compiled():
    from pimm_fn.torch_compat import is_compiled_module

    compiled = torch.compile(Net(), backend="eager")
    copy = structure_only(compiled)
    assert is_compiled_module(copy) and copy is not compiled
    assert all(p.is_meta for p in copy.parameters())
    assert all(not p.is_meta for p in compiled.parameters())


@attrs.frozen(slots=False, eq=False)
class EmaState(TrainState):
    """A subclass with a field of its own."""

    ema: dict = attrs.field(factory=dict)


def test_a_subclass_survives_replace_tree_maps_and_checkpoints(tmp_path):
    state = EmaState.create(Net(), adamw(1e-2), seed=3)
    state = state.replace(ema={k: v.clone() + 1 for k, v in state.params.items()})
    assert type(state) is EmaState and set(state.ema) == set(state.params)
    moved = tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) and t.is_floating_point() else t, state)
    assert type(moved) is EmaState and torch.equal(moved.ema["fc1.weight"], state.ema["fc1.weight"] * 2)
    leaves, treedef = optree.tree_flatten(state, namespace=NAMESPACE)
    back = optree.tree_unflatten(treedef, leaves)
    assert type(back) is EmaState and back.model is state.model and back.ema["fc2.bias"] is state.ema["fc2.bias"]
    path = ck.save(tmp_path / "ema.ckpt", state)
    like = EmaState.create(Net(), adamw(1e-2)).replace(ema={k: torch.zeros_like(v) for k, v in state.params.items()})
    restored, _ = ck.restore(path, like)
    assert type(restored) is EmaState and restored.rng == state.rng
    assert all(torch.equal(restored.ema[k], state.ema[k]) for k in state.ema)


def test_a_slotted_subclass_is_refused_when_defined():
    with pytest.raises(TypeError, match="slots=False"):
        @attrs.frozen(slots=True)
        class Slotted(TrainState):
            ema: dict = attrs.field(factory=dict)


def test_replace_names_unknown_fields():
    state = TrainState.create(Net(), sgd(0.1))
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['stpe'\]"):
        state.replace(stpe=1)
    cursor = state.cursor.replace(position=4)
    assert (cursor.position, state.cursor.position) == (4, 0)


def test_a_subclass_survives_a_step():
    state = EmaState.create(Net(), sgd(0.1)).replace(ema={"n": torch.zeros(())})
    new, _ = supervised()(state, _batch())
    assert type(new) is EmaState and new.ema["n"] is state.ema["n"] and int(new.step) == 1


@pytest.mark.parametrize("wrong, says", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "got torch's SGD, which keeps its state inside"),
    (lambda m: adamw, r"got the function adamw, not an optimizer: call it, e.g. pimm_fn.optim.adamw\(1e-3\)"),
    (lambda m: None, "needs an optimizer such as pimm_fn.optim.adamw"),
])
def test_create_names_a_wrong_optimizer(wrong, says):
    model = Net()
    with pytest.raises(TypeError, match=says):
        TrainState.create(model, wrong(model))


def test_parameters_with_requires_grad_off_warn_unless_frozen():
    from pimm_fn import optim

    model = Net()
    model.fc1.weight.requires_grad_(False)
    model.fc1.bias.requires_grad_(False)
    # torch's optimizers skip them; pimm_fn would train them: say so, and how to freeze them
    with pytest.warns(UserWarning, match=r"2 parameters of Net have requires_grad=False \('fc1.bias', 'fc1.weight'\)"
                                         ".*pimm_fn.optim.freeze") as w:
        TrainState.create(model, adamw(1e-3))
    assert w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainState.create(model, optim.freeze(adamw(1e-3), "fc1."))  # frozen as torch would: no warning


@pytest.mark.parametrize("kw, says", [
    (dict(seed=None), "seed must be an int, got None"),
    (dict(seed=1.7), "seed must be an int, got 1.7"),
    (dict(data_seed=2.0), "data_seed must be an int"),
    (dict(loss_scale="yes"), "loss_scale must be None, True, False or a LossScaleState"),
])
def test_create_names_wrong_seeds_and_loss_scales(kw, says):
    with pytest.raises(TypeError, match=says):
        TrainState.create(Net(), adamw(1e-3), **kw)


def test_replacing_params_with_other_names_is_refused_with_the_names():
    from pimm_fn import optim
    from pimm_fn.models import MLPClassifier

    state = TrainState.create(MLPClassifier(4, 3, hidden=(8,)), optim.adamw(1e-3), seed=0)
    params = dict(state.params)
    first = next(iter(params))
    dropped = {k: v for k, v in params.items() if k != first}
    with pytest.raises(ValueError, match=rf"missing \['{first}'\].*TrainState.create"):
        state.replace(params=dropped)
    with pytest.raises(ValueError, match=r"not in the state \['extra'\]"):
        state.replace(params={**params, "extra": torch.zeros(1)})
    same = state.replace(params={k: v + 1 for k, v in params.items()})  # new values, same names: fine
    assert same.params.keys() == params.keys()
    # model surgery: new params with their own optimizer state in one call keep step, rng, cursor
    grown = {**params, "extra": torch.zeros(1)}
    swapped = state.replace(params=grown, opt_state=state.tx.init(grown))
    assert "extra" in swapped.params and swapped.rng == state.rng
