"""Device placement on CPU: TrainState.create's device, to_device / DeviceLoader, device errors.

The CUDA side of the same contracts (non-blocking copies, a state on cuda:0) is in
tests/test_cuda.py; here the logic runs on "cpu" and "meta" (a device with no data, so a
state can be made "elsewhere" than the CPU without a GPU).
"""
from collections import namedtuple

import pytest
import torch

from pimm_fn import optim
from pimm_fn.amp import init_loss_scale
from pimm_fn.data import DeviceLoader, batch_devices, check_batch_device, to_device
from pimm_fn.data.collate import collate
from pimm_fn.data.loaders import build_train_loader
from pimm_fn.fit.source import _Source
from pimm_fn.state import TrainState, check_one_device, model_device
from pimm_fn.steps import supervised
from pimm_fn.tree import tree_leaves

CUDA = torch.cuda.is_available()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.bn = torch.nn.BatchNorm1d(2)

    def forward(self, batch):
        out = self.bn(self.lin(batch["x"]))
        return {"loss": ((out - batch["y"]) ** 2).mean()}


def _devices(state):
    tensors = tree_leaves((state.step, state.params, state.buffers, state.opt_state, state.loss_scale, state.extra))
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    return {t.device.type for t in tensors}, len(tensors)


def test_create_puts_every_tensor_on_the_models_device():
    state = TrainState.create(Net(), optim.adamw(1e-3), loss_scale=True)
    types, n = _devices(state)
    assert types == {"cpu"} and n > 10  # params, buffers, adam moments, count, scale, tracker, step
    assert state.device == torch.device("cpu")


def test_create_with_device_copies_everything_there_and_leaves_the_model():
    model = Net()
    extra = {"ref": {"w": torch.ones(2)}, "note": "kept"}
    state = TrainState.create(model, optim.adamw(1e-3), loss_scale=True, device="meta", extra=extra)
    types, _ = _devices(state)
    assert types == {"meta"}
    assert state.loss_scale.scale.device.type == "meta" and state.loss_scale.growth_tracker.device.type == "meta"
    assert state.extra["note"] == "kept"
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model was not moved
    assert state.rng.seed == 0 and state.cursor.epoch == 0  # host ints: no device


def test_a_ready_loss_scale_moves_with_the_state():
    ls = init_loss_scale(1024.0)  # made on the CPU
    state = TrainState.create(Net(), optim.sgd(0.1), loss_scale=ls, device="meta")
    assert state.loss_scale.scale.device.type == "meta"
    on_cpu = TrainState.create(Net(), optim.sgd(0.1), loss_scale=ls)
    assert float(on_cpu.loss_scale.scale) == 1024.0


def test_create_copies_not_aliases_on_the_same_device():
    model = Net()
    state = TrainState.create(model, optim.sgd(0.1), device="cpu")
    with torch.no_grad():
        model.lin.weight.add_(1.0)
    assert not torch.equal(state.params["lin.weight"], model.lin.weight)


def test_a_model_split_over_devices_is_an_error_naming_the_fix():
    model = Net()
    model.bn.to("meta")
    with pytest.raises(ValueError, match=r"2 devices.*bn\.weight.*model\.to\(device\)"):
        TrainState.create(model, optim.sgd(0.1))
    assert model_device(model.lin) == torch.device("cpu")
    # Given a device, the split model is gathered onto it.
    assert _devices(TrainState.create(model, optim.sgd(0.1), device="meta"))[0] == {"meta"}


