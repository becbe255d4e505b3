"""What the engine itself costs: the step boundary and fit's callbacks, interleaved in one process.

1. Boundary: a trivial compiled step (``state.step + 1`` and one reduction) called through
   ``compile_step`` versus the same core compiled bare with ``torch.compile(fullgraph=True)``
   and called on the inner state. The difference per call is what the boundary adds (RNG
   seeding, the host leaves, the finite check). Measured at the caller's stack depth and
   again 60 frames deeper (a notebook calls from deep stacks).
2. fit: a compiled supervised MLP step (64-256-10, batch 256, AdamW + OneCycle, clip 1.0;
   ~0.5-1 ms on 2 cores) run as a bare ``for b in batches: state, m = step(state, b)``
   loop, through ``fit`` with no callbacks, with each callback alone (ProgressBar to
   /dev/null, TensorBoard every step, Checkpoint every epoch) and with all three. Each way
   keeps its own state; a round runs every way once (one ``fit`` call of ``--epochs``
   epochs of ``--steps-per-epoch`` steps each, the order rotating); the figure is the
   median over rounds of each way's time divided by the bare loop's time in the same
   round. What a run pays once (opening files and bars, waiting for its last checkpoint
   write) is measured apart, from one-step runs, and printed beside it.
3. Engine work: the same ways over a host step that hands back the compiled step's metrics
   without running kernels, in process CPU time: what fit and each callback cost per step,
   steady under load where the wall-time ratios of 2. are not.

    python benchmarks/overhead.py                  # table + benchmarks/results/overhead.json
    python benchmarks/overhead.py --quick          # fewer rounds

Speed is measured here, never asserted in tests. Read the load average printed with the
table: on a busy machine the ratios are noise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

import pimm_fn
from pimm_fn import TrainState, compile_step, optim, schedules, steps
from pimm_fn.callbacks import Checkpoint, ProgressBar, TensorBoard
from pimm_fn.compile import Step
from pimm_fn.fit import fit
from pimm_fn.models import MLPClassifier

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load() -> list:
    return [round(x, 2) for x in os.getloadavg()]


# ----------------------------------------------------------------------------- boundary


def _trivial_core(state, batch):
    return state.replace(step=state.step + 1), {"total": batch["x"].sum()}


def _at_depth(depth: int, fn, *args):
    """Call ``fn(*args)`` ``depth`` Python frames below the caller."""
    if depth <= 0:
        return fn(*args)
    return _at_depth(depth - 1, fn, *args)


def boundary(rounds: int, calls: int, deep: int = 60) -> dict:
    """Per-call cost of ``compile_step``'s boundary over the bare compiled core, in microseconds."""
    model = MLPClassifier(8, 2, hidden=(8,))
    state = TrainState.create(model, optim.sgd(0.1), seed=0)
    batch = {"x": torch.randn(4, 8)}
    step = compile_step(Step(_trivial_core, name="trivial"))
    bare = torch.compile(_trivial_core, fullgraph=True)
    inner = state.replace(rng=None, cursor=None)
    holders = {"step": state, "bare": inner}

    def run_step(n):
        s = holders["step"]
        for _ in range(n):
            s, _ = step(s, batch)
        holders["step"] = s

    def run_bare(n):
        s = holders["bare"]
        for _ in range(n):
            s, _ = bare(s, batch)
        holders["bare"] = s

    ways = {"step": run_step, "bare": run_bare}
    for fn in ways.values():
        fn(50)  # compile, warm
    out = {}
    for label, depth in (("shallow", 0), ("deep", deep)):
        times = {k: [] for k in ways}
        for r in range(rounds):
            order = list(ways) if r % 2 == 0 else list(ways)[::-1]
            for k in order:
                t0 = time.perf_counter()
                _at_depth(depth, ways[k], calls)
                times[k].append((time.perf_counter() - t0) / calls * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[label] = {"depth": depth, "us_per_call": med, "boundary_us": med["step"] - med["bare"],
                      "per_round_us": times}
    out["compile_count"] = step.compile_count
    return out


# ----------------------------------------------------------------------------- fit

FIT_WAYS = ("bare_loop", "fit", "fit+progress", "fit+tensorboard", "fit+checkpoint", "fit+checkpoint_fg", "fit+all")


def _mlp_setup(steps_per_epoch: int, total_epochs: int):
    torch.manual_seed(0)
    model = MLPClassifier(64, 10, hidden=(256,))
    horizon = steps_per_epoch * total_epochs
    tx = optim.adamw(schedules.one_cycle(horizon, 1e-3), weight_decay=0.01)
    state = TrainState.create(model, tx, seed=0)
    g = torch.Generator().manual_seed(0)
    pool = [{"x": torch.randn(256, 64, generator=g), "y": torch.randint(0, 10, (256,), generator=g)}
            for _ in range(8)]
    loader = [pool[i % len(pool)] for i in range(steps_per_epoch)]
    return state, loader


def _callbacks(way: str, root: str, devnull) -> list:
    """The callbacks of one way, writing under ``root``."""
    made = {
        "progress": lambda: ProgressBar(file=devnull),
        "tensorboard": lambda: TensorBoard(os.path.join(root, "tb"), every_steps=1),
        "checkpoint": lambda: Checkpoint(os.path.join(root, "ckpt"), every_epochs=1, keep_last=2),
        "checkpoint_fg": lambda: Checkpoint(os.path.join(root, "ckpt"), every_epochs=1, keep_last=2,
                                            background=False),
    }
    if way == "fit":
        return []
    if way == "fit+all":
        return [made[k]() for k in ("progress", "tensorboard", "checkpoint")]
    return [made[way.split("+")[1]]()]


def _fold(step, state0, loader, rounds: int, epochs: int, clock, *more_clocks) -> dict:
    """Every way of FIT_WAYS over ``step``: ``clock`` seconds per round, the order rotating
    (and each of ``more_clocks`` over the same calls, under ``"more"``)."""
    tmp = tempfile.TemporaryDirectory(prefix="pimm_fn_overhead_")
    devnull = open(os.devnull, "w")
    cbs = {w: _callbacks(w, os.path.join(tmp.name, w.replace("+", "_")), devnull) for w in FIT_WAYS if w != "bare_loop"}
    states = {w: state0 for w in FIT_WAYS}

    def bare(state):
        for _ in range(epochs):
            for b in loader:
                state, _ = step(state, b)
        return state

    def through_fit(way):
        def run(state):
            return fit(state, loader, step, epochs=state.cursor.epoch + epochs, callbacks=cbs[way]).state
        return run

    runs = {w: (bare if w == "bare_loop" else through_fit(w)) for w in FIT_WAYS}
    for w in FIT_WAYS:  # compile once, open writers, make folders
        states[w] = runs[w](states[w])
    seconds = {w: [] for w in FIT_WAYS}
    more = [{w: [] for w in FIT_WAYS} for _ in more_clocks]
    for r in range(rounds):
        k = r % len(FIT_WAYS)
        for w in FIT_WAYS[k:] + FIT_WAYS[:k]:
            m0 = [c() for c in more_clocks]
            t0 = clock()
            states[w] = runs[w](states[w])
            seconds[w].append(clock() - t0)
            for c, start, out in zip(more_clocks, m0, more):
                out[w].append(c() - start)
    # What a run pays once, whatever its length (open the event file and the bars, wait for
    # the last checkpoint write): a one-step, one-epoch call minus one bare step.
    one = loader[:1]
    fixed = {w: [] for w in FIT_WAYS}
    for r in range(rounds):
        for w in FIT_WAYS:
            t0 = clock()
            if w == "bare_loop":
                states[w] = step(states[w], one[0])[0]
            else:
                states[w] = fit(states[w], one, step, epochs=states[w].cursor.epoch + 1, callbacks=cbs[w]).state
            fixed[w].append(clock() - t0)
    devnull.close()
    tmp.cleanup()
    return {"seconds": seconds, "fixed": fixed, "more": more}


def fit_overhead(rounds: int, steps_per_epoch: int, epochs: int) -> dict:
    """fit's per-step cost with each callback alone and all together, vs a bare loop (wall time)."""
    state0, loader = _mlp_setup(steps_per_epoch, epochs * (rounds + 2))
    step = compile_step(steps.supervised(clip_grad=1.0))
    out = _fold(step, state0, loader, rounds, epochs, time.perf_counter)
    seconds, fixed = out["seconds"], out["fixed"]
    n = steps_per_epoch * epochs
    ratios = {w: [s / b for s, b in zip(seconds[w], seconds["bare_loop"])] for w in FIT_WAYS}
    return {
        "steps_per_epoch": steps_per_epoch, "epochs_per_call": epochs, "rounds": rounds,
        "bare_ms_per_step": statistics.median(seconds["bare_loop"]) * 1e3 / n,
        "ms_per_step": {w: statistics.median(v) * 1e3 / n for w, v in seconds.items()},
        "overhead": {w: statistics.median(v) - 1 for w, v in ratios.items()},
        "per_round_ratio": ratios,
        "per_run_ms": {w: 1e3 * (statistics.median(fixed[w]) - statistics.median(fixed["bare_loop"]))
                       for w in FIT_WAYS},
        "compile_count": step.compile_count,
    }


def engine_cpu(rounds: int, steps_per_epoch: int, epochs: int) -> dict:
    """The engine's own work per step, without the step: the same ways over a host step that
    returns the compiled step's metrics unchanged (no kernels), in process CPU time (every
    thread, the checkpoint writer's included). Unlike wall-time ratios on a shared machine,
    this is steady under load: it says what fit and the callbacks cost, not what a busy
    neighbour did."""
    state0, loader = _mlp_setup(steps_per_epoch, epochs * (rounds + 2))
    compiled = compile_step(steps.supervised(clip_grad=1.0))
    real_state, metrics = compiled(state0, loader[0])

    def host_step(state, batch):
        return state, dict(metrics)  # a fresh dict of the same 0-dim tensors, as a step returns

    out = _fold(host_step, real_state, loader, rounds, epochs, time.process_time, time.thread_time)
    n = steps_per_epoch * epochs

    def over_bare(seconds):
        bare = statistics.median(seconds["bare_loop"])
        return {w: 1e6 * (statistics.median(v) - bare) / n for w, v in seconds.items()}

    # The training thread's share is what a step waits for; the rest (the checkpoint and
    # TensorBoard writer threads) runs beside the steps when a core is free.
    return {"metric_keys": sorted(metrics), "rounds": rounds, "steps_per_epoch": steps_per_epoch,
            "us_per_step_over_bare": over_bare(out["seconds"]),
            "training_thread_us_per_step_over_bare": over_bare(out["more"][0])}


# ----------------------------------------------------------------------------- report


def table(res: dict) -> str:
    b, f = res["boundary"], res["fit"]
    lines = [
        f"pimm_fn {pimm_fn.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average before {res['load_before']} after {res['load_after']}",
        "",
        "step boundary (compile_step call minus the bare compiled core), us per call:",
        "| caller stack | compiled step | bare core | boundary |",
        "|---|---|---|---|",
    ]
    for label in ("shallow", "deep"):
        d = b[label]
        lines.append(f"| {label} (+{d['depth']} frames) | {d['us_per_call']['step']:.1f} | "
                     f"{d['us_per_call']['bare']:.1f} | **{d['boundary_us']:.1f}** |")
    lines += [
        "",
        f"fit overhead over the bare loop (compiled MLP 64-256-10 step, batch 256, bare "
        f"{f['bare_ms_per_step']:.3f} ms/step; {f['epochs_per_call']} epochs x {f['steps_per_epoch']} steps "
        f"per call, median of {f['rounds']} paired rounds):",
        "| way | ms/step | overhead | once per run (1-step run minus 1 bare step) |",
        "|---|---|---|---|",
    ]
    for w in FIT_WAYS:
        lines.append(f"| {w} | {f['ms_per_step'][w]:.3f} | {100 * f['overhead'][w]:+.1f}% | "
                     f"{f['per_run_ms'][w]:.2f} ms |")
    e = res.get("engine_cpu")
    if e:
        lines += [
            "",
            f"engine work per step without the step (a host step returning the compiled step's metrics "
            f"{e['metric_keys']}; CPU time of the process (all threads) and of the training thread; median "
            f"of {e['rounds']} rounds), and as a share of the bare compiled step ({f['bare_ms_per_step']:.3f} ms):",
            "| way | all threads, us/step | share of the step | training thread, us/step | share of the step |",
            "|---|---|---|---|---|",
        ]
        step_us = 1e3 * f["bare_ms_per_step"]
        for w in FIT_WAYS:
            us, main_us = e["us_per_step_over_bare"][w], e["training_thread_us_per_step_over_bare"][w]
            lines.append(f"| {w} | {us:.1f} | {100 * us / step_us:.1f}% | {main_us:.1f} | {100 * main_us / step_us:.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--calls", type=int, default=2000, help="boundary calls per round and way")
    p.add_argument("--steps-per-epoch", type=int, default=200)
    p.add_argument("--epochs", type=int, default=5, help="epochs per fit call (one call per round and way)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="4 rounds, 500 boundary calls")
    p.add_argument("--json", default=os.path.join(RESULTS, "overhead.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.calls = 4, 500
    if args.threads:
        torch.set_num_threads(args.threads)
    res = {"machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                       "threads": torch.get_num_threads()},
           "load_before": load()}
    res["boundary"] = boundary(args.rounds, args.calls)
    res["fit"] = fit_overhead(args.rounds, args.steps_per_epoch, args.epochs)
    res["engine_cpu"] = engine_cpu(args.rounds, args.steps_per_epoch, args.epochs)
    res["load_after"] = load()
    write_results(res, table(res), args.json)
    return 0


def write_results(res: dict, text: str, json_path: str) -> None:
    """Print the table; write it beside the JSON (``name.txt`` next to ``name.json``)."""
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as fh:
        json.dump(res, fh, indent=1)
    with open(os.path.splitext(json_path)[0] + ".txt", "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
