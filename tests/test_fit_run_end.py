"""The end of a run and a resumed epoch: what the callbacks see equals the uninterrupted run.

Each test is a case that once went wrong silently: an end-of-run evaluation delivered after
the checkpoints and writers had closed, epoch averages of a resumed epoch over its second
part only, a per-step save that left the epoch-end checkpoint unrolled, an evaluation logged
before the steps that led to it, History columns misaligned in a checkpoint, and epoch
averages lost with ``fit(history=False)``.
"""
import pytest
import torch
from _fit_helpers import PermLoader, Recorder, dataset, make_state, step_fn

from pimm_fn import checkpoint as ckpt
from pimm_fn import events as E
from pimm_fn.callbacks import Checkpoint, Evaluate, on, resume
from pimm_fn.fit import History, fit

pytestmark = pytest.mark.usefixtures("one_thread")


def _kinds(rec, *names):
    return [(type(e).__name__, e.step) for e in rec.events if type(e).__name__ in names]


def test_an_end_of_run_evaluation_is_saved_as_best_before_the_end(tmp_path):
    x, y = dataset(32)  # 4 steps an epoch
    values = iter([0.1, 0.2, 0.9])  # the evaluation at the end is the best
    evaluate = Evaluate.of(lambda st: {"acc": next(values)}, every_epochs=2, at_end=True)
    saver = Checkpoint(tmp_path / "ck", every_epochs=1, best_metric="acc", mode="max", background=False)
    rec = Recorder()
    fit(make_state(), PermLoader(x, y), step_fn, epochs=5, callbacks=[evaluate, saver, rec])
    assert saver.best == 0.9 and saver.best_step == 20
    best = ckpt.CheckpointDir(tmp_path / "ck").best()
    restored, extra = ckpt.restore(best, make_state())
    assert int(restored.step) == 20 and extra["checkpoint"]["best"] == 0.9
    order = _kinds(rec, "TrainEnding", "EvalEnd", "CheckpointSaved", "TrainEnd")
    assert order[-4:] == [("TrainEnding", 20), ("EvalEnd", 20), ("CheckpointSaved", 20), ("TrainEnd", 20)]


def test_a_resumed_epoch_reports_the_whole_epochs_averages(tmp_path):
    x, y = dataset(32)
    stop_at_2 = on(E.StepEnd, once=2)(lambda e, s: E.Stop("killed"))
    fit(make_state(), PermLoader(x, y), step_fn, epochs=2,
        callbacks=[stop_at_2, Checkpoint(tmp_path, every_steps=2, background=False)])
    history, rec = History(), Recorder()
    state = resume(tmp_path, make_state(), history=history)
    assert state.cursor.position == 2
    fit(state, PermLoader(x, y), step_fn, epochs=2, callbacks=[rec], history=history)
    whole = Recorder()
    plain = fit(make_state(), PermLoader(x, y), step_fn, epochs=2, callbacks=[whole])
    losses = [[float(e.metrics["loss"]) for e in r.events if isinstance(e, E.EpochEnd)] for r in (rec, whole)]
    assert losses[0] == losses[1]
    assert history.epoch_averages() == plain.history.epoch_averages()


def test_a_per_step_save_on_an_epochs_last_step_is_saved_again_with_the_rolled_cursor(tmp_path):
    x, y = dataset(32)
    saver = Checkpoint(tmp_path, every_steps=4, every_epochs=1, background=False)
    fit(make_state(), PermLoader(x, y), step_fn, epochs=1, callbacks=[saver])
    restored, _ = ckpt.restore(ckpt.CheckpointDir(tmp_path).latest(), make_state())
    assert (restored.cursor.epoch, restored.cursor.position) == (1, 0)
    # A finished run resumed is complete, not replayed.
    again = fit(resume(tmp_path, make_state()), PermLoader(x, y), step_fn, epochs=1)
    assert again.status == "already_complete"


