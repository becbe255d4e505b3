"""Built-in callbacks and evaluation metrics."""
import io
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fit_helpers import PermLoader, Recorder, dataset, make_state, step_fn

from pimm_fn import events as ev
from pimm_fn import metrics as M
from pimm_fn.callbacks import (
    Checkpoint,
    EarlyStopping,
    Evaluate,
    ProgressBar,
    StopOnNonFinite,
    TensorBoard,
    TextLog,
    Trace,
    WandB,
    batch_stats,
    on,
    resume,
)
from pimm_fn.fit import fit
from pimm_fn.tree import tree_leaves


@pytest.fixture(scope="module")
def data():
    return dataset(32)  # 4 steps per epoch


def _eval_fn(state, batch):
    logits = torch.func.functional_call(state.model, (state.params, state.buffers), (batch["x"],))
    return {"pred": logits.argmax(-1), "target": batch["y"],
            "loss": torch.nn.functional.cross_entropy(logits, batch["y"])}


def test_tensorboard_tags_read_back(data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    val = [{"x": data[0][:16], "y": data[1][:16]}]
    res = fit(make_state(), PermLoader(*data), step_fn, epochs=2, block_seconds=0,
              callbacks=[TensorBoard(tmp_path, sync_every=3),
                         Evaluate(_eval_fn, val, metric=M.Accuracy(), every_epochs=1)])
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train_batch/loss", "train_batch/grad_norm", "params/lr", "train/loss", "val/acc", "val/loss"} <= tags
    assert [s.step for s in acc.Scalars("train_batch/loss")] == list(range(1, 9))
    assert [s.step for s in acc.Scalars("train/loss")] == [4, 8]
    assert [s.step for s in acc.Scalars("val/acc")] == [4, 8]
    assert acc.Scalars("params/lr")[0].value == pytest.approx(0.05)
    # each step's own values (one Event is refilled per step: no value may leak between steps)
    for key in ("loss", "grad_norm"):
        assert [s.value for s in acc.Scalars(f"train_batch/{key}")] == pytest.approx(
            res.history.values(key).tolist(), rel=1e-6)
    assert [s.value for s in acc.Scalars("train/loss")] == pytest.approx(
        [e["loss"] for e in res.history.epoch_averages()], rel=1e-6)


def test_refilled_events_equal_fresh_protos(tmp_path):
    """One Event per tag set is refilled each step: its bytes are a fresh Event's, steps and
    values never leak between steps, out-of-range values become inf as the proto makes them."""
    import math

    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary

    tb = TensorBoard(tmp_path)
    tags = ("train_batch/loss", "params/lr", "x" * 200, "train_batch/ünï")
    for step, values in [(0, [0.0, 1e-3, -2.5, 7.0]), (1, [math.inf, -math.inf, 1e40, 1e-45]),
                         (2**40 + 3, [1.0, 2.0, 3.0, 4.0]), (-1, [0.1, 0.2, 0.3, 0.4])]:
        want = Event(step=step, wall_time=1764789600.125, summary=Summary(value=[
            Summary.Value(tag=t, simple_value=v) for t, v in zip(tags, values)])).SerializeToString()
        assert tb._event(step, 1764789600.125, tags, values) == want


def test_tensorboard_huge_and_bool_values_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoard(tmp_path, sync_every=2)
    tb._rows = [(1, {"loss": torch.tensor(1e40, dtype=torch.float64), "skipped": torch.tensor(True)}),
                (2, {"loss": torch.tensor(0.5), "skipped": torch.tensor(False), "n": 3})]
    tb.drain()
    tb._close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [s.value for s in acc.Scalars("train_batch/loss")] == [float("inf"), 0.5]
    assert [s.value for s in acc.Scalars("train_batch/skipped")] == [1.0, 0.0]
    assert [(s.step, s.value) for s in acc.Scalars("train_batch/n")] == [(2, 3.0)]


def _event_records(folder):
    """The records of the one event file in ``folder``, wall times zeroed (they differ per run)."""
    from tensorboardX.proto.event_pb2 import Event

    (path,) = [os.path.join(folder, f) for f in os.listdir(folder)]
    raw, out, i = open(path, "rb").read(), [], 0
    while i < len(raw):
        n = int.from_bytes(raw[i:i + 8], "little")
        e = Event.FromString(raw[i + 12:i + 12 + n])
        e.wall_time = 0
        out.append(e)
        i += 12 + n + 4
    return out


def test_tensorboard_writer_thread_writes_what_the_training_thread_would(data, tmp_path):
    for background in (True, False):
        fit(make_state(), PermLoader(*data), step_fn, epochs=2,
            callbacks=[TensorBoard(tmp_path / str(background), sync_every=4, background=background)])
    threaded, inline = _event_records(tmp_path / "True"), _event_records(tmp_path / "False")
    assert len(threaded) > 10 and threaded == inline


def test_tensorboard_writes_a_cpu_run_on_the_training_thread_and_a_device_run_on_its_own(data, tmp_path):
    import threading

    seen = []

    def threads(event, state):
        if isinstance(event, ev.EpochEnd):
            seen.extend(t.name for t in threading.enumerate())

    tb = TensorBoard(tmp_path)
    fit(make_state(), PermLoader(*data), step_fn, epochs=2, callbacks=[tb, threads])
    assert seen and not any(name.startswith("pimm_fn-tensorboard") for name in seen)
    assert len(_event_records(tmp_path)) > 8
    # Metrics on a device would be read (a device sync) on the writer thread.
    off_cpu = make_state().replace(params={k: v.to("meta") for k, v in make_state().params.items()})
    tb = TensorBoard(tmp_path / "device")
    tb.on_train_start(ev.TrainStart(step=0, epoch=0, position=0, samples_seen=0, epochs=1, iters_per_epoch=1,
                                    resumed=False), off_cpu)
    assert tb._threaded
    tb._close()
    with pytest.raises(TypeError, match="background must be True, False or None"):
        TensorBoard(tmp_path, background="yes")


def test_tensorboard_keeps_the_order_when_a_second_run_changes_the_writing_thread(tmp_path):
    start = ev.TrainStart(step=0, epoch=0, position=0, samples_seen=0, epochs=1, iters_per_epoch=1, resumed=False)
    off_cpu = make_state().replace(params={k: v.to("meta") for k, v in make_state().params.items()})
    tb = TensorBoard(tmp_path)
    tb.on_train_start(start, off_cpu)  # a device run: its writes queue on the writer thread
    for s in range(1, 40):
        tb.add_scalar("x", s, s)
    tb.on_train_start(start, make_state())  # a CPU run with the same callback writes inline
    tb.add_scalar("x", 99, 99)
    tb._close()
    steps = [e.step for e in _event_records(tmp_path) if e.HasField("summary")]
    assert steps == list(range(1, 40)) + [99]


def test_tensorboard_writer_error_surfaces_on_the_training_thread(tmp_path):
    tb = TensorBoard(tmp_path, sync_every=1, background=True)
    tb._open()
    tb._wait()
    tb._file._f.close()  # the writer's next write fails (as a full disk would)
    tb._rows = [(1, {"loss": torch.tensor(0.5)})]
    tb.drain()  # handed over; the error happens on the writer thread
    with pytest.raises(ValueError, match="closed file"):
        tb._flush()  # ... and is raised here, before a checkpoint would be written
    with pytest.raises(ValueError):
        tb._close()  # the broken file cannot be closed cleanly either; the thread is gone
    assert tb._worker is None and tb._file is None


def test_tensorboard_every_n_steps(data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fit(make_state(), PermLoader(*data), step_fn, epochs=2, callbacks=[TensorBoard(tmp_path, every_steps=3)])
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [s.step for s in acc.Scalars("train_batch/loss")] == [3, 6]


def test_text_log_lines_and_append_on_resume(data, tmp_path):
    first = fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[TextLog(tmp_path)]).state
    text = (tmp_path / "train.log").read_text()
    assert "from scratch" in text and text.count("Train: [1/1]") == 4
    line = [ln for ln in text.splitlines() if "Train: [1/1][2/4]" in ln][0]
    for part in ("Data ", "Step ", "Iter ", "Remain", "loss: ", "lr/default: "):
        assert part in line
    fit(first, PermLoader(*data), step_fn, epochs=2, callbacks=[TextLog(tmp_path)])
    text2 = (tmp_path / "train.log").read_text()
    assert text2.startswith(text) and "resuming at epoch 1" in text2 and "Train result epoch 2" in text2
    fit(make_state(), PermLoader(*data), step_fn, epochs=1, iters_per_epoch=1, callbacks=[TextLog(tmp_path)])
    assert "resuming" not in (tmp_path / "train.log").read_text()  # a fresh run starts a fresh log


def test_progress_bar_renders_two_bars(data):
    out = io.StringIO()
    bar = ProgressBar(file=out, refresh_seconds=0.0)
    fit(make_state(), PermLoader(*data), step_fn, epochs=2, callbacks=[bar])
    text = out.getvalue()
    assert "epochs" in text and "epoch 2/2" in text and "loss=" in text and "step/s" in text
    assert bar.epoch_bar is None and bar.step_bar is None  # closed at the end
    # a resumed run starts the bars where the cursor is
    mid = fit(make_state(), PermLoader(*data), step_fn, epochs=2,
              callbacks=[on(ev.StepEnd, once=2)(lambda e, s: ev.Stop())]).state
    out = io.StringIO()
    fit(mid, PermLoader(*data), step_fn, epochs=2, callbacks=[ProgressBar(file=out)])
    assert "2/4" in out.getvalue()


def test_checkpoint_every_keep_best_final_and_resume(data, tmp_path):
    val = [{"x": data[0], "y": data[1]}]
    scores = iter([0.5, 0.7, 0.6, 0.9, 0.1, 0.2])

    def scored(state, batch):
        return {"score": torch.tensor(next(scores))}

    rec = Recorder()
    cb = Checkpoint(tmp_path, every_steps=3, every_epochs=None, keep_last=2, best_metric="score", mode="max")
    res = fit(make_state(), PermLoader(*data), step_fn, epochs=3,
              callbacks=[rec, cb, Evaluate(scored, val, every_steps=2, every_epochs=None)])
    saved = [e for e in rec.events if isinstance(e, ev.CheckpointSaved)]
    # every 3 steps, the best (evals at steps 2,4,8 improved), and the final at step 12: again
    # after step 12's own save, whose cursor had not rolled to the next epoch yet
    assert [(e.step, e.best) for e in saved] == [(2, True), (3, False), (4, True), (6, False), (8, True),
                                                 (9, False), (12, False), (12, False)]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "best.ckpt" in files and "latest" in files
    assert sorted(f for f in files if f.startswith("step_")) == ["step_12.ckpt", "step_8.ckpt", "step_9.ckpt"]
    assert cb.best == pytest.approx(0.9) and cb.best_step == 8
    # resume puts the state, the best metric and the other callbacks' state back
    stopper = EarlyStopping("score", mode="max", patience=5)
    stopper.best, stopper.bad = 0.9, 2
    from pimm_fn import checkpoint as ckpt

    ckpt.CheckpointDir(tmp_path).save(res.state, step=12, extra={
        "checkpoint": cb.state_dict(), "loader": None, "callbacks": {"EarlyStopping": stopper.state_dict()}})
    cb2, stop2 = Checkpoint(tmp_path, best_metric="score"), EarlyStopping("score", mode="max", patience=5)
    state = resume(tmp_path, make_state(), callbacks=[cb2, stop2])
    assert int(state.step) == 12 and cb2.best == pytest.approx(0.9) and cb2.best_step == 8
    assert (stop2.best, stop2.bad) == (0.9, 2)


def test_checkpoint_saves_loader_and_callback_state(data, tmp_path):
    class StatefulLoader(PermLoader):
        def state_dict(self):
            return {"epoch_seen": len(self.calls)}

    stopper = EarlyStopping("loss", source="train", patience=99)
    fit(make_state(), StatefulLoader(*data), step_fn, epochs=1,
        callbacks=[stopper, Checkpoint(tmp_path, every_epochs=1)])
    from pimm_fn.callbacks import restore_latest

    _, extra = restore_latest(tmp_path, make_state())
    assert extra["loader"] == {"epoch_seen": 1}
    assert extra["callbacks"]["EarlyStopping"]["best"] == pytest.approx(stopper.best)


def test_checkpoint_on_interrupt(data, tmp_path):
    def interrupt(e, s):
        raise KeyboardInterrupt

    res = fit(make_state(), PermLoader(*data), step_fn, epochs=1,
              callbacks=[on(ev.StepEnd, once=3)(interrupt), Checkpoint(tmp_path, every_epochs=None)])
    assert res.status == "interrupted"
    assert int(resume(tmp_path, make_state()).step) == 3


def test_evaluate_segmentation_metrics(data):
    # a fixed "prediction" to check the formulas against a hand count
    pred = torch.tensor([0, 0, 1, 1, 2, 2, 1, 0])
    target = torch.tensor([0, 1, 1, 1, 2, -1, 0, 0])
    val = [{"pred": pred[:4], "target": target[:4]}, {"pred": pred[4:], "target": target[4:]}]
    rec = Recorder()
    ev_cb = Evaluate(lambda s, b: dict(b), val, metric=M.SegmentationMetric(3), every_epochs=1)
    fit(make_state(), PermLoader(*data), step_fn, epochs=1, iters_per_epoch=1, callbacks=[ev_cb, rec])
    (end,) = [e for e in rec.events if isinstance(e, ev.EvalEnd)]
    # ignoring the -1 point: class 0: I=2 (idx 0,7) P=3 T=3 -> U=4; class 1: I=2 P=3 T=3 -> U=4; class 2: I=1 P=1 T=1
    iou = [2 / 4, 2 / 4, 1.0]
    acc = [2 / 3, 2 / 3, 1.0]
    assert end.metrics["mIoU"] == pytest.approx(sum(iou) / 3)
    assert end.metrics["mAcc"] == pytest.approx(sum(acc) / 3)
    assert end.metrics["allAcc"] == pytest.approx(5 / 7)
    assert end.metrics["iou/2"] == pytest.approx(1.0)
    i, u, t = M.intersection_and_union(pred, target, 3)
    assert i.tolist() == [2, 2, 1] and u.tolist() == [4, 4, 1] and t.tolist() == [3, 3, 1]
    # summable: two halves add up to the whole
    a = M.intersection_and_union(pred[:4], target[:4], 3)
    b = M.intersection_and_union(pred[4:], target[4:], 3)
    assert [(x + y).tolist() for x, y in zip(a, b)] == [i.tolist(), u.tolist(), t.tolist()]
    # an absent class scores 0 IoU, as the seed's 1e-10 epsilon gives
    assert M.segmentation_scores([0, 1], [0, 1], [0, 1])["mIoU"] == pytest.approx(0.5)
    # a label the metric has no class for is the data's or the metric's mistake, not a score
    with pytest.raises(ValueError, match=r"label 2 is outside the 2 classes \(0..1\) and is not ignore_index=-1"):
        M.intersection_and_union(pred, target, 2)
    with pytest.raises(ValueError, match="target label 255 is outside"):
        M.intersection_and_union(pred[:1], torch.tensor([255]), 3)


def test_accuracy_and_evaluate_on_a_model(data):
    c, n = M.accuracy_counts(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, -1]))
    assert (int(c), int(n)) == (1, 2)
    val = [{"x": data[0], "y": data[1]}]
    ev_cb = Evaluate(_eval_fn, val, metric=M.Accuracy(), every_steps=2, every_epochs=None, at_end=True)
    rec = Recorder()
    state = fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[ev_cb, rec]).state
    evals = [e for e in rec.events if isinstance(e, ev.EvalEnd)]
    assert [e.step for e in evals] == [2, 4]  # at_end does not repeat step 4
    logits = torch.func.functional_call(state.model, (state.params, state.buffers), (data[0],))
    assert evals[-1].metrics["acc"] == pytest.approx(float((logits.argmax(-1) == data[1]).float().mean()))
    with pytest.raises(ValueError, match="no batches"):
        Evaluate(_eval_fn, []).evaluate(state)


