"""The ``pimm-fn`` command: train / eval / bench / list experiments.

    pimm-fn train EXPERIMENT [--set key=value ...] [--save-path DIR] [--resume | --overwrite] [--quick]
    pimm-fn eval EXPERIMENT --checkpoint PATH [--set key=value ...] [--quick]
    pimm-fn bench ...            (see ``pimm-fn bench --help``)
    pimm-fn list

Settings resolve as SETTINGS, then the experiment's QUICK under ``--quick``, then each
``--set`` (an explicit ``--set`` wins); see :mod:`pimm_fn.experiment`. A run folder holds
one run: ``train`` into a folder holding another run refuses unless ``--resume`` (continue
it) or ``--overwrite`` (clear what a run writes there first). ``settings.json`` is written
only once the run has been built and resumed, so a failed start leaves the folder as it was.

Every error ends the command with one line on stderr, ``pimm-fn: <cause>; <fix>``, and
exit status 1 (130 for an interrupted run); ``--debug`` shows the traceback instead.

Under ``torchrun --nproc_per_node=N -m pimm_fn train EXPERIMENT`` every rank builds the
experiment with its rank and world size; only rank 0 writes logs, checkpoints and the
report, and every rank restores the same checkpoint on ``--resume``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .atomic import atomic_write
from .experiment import ExperimentError, Run, RunContext, available_experiments, experiment_settings, load_experiment
from .settings import SettingsError

# What a run writes into its folder (nothing else is a sign of a run, nor cleared by
# --overwrite): top-level files, and per sub-folder the file names it writes there.
RUN_FILES = ("settings.json", "metrics.jsonl", "summary.json", "train.log", "curves.png", "prediction.png")
RUN_DIRS = {
    "checkpoints": ("step_*.ckpt", "best.ckpt", "latest", ".*.tmp"),
    "tensorboard": ("events.out.tfevents.*",),
}


class CliError(Exception):
    """An error the command line reports as one line: what went wrong, then what to do."""

    def __init__(self, cause: str, fix: str):
        super().__init__(f"{cause}; {fix}")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="on an error, show the traceback, not one line")
    p = argparse.ArgumentParser(prog="pimm-fn", description="pimm_fn: functional training for point clouds")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an experiment (experiments/<name>.py)", parents=[common])
    t.add_argument("experiment")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of the experiment (repeatable; wins over --quick)")
    t.add_argument("--save-path", default=None, help="run folder (default runs/<experiment>)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run folder")
    t.add_argument("--overwrite", action="store_true",
                   help="clear what an earlier run wrote in the run folder (other files stay), then train afresh")
    t.add_argument("--quick", action="store_true",
                   help="a smoke test: the experiment's QUICK settings and a few iterations per epoch")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    e = sub.add_parser("eval", help="evaluate a checkpoint of an experiment", parents=[common])
    e.add_argument("experiment")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--quick", action="store_true")
    b = sub.add_parser("bench", help="benchmark a step function", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("list", help="list the experiments", parents=[common])
    return p


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _run_marks(save: Path) -> list[str]:
    """The names in ``save`` that a run wrote (files, and sub-folders with a slash)."""
    marks = [name for name in RUN_FILES if (save / name).is_file()]
    return marks + [name + "/" for name in RUN_DIRS if (save / name).is_dir()]


def _check_save_path(save: Path) -> None:
    """Refuse a run folder that cannot exist (a file, or a path under one) or whose nearest
    existing folder is not writable, before anything is built."""
    if save.exists() and not save.is_dir():
        raise CliError(f"--save-path {save} is a file, not a folder", "pass a folder path")
    existing = save
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CliError(f"--save-path {save} lies under the file {existing}", "pass a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CliError(f"--save-path {save} cannot be written: {existing} is not writable",
                       "pass a folder you can write to")


def _clear_run(save: Path) -> int:
    """Delete what a run writes in ``save`` (see RUN_FILES / RUN_DIRS); returns the count.

    Only those names go: a sub-folder holding anything else keeps it (and stays), and so
    does every other file, so ``--overwrite`` on a folder that is not a run folder is safe.
    """
    removed = 0
    for name in RUN_FILES:
        path = save / name
        if path.is_file() or path.is_symlink():
            path.unlink()
            removed += 1
    for name, patterns in RUN_DIRS.items():
        folder = save / name
        if not folder.is_dir() or folder.is_symlink():
            continue
        for pattern in patterns:
            for path in folder.glob(pattern):
                if path.is_file() or path.is_symlink():
                    path.unlink()
                    removed += 1
        if not any(folder.iterdir()):
            folder.rmdir()
    return removed


def _write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON at ``path``, whole or not at all (a run killed mid-write keeps the old file)."""
    text = json.dumps(obj, indent=2).encode()
    atomic_write(path, lambda f: f.write(text))