def test_a_checkpoint_of_an_epochs_last_step_resumes_with_that_epochs_averages(tmp_path):
    # A save at the epoch's last position (a per-step save, then a crash before the epoch end's).
    x, y = dataset(32)
    stop = on(E.StepEnd, once=4)(lambda e, s: E.Stop("killed"))
    fit(make_state(), PermLoader(x, y), step_fn, epochs=2,
        callbacks=[stop, Checkpoint(tmp_path, every_steps=4, every_epochs=None, save_final=False, background=False)])
    history, rec = History(), Recorder()
    state = resume(tmp_path, make_state(), history=history)
    assert (state.cursor.epoch, state.cursor.position) == (0, 4)
    fit(state, PermLoader(x, y), step_fn, epochs=1, callbacks=[rec], history=history)
    ends = [e for e in rec.events if isinstance(e, E.EpochEnd)]
    assert len(ends) == 1 and ends[0].steps == 0
    assert float(ends[0].metrics["loss"]) == pytest.approx(history.epoch_averages()[0]["loss"])


def test_an_evaluation_a_step_causes_reaches_the_writers_after_that_steps_block():
    x, y = dataset(32)
    seen = []

    class Writer:
        def wants(self, event_type):
            return event_type is not E.StepEnd

        def __call__(self, event, state):
            if isinstance(event, E.StepBlock):
                seen.extend(("step", s) for s in event.steps)
            elif isinstance(event, E.EvalEnd):
                seen.append(("eval", event.step))

    fit(make_state(), PermLoader(x, y), step_fn, epochs=1, block_seconds=60.0,
        callbacks=[Evaluate.of(lambda st: {"acc": 1.0}, every_steps=3, every_epochs=None), Writer()])
    assert seen == [("step", 1), ("step", 2), ("step", 3), ("eval", 3), ("step", 4)]


def test_history_columns_some_steps_lack_survive_a_checkpoint():
    h = History()
    rows = h._open(0)
    rows += [(1, {"loss": torch.tensor(1.0), "aux": torch.tensor(10.0)}), (2, {"loss": torch.tensor(2.0)})]
    h._close()
    rows = h._open(1)
    rows += [(3, {"loss": torch.tensor(3.0), "aux": torch.tensor(30.0)}),
             (4, {"loss": torch.tensor(4.0), "aux": torch.tensor(40.0)})]
    h._close()
    again = History()
    again.load_state_dict(h.state_dict())
    assert again.epoch_averages() == h.epoch_averages() == [
        {"epoch": 0, "loss": 1.5, "aux": 10.0}, {"epoch": 1, "loss": 3.5, "aux": 35.0}]


def test_epoch_averages_without_a_history():
    x, y = dataset(32)
    rec = Recorder()
    result = fit(make_state(), PermLoader(x, y), step_fn, epochs=1, callbacks=[rec], history=False)
    ends = [e for e in rec.events if isinstance(e, E.EpochEnd)]
    assert result.history is None and set(ends[0].metrics) == {"loss", "lr/default", "grad_norm"}


@pytest.mark.parametrize("kwargs, error", [(dict(patience=0), ValueError), (dict(patience=2.5), TypeError),
                                           (dict(patience="3"), TypeError), (dict(min_delta=-0.1), ValueError)])
def test_early_stopping_names_a_bad_patience_or_min_delta(kwargs, error):
    from pimm_fn.callbacks import EarlyStopping

    with pytest.raises(error, match="EarlyStopping"):
        EarlyStopping("loss", **kwargs)


@pytest.mark.parametrize("args, kwargs, match", [
    ((None, [1]), {}, "eval_fn"), ((lambda s, b: {}, None), {}, "loader"),
    ((lambda s, b: {}, [1]), {"metric": "mIoU"}, "lacks init"),
])
def test_evaluate_names_a_bad_argument_when_built_not_after_an_epoch(args, kwargs, match):
    from pimm_fn.metrics import Accuracy

    with pytest.raises(TypeError, match=match):
        Evaluate(*args, **kwargs)
    with pytest.raises(TypeError, match="instance"):
        Evaluate(lambda s, b: {}, [1], metric=Accuracy)
    Evaluate.of(lambda state: {"acc": 1.0})  # the whole-state form takes no loader


def test_trace_and_metrics_record_refuse_a_cadence_below_one(tmp_path):
    from pimm_fn.callbacks import Trace
    from pimm_fn.report import MetricsRecord

    with pytest.raises(ValueError, match="batch_stats_every"):
        Trace(batch_stats_every=0)
    with pytest.raises(ValueError, match="every_steps"):
        MetricsRecord(tmp_path / "metrics.jsonl", every_steps=0)  # it became 1 silently
