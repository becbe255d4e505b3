"""The GPU path: state placement, batch copies, host syncs, AMP vs GradScaler, CUDA graphs.

Every test is marked ``cuda`` and skips, with the reason printed (``pytest -rs``), where
``torch.cuda.is_available()`` is False. ``scripts/gpu_check.sh`` runs them on a GPU
machine (``pytest -m cuda``). The CPU-side logic of the same contracts is in
tests/test_device.py and tests/test_compile_modes.py; two-GPU data parallelism over
nccl is tests/test_distributed_torchrun.py::test_compiled_data_parallel_step_has_zero_graph_breaks.
"""
import copy
import warnings

import pytest
import torch

from pimm_fn import optim
from pimm_fn.amp import LossScaleConfig
from pimm_fn.compile import compile_step
from pimm_fn.data import DeviceLoader, to_device
from pimm_fn.data.collate import collate
from pimm_fn.data.loaders import build_train_loader
from pimm_fn.fit import fit
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised
from pimm_fn.tree import tree_leaves

CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine"),
]
DEV = torch.device("cuda", 0)


class Net(torch.nn.Module):
    """Linear-BN-ReLU-dropout-Linear regression, Pointcept output dict."""

    def __init__(self, dropout=0.0, width=32):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(6, width, bias=False), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
            torch.nn.Dropout(dropout), torch.nn.Linear(width, 3),
        )

    def forward(self, batch):
        pred = self.body(batch["x"])
        return {"loss": torch.nn.functional.mse_loss(pred.float(), batch["y"])}


class PointNet(torch.nn.Module):
    """A per-point MLP over a variable number of points (segmentation loss per point)."""

    def __init__(self, classes=5):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))

    def forward(self, batch):
        logits = self.mlp(batch["feat"])
        return {"loss": torch.nn.functional.cross_entropy(logits.float(), batch["segment"])}