def test_stop_on_non_finite_names_step_and_batch(data):
    def nan_at_3(state, batch):
        new, m = step_fn(state, batch)
        if int(state.step) == 2:
            m = dict(m, loss=torch.tensor(float("nan")))
        return new, m

    rec = Recorder()
    with pytest.warns(RuntimeWarning, match="nan at step 3"):
        res = fit(make_state(), PermLoader(*data), nan_at_3, epochs=2, callbacks=[StopOnNonFinite(), rec])
    assert res.status == "stopped" and int(res.state.step) == 3
    assert "batch of 8 samples" in res.stop_reason and "epoch 0, position 2" in res.stop_reason
    # batched checks: still names step 3, stops at the next check
    with pytest.warns(RuntimeWarning, match="at step 3"):
        res = fit(make_state(), PermLoader(*data), nan_at_3, epochs=2, callbacks=[StopOnNonFinite(check_every=4)])
    assert int(res.state.step) == 4
    with pytest.raises(FloatingPointError, match="step 3"):
        fit(make_state(), PermLoader(*data), nan_at_3, epochs=2, callbacks=[StopOnNonFinite(raise_error=True)])



def test_callbacks_that_could_never_act_are_refused(data):
    # A watched metric no step reports, or a schedule that never fires, would watch nothing.
    with pytest.raises(KeyError, match=r"StopOnNonFinite\(key='Loss'\): the step reported \[.*'loss'"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[StopOnNonFinite(key="Loss")])
    with pytest.raises(KeyError, match=r"EarlyStopping: the epoch averages are \[.*\], not 'los'"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[EarlyStopping("los", source="train")])
    for make in (lambda n: Evaluate(_eval_fn, [], every_epochs=n), lambda n: TextLog(".", every_steps=n),
                 lambda n: Checkpoint(".", every_steps=n)):
        for n in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="must be a positive int or None"):
                make(n)
    with pytest.raises(ValueError, match="check_every must be an int >= 1"):
        StopOnNonFinite(check_every=0)


