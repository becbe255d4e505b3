"""How long a compiled step's first call takes, in fresh processes: cold, warm, and with the step cache.

For each model, five fresh Python processes run in sequence, each timing the first call(s)
of ``compile_step(steps.supervised(clip_grad=1.0))`` (import time is reported apart):

1. first_ever  empty inductor cache, no ISA-probe memo file yet (a new machine)
2. cold        empty inductor cache; the ISA-probe memo written by run 1 (any later compile)
3. warm        a second process on run 2's inductor cache (dynamo still traces)
4. cold+save   empty inductor cache, the step cache on (the default): compiles through
               aot_compile and saves
5. warm+load   a second process on run 4's caches: loads the saved step (no dynamo)

Runs 1-3 turn the step cache off (``cache=False``).

mlp: the MLP 64-256-10 step of benchmarks/overhead.py (batch 256). pointseg: PointSegNet on
variable-size point batches (pimm_fn/bench/workloads.py); its figure is the first two calls
(the second compiles the dynamic point count; a loaded static step falls back to dynamo there).
ptv3: the PTv3-class backbone of the ptv3 workload on two real LiDAR batches (their
topology from the collate); its figure is the first two calls. ptv3_default: ``PTv3(4, 3)``
with the constructor's defaults (5 levels, 22 blocks, 32-512 channels, drop path 0.3) on two
such batches with its 5-level topology; ptv3_block: one attention block (32 channels) between
one grid pooling and one unpooling, the smallest PTv3-shaped model. After the first calls
each child also times ``--steps`` more steps (median ``step_s``).

    python benchmarks/compile_time.py                 # mlp, pointseg -> results/compile_time.{json,txt}
    python benchmarks/compile_time.py --models mlp
    python benchmarks/compile_time.py --models ptv3 --runs cold,warm --json benchmarks/results/compile_time_ptv3.json
    python benchmarks/compile_time.py --models ptv3_default --runs cold --threads 1 --steps 5
    python benchmarks/compile_time.py --models ptv3_block --threads 1 --steps 5 \
        --json benchmarks/results/compile_time_ptv3_block.json
    python benchmarks/compile_time.py --models ptv3_block,ptv3_default --runs cold --kernel-units on,off

``--kernel-units off`` builds each inductor kernel as its own library, as torch does
(``PIMM_FN_KERNEL_UNITS=off`` in the children).

Read the load average printed with the table: compile times on a busy machine are noise.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
RUNS = ("first_ever", "cold", "warm", "cold+save", "warm+load")


# PTv3 configurations built here (the ptv3 model is the workload's): ptv3_default as the
# constructor makes it; ptv3_block the smallest PTv3-shaped model, one attention block
# between one grid pooling and one unpooling (issue 36's "one-block" model).
PTV3_CONFIGS = {
    "ptv3_default": {},
    "ptv3_block": dict(enc_depths=(1, 0), enc_channels=(32, 64), enc_heads=(2, 4), dec_depths=(0,),
                       dec_channels=(32,), dec_heads=(2,), drop_path=0.0),
}


def _ptv3_config_workload(model_name: str):
    # The workload's LiDAR batches, with the topology of this configuration's spec.
    import torch

    from pimm_fn import TrainState
    from pimm_fn.bench import workloads
    from pimm_fn.data import LidarBlocks, build_train_loader
    from pimm_fn.data import transforms as T
    from pimm_fn.models.ptv3 import PTv3, PTv3Collate

    torch.manual_seed(0)
    model = PTv3(4, 3, **PTV3_CONFIGS[model_name])
    transform = T.compose(T.random_rotate(axis="z"), T.random_flip(0.5), T.grid_sample(0.25, mode="train"),
                          T.center_shift(apply_z=False), T.assemble_feat(("coord", "intensity")))
    loader = build_train_loader(LidarBlocks("train"), batch_size=4, seed=0, transform=transform,
                                collate_fn=PTv3Collate(model.spec))
    batches = list(loader.iter_epoch(0, 0))[:2]
    tx, _ = workloads.make_optimizer()
    return TrainState.create(model, tx), batches


def _child(model: str, cache, threads: int = 0, steps_after: int = 0) -> dict:
    t0 = time.perf_counter()
    import torch

    from pimm_fn import compile_step, steps

    if threads:
        torch.set_num_threads(threads)
    imported = time.perf_counter() - t0
    if model in PTV3_CONFIGS:
        sys.path.insert(0, ROOT)
        state, batches = _ptv3_config_workload(model)
    elif model == "mlp":
        sys.path.insert(0, HERE)
        from overhead import mlp_workload

        _, state, pool = mlp_workload()
        batches = pool[:1]
    else:
        sys.path.insert(0, ROOT)
        from pimm_fn.bench import workloads

        w = getattr(workloads, model)(n_batches=2)
        state, batches = w.state, w.batches[:2]
    step = compile_step(steps.supervised(clip_grad=1.0), cache=cache)
    t = time.perf_counter()
    for b in batches:
        state, metrics = step(state, b)
    float(metrics["loss"])
    first = time.perf_counter() - t
    times = []
    for i in range(steps_after):
        t = time.perf_counter()
        state, metrics = step(state, batches[i % len(batches)])
        float(metrics["loss"])
        times.append(time.perf_counter() - t)
    return {"import_s": imported, "first_calls_s": first, "calls": len(batches),
            "step_s": sorted(times)[len(times) // 2] if times else None, "step_times_s": times,
            "compile_count": step.compile_count, "loaded_from_cache": step.loaded_from_cache,
            "threads": torch.get_num_threads()}


def _spawn(model: str, env: dict, cache, threads: int = 0, steps_after: int = 0) -> dict:
    from pimm_fn.bench.child import run_child  # here: a child importing this file must not import torch

    return run_child(__file__, f"_child({model!r}, {cache!r}, {threads!r}, {steps_after!r})", env=env,
                     timeout=1800, label=f"{model} probe")


def measure(model: str, runs=RUNS, threads: int = 0, steps_after: int = 0, kernel_units: str = "on") -> dict:
    with tempfile.TemporaryDirectory(prefix="pimm_fn_compile_time_") as tmp:
        d = lambda name: os.path.join(tmp, name)  # noqa: E731
        # The ISA-probe memo on (opt-in): run 1's empty home folder probes and writes it.
        base = {**os.environ, "PIMM_FN_ISA_MEMO": "1", "PIMM_FN_KERNEL_UNITS": kernel_units}
        if threads:
            base["OMP_NUM_THREADS"] = str(threads)
        base["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p])
        plan = {
            "first_ever": (dict(XDG_CACHE_HOME=d("home"), TORCHINDUCTOR_CACHE_DIR=d("ind1")), False),
            "cold": (dict(XDG_CACHE_HOME=d("home"), TORCHINDUCTOR_CACHE_DIR=d("ind2")), False),
            "warm": (dict(XDG_CACHE_HOME=d("home"), TORCHINDUCTOR_CACHE_DIR=d("ind2")), False),
            "cold+save": (dict(XDG_CACHE_HOME=d("home"), TORCHINDUCTOR_CACHE_DIR=d("ind3")), d("steps")),
            "warm+load": (dict(XDG_CACHE_HOME=d("home"), TORCHINDUCTOR_CACHE_DIR=d("ind3")), d("steps")),
        }
        out = {}
        for run in runs:
            env, cache = plan[run]
            load = [round(x, 2) for x in os.getloadavg()]
            out[run] = {**_spawn(model, {**base, **env}, cache, threads, steps_after), "load_before": load}
            step = f", step {out[run]['step_s'] * 1e3:.0f} ms" if out[run].get("step_s") else ""
            print(f"  {model} (units {kernel_units}) {run}: {out[run]['first_calls_s']:.2f} s{step} (load {load[0]})",
                  flush=True)
        return out


def table(res: dict) -> str:
    done = [r for r in RUNS if any(r in runs for runs in res["models"].values())]
    lines = [f"load average before {res['load_before']} after {res['load_after']}", "",
             "| model | " + " | ".join(done) + " | import |", "|---|" + "---|" * (len(done) + 1)]
    for model, runs in res["models"].items():
        cells = [(f"{runs[r]['first_calls_s']:.2f} s" + (" (loaded)" if runs[r]["loaded_from_cache"] else ""))
                 if r in runs else "-" for r in done]
        any_run = next(runs[r] for r in done if r in runs)
        lines.append(f"| {model} ({any_run['calls']} call{'s' if any_run['calls'] > 1 else ''}) | "
                     + " | ".join(cells) + f" | {any_run['import_s']:.2f} s |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mlp,pointseg")
    p.add_argument("--runs", default=",".join(RUNS), help=f"which of {','.join(RUNS)} (in that order: "
                   "warm needs cold, warm+load needs cold+save)")
    p.add_argument("--json", default=os.path.join(RESULTS, "compile_time.json"))
    p.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's default)")
    p.add_argument("--steps", type=int, default=0, help="steps timed after the first calls, in each child")
    p.add_argument("--kernel-units", default="on", help="on, off or on,off: inductor's CPU kernels compiled in "
                   "units (pimm_fn.compile.kernel_units, the default) or one library each; both: each model twice")
    args = p.parse_args(argv)
    sys.path.insert(0, HERE)
    from overhead import load, write_results

    res = {"load_before": load(), "models": {}}
    runs = tuple(r for r in RUNS if r in args.runs.split(","))
    ways = args.kernel_units.split(",")
    for model in args.models.split(","):
        for way in ways:
            label = model if ways == ["on"] else f"{model} units={way}"
            res["models"][label] = measure(model, runs, args.threads, args.steps, way)
    res["load_after"] = load()
    write_results(res, table(res), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