def batches(n, size=64, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    out = [{"x": torch.randn(size, 6, generator=g), "y": torch.randn(size, 3, generator=g)} for _ in range(n)]
    return [to_device(b, device) for b in out]


def point_batches(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [to_device({"feat": torch.rand(n, 3, generator=g), "segment": torch.randint(0, 5, (n,), generator=g)}, DEV)
            for n in sizes]


def state_tensors(state):
    return [t for t in tree_leaves((state.step, state.params, state.buffers, state.opt_state, state.loss_scale))
            if isinstance(t, torch.Tensor)]


class SyncCounter:
    """Count synchronizing CUDA calls (torch.cuda.set_sync_debug_mode("warn")) in a block."""

    def __enter__(self):
        torch.cuda.synchronize()
        self._w = warnings.catch_warnings(record=True)
        self.caught = self._w.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self._w.__exit__(*exc)
        self.count = sum("synchronizing" in str(w.message) for w in self.caught)
        return False


# ------------------------------------------------------------------ placement and copies
def test_state_lives_on_the_models_cuda_device():
    state = TrainState.create(Net().to(DEV), optim.adamw(1e-3), loss_scale=True)
    assert {t.device for t in state_tensors(state)} == {DEV} and len(state_tensors(state)) > 10
    moved = TrainState.create(Net(), optim.adamw(1e-3), loss_scale=True, device="cuda")
    assert {t.device.type for t in state_tensors(moved)} == {"cuda"}


def test_the_sync_counter_sees_a_sync():
    # The control for the no-sync tests below: a host read is counted.
    x = torch.ones((), device=DEV)
    with SyncCounter() as sc:
        x.item()
    assert sc.count >= 1


def test_device_loader_copies_pinned_and_non_blocking():
    data = [{"x": torch.randn(1, 6), "y": torch.randn(1, 3)} for _ in range(16)]
    inner = build_train_loader(data, batch_size=4, collate_fn=collate, pin_memory=True)
    host = next(iter(inner.iter_epoch(0, 0)))
    assert host["x"].is_pinned()  # the loader's workers (or main process) pinned it
    loader = DeviceLoader(inner, DEV)
    got = list(loader.iter_epoch(0, 0))
    assert all(b["x"].device == DEV for b in got)
    pageable = {"x": torch.randn(256, 6), "meta": "kept"}
    with SyncCounter() as sc:
        moved = to_device(pageable, DEV)  # pinned here, then copied without a host wait
    assert sc.count == 0 and moved["meta"] == "kept"
    torch.cuda.synchronize()
    assert torch.equal(moved["x"].cpu(), pageable["x"])


def test_a_batch_on_the_cpu_for_a_cuda_state_names_the_fix():
    state = TrainState.create(Net(), optim.sgd(0.1), device=DEV)
    cpu_batch = batches(1, device="cpu")[0]
    with pytest.raises(ValueError, match=r"another device than the state \(cuda:0\).*DeviceLoader"):
        supervised()(state, cpu_batch)
    with pytest.raises(ValueError, match=r"another device than the state \(cuda:0\).*to_device"):
        compile_step(supervised())(state, cpu_batch)


# ------------------------------------------------------------------ host syncs
def test_compiled_and_eager_steps_never_sync_with_the_host():
    state = TrainState.create(Net(), optim.adamw(1e-3), loss_scale=True, device=DEV)
    bs = batches(4)
    for fn in (compile_step(supervised(clip_grad=1.0)), supervised(clip_grad=1.0)):
        s, _ = fn(state, bs[0])  # the first call compiles (and may sync)
        with SyncCounter() as sc:
            for b in bs[1:]:
                s, m = fn(s, b)
        assert sc.count == 0, [str(w.message) for w in sc.caught][:3]
        assert int(s.step) == 4 and torch.isfinite(m["loss"])


def test_fit_syncs_a_fixed_number_of_times_not_per_step():
    # fit reads state.step once at the start (documented in fit.loop); its per-step path,
    # without callbacks, reads nothing from the device, so more steps add no syncs.
    step = compile_step(supervised())
    state = TrainState.create(Net(), optim.sgd(0.1), device=DEV)
    state, _ = step(state, batches(1)[0])
    counts = []
    for n in (3, 9):
        loader = DeviceLoader([{"x": torch.randn(16, 6), "y": torch.randn(16, 3)} for _ in range(n)], DEV)
        with SyncCounter() as sc:
            state = fit(state, loader, step, epochs=state.cursor.epoch + 1, block_seconds=3600.0).state
        counts.append(sc.count)
    assert counts[0] == counts[1], counts


# ------------------------------------------------------------------ AMP
def test_fp16_loss_scale_matches_grad_scaler_on_cuda_and_skips_inf_steps():
    torch.manual_seed(3)
    model = Net().to(DEV)
    reference = copy.deepcopy(model)
    bs = batches(24, seed=3)
    for t in (4, 5, 17):
        bs[t]["x"][0, 0] = float("inf")
    bs[11]["x"][1, 2] = float("nan")
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=3)
    ref_scales, ref_skipped = [], []
    for b in bs:
        opt.zero_grad()
        before = scaler.get_scale()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = reference(b)["loss"]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        ref_scales.append(before)
        ref_skipped.append(scaler.get_scale() < before)

    for step in (supervised(autocast="float16", loss_scale_config=LossScaleConfig(growth_interval=3)),
                 compile_step(supervised(autocast="float16", loss_scale_config=LossScaleConfig(growth_interval=3)))):
        state = TrainState.create(model, optim.sgd(lr=0.05, momentum=0.9), loss_scale=True)
        assert state.loss_scale.scale.device == DEV
        scales, skipped = [], []
        for b in bs:
            before = state
            state, m = step(state, b)
            scales.append(float(m["loss_scale"]))
            skipped.append(bool(m["skipped"]))
            if skipped[-1]:  # a skipped step leaves params and BN statistics exactly as they were
                assert all(torch.equal(state.params[k], before.params[k]) for k in state.params)
                assert all(torch.equal(state.buffers[k], before.buffers[k]) for k in state.buffers)
        assert scales == ref_scales
        assert skipped == ref_skipped and all(skipped[t] for t in (4, 5, 11, 17))
        assert max(scales) > 2.0**16
        for name, p in reference.named_parameters():
            torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-3, atol=1e-4)