def test_early_stopping(data):
    val = [{"x": data[0], "y": data[1]}]
    values = iter([1.0, 0.5, 0.6, 0.55, 0.7, 0.1])
    stop = EarlyStopping("m", mode="min", patience=3)
    res = fit(make_state(), PermLoader(*data), step_fn, epochs=9,
              callbacks=[Evaluate(lambda s, b: {"m": torch.tensor(next(values))}, val), stop])
    assert res.status == "stopped" and res.state.cursor.epoch == 5 and "did not improve" in res.stop_reason
    assert stop.best == 0.5


def test_evaluate_counts_samples_as_fit_does():
    # One rule for samples (pimm_fn.data.count_batch): clouds of a point batch, the leading
    # dim of an image batch; a batch it has no rule for adds none.
    def count(loader):
        return Evaluate(lambda s, b: {"m": torch.tensor(1.0)}, loader).evaluate(make_state())[1]

    assert count([{"image": torch.zeros(3, 1, 2, 2)}, {"image": torch.zeros(2, 1, 2, 2)}]) == 5
    assert count([{"coord": torch.zeros(7, 3), "offset": torch.tensor([3, 7])}]) == 2
    assert count(["not a batch"]) == 0


def test_trace_jsonl_and_batch_stats(data, tmp_path):
    batch = {"coord": torch.zeros(10, 3), "offset": torch.tensor([4, 10])}
    assert batch_stats(batch) == {"clouds": 2, "points": 10}
    assert batch_stats({"offset": torch.tensor([4])}) == {"clouds": 1}
    assert batch_stats({"image": torch.zeros(2, 3)}) == {}

    class PointLoader(PermLoader):
        def iter_epoch(self, epoch, start=0):
            for b in super().iter_epoch(epoch, start):
                yield dict(b, coord=torch.zeros(12, 3), offset=torch.tensor([5, 12]))

    path = tmp_path / "trace.jsonl"
    fit(make_state(), PointLoader(*data, limit=3), step_fn, epochs=1, callbacks=[Trace(2, jsonl=path)])
    done = fit(make_state(), PointLoader(*data), step_fn, epochs=1, iters_per_epoch=1).state
    fit(done, PointLoader(*data), step_fn, epochs=1, callbacks=[Trace(jsonl=path)])
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    names = [r["name"] for r in recs]
    assert names == ["training_start", "batch", "dataloader_exhausted", "training_end", "training_already_complete"]
    assert recs[1]["step"] == 2 and recs[1]["clouds"] == 2 and recs[1]["points"] == 12