def _settings_diff(save: Path, settings: dict) -> str:
    """``width=32 (now 16), ...``: where ``settings`` differ from the run folder's settings.json."""
    try:
        saved = json.loads((save / "settings.json").read_text())
    except (OSError, ValueError):
        return ""
    return ", ".join(f"{k}={saved[k]!r} (now {v!r})" for k, v in settings.items() if k in saved and saved[k] != v)


def _checkpoint_error(err, path, experiment: str, settings: dict, run_folder: Optional[Path], retry: str) -> CliError:
    """One-line cause and fix for a checkpoint that cannot be restored."""
    from . import checkpoint as ckpt

    if isinstance(err, ckpt.CheckpointMismatchError):
        diffs = getattr(err, "differences", None) or [_one_line(err)]
        cause = (f"checkpoint {path} does not fit experiment {experiment!r} with these settings "
                 f"({len(diffs)} difference{'s' if len(diffs) != 1 else ''}, e.g. {diffs[0]})")
        changed = _settings_diff(run_folder, settings) if run_folder is not None else ""
        if changed:
            fix = f"its run's settings.json differs: {changed}; use those settings, or {retry}"
        else:
            fix = f"pass the settings it was trained with (its run folder's settings.json), or {retry}"
        return CliError(cause, fix)
    if isinstance(err, ckpt.CheckpointCorruptError):
        intact = getattr(err, "intact", None)
        detail = _one_line(getattr(err, "detail", err))
        cause = detail if str(path) in detail else f"checkpoint {path} is corrupt: {detail}"
        fix = f"the earlier checkpoint {intact} is intact: use it, or {retry}" if intact else retry
        return CliError(cause, fix)
    if isinstance(err, ckpt.CheckpointNotFoundError):
        folder = Path(path).parent
        near = sorted(p.name for p in folder.glob("*.ckpt")) if folder.is_dir() else []
        return CliError(f"checkpoint {path} does not exist",
                        f"pass an existing file ({', '.join(near)} are in {folder})" if near else retry)
    return CliError(f"cannot restore {path}: {_one_line(err)}", retry)


def _standard_callbacks(run: Run, save: Path, is_main: bool, progress: bool, world_size: int = 1):
    from .callbacks import Checkpoint, ProgressBar, RanksInSync, StopOnNonFinite, TensorBoard, TextLog
    from .report import MetricsRecord

    cbs: list = [StopOnNonFinite(check_every=10)]
    if world_size > 1:  # every rank: a collective
        cbs.append(RanksInSync())
    evaluator = run.evaluator()
    if evaluator is not None:
        cbs.append(evaluator)
    record = None
    if is_main:
        record = MetricsRecord(save / "metrics.jsonl", every_steps=5)
        cbs += [TextLog(save), TensorBoard(save / "tensorboard", sync_every=50), record]
        if progress:
            cbs.append(ProgressBar(metrics=("loss",)))
        cbs.append(Checkpoint(save / "checkpoints", every_epochs=1, keep_last=2,
                              best_metric=run.best_metric, mode=run.best_mode))
    return cbs + list(run.callbacks), record


