"""fit / fit_epoch: the fold, the cursor, the event table, requests, guards and run switches."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fit_helpers import PermLoader, Recorder, dataset, leaves_equal, make_state, step_fn
from test_frame_room import _worst_faults_per_call, chunked_stack_only

from pimm_fn import events as ev
from pimm_fn.callbacks import Callback, on
from pimm_fn.fit import StateMutationError, fit, fit_epoch, resolve_iters_per_epoch


@pytest.fixture(scope="module")
def data():
    return dataset(48)


@pytest.fixture(scope="module")
def four_epochs(data):
    """A straight 4-epoch run (24 steps) shared by the comparisons below."""
    rec = Recorder()
    res = fit(make_state(), PermLoader(*data), step_fn, epochs=4, callbacks=[rec])
    return res, rec


def test_normal_run_cursor_events_history(data, four_epochs):
    res, rec = four_epochs
    assert res.status == "completed"
    st = res.state
    assert int(st.step) == 24 and st.cursor.epoch == 4 and st.cursor.position == 0
    assert st.cursor.samples_seen == 4 * 48
    kinds = rec.kinds()
    assert kinds[0] == "TrainStart" and kinds[-1] == "TrainEnd"
    assert kinds.count("EpochStart") == kinds.count("EpochEnd") == 4 and kinds.count("StepEnd") == 24
    # per epoch: EpochStart, 6 StepEnd, EpochEnd
    assert kinds[1:9] == ["EpochStart"] + ["StepEnd"] * 6 + ["EpochEnd"]
    steps = [e for e in rec.events if isinstance(e, ev.StepEnd)]
    assert [e.step for e in steps] == list(range(1, 25))
    assert [e.position for e in steps[:6]] == list(range(6)) and steps[6].epoch == 1
    assert steps[-1].is_last and not steps[-2].is_last and steps[5].last_in_epoch
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in steps[0].metrics.values())
    assert steps[0].samples_seen == 8 and steps[0].batch_size == 8
    with pytest.raises(TypeError):
        steps[0].metrics["loss"] = 1.0  # the mapping is read-only
    # history: per-step values and per-epoch averages, as tensors until read
    h = res.history
    assert len(h) == 24 and h.epochs == [0, 1, 2, 3] and h.steps == list(range(1, 25))
    losses = h.values("loss")
    assert losses.shape == (24,)
    assert torch.equal(losses, torch.stack([e.metrics["loss"] for e in steps]))
    ends = [e for e in rec.events if isinstance(e, ev.EpochEnd)]
    assert torch.allclose(ends[1].metrics["loss"], losses[6:12].mean())
    assert h.epoch_averages()[1]["loss"] == pytest.approx(float(losses[6:12].mean()))
    state_a, hist = res  # unpacks
    assert state_a is st and hist is h


def test_already_complete_returns_at_once(data, four_epochs):
    done = four_epochs[0].state
    rec = Recorder()
    loader = PermLoader(*data)
    res = fit(done, loader, step_fn, epochs=4, callbacks=[rec])
    assert res.status == "already_complete" and res.state is done
    assert rec.kinds() == ["AlreadyComplete"] and loader.calls == []
    assert rec.events[0].epoch == 4 and rec.events[0].epochs == 4 and rec.events[0].step == 24
    assert fit(done, loader, step_fn, epochs=2).status == "already_complete"


def test_extending_a_finished_run_trains_exactly_the_new_epochs(data, four_epochs):
    two = fit(make_state(), PermLoader(*data), step_fn, epochs=2).state
    assert two.cursor.epoch == 2 and int(two.step) == 12
    loader = PermLoader(*data)
    rec = Recorder()
    res = fit(two, loader, step_fn, epochs=4, callbacks=[rec])
    assert loader.calls == [(2, 0), (3, 0)]
    assert rec.kinds().count("StepEnd") == 12
    assert rec.events[0].resumed and rec.events[0].epoch == 2
    assert leaves_equal(res.state, four_epochs[0].state)
    assert int(res.state.step) == 24


def test_mid_epoch_resume_from_the_cursor_is_exact(data, four_epochs):
    # stop after step 9 (epoch 1, position 3), then continue from that state alone
    res = fit(make_state(), PermLoader(*data), step_fn, epochs=4,
              callbacks=[on(ev.StepEnd, once=9)(lambda e, s: ev.Stop("pause"))])
    assert res.status == "stopped" and res.stop_reason == "pause"
    mid = res.state
    assert (mid.cursor.epoch, mid.cursor.position, int(mid.step)) == (1, 3, 9)
    loader = PermLoader(*data)
    rec = Recorder()
    out = fit(mid, loader, step_fn, epochs=4, callbacks=[rec])
    assert loader.calls[0] == (1, 3)
    assert rec.events[1].position == 3  # EpochStart at position 3
    assert [e.step for e in rec.events if isinstance(e, ev.StepEnd)][0] == 10
    assert leaves_equal(out.state, four_epochs[0].state)


def test_fit_epoch_is_the_inner_fold(data, four_epochs):
    state = make_state()
    rec = Recorder()
    for _ in range(4):
        r = fit_epoch(state, PermLoader(*data), step_fn, callbacks=[rec])
        assert r.status == "completed"
        state = r.state
    assert state.cursor.epoch == 4 and leaves_equal(state, four_epochs[0].state)
    assert "TrainStart" not in rec.kinds() and rec.kinds().count("EpochEnd") == 4


def test_exhausted_loader_ends_the_epoch_early(data):
    rec = Recorder()
    res = fit(make_state(), PermLoader(*data, limit=4), step_fn, epochs=2, callbacks=[rec])
    ends = [e for e in rec.events if isinstance(e, ev.EpochEnd)]
    assert [(e.steps, e.exhausted) for e in ends] == [(4, True), (4, True)]
    assert int(res.state.step) == 8 and res.state.cursor.epoch == 2


def test_a_loader_that_yields_nothing_is_an_error(data):
    class Spent:  # says it has batches, yields none (a generator spent by an earlier epoch)
        def __len__(self):
            return 4

        def __iter__(self):
            return iter(())

    with pytest.raises(ValueError, match="yielded no batch for epoch 0 .*4 batches an epoch"):
        fit(make_state(), Spent(), step_fn, epochs=2)
    first = fit(make_state(), PermLoader(*data, limit=4), step_fn, epochs=1).state
    # Resumed at a position the (now shorter) loader never reaches.
    at = first.replace(cursor=first.cursor.replace(epoch=1, position=3))
    with pytest.raises(ValueError, match="after skipping to position 3"):
        fit(at, PermLoader(*data, limit=2), step_fn, epochs=2, iters_per_epoch=4)


def test_plain_iterables_and_iters_per_epoch(data):
    x, y = data
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 48, 8)]
    res = fit(make_state(), batches, step_fn, epochs=1)
    assert int(res.state.step) == 6 and res.state.cursor.samples_seen == 48
    # cut at iters_per_epoch
    res = fit(make_state(), batches, step_fn, epochs=2, iters_per_epoch=4)
    assert int(res.state.step) == 8
    # resume on a plain list skips the consumed batches: equal to the straight run
    half = fit(make_state(), batches, step_fn, epochs=1, callbacks=[on(ev.StepEnd, once=2)(lambda e, s: ev.Stop())])
    assert half.state.cursor.position == 2
    full = fit(make_state(), batches, step_fn, epochs=1).state
    assert leaves_equal(fit(half.state, batches, step_fn, epochs=1).state, full)
    # a torch DataLoader works too (and hears set_epoch through its sampler when it has one)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    assert int(fit(make_state(), dl, step_fn, epochs=1).state.step) == 3


def test_bad_loaders_raise_clear_errors(data):
    x, y = data

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(0, 48, 8):
                yield (x[i:i + 8], y[i:i + 8])

    stream = torch.utils.data.DataLoader(Stream(), batch_size=None)
    with pytest.raises(ValueError, match="iters_per_epoch"):
        fit(make_state(), stream, step_fn, epochs=1)
    assert int(fit(make_state(), stream, step_fn, epochs=1, iters_per_epoch=3).state.step) == 3
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="positive int"):
            resolve_iters_per_epoch(stream, bad)
    with pytest.raises(ValueError, match="no batches per epoch"):
        fit(make_state(), [], step_fn, epochs=1)
    with pytest.raises(TypeError, match="one-shot iterator"):
        fit(make_state(), iter([(x, y)]), step_fn, epochs=1)

    class Counted:  # num_samples() rule for a length-less stream
        dataset = type("D", (), {"num_samples": staticmethod(lambda: 50)})()
        batch_size = 8
        world_size = 2

        def __iter__(self):
            return iter(())

    assert resolve_iters_per_epoch(Counted()) == 3  # 50 // 2 // 8
    Counted.batch_size = 40
    with pytest.raises(ValueError, match="<= 0"):
        resolve_iters_per_epoch(Counted())


def _table(data, requester, epochs=2):
    rec = Recorder()
    res = fit(make_state(), PermLoader(*data), step_fn, epochs=epochs, callbacks=[requester, rec])
    return res, rec.kinds(), rec


def test_stop_request_ends_after_the_current_step_and_fires_the_table(data):
    # mid-epoch stop: the step finishes, its StepEnd reaches every callback, no EpochEnd, TrainEnding, TrainEnd(stopped)
    res, kinds, rec = _table(data, on(ev.StepEnd, once=3)(lambda e, s: ev.Stop("enough")))
    assert res.status == "stopped" and int(res.state.step) == 3 and res.state.cursor.position == 3
    assert kinds == ["TrainStart", "EpochStart", "StepEnd", "StepEnd", "StepEnd", "TrainEnding", "TrainEnd"]
    assert rec.events[-1].reason == "stopped" and rec.events[-1].stop_reason == "enough"
    # stop on an epoch's last step: the epoch is complete, so EpochEnd fires
    res, kinds, _ = _table(data, on(ev.StepEnd, once=6)(lambda e, s: ev.Stop()))
    assert kinds[-4:] == ["StepEnd", "EpochEnd", "TrainEnding", "TrainEnd"] and res.state.cursor.epoch == 1
    # stop from EpochEnd / TrainStart / EpochStart
    _, kinds, _ = _table(data, on(ev.EpochEnd, once=0)(lambda e, s: ev.Stop()))
    assert kinds.count("EpochStart") == 1 and kinds[-1] == "TrainEnd"
    res, kinds, _ = _table(data, on(ev.TrainStart)(lambda e, s: ev.Stop()))
    assert kinds == ["TrainStart", "TrainEnding", "TrainEnd"] and int(res.state.step) == 0
    res, kinds, _ = _table(data, on(ev.EpochStart)(lambda e, s: ev.Stop()))
    assert kinds == ["TrainStart", "EpochStart", "TrainEnding", "TrainEnd"]


def test_keyboard_interrupt_returns_last_completed_state(data):
    calls = {"n": 0}

    def flaky(state, batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return step_fn(state, batch)

    rec = Recorder()
    res = fit(make_state(), PermLoader(*data), flaky, epochs=2, callbacks=[rec])
    assert res.status == "interrupted" and int(res.state.step) == 4 and res.state.cursor.position == 4
    assert rec.kinds()[-1] == "Interrupted" and "TrainEnd" not in rec.kinds()
    assert rec.events[-1].step == 4
    # an interrupt inside a callback: the step it observes is complete and kept
    res = fit(make_state(), PermLoader(*data), step_fn, epochs=2,
              callbacks=[on(ev.StepEnd, once=2)(lambda e, s: (_ for _ in ()).throw(KeyboardInterrupt()))])
    assert res.status == "interrupted" and int(res.state.step) == 2


def test_exceptions_fire_failed_then_propagate(data):
    rec = Recorder()

    def boom(e, s):
        raise ZeroDivisionError("bad callback")

    with pytest.raises(ZeroDivisionError):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[on(ev.StepEnd, once=2)(boom), rec])
    assert rec.kinds()[-1] == "Failed" and isinstance(rec.events[-1].error, ZeroDivisionError)
    assert "TrainEnd" not in rec.kinds()


def test_a_callback_cannot_change_the_state(data):
    def assign(e, s):
        s.step = torch.tensor(99)

    with pytest.raises(StateMutationError, match=r"assign.*immutable.*Stop\(\)"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[on(ev.StepEnd, once=1)(assign)])

    def cursor(e, s):
        s.cursor.position = 0

    with pytest.raises(StateMutationError, match="frozen"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[on(ev.StepEnd, once=1)(cursor)])

    def swap(e, s):
        s.params["fc1.weight"] = torch.zeros_like(s.params["fc1.weight"])

    with pytest.raises(StateMutationError, match=r"changed the TrainState.*params"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[on(ev.StepEnd, once=1)(swap)])

    def inplace(e, s):
        s.params["fc1.weight"].add_(1.0)

    with pytest.raises(StateMutationError, match="in place"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, guard_state="full",
            callbacks=[on(ev.StepEnd, once=1)(inplace)])


def test_filters(data):
    seen = {"every": [], "once": [], "last": [], "epochs": [], "when": []}
    cbs = [
        on(ev.StepEnd, every=4)(lambda e, s: seen["every"].append(e.step)),
        on(ev.StepEnd, once=7)(lambda e, s: seen["once"].append(e.step)),
        on(ev.StepEnd, last=True)(lambda e, s: seen["last"].append(e.step)),
        on(ev.EpochEnd, every=2)(lambda e, s: seen["epochs"].append(e.epoch)),
        on(ev.StepEnd, when=lambda e: e.position == 0)(lambda e, s: seen["when"].append(e.step)),
    ]
    fit(make_state(), PermLoader(*data), step_fn, epochs=4, iters_per_epoch=3, callbacks=cbs)
    assert seen == {"every": [4, 8, 12], "once": [7], "last": [12], "epochs": [1, 3], "when": [1, 4, 7, 10]}
    with pytest.raises(ValueError):
        on(ev.TrainEnd, every=2)
    with pytest.raises(ValueError):
        on(ev.StepEnd, every=0)


def test_callback_class_dispatch_order_and_bad_returns(data):
    order = []

    class A(Callback):
        order = 5

        def on_step_end(self, e, s):
            order.append("A")

    class B(Callback):
        def on_step_end(self, e, s):
            order.append("B")

    fit(make_state(), PermLoader(*data), step_fn, epochs=1, iters_per_epoch=1, callbacks=[A(), B()])
    assert order == ["B", "A"]  # sorted by `order`, stable
    with pytest.raises(TypeError, match="returned 42"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[lambda e, s: 42])


class _Tripwire(torch.Tensor):
    """A tensor that fails the test if anyone pulls a Python number out of it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("item", "__float__", "__int__", "__bool__", "tolist", "__index__", "numpy", "__format__"):
            raise AssertionError(f"fit pulled a number from a metric ({name})")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_fit_never_syncs_metrics(data):
    def wired(state, batch):
        new, m = step_fn(state, batch)
        return new, {k: v.as_subclass(_Tripwire) for k, v in m.items()}

    rec = Recorder()
    res = fit(make_state(), PermLoader(*data), wired, epochs=2, callbacks=[rec])
    assert res.status == "completed" and len(res.history) == 12


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")  # asked for: the switch under test
def test_run_switches_and_profiler_spans(data, tmp_path):
    from pimm_fn.callbacks import Checkpoint, Trace

    before = torch.get_float32_matmul_precision()
    seen = []
    fit(make_state(), PermLoader(*data), step_fn, epochs=1, iters_per_epoch=2, matmul_precision="medium",
        detect_anomaly=True, empty_cache="step",
        callbacks=[lambda e, s: seen.append((torch.get_float32_matmul_precision(), torch.is_anomaly_enabled()))])
    assert set(seen) == {("medium", True)}
    assert torch.get_float32_matmul_precision() == before and not torch.is_anomaly_enabled()
    with pytest.raises(ValueError):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, empty_cache="always")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, iters_per_epoch=2,
            callbacks=[Trace(), Checkpoint(tmp_path / "ck", every_steps=1)])
    names = {e.name for e in prof.events()}
    for want in ("data_fetch", "step", "callback.Trace.StepEnd", "callback.Checkpoint.SaveRequested",
                 "checkpoint.save", "instant.training_start", "instant.training_end"):
        assert any(n.startswith(want) for n in names), want


