"""The ``pimm-fn`` command: train / eval / bench / list experiments.

    pimm-fn train EXPERIMENT [--set key=value ...] [--save-path DIR] [--resume] [--quick]
    pimm-fn eval EXPERIMENT --checkpoint PATH [--set key=value ...]
    pimm-fn bench ...            (see ``pimm-fn bench --help``)
    pimm-fn list

Under ``torchrun --nproc_per_node=N -m pimm_fn train EXPERIMENT`` every rank builds the
experiment with its rank and world size; only rank 0 writes logs, checkpoints and the
report, and every rank restores the same checkpoint on ``--resume``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from .experiment import Run, RunContext, available_experiments, experiment_settings, load_experiment
from .settings import SettingsError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pimm-fn", description="pimm_fn: functional training for point clouds")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an experiment (experiments/<name>.py)")
    t.add_argument("experiment")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of the experiment (repeatable)")
    t.add_argument("--save-path", default=None, help="run folder (default runs/<experiment>)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run folder")
    t.add_argument("--quick", action="store_true", help="a few steps only (smoke test)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    e = sub.add_parser("eval", help="evaluate a checkpoint of an experiment")
    e.add_argument("experiment")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--quick", action="store_true")
    b = sub.add_parser("bench", help="benchmark a step function", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("list", help="list the experiments")
    return p


def _standard_callbacks(run: Run, save: Path, is_main: bool, progress: bool):
    from .callbacks import Checkpoint, Evaluate, ProgressBar, StopOnNonFinite, TensorBoard, TextLog
    from .report import MetricsRecord

    cbs: list = [StopOnNonFinite(check_every=10)]
    if run.evaluate is not None:
        def eval_fn(state, _batch, _evaluate=run.evaluate):
            return {k: torch.tensor(float(v)) for k, v in _evaluate(state).items()}

        cbs.append(Evaluate(eval_fn, [None], every_epochs=run.eval_every_epochs, name="val", at_end=True))
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
    (save / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_curves(records, save / "curves.png")
    if run.render is not None:
        run.render(result.state, save / "prediction.png")
    return summary


def train(args) -> int:
    from . import distributed
    from .callbacks import resume as resume_state
    from .fit import fit

    module = load_experiment(args.experiment)
    try:
        settings = experiment_settings(module, args.overrides, quick=args.quick)
    except SettingsError as err:
        raise SystemExit(f"pimm-fn: {err}") from None
    ctx_dist = distributed.init_from_env()
    save = Path(args.save_path or Path("runs") / Path(args.experiment).stem).resolve()
    if ctx_dist.is_main:
        save.mkdir(parents=True, exist_ok=True)
        (save / "settings.json").write_text(json.dumps({"experiment": args.experiment, **settings}, indent=2))
    ctx = RunContext(save_path=save, device=ctx_dist.device, rank=ctx_dist.rank,
                     world_size=ctx_dist.world_size, quick=args.quick)
    run = module.build(settings, ctx)
    callbacks, record = _standard_callbacks(run, save, ctx_dist.is_main, not args.no_progress)
    state = run.state
    if args.resume:
        state = resume_state(save / "checkpoints", state, loader=run.loader, callbacks=callbacks)
        if state is not run.state:
            print(f"pimm-fn: resuming from step {int(state.step)} "
                  f"(epoch {state.cursor.epoch}, iteration {state.cursor.position})", flush=True)
    start = time.perf_counter()
    with distributed.guard():
        result = fit(state, run.loader, run.step, epochs=run.epochs, callbacks=callbacks,
                     iters_per_epoch=run.iters_per_epoch)
    if result.status == "already_complete":
        print(f"pimm-fn: training already complete (epoch {state.cursor.epoch} >= epochs {run.epochs}); "
              "raise --set epochs=N to train on", flush=True)
        return 0
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
    from .checkpoint import restore

    module = load_experiment(args.experiment)
    try:
        settings = experiment_settings(module, args.overrides, quick=args.quick)
    except SettingsError as err:
        raise SystemExit(f"pimm-fn: {err}") from None
    ctx = RunContext(save_path=Path(args.checkpoint).resolve().parent, quick=args.quick)
    run = module.build(settings, ctx)
    if run.evaluate is None:
        raise SystemExit(f"pimm-fn: experiment {args.experiment!r} defines no evaluation")
    state, _ = restore(args.checkpoint, like=run.state)
    metrics = {k: float(v) for k, v in run.evaluate(state).items()}
    print(json.dumps({"checkpoint": str(args.checkpoint), "step": int(state.step), **metrics}, indent=2))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "list":
        print("\n".join(available_experiments()))
        return 0
    if args.command == "bench":
        from .bench import bench_main

        return int(bench_main(args.rest) or 0)
    if args.command == "eval":
        return evaluate(args)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