def test_wandb_offline(data, tmp_path):
    try:
        import wandb  # noqa: F401
    except ImportError:
        print("SKIP test_wandb_offline: wandb is not installed (pip install 'pimm_fn[wandb]')")
        pytest.skip("wandb is not installed (pip install 'pimm_fn[wandb]')")
    cb = WandB(project="pimm_fn-test", mode="offline", dir=str(tmp_path))
    fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[cb])
    assert any((tmp_path / "wandb").iterdir())


def test_wandb_without_wandb_says_how_to_install(data, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match="pip install"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[WandB(mode="offline")])


def test_interrupt_during_a_checkpoint_write_leaves_no_partial_file(data, tmp_path, monkeypatch):
    from pimm_fn import checkpoint as ckpt

    real = os.fsync
    hits = {"n": 0}

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if name.endswith(".tmp") and "step_4" in name and hits["n"] == 0:
            hits["n"] += 1
            raise KeyboardInterrupt  # the notebook's stop button, mid-write
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    rec = Recorder()
    res = fit(make_state(), PermLoader(*data), step_fn, epochs=2,
              callbacks=[rec, Checkpoint(tmp_path, every_steps=2, every_epochs=None, save_on_interrupt=False,
                                         background=False)])  # an interrupt lands on the training thread
    assert hits["n"] == 1 and res.status == "interrupted" and int(res.state.step) == 4
    assert rec.kinds()[-1] == "Interrupted"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".ckpt") == ["step_2.ckpt"]
    assert ckpt.CheckpointDir(tmp_path).latest().name == "step_2.ckpt"


