"""Compiled pimm_fn steps vs the seed-style eager trainer, interleaved, in one run.

    python benchmarks/run_steps.py --threads 1            # full
    python benchmarks/run_steps.py --threads 1 --quick    # fewer rounds / steps, mlp cache probe only
    python benchmarks/run_steps.py --threads 1 --quick --fit-rounds 0 --cache-probe none \\
        --ways seed_eager,pimm_compiled,jax               # pimm_fn vs JAX

For each model (mlp, pointseg on variable-size batches, cnn) every "way" trains from the
same initial weights on the same batches. Ways run round-robin: each round runs every way
for ``--steps`` steps (the order rotates per round), so load on a shared machine slows
all ways alike; each way's figure is the median (and min) step time over all rounds,
quoted as a ratio to the seed-style eager trainer (``seed_eager``: nn.Module +
AdamW(foreach=True) + clip_grad_norm_ + OneCycleLR, the seed's run_step).
``seed_default`` is the same with AdamW's own default implementation, as Pointcept builds
its optimizer: on the CPU torch picks the per-tensor loop (foreach only on accelerators).

The ``jax`` way (benchmarks/jax_ways.py) runs the same models reimplemented in JAX
(jit + optax: clip_by_global_norm + adamw over the same one-cycle lr) from the same
initial weights, when the ``bench`` extra (jax, optax) is installed; otherwise it is
skipped with the reason printed. Its first loss is checked against the torch step's
(|diff| <= 1e-4). ``--threads N`` also starts XLA's CPU client with N threads (see
jax_ways.configure_threads: XLA_FLAGS alone do not limit it).

Models: pimm_fn.models' MLPClassifier, PointSegNet (variable-size point batches, every
total above 4096) and ImageClassifier (see pimm_fn/bench/workloads.py).
Also: fit's per-step overhead over a bare loop (mlp), the machine's bound (forward+backward
FLOPs from FlopCounterMode over the measured peak float32 GEMM rate), per-way peak memory,
time per point on variable- vs fixed-size
point batches, and compile time cold vs warm (two fresh processes, one inductor cache).
Writes benchmarks/results/run_steps.json and run_steps.png.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import jax_ways as J  # imports jax only when the way runs
from pimm_fn.bench import PeakMemory, graph_breaks, machine_info, measure_compile_cache
from pimm_fn.bench import workloads as W
from pimm_fn.compile import compile_step
from pimm_fn.data import count_batch

WAYS = ("seed_eager", "seed_default", "seed_fused", "pimm_eager", "pimm_compiled", "compile_model", "compile_model_opt",
        "jax")
LABELS = {
    "seed_eager": "seed-style eager (AdamW foreach)",
    "seed_default": "seed-style eager (AdamW default)",
    "seed_fused": "eager, AdamW(fused=True)",
    "pimm_eager": "pimm_fn step, eager",
    "pimm_compiled": "pimm_fn step, compiled",
    "compile_model": "torch.compile(model) + eager AdamW",
    "compile_model_opt": "torch.compile(model) + compiled optimizer",
    "pimm_compiled_fixed": "pimm_fn compiled, fixed-size batches",
    "jax": "JAX jit + optax",
}
JAX_CHECK_STEPS = 3  # steps whose losses are compared, torch (pimm_fn eager step) vs JAX


def peak_gemm_gflops(n=2048, reps=6) -> dict:
    """Float32 n x n matmul rate: best and median of ``reps`` timed products."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    flops = 2.0 * n**3
    return {"n": n, "best_gflops": flops / min(times) / 1e9, "median_gflops": flops / statistics.median(times) / 1e9}


def step_flops(model, batch) -> float:
    """Forward+backward FLOPs of one step (matmul/conv ops, as FlopCounterMode counts)."""
    m = copy.deepcopy(model)
    with FlopCounterMode(display=False) as fc:
        m(batch)["loss"].backward()
    return float(fc.get_total_flops())


