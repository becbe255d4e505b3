"""What the engine itself costs: the step boundary, and fit's cost per step over a bare loop.

1. Boundary: a trivial compiled step (``state.step + 1`` and one reduction) called through
   ``compile_step`` versus the same core compiled bare with ``torch.compile(fullgraph=True)``
   and called on the inner state. The difference per call is what the boundary adds (RNG
   seeding, the host leaves, the finite check). Measured at the caller's stack depth and
   again 60 frames deeper (a notebook calls from deep stacks), for the default step (which
   runs its cache's saved step) and for one built with ``cache=False``.
2. fit: one step function run as a bare ``for b in batches: state, m = step(state, b)`` loop
   and through ``fit`` (no callbacks; ProgressBar to /dev/null + TensorBoard every step +
   Checkpoint every epoch, "fit+all"; with ``--each`` each callback alone), each way with its
   own state. A round runs every way for 1 and for 4 epochs of E steps (one ``fit`` call
   each), in a rotating order. A way's cost per step in a round is the slope
   ``(t(4E) - t(E)) / 3E``: what a run pays once (opening the event file and the bars,
   waiting for the last checkpoint write) cancels, what an epoch pays (its checkpoint, one
   every 200 steps by default: far more often than a real run saves) is spread over its
   steps. The bare loop runs on a frame stack of its own, as fit's epochs do
   (``pimm_fn.frame_room``): at some stack depths a step maps memory on every call, and
   the two would differ by where each was called from. The overhead is that slope minus
   the bare loop's slope of the same round; its
   median over the rounds is printed with its quartiles, beside the slope of each way's
   fastest runs at each length (what a run costs when nothing else on the machine got in
   its way: the figure to compare on a shared machine). What a run pays once is
   ``t(E) - E * slope`` over the bare loop's. Each run is timed in wall time (what training
   waits for) and in CPU time, of the whole process (the writer threads' work included) and
   of the training thread: a busy machine scatters wall time, CPU time much less.

   ``--model mlp``: the compiled supervised MLP 64-256-10 step, batch 256, AdamW + OneCycle,
   clip 1.0 (~0.55 ms on one thread). ``--model ptv3``: the PTv3-class backbone on real LiDAR
   batches (``pimm_fn.bench.workloads.ptv3``), run eagerly (compiling it takes minutes).

    python benchmarks/overhead.py --threads 1                  # mlp; results/overhead.{json,txt}
    python benchmarks/overhead.py --threads 1 --model ptv3 --steps-per-epoch 2 --rounds 5 --skip-boundary

Speed is measured here, never asserted in tests. Read the load average printed with the
table: on a busy machine the spread widens.
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
from pimm_fn.frame_room import call_with_frame_room
from pimm_fn.models import MLPClassifier

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load() -> list:
    return [round(x, 2) for x in os.getloadavg()]
# ----------------------------------------------------------------------------- boundary


def _trivial_core(state, batch):
    return state.replace(step=state.step + 1), {"total": batch["x"].sum()}


def _trivial_core_no_cache(state, batch):
    return state.replace(step=state.step + 1), {"total": batch["x"].sum()}


def _trivial_core_bare(state, batch):
    # The same core as its own code object (as _trivial_core_no_cache): dynamo keeps its
    # compiled entries per code object, and no way may share (and be slowed by) another's.
    return state.replace(step=state.step + 1), {"total": batch["x"].sum()}


def _at_depth(depth: int, fn, *args):
    """Call ``fn(*args)`` ``depth`` Python frames below the caller."""
    if depth <= 0:
        return fn(*args)
    return _at_depth(depth - 1, fn, *args)


def boundary(rounds: int, calls: int, deep: int = 60) -> dict:
    """Per-call cost of ``compile_step``'s boundary over the bare compiled core, in microseconds.

    Two compiled steps: the default one, which goes through the step cache (a fresh folder
    here, so it compiles and saves, then runs the saved step: what every process runs,
    the first included), and one built with ``cache=False`` (``torch.compile``'s own
    entry, as eager-fallback and ``fullgraph=False`` steps and an opted-out cache run).
    """
    model = MLPClassifier(8, 2, hidden=(8,))
    state = TrainState.create(model, optim.sgd(0.1), seed=0)
    batch = {"x": torch.randn(4, 8)}
    cache_dir = tempfile.TemporaryDirectory(prefix="pimm_fn_boundary_cache_")
    steps = {"step": compile_step(Step(_trivial_core, name="trivial"), cache=cache_dir.name),
             "step_no_cache": compile_step(Step(_trivial_core_no_cache, name="trivial"), cache=False)}
    bare = torch.compile(_trivial_core_bare, fullgraph=True)
    holders = dict.fromkeys(steps, state)
    holders["bare"] = state.replace(rng=None, cursor=None)

    def way(name, fn):
        def run(n):
            s = holders[name]
            for _ in range(n):
                s, _ = fn(s, batch)
            holders[name] = s
        return run

    ways = {name: way(name, fn) for name, fn in (*steps.items(), ("bare", bare))}
    for fn in ways.values():
        fn(50)  # compile, warm
    out = {}
    for label, depth in (("shallow", 0), ("deep", deep)):
        times = {k: [] for k in ways}
        for r in range(rounds):
            order = list(ways)[r % len(ways):] + list(ways)[:r % len(ways)]
            for k in order:
                t0 = time.perf_counter()
                _at_depth(depth, ways[k], calls)
                times[k].append((time.perf_counter() - t0) / calls * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[label] = {"depth": depth, "us_per_call": med, "boundary_us": med["step"] - med["bare"],
                      "boundary_no_cache_us": med["step_no_cache"] - med["bare"], "per_round_us": times}
    out["compile_count"] = {k: s.compile_count for k, s in steps.items()}
    cache_dir.cleanup()
    return out


# ----------------------------------------------------------------------------- fit

CALLBACKS = ("progress", "tensorboard", "checkpoint")


def _callbacks(names, root: str, devnull) -> list:
    made = {
        "progress": lambda: ProgressBar(file=devnull),
        "tensorboard": lambda: TensorBoard(os.path.join(root, "tb"), every_steps=1),
        "checkpoint": lambda: Checkpoint(os.path.join(root, "ckpt"), every_epochs=1, keep_last=2),
    }
    return [made[n]() for n in names]


def mlp_workload():
    """The compiled MLP step, its state and a pool of 8 batches."""
    torch.manual_seed(0)
    model = MLPClassifier(64, 10, hidden=(256,))
    state = TrainState.create(model, optim.adamw(schedules.one_cycle(10**7, 1e-3), weight_decay=0.01), seed=0)
    g = torch.Generator().manual_seed(0)
    pool = [{"x": torch.randn(256, 64, generator=g), "y": torch.randint(0, 10, (256,), generator=g)}
            for _ in range(8)]
    return compile_step(steps.supervised(clip_grad=1.0)), state, pool


def ptv3_workload():
    """The PTv3-class step (eager), its state and 4 real LiDAR batches."""
    from pimm_fn.bench import workloads

    wl = workloads.ptv3(4)
    return compile_step(wl.step, eager=True), wl.state, list(wl.batches)


def fit_overhead(step, state0, pool, *, steps_per_epoch: int, epochs: int, rounds: int, each: bool) -> dict:
    """Per-step wall time of each way as a slope over runs of ``epochs`` and ``4 * epochs``
    epochs of ``steps_per_epoch`` steps (see the module doc)."""
    ways = {"bare_loop": None, "fit": ()}
    if each:
        ways.update({f"fit+{c}": (c,) for c in CALLBACKS})
    ways["fit+all"] = CALLBACKS
    loader = [pool[i % len(pool)] for i in range(steps_per_epoch)]
    lengths = (epochs, 4 * epochs)
    tmp = tempfile.TemporaryDirectory(prefix="pimm_fn_overhead_")
    devnull = open(os.devnull, "w")
    cbs = {w: _callbacks(c, os.path.join(tmp.name, w.replace("+", "_")), devnull)
           for w, c in ways.items() if c is not None}
    states = dict.fromkeys(ways, state0)

    def bare_loop(state, k):
        for _ in range(k):
            for b in loader:
                state, _ = step(state, b)
        return state

    def run(way, k):
        state = states[way]
        if way == "bare_loop":
            state = call_with_frame_room(bare_loop, state, k)  # where fit runs its steps
        else:
            state = fit(state, loader, step, epochs=state.cursor.epoch + k, callbacks=cbs[way]).state
        states[way] = state

    step(state0, pool[0])  # compile outside fit: the first call is nobody's overhead
    for way in ways:  # warm: open writers, make folders
        run(way, 1)
    clocks = {"wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time}
    seconds = {(c, w, k): [] for c in clocks for w in ways for k in lengths}
    order = [(w, k) for w in ways for k in lengths]
    for r in range(rounds):
        shift = r % len(order)
        for w, k in order[shift:] + order[:shift]:
            start = {c: clock() for c, clock in clocks.items()}
            run(w, k)
            for c, clock in clocks.items():
                seconds[(c, w, k)].append(clock() - start[c])
    devnull.close()
    tmp.cleanup()

    n = epochs * steps_per_epoch

    def slope(c, w, r):
        return (seconds[(c, w, 4 * epochs)][r] - seconds[(c, w, epochs)][r]) / (3 * n)

    out = {"steps_per_epoch": steps_per_epoch, "epochs": list(lengths), "rounds": rounds}
    for c in clocks:
        res = out[c] = {"us_per_step": {}, "overhead_us": {}, "overhead_quartiles_us": {}, "once_per_run_ms": {},
                        "per_round_overhead_us": {}}
        bare = [slope(c, "bare_loop", r) for r in range(rounds)]
        for w in ways:
            per_step = [slope(c, w, r) for r in range(rounds)]
            over = [1e6 * (a - b) for a, b in zip(per_step, bare)]
            once = [seconds[(c, w, epochs)][r] - n * per_step[r] - (seconds[(c, "bare_loop", epochs)][r] - n * bare[r])
                    for r in range(rounds)]
            res["us_per_step"][w] = 1e6 * statistics.median(per_step)
            res["overhead_us"][w] = statistics.median(over)
            res["overhead_quartiles_us"][w] = _quartiles(over)
            res["once_per_run_ms"][w] = 1e3 * statistics.median(once)
            res["per_round_overhead_us"][w] = over
            # The fastest of the rounds' runs at each length: what a run costs when nothing
            # else on the machine got in its way.
            fastest = {k: min(seconds[(c, w, k)]) for k in lengths}
            res.setdefault("fastest_us_per_step", {})[w] = 1e6 * (fastest[4 * epochs] - fastest[epochs]) / (3 * n)
        bare_fastest = res["fastest_us_per_step"]["bare_loop"]
        res["fastest_overhead_us"] = {w: v - bare_fastest for w, v in res["fastest_us_per_step"].items()}
    out["seconds"] = {f"{c} {w} {k}": v for (c, w, k), v in seconds.items()}
    return out


def _quartiles(xs) -> list:
    if len(xs) < 2:
        return [xs[0], xs[0]] if xs else [0.0, 0.0]
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


# ----------------------------------------------------------------------------- report


def table(res: dict) -> str:
    lines = [
        f"pimm_fn {pimm_fn.__version__}, torch {torch.__version__}, {res['machine']['cpu']}, "
        f"{torch.get_num_threads()} threads, load average before {res['load_before']} after {res['load_after']}",
    ]
    b = res.get("boundary")
    if b:
        lines += [
            "",
            "step boundary (compile_step call minus the bare compiled core), us per call; the default",
            "step runs the saved step of its cache, the other is built with cache=False:",
            "| caller stack | compiled step (default) | bare core | boundary | compiled step, cache=False | boundary |",
            "|---|---|---|---|---|---|",
        ]
        for label in ("shallow", "deep"):
            d = b[label]
            us = d["us_per_call"]
            lines.append(f"| {label} (+{d['depth']} frames) | {us['step']:.1f} | {us['bare']:.1f} | "
                         f"**{d['boundary_us']:.1f}** | {us['step_no_cache']:.1f} | {d['boundary_no_cache_us']:.1f} |")
    f = res["fit"]
    bare_us = f["wall"]["fastest_us_per_step"]["bare_loop"]
    lines += [
        "",
        f"fit over the bare loop, {res['model']} step (bare {bare_us / 1e3:.3f} ms/step), slope over runs of "
        f"{f['epochs'][0]} and {f['epochs'][1]} epochs of {f['steps_per_epoch']} steps (a checkpoint each epoch), "
        f"{f['rounds']} rounds; us/step over the bare loop from the fastest runs (wall; CPU time of the process, "
        "all threads; CPU time of the training thread) and the median of the rounds' paired wall slopes:",
        "| way | wall, fastest runs | share of the step | wall, median of rounds (quartiles) | CPU all threads "
        "| CPU training thread | once per run (wall) |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in f["wall"]["us_per_step"]:
        wall = f["wall"]
        over, (q1, q3), fast = wall["overhead_us"][w], wall["overhead_quartiles_us"][w], wall["fastest_overhead_us"][w]
        lines.append(f"| {w} | {fast:.1f} | {100 * fast / bare_us:+.2f}% | {over:.1f} ({q1:.0f} .. {q3:.0f}) | "
                     f"{f['cpu']['fastest_overhead_us'][w]:.1f} | {f['thread']['fastest_overhead_us'][w]:.1f} | "
                     f"{wall['once_per_run_ms'][w]:.1f} ms |")
    return "\n".join(lines)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("mlp", "ptv3"), default="mlp")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps-per-epoch", type=int, default=200)
    p.add_argument("--epochs", type=int, default=1, help="k: each way runs k and 4k epochs a round")
    p.add_argument("--each", action="store_true", help="also each callback alone")
    p.add_argument("--calls", type=int, default=2000, help="boundary calls per round and way")
    p.add_argument("--skip-boundary", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="5 rounds, 500 boundary calls")
    p.add_argument("--json", default=None, help="default results/overhead.json (overhead_ptv3.json for ptv3)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.calls = 5, 500
    if args.threads:
        torch.set_num_threads(args.threads)
    res = {"machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpu": _cpu(),
                       "cpus": os.cpu_count(), "threads": torch.get_num_threads()},
           "model": args.model, "load_before": load()}
    if not args.skip_boundary:
        res["boundary"] = boundary(args.rounds, args.calls)
    step, state, pool = mlp_workload() if args.model == "mlp" else ptv3_workload()
    res["fit"] = fit_overhead(step, state, pool, steps_per_epoch=args.steps_per_epoch, epochs=args.epochs,
                              rounds=args.rounds, each=args.each)
    res["load_after"] = load()
    name = "overhead.json" if args.model == "mlp" else f"overhead_{args.model}.json"
    write_results(res, table(res), args.json or os.path.join(RESULTS, name))
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