def test_background_checkpoints_equal_foreground_ones_and_are_durable_when_fit_returns(data, tmp_path):
    from pimm_fn import checkpoint as ckpt

    runs = {}
    for background in (False, True):
        rec = Recorder()
        folder = tmp_path / str(background)
        res = fit(make_state(), PermLoader(*data), step_fn, epochs=2,
                  callbacks=[rec, Checkpoint(folder, every_steps=2, keep_last=None, background=background)])
        # every write was reported (in order) and is on disk by the time fit returns
        saved = [e.step for e in rec.events if isinstance(e, ev.CheckpointSaved)]
        assert saved == sorted(saved) and all((folder / f"step_{s}.ckpt").is_file() for s in saved)
        runs[background] = (saved, folder, res.state)
    assert runs[True][0] == runs[False][0] and runs[True][0]
    for step in runs[True][0]:
        a, _ = ckpt.restore(runs[False][1] / f"step_{step}.ckpt", make_state())
        b, _ = ckpt.restore(runs[True][1] / f"step_{step}.ckpt", make_state())
        for x, y in zip(tree_leaves(a.params), tree_leaves(b.params)):
            assert torch.equal(x, y)
    assert ckpt.CheckpointDir(runs[True][1]).latest().name == f"step_{runs[True][0][-1]}.ckpt"


