"""Inductor's CPU kernels compiled in units (pimm_fn.compile.kernel_units): same bits, fewer compiler runs.

Each test runs in a fresh process with an empty inductor cache, so every kernel is really
compiled by g++ (as one unit, or one by one for the comparison).
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="inductor's C++ kernels are built with g++ here")


def _python(code: str, tmp_path, **env) -> str:
    full = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **env}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


# A function of several kernels: each softmax between matmuls (library calls) is its own.
SEVERAL_KERNELS = """
    import threading, warnings
    import torch
    from torch._inductor.async_compile import get_compile_threads
    from pimm_fn.compile import kernel_units

    def f(x, w):
        outs = []
        for i in range(5):
            x = torch.softmax((x @ w) * (1.0 + i / 8), dim=1)
            outs.append(x.sin().sum(0))
        return x, torch.stack(outs)

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 40, generator=g), torch.randn(40, 40, generator=g)
"""


def _both_ways(code: str, tmp_path) -> tuple:
    """Run ``code`` (which saves its result to OUT) in two fresh processes, each with an
    empty inductor cache: kernels in units, and one library per kernel. Returns both
    results and the first process's kernel_units.stats()."""
    import torch

    results = []
    for way in ("on", "off"):
        out = tmp_path / f"result_{way}.pt"
        printed = _python(code.replace("OUT", repr(str(out))), tmp_path / way, PIMM_FN_KERNEL_UNITS=way)
        results.append(torch.load(out))
        if way == "on":
            stats = eval(printed.strip().splitlines()[-1])
    return results, stats


def _compile_threads() -> int:
    from torch._inductor.async_compile import get_compile_threads

    return get_compile_threads()


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_another_thread_and_the_off_switch_compile_as_torch_does(tmp_path):
    out = _python(SEVERAL_KERNELS + """
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with kernel_units.batched():
            inside.set()
            leave.wait()

    t = threading.Thread(target=hold)
    t.start()
    inside.wait()
    torch.compile(f)(x, w)  # this thread is not inside `batched`
    leave.set()
    t.join()
    assert kernel_units.stats()["kernels"] == 0, kernel_units.stats()

    # Nor while another thread is inside a compiled step's call.
    from pimm_fn import TrainState, compile_step, optim

    def waiting_core(state, batch):
        inside.set()
        leave.wait()
        return state, {}

    inside.clear(), leave.clear()
    stepping = threading.Thread(target=lambda: compile_step(waiting_core, eager=True)(
        TrainState.create(torch.nn.Linear(2, 2), optim.sgd(0.1)), {"x": torch.zeros(1)}))
    stepping.start()
    inside.wait()
    torch.compile(lambda x, w: f(x * 2.0, w))(x, w)
    leave.set()
    stepping.join()
    assert kernel_units.stats()["kernels"] == 0, kernel_units.stats()
    import os
    os.environ["PIMM_FN_KERNEL_UNITS"] = "off"
    torch.compiler.reset()
    with kernel_units.batched():
        torch.compile(lambda x, w: f(x * 0.5, w))(x, w)
    assert kernel_units.stats()["kernels"] == 0, kernel_units.stats()
    print("ok")
    """, tmp_path)
    assert out.startswith("ok"), out


def test_a_unit_that_fails_to_compile_falls_back_to_one_library_per_kernel(tmp_path):
    out = _python(SEVERAL_KERNELS + """
    if get_compile_threads() < 2:
        print("ok (one compile worker: no units)")
        raise SystemExit
    expected = f(x, w)
    real = kernel_units._unit_source
    kernel_units._unit_source = lambda unit: real(unit) + "\\nthis is not C++;\\n"
    with warnings.catch_warnings(record=True) as caught, kernel_units.batched():
        warnings.simplefilter("always")
        got = torch.compile(f)(x, w)
    messages = [str(w.message) for w in caught if "one by one" in str(w.message)]
    assert messages and "PIMM_FN_KERNEL_UNITS=off" in messages[0], [str(w.message) for w in caught]
    assert kernel_units.stats()["fallbacks"] >= 1
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(expected, got))
    print("ok")
    """, tmp_path)
    assert out.startswith("ok"), out


def test_compile_step_builds_its_kernels_in_units_with_the_same_bits(tmp_path):
    (units, alone), stats = _both_ways("""
    import torch
    from pimm_fn import TrainState, compile_step, optim, schedules, steps
    from pimm_fn.compile import kernel_units
    from pimm_fn.models import MLPClassifier
    from pimm_fn.tree import tree_leaves

    torch.manual_seed(0)
    model = MLPClassifier(16, 5, hidden=(48,))
    state = TrainState.create(model, optim.adamw(schedules.one_cycle(100, 1e-2), weight_decay=0.01), seed=0)
    step = compile_step(steps.supervised(clip_grad=1.0), cache=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = {"x": torch.randn(32, 16, generator=g), "y": torch.randint(0, 5, (32,), generator=g)}
        state, _ = step(state, batch)
    torch.save(tree_leaves((state.params, state.opt_state)), OUT)
    print(kernel_units.stats())
    """, tmp_path)
    assert stats["kernels"] >= 3 and stats["units"] >= 1 and not stats["fallbacks"], stats
    assert len(units) == len(alone) > 4
    assert all(torch_equal(a, b) for a, b in zip(units, alone))


def test_a_saved_step_loads_without_compiling_under_another_number_of_compile_workers(tmp_path):
    # The units are cut by size, not by the machine's compile workers: a job on fewer CPUs
    # sharing the inductor cache and the step cache loads what another job built.
    code = """
    import glob, os, sys
    import torch
    from pimm_fn import TrainState, compile_step, optim, steps
    from pimm_fn.compile import kernel_units
    from pimm_fn.models import MLPClassifier

    torch.manual_seed(0)
    state = TrainState.create(MLPClassifier(16, 5, hidden=(40,)), optim.adamw(1e-2), seed=0)
    step = compile_step(steps.supervised(clip_grad=1.0), cache=os.environ["STEPS"])
    before = set(glob.glob(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "**", "*.so"), recursive=True))
    step(state, {"x": torch.randn(8, 16), "y": torch.randint(0, 5, (8,))})
    after = set(glob.glob(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "**", "*.so"), recursive=True))
    print(step.loaded_from_cache, len(after - before), kernel_units.stats()["units"])
    """
    steps_dir = str(tmp_path / "steps")
    saved = _python(code, tmp_path, STEPS=steps_dir, TORCHINDUCTOR_COMPILE_THREADS="2").split()
    assert saved[0] == "False" and int(saved[1]) >= 1 and int(saved[2]) >= 1, saved
    loaded = _python(code, tmp_path, STEPS=steps_dir, TORCHINDUCTOR_COMPILE_THREADS="1").split()
    assert loaded[0] == "True" and loaded[1] == "0", loaded
