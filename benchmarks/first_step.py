"""How long ``fit`` takes to deliver its first step on a cold machine, and how the run goes on.

Each (model, way) runs in a fresh process with an empty inductor cache, an empty home
folder (no ISA-probe memo, no step cache) and the step cache off, and fits for ``--steps``
steps (background: until ``--after`` steps past the switch, or ``--steps``, whichever is
later, capped by ``--seconds``). A callback records when each step ended, counted from the
``fit`` call. Ways:

- eager       ``compile_step(step, eager=True)``
- compiled    ``compile_step(step)``: the first call compiles, in the foreground
- background  ``compile_step(step, background=True)``: eager steps while it compiles

Models: mlp (the MLP step of overhead.py), ptv3 (the PTv3-class workload of run_steps.py,
real LiDAR batches), ptv3_default (``PTv3(4, 3)`` with its default 5-level config; see
compile_time.py).

    python benchmarks/first_step.py --models ptv3 --threads 1
    python benchmarks/first_step.py --models ptv3_default --ways eager,background --steps 4 --threads 1

Read the load average printed with the table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WAYS = ("eager", "compiled", "background")


def _workload(model: str):
    if model == "mlp":
        sys.path.insert(0, HERE)
        from overhead import mlp_workload

        _, state, batches = mlp_workload()
        return state, batches
    if model == "ptv3_default":
        sys.path.insert(0, HERE)
        from compile_time import _ptv3_config_workload

        return _ptv3_config_workload("ptv3_default")
    from pimm_fn.bench import workloads

    w = getattr(workloads, model)(n_batches=8)
    return w.state, list(w.batches)


def _child(model: str, way: str, steps_wanted: int, after: int, seconds: float, threads: int) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from pimm_fn import compile_step, fit, steps
    from pimm_fn import events as ev

    state, batches = _workload(model)
    step = compile_step(steps.supervised(clip_grad=1.0), eager=way == "eager", background=way == "background",
                        cache=False)
    ends: list = []

    def enough() -> bool:
        if ends[-1] > seconds:
            return True
        if len(ends) < steps_wanted:
            return False
        return way != "background" or step.switch_at is not None and len(ends) >= step.switch_at + after

    def record(event, _state):
        if isinstance(event, ev.StepEnd):
            ends.append(time.perf_counter() - t0)
            if enough():
                return ev.Stop("enough")
        return None

    t0 = time.perf_counter()
    fit(state, batches, step, epochs=10**6, callbacks=[record], history=False)
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    switch = step.switch_at
    return {"first_step_s": ends[0], "steps": len(ends), "total_s": ends[-1], "step_ends_s": ends,
            "median_later_step_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
            "switch_at": switch, "switch_s": ends[switch - 1] if switch and switch <= len(ends) else None,
            # gaps[i] is call i + 2's time; calls from switch_at + 1 on run compiled
            "compiled_step_s": (sorted(gaps[switch - 1:])[len(gaps[switch - 1:]) // 2]
                                if switch and gaps[switch - 1:] else None),
            "compile_count": step.compile_count, "threads": torch.get_num_threads()}


def _spawn(model, way, args) -> dict:
    from pimm_fn.bench.child import run_child  # here: a child importing this file must not import torch

    with tempfile.TemporaryDirectory(prefix="pimm_fn_first_step_") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
               "XDG_CACHE_HOME": os.path.join(tmp, "home"), "PIMM_FN_ISA_MEMO": "1", "PIMM_FN_STEP_CACHE": "off"}
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        return run_child(__file__, f"_child({model!r}, {way!r}, {args.steps}, {args.after}, {args.seconds}, "
                                   f"{args.threads})", env=env, timeout=7200, label=f"{model}/{way}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,ptv3")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--steps", type=int, default=20, help="steps to run at least")
    ap.add_argument("--after", type=int, default=10, help="background: steps to run past the switch")
    ap.add_argument("--seconds", type=float, default=3600.0, help="stop a run after this long")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "first_step.json"))
    args = ap.parse_args(argv)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    results = {"cpu": cpu, "load_before": os.getloadavg(), "args": vars(args), "runs": {}}
    print(f"CPU {cpu}, load {[round(x, 2) for x in os.getloadavg()]}")
    print("| model | way | first step | eager step | first / eager | switch (step, s) | compiled step | "
          "steps in total_s |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        eager_step = None
        for way in args.ways.split(","):
            r = _spawn(model, way, args)
            r["load_before"] = os.getloadavg()
            results["runs"][f"{model}/{way}"] = r
            if way == "eager":
                eager_step = r["median_later_step_s"]
            ratio = f"{r['first_step_s'] / eager_step:.2f}x" if eager_step else "-"
            sw = f"{r['switch_at']}, {r['switch_s']:.1f} s" if r["switch_s"] is not None else "-"
            cs = f"{r['compiled_step_s'] * 1e3:.1f} ms" if r["compiled_step_s"] else "-"
            es = f"{eager_step * 1e3:.1f} ms" if eager_step else "-"
            print(f"| {model} | {way} | {r['first_step_s']:.2f} s | {es} | {ratio} | {sw} | {cs} | "
                  f"{r['steps']} in {r['total_s']:.1f} s |", flush=True)
    results["load_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"load after {[round(x, 2) for x in os.getloadavg()]}; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