class _Blocks(Callback):
    """Records StepBlocks and, for order, every other event it is sent."""

    def __init__(self):
        self.log = []

    def on_step_block(self, e, s):
        self.log.append(("block", e.steps, e.epoch, e.samples_seen, e.is_last, len(e)))

    def __call__(self, e, s):
        if not isinstance(e, (ev.StepBlock, ev.StepEnd)):
            self.log.append((type(e).__name__,))
        return super().__call__(e, s)

    def blocks(self):
        return [x for x in self.log if x[0] == "block"]


def test_step_blocks_carry_every_step_once_before_epoch_end_and_the_end(data):
    blocks, plain = _Blocks(), Recorder()
    res = fit(make_state(), PermLoader(*data), step_fn, epochs=2, callbacks=[blocks, plain], block_seconds=3600)
    # one block per epoch (the interval never elapses), delivered just before EpochEnd
    assert [b[1] for b in blocks.blocks()] == [tuple(range(1, 7)), tuple(range(7, 13))]
    kinds = [x[0] for x in blocks.log]
    assert kinds == ["TrainStart", "EpochStart", "block", "EpochEnd", "EpochStart", "block", "EpochEnd", "TrainEnding",
                     "TrainEnd"]
    assert [b[2] for b in blocks.blocks()] == [0, 1] and blocks.blocks()[-1][4] and not blocks.blocks()[0][4]
    assert blocks.blocks()[0][3] == 48  # samples seen after the block's last step
    # a plain callable is not sent blocks (they repeat its StepEnds)
    assert "StepBlock" not in plain.kinds() and plain.kinds().count("StepEnd") == 12
    # block_seconds=0: a block per step, each right after its step
    per_step = _Blocks()
    fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[per_step], block_seconds=0)
    assert [b[1] for b in per_step.blocks()] == [(i,) for i in range(1, 7)]
    # on(StepBlock) filters opt in too
    got = []
    fit(make_state(), PermLoader(*data), step_fn, epochs=1, block_seconds=3600,
        callbacks=[on(ev.StepBlock)(lambda e, s: got.extend(e.steps))])
    assert got == list(range(1, 7))
    assert int(res.state.step) == 12
    with pytest.raises(ValueError, match="block_seconds"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, block_seconds=-1)


