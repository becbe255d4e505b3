"""Compile time in fresh processes: a workload compiled cold (empty inductor cache), then
warm (the same cache), each in a new interpreter; and the factory specs that name workloads."""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import torch

from .. import torch_compat
from ..compile import compile_step


def load_factory(spec: str) -> Callable:
    """Resolve "package.module:function" or "path/to/file.py:function"."""
    if ":" not in spec:
        raise ValueError(f"a factory is 'module:function' or 'file.py:function', got {spec!r}")
    mod_name, attr = spec.rsplit(":", 1)
    if mod_name.endswith(".py"):
        spec_obj = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
        module = importlib.util.module_from_spec(spec_obj)
        spec_obj.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(mod_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"{mod_name} has no factory {attr!r}") from None


def _cache_counters() -> dict:
    counters = torch_compat.dynamo_counters()
    keys = {"inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
            "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}
    return {k: int(counters[group][k]) for group, ks in keys.items() for k in ks}


def _probe(spec: str, kwargs: dict, calls: int, compile_kw: dict) -> dict:
    """In this (fresh) process: build the workload and compile its step; report times."""
    wl = load_factory(spec)(**kwargs)
    # Inductor's and AOTAutograd's caches are what this measures: a step loaded from the
    # step cache would skip them.
    step = compile_step(wl.step, **{"cache": False, **compile_kw})
    state = wl.state
    t0 = time.perf_counter()
    calls = max(1, min(calls, len(wl.batches)))
    for i in range(calls):
        state, _ = step(state, wl.batches[i])
    total = time.perf_counter() - t0
    return {"compile_s": sum(step.compile_seconds), "first_calls_s": total, "calls": calls,
            "compile_count": step.compile_count, "counters": _cache_counters(),
            "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}


def measure_compile_cache(factory: str, factory_kwargs: Optional[dict] = None, *, cache_dir: Optional[str] = None,
                          calls: int = 2, dynamic=None, mode=None, options=None, timeout: float = 900) -> dict:
    """Compile a workload's step in two fresh processes sharing one inductor cache.

    The first process starts from an empty ``TORCHINDUCTOR_CACHE_DIR`` (cold; a fresh
    temporary directory unless ``cache_dir`` is given), the second reuses it (warm: FX
    graph cache and AOTAutograd cache hits; dynamo still traces). ``calls`` first calls
    are made (2 covers the dynamic recompile of variable-size batches); compile time is
    the wall time of the calls that compiled. Returns cold_s, warm_s, warm_over_cold and
    each process's cache hit/miss counters.
    """
    tmp = None
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="pimm_fn_bench_cache_")
        cache_dir = tmp.name
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    payload = json.dumps({"spec": factory, "kwargs": factory_kwargs or {}, "calls": calls,
                          "compile_kw": {"dynamic": dynamic, "mode": mode, "options": options},
                          "threads": torch.get_num_threads()})
    runs = []
    try:
        for _ in range(2):
            proc = subprocess.run([sys.executable, "-m", "pimm_fn.bench", "--compile-probe", payload],
                                  env=env, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"compile probe for {factory} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        if tmp is not None:
            tmp.cleanup()
    cold, warm = runs
    return {"cold_s": cold["compile_s"], "warm_s": warm["compile_s"],
            "warm_over_cold": warm["compile_s"] / cold["compile_s"] if cold["compile_s"] else math.nan,
            "cold": cold, "warm": warm}