def test_bf16_autocast_step_trains_in_fp32_master_params():
    state = TrainState.create(Net(), optim.adamw(1e-2), device=DEV)
    step = compile_step(supervised(autocast="bfloat16"))
    bs = batches(6, seed=5)
    state, m = step(state, bs[0])
    first, compiles = float(m["loss"]), step.compile_count
    for b in bs * 3:
        state, m = step(state, b)
    assert all(p.dtype == torch.float32 for p in state.params.values())
    # (compile_count counts from the first call: another step of the same code compiled
    # earlier in the process can make that first call compile twice)
    assert float(m["loss"]) < first and step.compile_count == compiles, step.recompile_reasons
    eager_state = TrainState.create(Net(), optim.adamw(1e-2), device=DEV)
    _, em = supervised(autocast="bfloat16")(eager_state, bs[0])
    assert em["loss"].dtype == torch.float32


# ------------------------------------------------------------------ CUDA graphs
def test_reduce_overhead_static_shape_matches_the_default_compile_and_keeps_old_states():
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    state0 = TrainState.create(Net(), optim.adamw(1e-2), loss_scale=True, device=DEV)
    bs = batches(6, seed=1)
    graphed = compile_step(supervised(clip_grad=1.0), mode="reduce-overhead")
    plain = compile_step(supervised(clip_grad=1.0))
    g, p = state0, state0
    kept = []
    compiles = None
    for i, b in enumerate(bs):
        g, gm = graphed(g, b)
        p, pm = plain(p, b)
        kept.append((g, {k: v.clone() for k, v in g.params.items()}))
        if i == 0:
            compiles = graphed.compile_count
    assert graphed.compile_count == compiles  # replays, no recompiles
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])  # the graph was recorded
    for k in p.params:
        torch.testing.assert_close(g.params[k], p.params[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gm["loss"], pm["loss"])
    # every state a call returned is still what it was (not overwritten by later replays)
    for st, snap in kept:
        assert all(torch.equal(st.params[k], snap[k]) for k in snap)


def test_new_hyperparameters_reuse_the_graphed_step_with_their_numbers_on_the_device():
    # The schedules' and the optimizer's numbers are made on the params' device (no CPU input
    # that would keep the step off CUDA graphs), and another peak lr or length compiles nothing.
    from torch._dynamo.utils import counters

    from pimm_fn import schedules

    counters.clear()
    step = compile_step(supervised(clip_grad=1.0), mode="reduce-overhead")
    for max_lr, total in ((1e-2, 50), (3e-3, 20)):
        tx = optim.adamw(schedules.one_cycle(total, max_lr), b1=schedules.one_cycle_momentum(total), weight_decay=0.05)
        state = eager = TrainState.create(Net(), tx, device=DEV)
        for b in batches(3, seed=2):
            state, m = step(state, b)
            eager, m_eager = supervised(clip_grad=1.0)(eager, b)
            torch.testing.assert_close(m["lr"], m_eager["lr"])
        for k in state.params:
            torch.testing.assert_close(state.params[k], eager.params[k], rtol=1e-5, atol=1e-6)
    assert step.compile_count == 1, step.recompile_reasons
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_reduce_overhead_variable_point_counts_compile_once_without_rerecording():
    from torch._dynamo.utils import counters

    counters.clear()
    state = TrainState.create(PointNet(), optim.adamw(1e-3), device=DEV)
    step = compile_step(supervised(), mode="reduce-overhead", dynamic=True)
    compiles = None
    for i, b in enumerate(point_batches([5000, 5100, 6200, 7300, 5550, 8000, 6001])):
        state, m = step(state, b)
        if i == 0:
            compiles = step.compile_count
    assert step.compile_count == compiles and torch.isfinite(m["loss"]), step.recompile_reasons
    # the dynamic graph was kept off CUDA graphs (no recording per point count)
    assert counters["inductor"]["cudagraph_skips"] >= 1, dict(counters["inductor"])


# ------------------------------------------------------------------ RNG
def test_dropout_on_cuda_is_a_function_of_the_state():
    state = TrainState.create(Net(dropout=0.5), optim.sgd(0.1), device=DEV)
    b = batches(1, seed=9)[0]
    step = compile_step(supervised())
    a1, m1 = step(state, b)
    a2, m2 = step(state, b)  # the same state: the same dropout masks
    assert torch.equal(m1["loss"], m2["loss"])
    assert all(torch.equal(a1.params[k], a2.params[k]) for k in a1.params)
    _, m3 = step(state.replace(rng=state.rng.next()), b)  # the same params, the next key: other masks
    assert not torch.equal(m1["loss"], m3["loss"])


def test_resume_on_cuda_is_bitwise(tmp_path):
    # 4 steps straight == 2 steps, save, restore into a fresh CUDA state, 2 steps: the RNG
    # key and cursor are host ints, every tensor comes back onto the like-state's device.
    from pimm_fn.checkpoint import restore, save

    def fresh():
        torch.manual_seed(0)
        return TrainState.create(Net(dropout=0.3), optim.adamw(1e-2), loss_scale=True, device=DEV)

    step = compile_step(supervised(autocast="float16"))
    bs = batches(4, seed=2)
    straight = fresh()
    for b in bs:
        straight, _ = step(straight, b)
    half = fresh()
    for b in bs[:2]:
        half, _ = step(half, b)
    save(tmp_path / "ckpt.safetensors", half)
    resumed, _ = restore(tmp_path / "ckpt.safetensors", fresh())
    assert {t.device for t in state_tensors(resumed)} == {DEV}
    for b in bs[2:]:
        resumed, _ = step(resumed, b)
    for k in straight.params:
        assert torch.equal(straight.params[k], resumed.params[k]), k
    assert torch.equal(straight.loss_scale.scale, resumed.loss_scale.scale)


def test_grpo_rollout_made_on_the_host_goes_to_the_states_device():
    # A sampler whose mask and rewards are made on the CPU (as an environment's are):
    # the step's prepare moves the rollout to the state's device before the compiled core.
    from pimm_fn.steps.grpo import Rollout, grpo

    n_obs, n_act, steps, events, group = 3, 4, 5, 2, 4

    class Policy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(n_obs, n_act)

        def log_probs(self, obs):
            return torch.log_softmax(self.lin(obs), -1)

    def sample(policy, batch, g):
        obs = batch["x"].repeat_interleave(g, 0)
        table = policy(obs)
        actions = table.argmax(-1)
        logp = table.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        mask = torch.ones(obs.shape[0], steps, dtype=torch.bool)  # host-made
        return Rollout(traj={"obs": obs, "actions": actions, "logp_old": logp, "mask": mask})

    def reward(batch, ro):
        return torch.arange(events * group, dtype=torch.float32).view(events, group)  # host-made

    torch.manual_seed(0)
    state = TrainState.create(Policy(), optim.adam(lr=0.05), device=DEV)
    step = compile_step(grpo(sample=sample, reward=reward, group_size=group, policy_updates=2))
    batch = to_device({"x": torch.randn(events, steps, n_obs)}, DEV)
    new, m = step(state, batch)
    assert new.params["lin.weight"].device == DEV and torch.isfinite(m["loss"])
    assert not torch.equal(new.params["lin.weight"], state.params["lin.weight"])


# ------------------------------------------------------------------ ops
def test_neighbour_conv_on_cuda_equals_the_cpu_and_repeats_bitwise():
    # One index_add_ per tap on CUDA (atomics): PTv3's pairs write a row once per tap, so
    # two calls give the same bits; the result equals the CPU's to rounding.
    from pimm_fn.models.serialization import CENTRE, OFF_CENTRE, neighbour_map, neighbour_pairs
    from pimm_fn.ops import neighbour_conv

    torch.manual_seed(0)
    grid = torch.unique(torch.randint(0, 12, (3000, 3)), dim=0)
    pairs = neighbour_pairs(neighbour_map(grid, torch.zeros(len(grid), dtype=torch.long)))
    x = torch.randn(len(grid), 32, requires_grad=True)
    weight = torch.randn(27, 32, 16, requires_grad=True)

    def run(device):
        xd, wd = x.detach().to(device).requires_grad_(), weight.detach().to(device).requires_grad_()
        rows = [r.to(device) for r in pairs["rows"]]
        cols = [c.to(device) for c in pairs["cols"]]
        out = neighbour_conv(xd, wd, OFF_CENTRE, rows, cols, centre=CENTRE)
        return (out, *torch.autograd.grad(out.square().sum(), [xd, wd]))

    first, second, cpu = run(DEV), run(DEV), run("cpu")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for a, b in zip(first, cpu):
        assert torch.allclose(a.cpu(), b, rtol=1e-4, atol=1e-3 * float(b.abs().max()))