def _write_report(run: Run, result, save: Path, record, settings: dict, seconds: float) -> dict:
    from .report import plot_curves, read_records

    records = read_records(save / "metrics.jsonl")
    summary = {
        "status": result.status,
        "step": int(result.state.step),
        "epoch": result.state.cursor.epoch,
        "samples_seen": result.state.cursor.samples_seen,
        "seconds_this_process": round(seconds, 1),
    }
    evals = records.get("val", [])
    if evals:
        summary["final_eval"] = {k: v for k, v in evals[-1].items() if k not in ("kind",)}
        if run.best_metric and any(run.best_metric in r for r in evals):
            pick = max if run.best_mode == "max" else min
            summary["best_" + run.best_metric] = pick(r[run.best_metric] for r in evals if run.best_metric in r)
    train = records.get("train", [])
    if train:
        summary["final_train"] = {k: v for k, v in train[-1].items() if k not in ("kind",)}
    summary["settings"] = settings
    _write_json(save / "summary.json", summary)
    plot_curves(records, save / "curves.png")
    if run.render is not None:
        run.render(result.state, save / "prediction.png")
    return summary


def train(args) -> int:
    from . import checkpoint as ckpt
    from . import distributed
    from .callbacks import resume as resume_state
    from .fit import History, fit

    module = load_experiment(args.experiment)
    settings = experiment_settings(module, args.overrides, quick=args.quick)
    save = Path(args.save_path or Path("runs") / Path(args.experiment).stem).resolve()
    if args.resume and args.overwrite:
        raise CliError("--resume and --overwrite contradict each other (continue the run, or clear it)",
                       "pass one of them")
    _check_save_path(save)  # before the data and the model are built
    marks = _run_marks(save)
    if marks and not (args.resume or args.overwrite):
        raise CliError(f"{save} already holds a run ({', '.join(marks)})",
                       "continue it with --resume, train into a new --save-path, or pass --overwrite to clear it first")
    ctx_dist = distributed.init_from_env()
    ctx = RunContext(save_path=save, device=ctx_dist.device, rank=ctx_dist.rank,
                     world_size=ctx_dist.world_size, quick=args.quick)
    run = module.build(settings, ctx)
    callbacks, record = _standard_callbacks(run, save, ctx_dist.is_main, not args.no_progress, ctx_dist.world_size)
    state = run.state
    history = History()  # a resumed run's checkpoints carry the whole run's step metrics, not only this process's
    if args.resume:
        try:
            state = resume_state(save / "checkpoints", state, loader=run.loader, callbacks=callbacks, step=run.step,
                                 history=history)
        except ckpt.CheckpointError as err:
            path = ckpt.CheckpointDir(save / "checkpoints").latest() or save / "checkpoints"
            raise _checkpoint_error(err, path, args.experiment, settings, save,
                                    "train afresh into a new --save-path") from err
    if state is run.state and run.epochs < 1:  # (MINIMUM usually catches it first, naming the setting)
        raise CliError(f"experiment {args.experiment!r} built a run of {run.epochs} epochs",
                       "pass --set epochs=N with N >= 1")
    if state.cursor.epoch >= run.epochs:
        more = "raise --set epochs=N to train on, or " if "epochs" in settings else ""
        raise CliError(f"training in {save} is already complete (epoch {state.cursor.epoch} >= epochs {run.epochs}); "
                       "nothing was trained", f"{more}train into a new --save-path")
    if state is not run.state:
        print(f"pimm-fn: resuming from step {int(state.step)} "
              f"(epoch {state.cursor.epoch}, iteration {state.cursor.position})", flush=True)
    if ctx_dist.is_main:
        # Only now, with the run built and resumed, does the folder change.
        if args.overwrite and marks:
            print(f"pimm-fn: --overwrite: cleared {_clear_run(save)} files of the earlier run in {save}", flush=True)
        try:
            save.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CliError(f"--save-path {save} cannot be made ({err.strerror})",
                           "pass a folder you can write to") from None
        _write_json(save / "settings.json", {"experiment": args.experiment, **settings})
    start = time.perf_counter()
    with distributed.guard():
        result = fit(state, run.loader, run.step, epochs=run.epochs, callbacks=callbacks,
                     iters_per_epoch=run.iters_per_epoch, history=history)
    if ctx_dist.is_main:
        summary = _write_report(run, result, save, record, settings, time.perf_counter() - start)
        shown = summary.get("final_eval") or summary.get("final_train") or {}
        print(f"pimm-fn: {result.status} at step {summary['step']}; "
              + ", ".join(f"{k}={v:.4g}" for k, v in shown.items() if isinstance(v, float))
              + f"\npimm-fn: run folder {save}", flush=True)
    if result.status == "interrupted":
        return 130
    distributed.shutdown()
    return 0


