"""pimm_fn.bench: benchmark_step on a tiny step reports sane, serialisable fields."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pimm_fn.bench import BenchResult, PeakMemory, bench_main, benchmark_step, load_factory
from pimm_fn.compile import compile_step
from pimm_fn.optim.base import GradientTransformation
from pimm_fn.state import TrainState
from pimm_fn.tree import tree_map


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, batch):
        return {"loss": F.cross_entropy(self.fc(batch["x"]), batch["y"])}


def _sgd(lr=0.1):
    # A minimal transform so the test does not depend on pimm_fn.optim's transforms.
    return GradientTransformation(
        init=lambda p: {},
        update=lambda g, s, p: (tree_map(lambda x: -lr * x, g), s),
    )


def _core(state, batch):
    """A plain pure core: SGD on the tiny model (no Step wrapper)."""
    params = {k: v.detach().requires_grad_(True) for k, v in state.params.items()}
    out = torch.func.functional_call(state.model, (params, state.buffers), (batch,))
    grads = torch.autograd.grad(out["loss"], list(params.values()))
    new = {k: (p - 0.1 * g).detach() for (k, p), g in zip(params.items(), grads)}
    return state.replace(step=state.step + 1, params=new), {"loss": out["loss"].detach()}


def _breaking_core(state, batch):
    """The same step with a deliberate host sync: ``.item()`` is a graph break."""
    new_state, metrics = _core(state, batch)
    if metrics["loss"].item() > 1e9:  # the .item() is the point
        metrics["big"] = metrics["loss"]
    return new_state, metrics


def _setup():
    torch.manual_seed(0)
    state = TrainState.create(Tiny(), _sgd())
    batches = [{"x": torch.randn(8, 4), "y": torch.randint(0, 3, (8,))} for _ in range(3)]
    return state, batches


def test_benchmark_step_reports_sane_fields():
    state, batches = _setup()
    res = benchmark_step(_core, state, batches, steps=6, warmup=1, eager_baseline=True, rounds=2)
    assert isinstance(res, BenchResult)
    assert res.compiled and res.compile_error is None
    assert res.compile_count == 1 and res.recompiles_in_timed_steps == 0 and res.recompile_reasons == []
    assert res.graph_break_count == 0 and res.break_reasons == [] and not res.has_graph_breaks
    assert len(res.step_times_ms) == 6 and all(t > 0 for t in res.step_times_ms)
    assert res.step_ms["min"] <= res.step_ms["median"] <= res.step_ms["max"]
    assert res.first_call_s is not None and res.first_call_s > res.step_ms["median"] / 1e3
    assert res.compile_s is not None and res.compile_s > 0
    assert res.samples_per_step == 8 and res.points_per_step is None and res.samples_per_s > 0
    assert res.eager_step_ms is not None and res.speedup_vs_eager > 0
    assert res.peak_memory_bytes is not None and res.peak_memory_bytes >= 0 and res.memory_method
    d = json.loads(res.to_json())
    assert d["compile_count"] == 1 and d["has_graph_breaks"] is False
    text = res.table()
    assert "compilations" in text and "graph breaks" in text and "speedup vs eager" in text


def test_graph_break_is_reported_not_hidden():
    state, batches = _setup()
    res = benchmark_step(_breaking_core, state, batches, steps=2, warmup=0)
    # fullgraph compilation fails on .item(); the result says so and times the step eagerly
    assert res.has_graph_breaks
    assert any("item" in r.lower() for r in res.break_reasons), res.break_reasons
    assert not res.compiled and res.compile_error is not None
    assert "COMPILE FAILED" in res.table()
    assert len(res.step_times_ms) == 2
    json.loads(res.to_json())


def test_recompiles_on_new_shapes_are_counted():
    state, _ = _setup()
    batches = [{"x": torch.randn(n, 4), "y": torch.randint(0, 3, (n,))} for n in (8, 9, 10, 11)]
    step = compile_step(_core)
    res = benchmark_step(step, state, batches, steps=4, warmup=1, check_graph_breaks=False)
    # static first, then one dynamic recompile on the second size (in warm-up); none after
    assert res.compile_count == 2, res.recompile_reasons
    assert len(res.recompile_reasons) == 1 and res.recompiles_in_timed_steps == 0


def test_peak_memory_sees_an_allocation():
    with PeakMemory(torch.device("cpu")) as mem:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del x
    assert mem.peak_bytes is not None and mem.peak_bytes > 32 * 2**20, (mem.peak_bytes, mem.method)


def test_load_factory_errors_name_the_problem():
    with pytest.raises(ValueError, match="module:function"):
        load_factory("no_colon")
    with pytest.raises(AttributeError, match="no factory"):
        load_factory("pimm_fn.bench:does_not_exist")


def test_bench_main_user_factory(tmp_path, capsys):
    factory = tmp_path / "my_wl.py"
    factory.write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "from pimm_fn.bench import Workload\n"
        "from pimm_fn.optim.base import GradientTransformation\n"
        "from pimm_fn.state import TrainState\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = nn.Linear(4, 3)\n"
        "    def forward(self, b):\n"
        "        return {'loss': F.cross_entropy(self.fc(b['x']), b['y'])}\n"
        "def core(state, batch):\n"
        "    p = {k: v.detach().requires_grad_(True) for k, v in state.params.items()}\n"
        "    out = torch.func.functional_call(state.model, (p, state.buffers), (batch,))\n"
        "    g = torch.autograd.grad(out['loss'], list(p.values()))\n"
        "    new = {k: (v - 0.1 * gi).detach() for (k, v), gi in zip(p.items(), g)}\n"
        "    return state.replace(step=state.step + 1, params=new), {'loss': out['loss'].detach()}\n"
        "def make():\n"
        "    tx = GradientTransformation(lambda p: {}, lambda g, s, p: (g, s))\n"
        "    state = TrainState.create(M(), tx)\n"
        "    return Workload('tiny', core, state, [{'x': torch.randn(8, 4), 'y': torch.randint(0, 3, (8,))}])\n"
    )
    out = tmp_path / "r.json"
    assert bench_main([f"{factory}:make", "--steps", "3", "--warmup", "0", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["name"] == "tiny"
    assert "step time" in capsys.readouterr().out


def test_peak_memory_of_a_step_in_a_warm_process():
    # The RSS method read 0 here (glibc keeps freed blocks mapped); the allocator accounting must not.
    state, batches = _setup()
    big = [{"x": torch.randn(4096, 4), "y": torch.randint(0, 3, (4096,))}]
    for _ in range(2):
        state, _ = _core(state, big[0])
    with PeakMemory(torch.device("cpu")) as mem:
        state, _ = _core(state, big[0])
    # at least the logits' and softmax's [4096, 3] float32 buffers (48 KiB each)
    assert mem.peak_bytes is not None and mem.peak_bytes >= 4096 * 3 * 4, (mem.peak_bytes, mem.method)
    assert "allocator" in mem.method


def test_bench_graph_breaks_leaves_the_callers_generator_alone():
    import torch

    from pimm_fn import TrainState, bench, optim, steps
    from pimm_fn.models import MLPClassifier

    state = TrainState.create(MLPClassifier(4, 3, hidden=(8,)), optim.sgd(0.1), seed=5)
    batch = {"x": torch.randn(6, 4), "y": torch.randint(0, 3, (6,))}
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    assert bench.graph_breaks(steps.supervised(), state, batch)[0] == 0
    assert torch.equal(torch.rand(3), expected)


def test_run_child_calls_a_scripts_function_in_its_folder_and_names_a_failure(tmp_path):
    # The child runs in the script's folder: a checkout's own package in the caller's
    # folder is not imported (here a fake `pimm_fn` beside the caller's cwd would shadow it).
    import os

    from pimm_fn.bench.child import run_child

    script = tmp_path / "bench_dir" / "probe.py"
    script.parent.mkdir()
    script.write_text("import os\n"
                      "def where(x):\n"
                      "    import pimm_fn\n"
                      "    return {'x': x, 'cwd': os.getcwd(), 'pimm_fn': pimm_fn.__file__}\n"
                      "def fail():\n"
                      "    raise ValueError('the child says why')\n")
    caller = tmp_path / "checkout"
    (caller / "pimm_fn").mkdir(parents=True)
    (caller / "pimm_fn" / "__init__.py").write_text("raise ImportError('the wrong pimm_fn')\n")
    old = os.getcwd()
    os.chdir(caller)
    try:
        got = run_child(str(script), "where(3)", timeout=120, label="probe")
        with pytest.raises(RuntimeError, match="(?s)probe failed.*the child says why"):
            run_child(str(script), "fail()", timeout=120, label="probe")
    finally:
        os.chdir(old)
    assert got["x"] == 3 and got["cwd"] == str(script.parent)
    assert not got["pimm_fn"].startswith(str(caller))


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_pimm_fn_bench_help_is_bench_own(flag):
    proc = subprocess.run([sys.executable, "-m", "pimm_fn", "bench", flag], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--steps" in proc.stdout and "--json" in proc.stdout, proc.stdout  # bench's options, not the top level's