def test_step_blocks_reach_writers_before_a_save_a_stop_and_an_interrupt(data, tmp_path):
    # a mid-epoch save request: the block comes first, so writers flush what the checkpoint covers
    blocks = _Blocks()
    with pytest.warns(UserWarning, match="no callback saved a checkpoint") as caught:
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, block_seconds=3600,
            callbacks=[blocks, on(ev.StepEnd, once=4)(lambda e, s: ev.SaveNow("test"))])
    assert [w.filename for w in caught if "SaveNow" in str(w.message)] == [__file__]  # the fit(...) line
    log = blocks.log
    assert log.index(("SaveRequested",)) == log.index(("block", (1, 2, 3, 4), 0, 32, False, 4)) + 1
    # a mid-epoch stop under fit_epoch (no TrainEnd follows) still delivers its steps
    blocks = _Blocks()
    res = fit_epoch(make_state(), PermLoader(*data), step_fn, block_seconds=3600,
                    callbacks=[blocks, on(ev.StepEnd, once=3)(lambda e, s: ev.Stop())])
    assert res.status == "stopped" and [b[1] for b in blocks.blocks()] == [(1, 2, 3)]
    # KeyboardInterrupt mid-epoch: the completed steps arrive before Interrupted
    blocks = _Blocks()

    def interrupt(e, s):
        raise KeyboardInterrupt

    res = fit(make_state(), PermLoader(*data), step_fn, epochs=1, block_seconds=3600,
              callbacks=[blocks, on(ev.StepEnd, once=2)(interrupt)])
    assert res.status == "interrupted" and int(res.state.step) == 2
    assert [x[0] for x in blocks.log][-2:] == ["block", "Interrupted"] and blocks.blocks()[-1][1] == (1, 2)