def test_a_failed_background_write_raises_on_the_training_thread_and_keeps_latest(data, tmp_path, monkeypatch):
    from pimm_fn import checkpoint as ckpt

    real = os.fsync

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if name.endswith(".tmp") and "step_4" in name:
            raise OSError(28, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(ckpt.CheckpointError, match=r"step 4 .*No space left.*intact.*latest"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=3,
            callbacks=[Checkpoint(tmp_path, every_steps=2, every_epochs=None)])
    latest = ckpt.CheckpointDir(tmp_path).latest()
    assert latest.name != "step_4.ckpt" and not (tmp_path / "step_4.ckpt").exists()
    ckpt.verify(latest)  # whatever latest names is complete
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_resumed_fit_hands_back_the_whole_runs_history_from_the_checkpoint(data, tmp_path):
    from pimm_fn import History

    full = fit(make_state(), PermLoader(*data), step_fn, epochs=3).history  # 12 steps
    # a run stopped mid-epoch 1 at step 6; Checkpoint saves its final state there
    first = fit(make_state(), PermLoader(*data), step_fn, epochs=3,
                callbacks=[Checkpoint(tmp_path, every_epochs=1), on(ev.StepEnd, once=6)(lambda e, s: ev.Stop())])
    assert first.status == "stopped" and len(first.history) == 6
    history = History()
    state = resume(tmp_path, make_state(), loader=PermLoader(*data), history=history)
    assert int(state.step) == 6 and history.steps == list(range(1, 7))
    rest = fit(state, PermLoader(*data), step_fn, epochs=3, callbacks=[Checkpoint(tmp_path, every_epochs=1)],
               history=history)
    assert rest.history is history and history.steps == list(range(1, 13))
    assert torch.equal(history.values("loss"), full.values("loss"))
    assert history.epochs == [0, 1, 2]  # epoch 1's two halves are one record
    assert [e["loss"] for e in history.epoch_averages()] == [e["loss"] for e in full.epoch_averages()]
    # without a History, resume leaves the history alone: fit returns this call's steps only
    assert len(fit(state, PermLoader(*data), step_fn, epochs=3).history) == 6


@pytest.mark.parametrize("where", ["a_file", "a_file/sub"])
def test_checkpoint_folder_that_cannot_exist_fails_at_the_start(data, tmp_path, where):
    from pimm_fn.checkpoint import CheckpointError

    (tmp_path / "a_file").write_text("not a folder")
    rec = Recorder()
    with pytest.raises(CheckpointError, match="is a file; pass a folder path"):
        fit(make_state(), PermLoader(*data), step_fn, epochs=1, callbacks=[Checkpoint(tmp_path / where), rec])
    assert not any(isinstance(e, ev.StepEnd) for e in rec.events)  # before any training
    assert (tmp_path / "a_file").read_text() == "not a folder"


def test_best_metric_without_its_evaluation_warns(data, tmp_path):
    val = [{"x": data[0][:16], "y": data[1][:16]}]
    evaluate = Evaluate(_eval_fn, val, metric=M.Accuracy(), every_epochs=1, name="test")
    with pytest.warns(UserWarning, match=r"no 'val' evaluation ran in this run \(evaluations: 'test'\)") as w:
        fit(make_state(), PermLoader(*data), step_fn, epochs=1,
            callbacks=[Checkpoint(tmp_path, best_metric="acc"), evaluate])
    assert w[0].filename == __file__
    assert not (tmp_path / "best.ckpt").exists()