class Way:
    """One way of training: a callable ``batch -> None`` keeping its own state."""

    def __init__(self, name, run, counter=None):
        self.name, self.run, self.counter = name, run, counter
        self.times_ms: list = []
        self.ms_per_point: list = []
        self.first_call_s = None
        self.compiles_after_warmup = None


def build_ways(wl, only=WAYS):
    model0 = wl.model
    ways = {}
    for name in only:
        if name == "jax":
            ok, why = J.available()
            if not ok:
                print(f"  skip jax: {why}", flush=True)
                continue
            trainer = J.trainer_for(model0, total_steps=W.TOTAL_STEPS, max_lr=W.MAX_LR,
                                    weight_decay=W.WEIGHT_DECAY, clip=W.CLIP)
            ways[name] = Way(name, trainer.run, counter=trainer)
        elif name.startswith("pimm"):
            step = compile_step(wl.step) if name == "pimm_compiled" else compile_step(wl.step, eager=True)
            holder = {"state": wl.state}

            def run(batch, step=step, holder=holder):
                holder["state"], _ = step(holder["state"], batch)

            ways[name] = Way(name, run, counter=step)
        else:
            kw = {"seed_eager": {}, "seed_default": {"foreach": None}, "seed_fused": {"fused": True},
                  "compile_model": {"compile_model": True},
                  "compile_model_opt": {"compile_model": True, "compile_optimizer": True}}[name]
            train_step = W.seed_trainer(copy.deepcopy(model0), **kw)
            ways[name] = Way(name, lambda batch, ts=train_step: ts(batch))
    return ways


def warm(ways, batches, n_warm):
    for w in ways.values():
        t0 = time.perf_counter()
        w.run(batches[0])
        w.first_call_s = time.perf_counter() - t0
        for i in range(1, n_warm):
            w.run(batches[i % len(batches)])
        if hasattr(w.counter, "precompile"):  # jax: one compile per padded point bucket, all before timing
            w.counter.precompile(batches)
        if w.counter is not None:
            w.compiles_after_warmup = w.counter.compile_count
        print(f"  warm {w.name}: first call {w.first_call_s:.1f} s", flush=True)


def interleave(ways, batches, rounds, steps, start):
    names = list(ways)
    pos = start
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            w = ways[name]
            for i in range(steps):
                b = batches[(pos + i) % len(batches)]
                t0 = time.perf_counter()
                w.run(b)
                dt = (time.perf_counter() - t0) * 1e3
                w.times_ms.append(dt)
                pts = count_batch(b).points
                if pts:
                    w.ms_per_point.append(dt / pts)
        pos += steps
    return pos


def memory_pass(ways, batches, start):
    """Peak extra memory of one (untimed) step per way, all on the same batch (point batches
    differ in size, and so does a step's peak): CUDA peak, or torch's CPU allocator
    accounting (profiler memory events) on CPU; see pimm_fn.bench.PeakMemory."""
    out, method = {}, None
    batch = batches[start % len(batches)]
    for name, w in ways.items():
        if name == "jax":  # XLA's buffers are not torch's allocator: not measured
            continue
        mem = PeakMemory(torch.device("cpu"))
        with mem:
            w.run(batch)
        out[name], method = mem.peak_bytes, mem.method
    return out, method


FIT_WAYS = ("bare_loop", "fit_no_callbacks", "fit_callbacks")