def test_state_tensors_off_device_are_named():
    state = TrainState.create(Net(), optim.adamw(1e-3), device="meta")
    bad = state.replace(opt_state=state.opt_state._replace(count=torch.zeros((), dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"1 are not \(state\.opt_state\.count on cpu\)"):
        check_one_device(bad, torch.device("meta"))
    check_one_device(state, torch.device("meta"))  # a consistent state passes


def test_to_device_nested_and_passthrough():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.ones(2, 3), "parts": [torch.zeros(2), (torch.arange(3), "name")],
             "pair": Pair(torch.ones(1), 7), "meta": {"id": "s1", "n": 3, "none": None}}
    moved = to_device(batch, "meta")
    assert moved["x"].device.type == "meta" and moved["x"].shape == (2, 3)
    assert moved["parts"][0].device.type == "meta" and moved["parts"][1][0].device.type == "meta"
    assert isinstance(moved["parts"], list) and isinstance(moved["parts"][1], tuple)
    assert moved["parts"][1][1] == "name"
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.device.type == "meta" and moved["pair"].b == 7
    assert moved["meta"] == {"id": "s1", "n": 3, "none": None}
    assert batch["x"].device.type == "cpu"  # the input batch is not changed
    same = to_device(batch, "cpu")
    assert same["x"] is batch["x"]  # already there: no copy


def test_to_device_pins_only_for_cuda_targets():
    # Pinning needs a CUDA driver; to a non-CUDA target it is never attempted (no error
    # on a CPU-only build even with pin_memory=True).
    out = to_device({"x": torch.ones(4)}, "meta", pin_memory=True)
    assert out["x"].device.type == "meta"


@pytest.mark.skipif(not CUDA, reason="pinned host memory needs CUDA (torch.cuda.is_available() is False)")
def test_to_device_pins_and_copies_to_cuda():
    x = torch.randn(64)
    out = to_device({"x": x}, "cuda")
    torch.cuda.synchronize()
    assert out["x"].is_cuda and torch.equal(out["x"].cpu(), x)
    back = to_device(out, "cpu")
    assert back["x"].device.type == "cpu" and torch.equal(back["x"], x)


def test_device_loader_wraps_the_protocol_and_plain_iterables():
    data = [{"x": torch.randn(1, 3), "y": torch.randn(1, 2)} for _ in range(8)]
    inner = build_train_loader(data, batch_size=2, seed=0, pin_memory=False, collate_fn=collate)
    loader = DeviceLoader(inner, "meta")
    assert len(loader) == len(inner) and loader.batch_size == 2 and loader.world_size == 1
    got = list(loader.iter_epoch(0, 1))
    want = list(inner.iter_epoch(0, 1))
    assert len(got) == len(want) == len(inner) - 1
    assert all(b["coord" if "coord" in b else next(iter(b))].device.type == "meta" for b in got)
    assert loader.samples_in(got[0]) == inner.samples_in(want[0])
    assert loader.state_dict()["position"] == inner.state_dict()["position"]
    assert _Source(loader, None).protocol  # fit drives it through iter_epoch
    plain = DeviceLoader([{"x": torch.ones(2)}, {"x": torch.zeros(2)}], "meta")
    assert not _Source(plain, None).protocol  # a plain list stays a plain iterable
    assert [b["x"].device.type for b in plain] == ["meta", "meta"] and len(plain) == 2
    assert DeviceLoader(loader, "cpu").loader is inner  # no double wrapping


def test_build_train_loader_device_option_wraps():
    data = [{"x": torch.randn(1, 3), "y": torch.randn(1, 2)} for _ in range(4)]
    loader = build_train_loader(data, batch_size=2, device="meta", pin_memory=False, collate_fn=collate)
    assert isinstance(loader, DeviceLoader) and loader.device.type == "meta"
    assert next(iter(loader.iter_epoch(0, 0)))["x"].device.type == "meta"
    assert not isinstance(build_train_loader(data, batch_size=2, collate_fn=collate), DeviceLoader)
    # the CPU needs no copies: device="cpu" (a CPU run's ctx.device) gives the loader itself
    assert not isinstance(build_train_loader(data, batch_size=2, collate_fn=collate, device="cpu"), DeviceLoader)


def test_check_batch_device_names_tensor_and_fix():
    batch = {"x": torch.ones(2, 3), "y": [torch.ones(2)], "scale": torch.tensor(2.0)}
    assert [p for p, _ in batch_devices(batch)] == ["'x'", "'y'[0]"]  # 0-dim tensors mix freely
    with pytest.raises(ValueError, match=r"another device than the state \(meta\): 'x' on cpu.*DeviceLoader"):
        check_batch_device(batch, "meta")
    check_batch_device(batch, "cpu")


def test_a_step_on_a_batch_on_another_device_names_the_fix():
    state = TrainState.create(Net(), optim.sgd(0.1), device="meta")
    batch = {"x": torch.randn(4, 3), "y": torch.randn(4, 2)}
    with pytest.raises(ValueError, match=r"another device than the state \(meta\).*to_device") as info:
        supervised()(state, batch)
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's own error stays attached


def test_a_compiled_step_checks_the_first_batch_device_before_tracing():
    from pimm_fn.compile import compile_step

    state = TrainState.create(Net(), optim.sgd(0.1), device="meta")
    step = compile_step(supervised())
    with pytest.raises(ValueError, match=r"another device than the state \(meta\): 'x' on cpu, 'y' on cpu"):
        step(state, {"x": torch.randn(4, 3), "y": torch.randn(4, 2)})
    assert step.compile_count == 0  # refused before dynamo traced anything


def test_off_device_paths_name_nested_entries():
    state = TrainState.create(Net(), optim.adamw(1e-3), device="meta")
    mu = dict(state.opt_state.mu)
    mu["lin.weight"] = torch.zeros(2, 3)
    bad = state.replace(opt_state=state.opt_state._replace(mu=mu), extra={"ref": {"w": torch.ones(1)}})
    with pytest.raises(ValueError, match=r"2 are not \(state\.extra\['ref'\]\['w'\] on cpu; "
                                         r"state\.opt_state\.mu\['lin\.weight'\] on cpu\)"):
        check_one_device(bad, torch.device("meta"))
