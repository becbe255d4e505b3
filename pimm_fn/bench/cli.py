"""``pimm-fn bench`` (also ``python -m pimm_fn.bench``): benchmark a built-in or user workload."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import torch

from .compile_cache import _probe, load_factory
from .timing import benchmark_step

BUILTIN_WORKLOADS = ("mlp", "pointseg", "cnn")  # GRPO: benchmarks/grpo_step.py


def _resolve_workload(name: str) -> str:
    if ":" in name:
        return name
    if name not in BUILTIN_WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}: use one of {', '.join(BUILTIN_WORKLOADS)} or 'module:factory'")
    return f"pimm_fn.bench.workloads:{name}"


def bench_main(argv: Optional[Sequence[str]] = None) -> int:
    """``pimm-fn bench WORKLOAD [--steps N] [--warmup N] [--eager] [--cache] [--json OUT]``.

    WORKLOAD: mlp | pointseg | cnn, or "module:factory" / "file.py:factory" for your
    own step (the factory returns a :class:`Workload`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--compile-probe"]:
        p = json.loads(argv[1])
        torch.set_num_threads(p["threads"])
        print(json.dumps(_probe(p["spec"], p["kwargs"], p["calls"], p["compile_kw"])))
        return 0
    ap = argparse.ArgumentParser(prog="pimm-fn bench", description="Benchmark a compiled pimm_fn step.")
    ap.add_argument("workload", help="mlp | pointseg | cnn | module:factory | file.py:factory")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the compiling call")
    ap.add_argument("--eager", action="store_true", help="also time the eager step, interleaved")
    ap.add_argument("--cache", action="store_true",
                    help="measure compile time cold and warm in two fresh processes sharing an inductor cache")
    ap.add_argument("--mode", default=None, help="inductor mode, e.g. max-autotune")
    ap.add_argument("--dynamic", choices=["auto", "true", "false"], default="auto")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="inductor config patch, e.g. cpp_wrapper=True (repeatable)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {}
    for kv in args.option:
        k, _, v = kv.partition("=")
        try:
            options[k] = json.loads(v.lower() if v in ("True", "False") else v)
        except json.JSONDecodeError:
            options[k] = v
    dynamic = {"auto": None, "true": True, "false": False}[args.dynamic]
    spec = _resolve_workload(args.workload)
    try:
        wl = load_factory(spec)()
    except ImportError as e:
        raise SystemExit(f"cannot build workload {args.workload!r} ({spec}): {e}") from None
    res = benchmark_step(wl.step, wl.state, list(wl.batches), steps=args.steps, warmup=args.warmup,
                         eager_baseline=args.eager, dynamic=dynamic, mode=args.mode, options=options or None,
                         factory=spec if args.cache else None, name=wl.name)
    print(res.table())
    if args.json:
        with open(args.json, "w") as f:
            f.write(res.to_json())
        print(f"wrote {args.json}")
    return 0