def fit_overhead(rounds: int, steps_per_epoch: int = 50) -> dict:
    """fit's per-step cost over a bare Python loop, on the mlp's compiled step.

    Three ways, each with its own state, over the same list of ``steps_per_epoch`` batches:
    ``bare_loop`` (``for b in batches: state, m = step(state, b)``), ``fit`` with no
    callbacks, and ``fit`` with ProgressBar (to /dev/null) + TensorBoard(every_steps=50)
    + Checkpoint(every_epochs=1), one epoch per ``fit`` call (so each round includes one
    TensorBoard write, one checkpoint save and the bars' setup/teardown). Rounds rotate
    the order; the figure is the median over rounds of (epoch wall time / steps).
    """
    import tempfile

    from pimm_fn.callbacks import Checkpoint, ProgressBar, TensorBoard
    from pimm_fn.fit import fit

    wl = W.mlp()
    step = compile_step(wl.step)
    loader = [wl.batches[i % len(wl.batches)] for i in range(steps_per_epoch)]
    tmp = tempfile.TemporaryDirectory(prefix="pimm_fn_fit_overhead_")
    devnull = open(os.devnull, "w")
    cbs = [ProgressBar(file=devnull), TensorBoard(os.path.join(tmp.name, "tb"), every_steps=50),
           Checkpoint(os.path.join(tmp.name, "ckpt"), every_epochs=1)]
    states = {n: wl.state for n in FIT_WAYS}

    def bare(state):
        for b in loader:
            state, _ = step(state, b)
        return state

    def run_fit(state, callbacks):
        return fit(state, loader, step, epochs=state.cursor.epoch + 1, callbacks=callbacks).state

    runs = {"bare_loop": bare, "fit_no_callbacks": lambda s: run_fit(s, ()),
            "fit_callbacks": lambda s: run_fit(s, cbs)}
    for n in FIT_WAYS:  # warm: compile once, open the TensorBoard writer, make the checkpoint dir
        states[n] = runs[n](states[n])
    per_step = {n: [] for n in FIT_WAYS}
    for r in range(rounds):
        for n in FIT_WAYS[r % 3:] + FIT_WAYS[: r % 3]:
            t0 = time.perf_counter()
            states[n] = runs[n](states[n])
            per_step[n].append((time.perf_counter() - t0) * 1e3 / steps_per_epoch)
    devnull.close()
    tmp.cleanup()
    med = {n: statistics.median(v) for n, v in per_step.items()}
    return {"steps_per_epoch": steps_per_epoch, "rounds": rounds, "per_step_ms": per_step, "median_ms": med,
            "overhead_fit_callbacks": med["fit_callbacks"] / med["bare_loop"] - 1,
            "overhead_fit_no_callbacks": med["fit_no_callbacks"] / med["bare_loop"] - 1,
            "compile_count": step.compile_count,
            "callbacks": "ProgressBar(file=/dev/null) + TensorBoard(every_steps=50) + Checkpoint(every_epochs=1)"}


def summarize(ways):
    return {n: {"median_ms": statistics.median(w.times_ms), "min_ms": min(w.times_ms), "max_ms": max(w.times_ms),
                "n": len(w.times_ms), "first_call_s": w.first_call_s,
                "compile_count": None if w.counter is None else w.counter.compile_count,
                "recompiles_after_warmup": (None if w.counter is None
                                            else w.counter.compile_count - w.compiles_after_warmup),
                "recompile_reasons": None if w.counter is None else list(w.counter.recompile_reasons),
                "median_us_per_point": statistics.median(w.ms_per_point) * 1e3 if w.ms_per_point else None}
            for n, w in ways.items()}