def test_history_state_dict_round_trips_compact_and_mixed(four_epochs):
    from pimm_fn import History

    h = four_epochs[0].history
    sd = h.state_dict()
    assert set(sd) == {"epochs", "lengths", "steps", "metrics"}  # one tensor per column
    back = History()
    back.load_state_dict(sd)
    assert back.steps == h.steps and back.epochs == h.epochs
    assert torch.equal(back.values("loss"), h.values("loss"))
    mixed = History()
    mixed._open(0).append((1, {"loss": torch.tensor(1.0)}))
    mixed._close()
    mixed._open(1).append((2, {"loss": torch.tensor(2.0), "acc": torch.tensor(0.5)}))  # left open
    again = History()
    again.load_state_dict(mixed.state_dict())
    assert again.steps == [1, 2] and again.values("acc").tolist() == [0.5]


@chunked_stack_only
def test_steps_run_on_a_frame_stack_of_their_own(data):
    # At some stack depths a call maps a frame-stack chunk every time (tests/test_frame_room.py);
    # fit's steps never sit at such a depth, whatever depth fit is called from.

    worst = []

    def probing_step(state, batch):
        worst.append(_worst_faults_per_call())
        return step_fn(state, batch)

    assert _worst_faults_per_call() >= 0.9
    fit(make_state(), PermLoader(*data), probing_step, epochs=1)
    fit_epoch(make_state(), PermLoader(*data), probing_step)
    assert len(worst) == 12 and max(worst) <= 0.05, worst


