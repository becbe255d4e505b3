"""compile_step(background=True): eager steps while the step compiles in a thread, one
recorded switch to the compiled graph, and resumes that switch where the original did."""
import threading
import time

import pytest
import torch

from pimm_fn import TrainState, compile_step, fit, optim, schedules, steps, torch_compat
from pimm_fn.callbacks import Checkpoint, resume
from pimm_fn.checkpoint import restore
from pimm_fn.tree import tree_leaves

pytestmark = pytest.mark.usefixtures("one_thread")


class _DropoutNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.drop = torch.nn.Dropout(0.3)
        self.b = torch.nn.Linear(32, 3)

    def forward(self, batch):
        logits = self.b(self.drop(torch.relu(self.a(batch["x"]))))
        return {"loss": torch.nn.functional.cross_entropy(logits, batch["y"])}


def _fresh():
    torch.manual_seed(0)
    return TrainState.create(_DropoutNet(), optim.adamw(schedules.one_cycle(1000, 1e-2)), seed=3)


def _batches(n=8):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(16, 8, generator=g), "y": torch.randint(0, 3, (16,), generator=g)} for _ in range(n)]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b)) if isinstance(x, torch.Tensor))


def _run_until_switched(step, state, batches, extra=3, limit_s=600):
    states, deadline, i = [state], time.monotonic() + limit_s, 0
    while step.switch_at is None or i < step.switch_at + extra:
        assert time.monotonic() < deadline, "the background compile never finished"
        state, _ = step(state, batches[i % len(batches)])
        states.append(state)
        i += 1
    return states


def test_eager_calls_while_compiling_then_one_recorded_switch_pinned_runs_reproduce_it():
    core, batches = steps.supervised(), _batches()
    step = compile_step(core, background=True, cache=False)
    states = _run_until_switched(step, _fresh(), batches)
    s = step.switch_at
    assert s >= 1 and step.compile_count == 1 and step.state_dict() == {"switch_at": s}
    eager = _fresh()
    for i in range(s):  # the calls before the switch are the eager step, bitwise
        eager, _ = core(eager, batches[i % len(batches)])
    assert _equal(states[s], eager)
    plain = compile_step(core, cache=False)  # and the first compiled call is the compiled step
    assert _equal(states[s + 1], plain(states[s], batches[s % len(batches)])[0])
    # the same switch, pinned, reproduces the run from scratch
    pinned = compile_step(core, background=True, switch_at=s, cache=False)
    again = _fresh()
    for i in range(len(states) - 1):
        again, _ = pinned(again, batches[i % len(batches)])
    assert _equal(again, states[-1]) and pinned.compile_count == 1
    # a state from before the switch runs eagerly again on the same step object
    assert _equal(step(states[s - 1], batches[(s - 1) % len(batches)])[0], states[s])


def test_a_pinned_switch_that_waits_for_the_compile_counts_it_once():
    core, batches = steps.supervised(), _batches()
    step = compile_step(core, background=True, switch_at=1, cache=False)
    state = _fresh()
    for i in range(3):  # the second call waits for the compile the first one started
        state, _ = step(state, batches[i % len(batches)])
    assert step.compile_count == 1, step.recompile_reasons


def test_a_resumed_run_switches_where_its_checkpoints_say(tmp_path):
    core, batches = steps.supervised(), _batches()
    first = compile_step(core, background=True, switch_at=5, cache=False)
    full = fit(_fresh(), batches, first, epochs=2,
               callbacks=[Checkpoint(tmp_path, every_steps=3, every_epochs=None, keep_last=None)]).state
    assert restore(tmp_path / "step_3.ckpt", _fresh())[1]["step"] == {"switch_at": 5}
    for saved in (3, 9):  # before the switch and after it
        step = compile_step(core, background=True, cache=False)  # a fresh process's step
        state = resume(tmp_path / f"step_{saved}.ckpt", _fresh(), step=step)
        assert step.switch_at == 5 and int(state.step) == saved
        assert _equal(fit(state, batches, step, epochs=2).state, full)


def test_a_background_compile_never_moves_the_generator_under_the_main_thread():
    original = torch.random.set_rng_state
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    inside = threading.Event()
    release = threading.Event()

    def compile_thread():
        with torch_compat.generator_untouched_by_this_thread():
            torch.random.set_rng_state(torch.Generator().manual_seed(99).get_state())  # as dynamo's restore
            inside.set()
            release.wait(10)

    t = threading.Thread(target=compile_thread)
    t.start()
    assert inside.wait(10)
    assert torch.equal(torch.random.get_rng_state(), before)  # the thread's restore did nothing
    torch.random.set_rng_state(torch.Generator().manual_seed(5).get_state())  # this thread's still works
    assert not torch.equal(torch.random.get_rng_state(), before)
    release.set()
    t.join()
    assert torch.random.set_rng_state is original  # unwrapped once no such block runs


def test_bad_background_settings_are_refused_with_the_fix():
    core = steps.supervised()
    with pytest.raises(ValueError, match="eager=True"):
        compile_step(core, background=True, eager=True)
    with pytest.raises(ValueError, match="fullgraph=False"):
        compile_step(core, background=True, fullgraph=False)
    for bad in (3, -1, True, "5"):
        kw = {"switch_at": bad, "background": bad != 3}
        with pytest.raises(ValueError, match="switch_at"):
            compile_step(core, **kw)


class _Branchy(_DropoutNet):
    def forward(self, batch):
        out = super().forward(batch)
        if batch["x"].sum() > 0:  # data-dependent Python control flow: no whole-step graph
            out["loss"] = out["loss"] * 2
        return out


def test_a_step_that_cannot_compile_says_so_after_its_eager_calls():
    torch.manual_seed(0)
    state = TrainState.create(_Branchy(), optim.adamw(schedules.one_cycle(1000, 1e-2)), seed=3)
    step = compile_step(steps.supervised(), background=True, cache=False)
    batches, deadline, calls = _batches(), time.monotonic() + 600, 0
    with pytest.warns(RuntimeWarning, match="background compile failed"), pytest.raises(Exception) as err:
        while time.monotonic() < deadline:
            state, _ = step(state, batches[calls % len(batches)])
            calls += 1
    assert calls >= 1 and "data-dependent" in str(err.value).lower(), str(err.value)[:500]


def test_the_compile_thread_never_makes_inductors_one_fx_symbolic_trace(monkeypatch):
    # FX's symbolic tracer swaps nn.Module.__call__ for the whole process while it runs: made
    # by the compile thread, it caught the main thread's eager module calls (a NameError in
    # the test above, once in a while). BackgroundCompile.start makes it first, on its caller.
    from pimm_fn.compile.background import BackgroundCompile

    traced_on = []
    original = torch.fx.Tracer.trace

    def trace(self, *args, **kwargs):
        traced_on.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Tracer, "trace", trace)
    from torch._inductor.loop_body import InterpreterShim

    InterpreterShim._dummy_gm.cache_clear()
    job = BackgroundCompile(lambda: InterpreterShim._dummy_gm(), "dummy")
    job.start()
    job.result()
    assert traced_on == [threading.current_thread().name]