def bench_model(name, args, gemm):
    wl = W.WORKLOADS[name]()
    batches = list(wl.batches)
    print(f"[{name}] {wl.notes}", flush=True)
    gb_count, gb_reasons = graph_breaks(wl.step, wl.state, batches[0])  # resets dynamo: before compiling
    ways = build_ways(wl, only=args.ways)
    extra = {}
    if name == "pointseg" and "pimm_compiled" in args.ways:
        fixed = W.pointseg_fixed()
        extra = build_ways(fixed, only=("pimm_compiled",))
        extra["pimm_compiled_fixed"] = extra.pop("pimm_compiled")
    n_warm = 4 if name == "pointseg" else 2  # variable sizes: the dynamic recompile happens in warm-up
    warm(ways, batches, n_warm)
    if extra:
        warm(extra, list(fixed.batches), 2)
    all_ways = {**ways, **extra}
    t0 = time.perf_counter()
    pos = n_warm
    for r in range(args.rounds):  # rounds over all ways, the fixed-size way included
        for wn in list(all_ways)[r % len(all_ways):] + list(all_ways)[: r % len(all_ways)]:
            bs = list(fixed.batches) if wn == "pimm_compiled_fixed" else batches
            interleave({wn: all_ways[wn]}, bs, 1, args.steps, pos)
        pos += args.steps
    timed_s = time.perf_counter() - t0
    mem, mem_method = memory_pass(ways, batches, pos)
    if extra:  # the fixed way on its own batches
        m2, _ = memory_pass(extra, list(fixed.batches), pos)
        mem.update(m2)
    flops = statistics.fmean(step_flops(wl.model, b) for b in batches[:4])
    bound_ms = flops / (gemm["best_gflops"] * 1e9) * 1e3
    jax_check = jax_loss_check(wl, ways["jax"].counter, batches) if "jax" in ways else None
    summary = summarize(all_ways)
    base = summary["seed_eager"]
    for n, s in summary.items():
        s["time_ratio_to_seed"] = s["median_ms"] / base["median_ms"]
        s["speedup_vs_seed"] = base["median_ms"] / s["median_ms"]
        s["min_time_ratio_to_seed"] = s["min_ms"] / base["min_ms"]
        s["x_of_bound"] = s["median_ms"] / bound_ms
        s["peak_memory_mib"] = None if mem.get(n) is None else mem[n] / 2**20
    res = {"model": name, "notes": wl.notes, "load_avg_after": os.getloadavg(),
           "samples_per_step": count_batch(batches[0]).samples,
           "graph_break_count": gb_count, "break_reasons": gb_reasons,
           "flops_per_step": flops, "bound_ms": bound_ms, "ways": summary, "timed_seconds": timed_s,
           "memory_method": mem_method, "jax_loss_check": jax_check}
    if "jax" in summary:
        if "pimm_compiled" in summary:
            res["pimm_compiled_over_jax_time"] = summary["pimm_compiled"]["median_ms"] / summary["jax"]["median_ms"]
        if args.gemm_jax:
            res["bound_ms_xla_gemm"] = flops / (args.gemm_jax["best_gflops"] * 1e9) * 1e3
    if "pimm_compiled_fixed" in summary:
        v = summary["pimm_compiled"]["median_us_per_point"]
        f = summary["pimm_compiled_fixed"]["median_us_per_point"]
        res["variable_vs_fixed_per_point"] = v / f
    return res


def jax_loss_check(wl, trainer, batches, steps=JAX_CHECK_STEPS) -> dict:
    """Losses of the first ``steps`` steps from the initial weights: pimm_fn's eager step vs JAX.

    The first loss is the forward at the shared initial weights (must agree within 1e-4);
    the later ones also go through gradients, clip, AdamW and the schedule.
    """
    step = compile_step(wl.step, eager=True)
    state, torch_losses = wl.state, []
    for b in batches[:steps]:
        state, m = step(state, b)
        torch_losses.append(float(m["loss"]))
    trainer.reset()
    for b in batches[:steps]:
        trainer.run(b, record=True)
    res = J.compare_losses(torch_losses, trainer.losses)
    verdict = "OK" if res["first_ok"] else "MISMATCH"
    print(f"  jax loss check: first loss torch {torch_losses[0]:.6f} vs jax {trainer.losses[0]:.6f} "
          f"(|diff| {res['abs_diff'][0]:.1e}, tol {res['tol']:.0e}: {verdict}); steps 1-{steps} max |diff| "
          f"{max(res['abs_diff']):.1e}", flush=True)
    return res