def test_common_call_mistakes_are_named(data):
    from pimm_fn import steps
    from pimm_fn.callbacks import ProgressBar
    from pimm_fn.compile import compile_step

    state, loader = make_state(), PermLoader(*data)
    with pytest.raises(TypeError, match="fit takes the TrainState, not the module"):
        fit(state.model, loader, step_fn, epochs=1)
    with pytest.raises(TypeError, match=r"fit got one batch \(a dict with keys \['x', 'y'\]\) as its loader"):
        fit(state, {"x": data[0], "y": data[1]}, step_fn, epochs=1)
    for call in (lambda: fit(state, loader, steps.supervised, epochs=1),
                 lambda: fit_epoch(state, loader, steps.supervised), lambda: compile_step(steps.supervised)):
        with pytest.raises(TypeError, match=r"cannot be called as supervised\(state, batch\).*must be called first"):
            call()
    with pytest.raises(TypeError, match=r"callback ProgressBar is a class; pass an instance: ProgressBar\(...\)"):
        fit(state, loader, step_fn, epochs=1, callbacks=[ProgressBar])


def test_a_callback_failing_at_the_end_keeps_the_trained_state(data):
    class FullDisk(Callback):
        def on_train_end(self, event, state):
            raise OSError(28, "No space left on device")

    with pytest.raises(RuntimeError, match="failed while handling TrainEnd; the run's state is kept") as info:
        fit(make_state(), PermLoader(*data), step_fn, epochs=2, callbacks=[FullDisk()])
    assert int(info.value.state.step) == 12 and info.value.state.cursor.epoch == 2  # 6 steps an epoch
    assert isinstance(info.value.__cause__, OSError)


def test_a_loader_whose_length_changes_trains_each_epoch_whole(data):
    class Growing:  # e.g. a sampler that adds hard examples each epoch
        def __init__(self):
            self.n = 2

        def __len__(self):
            return self.n

        def __iter__(self):
            batches = list(PermLoader(*data).iter_epoch(0, 0))[: self.n]
            self.n += 1
            return iter(batches)

    rec = Recorder()
    res = fit(make_state(), Growing(), step_fn, epochs=3, callbacks=[rec])
    assert [e.steps for e in rec.events if isinstance(e, ev.EpochEnd)] == [2, 3, 4]
    assert [e.iters_per_epoch for e in rec.events if isinstance(e, ev.EpochStart)] == [2, 3, 4]
    assert int(res.state.step) == 9