def evaluate(args) -> int:
    from . import checkpoint as ckpt

    module = load_experiment(args.experiment)
    settings = experiment_settings(module, args.overrides, quick=args.quick)
    path = Path(args.checkpoint).resolve()
    if not path.is_file():  # before building: a typo should not wait for the data and model
        raise _checkpoint_error(ckpt.CheckpointNotFoundError(str(path)), path, args.experiment, settings, None,
                                "pass a checkpoint file (RUN/checkpoints/best.ckpt or step_N.ckpt)")
    run = module.build(settings, RunContext(save_path=path.parent, quick=args.quick))
    if run.evaluate is None:
        raise CliError(f"experiment {args.experiment!r} defines no evaluation",
                       "give its build() an evaluation: Run(evaluate=recipes.segmentation_eval(...)), an Evaluate, "
                       "or a function state -> dict")
    try:
        state, _ = ckpt.restore(path, like=run.state)
    except ckpt.CheckpointError as err:
        # a checkpoint lives in RUN/checkpoints/, beside the run's settings.json
        raise _checkpoint_error(err, path, args.experiment, settings, path.parent.parent,
                                "pass another checkpoint to --checkpoint") from err
    metrics = run.evaluator().metrics(state)
    print(json.dumps({"checkpoint": str(args.checkpoint), "step": int(state.step), **metrics}, indent=2))
    return 0


def _command(args) -> int:
    if args.command == "list":
        print("\n".join(available_experiments()))
        return 0
    if args.command == "bench":
        from .bench import bench_main

        return int(bench_main(args.rest) or 0)
    if args.command == "eval":
        return evaluate(args)
    return train(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command; an error prints ``pimm-fn: <cause>; <fix>`` on stderr and returns 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # bench parses its own arguments (as `python -m pimm_fn.bench`), its --help included:
        # argparse hands a sub-command's REMAINDER nothing that starts with a dash.
        args = argparse.Namespace(command="bench", rest=argv[1:])
    else:
        args = _parser().parse_args(argv)
    # The CLI opts in to the memo of inductor's CPU probes (seconds off every compile;
    # pimm_fn.compile.isa_memo); PIMM_FN_ISA_MEMO=0 opts out.
    os.environ.setdefault("PIMM_FN_ISA_MEMO", "1")
    try:
        return _command(args)
    except Exception as err:  # KeyboardInterrupt / SystemExit pass through
        if getattr(args, "debug", False):
            raise
        from .data.fetch import DatasetMissingError

        message = _one_line(err) or type(err).__name__
        if not isinstance(err, (CliError, SettingsError, ExperimentError, DatasetMissingError)):
            # not an error this module foresaw: keep its type, and say how to see where it came from
            message = f"{type(err).__name__}: {message}; rerun with --debug for the traceback"
        print(f"pimm-fn: {message}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