def table(results):
    lines = []
    for r in results:
        lines.append(f"\n{r['model']}  (fwd+bwd {r['flops_per_step'] / 1e9:.2f} GFLOP/step, "
                     f"bound {r['bound_ms']:.2f} ms; graph breaks {r['graph_break_count']})")
        lines.append(f"  {'way':<44}{'median ms':>10}{'min ms':>9}{'x seed':>8}{'speedup':>9}{'x bound':>9}"
                     f"{'peak MiB':>10}{'compiles':>9}")
        for n, s in r["ways"].items():
            mem = "-" if s["peak_memory_mib"] is None else f"{s['peak_memory_mib']:.1f}"
            cc = "-" if s["compile_count"] is None else f"{s['compile_count']}(+{s['recompiles_after_warmup']})"
            lines.append(f"  {LABELS[n]:<44}{s['median_ms']:>10.2f}{s['min_ms']:>9.2f}{s['time_ratio_to_seed']:>8.2f}"
                         f"{s['speedup_vs_seed']:>8.2f}x{s['x_of_bound']:>9.1f}{mem:>10}{cc:>9}")
        if r.get("jax_loss_check"):
            c = r["jax_loss_check"]
            lines.append(f"  jax vs torch first loss: |diff| {c['abs_diff'][0]:.1e} "
                         f"({'OK' if c['first_ok'] else 'MISMATCH'}, "
                         f"tol {c['tol']:.0e}); first {len(c['abs_diff'])} steps max |diff| {max(c['abs_diff']):.1e}")
        if "pimm_compiled_over_jax_time" in r:
            q = r["pimm_compiled_over_jax_time"]
            lines.append(f"  pimm_fn compiled time / JAX time: {q:.2f} ({'pimm_fn faster' if q < 1 else 'JAX faster'})")
        if "bound_ms_xla_gemm" in r:
            lines.append(f"  bound at XLA's GEMM rate: {r['bound_ms_xla_gemm']:.2f} ms")
        if "variable_vs_fixed_per_point" in r:
            lines.append(f"  time/point, variable vs fixed-size batches: {r['variable_vs_fixed_per_point']:.2f}")
        if r.get("compile_cache"):
            c = r["compile_cache"]
            lines.append(f"  compile (fresh process): cold {c['cold_s']:.1f} s, warm cache {c['warm_s']:.1f} s,"
                         f" warm/cold {c['warm_over_cold']:.2f}")
    return "\n".join(lines)


def fit_table(f):
    m = f["median_ms"]
    lines = [f"fit overhead (mlp, compiled step, {f['steps_per_epoch']}-step epochs, {f['rounds']} rounds interleaved; "
             f"median ms/step)", f"  bare loop {m['bare_loop']:.2f}, fit {m['fit_no_callbacks']:.2f} "
             f"({100 * f['overhead_fit_no_callbacks']:+.1f}%), fit + {f['callbacks']} {m['fit_callbacks']:.2f} "
             f"({100 * f['overhead_fit_callbacks']:+.1f}%)"]
    return "\n".join(lines)


def chart(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    models = [r["model"] for r in results]
    ways = [w for w in WAYS]
    width = 0.8 / len(ways)
    for i, w in enumerate(ways):
        vals = [r["ways"][w]["speedup_vs_seed"] if w in r["ways"] else 0 for r in results]
        ax.bar([j + i * width for j in range(len(models))], vals, width, label=LABELS[w])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.3, color="r", lw=0.8, ls="--", label="target 1.3x")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
    ax.set_ylabel("speedup vs seed-style eager (median step)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"pimm_fn steps, {machine_info()['cpu']}, torch {torch.__version__}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds x 3 steps; cache probe on mlp only")
    ap.add_argument("--models", default="mlp,pointseg,cnn")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="steps per way per round")
    ap.add_argument("--cache-probe", default=None, help="models whose compile is timed cold/warm in fresh processes "
                                                        "(comma list, 'none'); default all (quick: mlp)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads; 1 on a shared box (2 OpenMP threads on 2 busy cores wait at every barrier)")
    ap.add_argument("--fit-rounds", type=int, default=None, help="rounds of the fit-overhead comparison "
                                                                  "(50-step epochs; default 6, quick 4; 0 skips)")
    ap.add_argument("--ways", default=",".join(WAYS),
                    help=f"comma list of ways (seed_eager, the baseline, is always run); default all: {','.join(WAYS)}")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "run_steps"))
    args = ap.parse_args(argv)
    unknown = [w for w in args.ways.split(",") if w and w not in WAYS]
    if unknown:
        ap.error(f"unknown ways {unknown}; choose from {', '.join(WAYS)}")
    args.ways = tuple(w for w in WAYS if w == "seed_eager" or w in args.ways.split(","))
    os.chdir(os.path.dirname(HERE))  # the cache probe puts the cwd on PYTHONPATH: this checkout's pimm_fn
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.steps = args.steps or (3 if args.quick else 5)
    args.fit_rounds = (4 if args.quick else 6) if args.fit_rounds is None else args.fit_rounds
    if args.threads:
        torch.set_num_threads(args.threads)
    models = [m for m in args.models.split(",") if m]
    probe = args.cache_probe or ("mlp" if args.quick else ",".join(models))
    probe = [] if probe == "none" else probe.split(",")
    machine = machine_info()
    load_before = os.getloadavg()
    gemm = peak_gemm_gflops()
    print(f"machine: {machine}\npeak fp32 GEMM (2048^2): {gemm['best_gflops']:.0f} GFLOP/s best, "
          f"{gemm['median_gflops']:.0f} median; load avg {load_before}", flush=True)
    args.gemm_jax = None
    if "jax" in args.ways:
        ok, why = J.available()
        if ok:
            machine["jax"] = why
            machine["jax_threads"] = J.configure_threads(args.threads)  # before anything else starts JAX's backend
            args.gemm_jax = J.peak_gemm_gflops()
            print(f"XLA (jax jit) fp32 GEMM (2048^2): {args.gemm_jax['best_gflops']:.0f} GFLOP/s best, "
                  f"{args.gemm_jax['median_gflops']:.0f} median; threads: {machine['jax_threads']}", flush=True)
        else:
            print(f"jax way skipped: {why}", flush=True)
    t_start = time.perf_counter()
    results = []
    for m in models:
        results.append(bench_model(m, args, gemm))
        # partial results survive a run cut short (a slow shared machine)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out + ".partial.json", "w") as f:
            json.dump({"machine": machine, "gemm": gemm, "results": results}, f, indent=2, default=str)
        print(table(results[-1:]), flush=True)
    # On a shared machine the GEMM rate moves with the load: keep the best of two measurements.
    gemm2 = peak_gemm_gflops()
    if gemm2["best_gflops"] > gemm["best_gflops"]:
        for r in results:
            r["bound_ms"] *= gemm["best_gflops"] / gemm2["best_gflops"]
            for s in r["ways"].values():
                s["x_of_bound"] *= gemm2["best_gflops"] / gemm["best_gflops"]
        gemm = gemm2
    fit_res = None
    if args.fit_rounds:
        print("[fit overhead] mlp compiled step: bare loop vs fit vs fit + callbacks, interleaved...", flush=True)
        fit_res = fit_overhead(args.fit_rounds)
        print(fit_table(fit_res), flush=True)
    for r in results:
        if r["model"] in probe:
            print(f"[{r['model']}] compile cache probe (two fresh processes)...", flush=True)
            r["compile_cache"] = measure_compile_cache(f"pimm_fn.bench.workloads:{r['model']}")
    out = {"command": "python benchmarks/run_steps.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine, "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
           "gemm": gemm, "gemm_jax": args.gemm_jax, "rounds": args.rounds, "steps_per_round": args.steps,
           "threads": torch.get_num_threads(),
           "results": results, "fit_overhead": fit_res,
           "wall_seconds": time.perf_counter() - t_start}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=2, default=str)
    text = table(results) + ("\n\n" + fit_table(fit_res) if fit_res else "")
    print(text)
    with open(args.out + ".txt", "w") as f:
        f.write(f"{out['command']}\n{machine['cpu']}, {machine['cpu_count']} cores, torch {machine['torch']}, "
                f"{torch.get_num_threads()} torch thread(s), load avg before {load_before}, "
                f"after {out['load_avg_after']}\npeak fp32 GEMM {gemm['best_gflops']:.0f} GFLOP/s"
                + (f" (torch), {args.gemm_jax['best_gflops']:.0f} GFLOP/s (XLA, {machine['jax']})"
                   if args.gemm_jax else "")
                + f"\n{text}\n")
    chart(results, args.out + ".png")
    print(f"wrote {args.out}.json/.txt/.png in {out['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
