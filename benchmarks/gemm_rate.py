"""Which fp32 GEMM path reaches this CPU's rate from torch, at the MLP step's shapes (issue 13, item 4).

    python benchmarks/gemm_rate.py [--threads 1] [--rounds 5] [--reps 5] [--no-template] [--no-jax]

The MLP benchmark step (MLPClassifier(256, 10, hidden=(512, 512)), batch 512) is GEMM-bound,
so its speed is whatever the GEMM behind ``aten.mm`` delivers. Candidates, all fp32 and all
on the same operands:

- ``aten_mm``: ``torch.mm`` (what inductor's compiled step calls through ``extern_kernels``;
  MKL sgemm on x86 builds), with the operand layouts the step uses (NN, NT = ``x @ w.t()``,
  TN = ``a.t() @ b``, the weight-gradient form);
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on dense (not prepacked) weights,
  oneDNN's own matmul (brgemm) kernels;
- ``cpp_template``: inductor's C++ GEMM template (``max_autotune`` with
  ``max_autotune_gemm_backends="CPP"`` only, so nothing else can be picked). In torch 2.13 it
  is reachable for a non-constant weight only through ``bmm``; ``mm``/``addmm`` require the
  weight to be a frozen module buffer (``use_cpp_gemm_template(require_constant_mat2=True)``);
- ``xla``: ``jax.jit(jnp.matmul)``, XLA's CPU GEMM, on as many threads as torch (see
  ``jax_ways.configure_threads``), for the JAX way's reference.

Rounds are interleaved (every path once per round, shapes in turn) so machine load hits
all alike; reported: median GFLOP/s per path and shape, and each path's ratio to
``aten_mm`` (> 1 is faster). Every result is checked against a float64 product.
Writes a table and ``--out`` JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np
import torch

# (label, M, K, N, layout): the products of one MLP step (batch 512, 256 -> 512 -> 512 -> 10),
# plus 2048^3 for the machine's peak. NN: [M,K] @ [K,N]; NT: x @ w.t() (the forward linear);
# TN: a.t() @ b (weight gradients: grad_out.t() @ input).
SHAPES = [
    ("fwd 512x256->512", 512, 256, 512, "NT"),
    ("fwd 512x512->512", 512, 512, 512, "NT"),
    ("bwd dX 512x512<-512", 512, 512, 512, "NN"),
    ("bwd dW 512x512 (K=512)", 512, 512, 512, "TN"),
    ("bwd dW 512x256 (K=512)", 512, 512, 256, "TN"),
    ("peak 2048^3", 2048, 2048, 2048, "NN"),
]


def operands(M, K, N, layout, gen):
    """(a, b) laid out so that ``op(a) @ op(b)`` is [M, N], as the step holds them."""
    if layout == "NN":
        return torch.randn(M, K, generator=gen), torch.randn(K, N, generator=gen)
    if layout == "NT":  # b is a [N, K] weight, used transposed
        return torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
    if layout == "TN":  # a is [K, M] (grad_out), used transposed
        return torch.randn(K, M, generator=gen), torch.randn(K, N, generator=gen)
    raise ValueError(layout)


def dense(a, b, layout):
    """The two operands as plain row-major [M, K] and [K, N] (for the paths that need it)."""
    A = a.t() if layout == "TN" else a
    B = b.t() if layout == "NT" else b
    return A, B


def aten_mm(a, b, layout):
    A, B = dense(a, b, layout)  # views: torch.mm passes the transposes to the BLAS
    return lambda: torch.mm(A, B)


def onednn(a, b, layout):
    A, B = dense(a, b, layout)
    A = A.contiguous()
    W = B.t().contiguous()  # linear's [N, K] weight
    return lambda: torch.ops.mkldnn._linear_pointwise(A, W, None, "none", [], "")


def cpp_template(a, b, layout):
    import torch._inductor.config as ic

    A, B = dense(a, b, layout)
    A, B = A.contiguous(), B.contiguous()

    def f(x, y):
        return torch.bmm(x.unsqueeze(0), y.unsqueeze(0)).squeeze(0)

    with ic.patch(max_autotune=True, max_autotune_gemm_backends="CPP"):
        g = torch.compile(f, fullgraph=True, dynamic=False)
        g(A, B)  # compiles (and autotunes) here, under the patch
    return lambda: g(A, B)


def xla(a, b, layout):
    import jax
    import jax.numpy as jnp

    A, B = dense(a, b, layout)
    A, B = jnp.asarray(A.contiguous().numpy()), jnp.asarray(B.contiguous().numpy())
    mm = jax.jit(jnp.matmul)
    mm(A, B).block_until_ready()
    return lambda: mm(A, B).block_until_ready()


PATHS = {"aten_mm": aten_mm, "onednn": onednn, "cpp_template": cpp_template, "xla": xla}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="timed products per path, shape and round (median kept)")
    ap.add_argument("--no-template", action="store_true", help="skip inductor's C++ template (its autotuning is slow)")
    ap.add_argument("--no-jax", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gemm_rate.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = dict(PATHS)
    notes = {}
    if args.no_template:
        paths.pop("cpp_template")
    if args.no_jax:
        paths.pop("xla")
    else:
        try:
            import jax_ways

            notes["xla_threads"] = jax_ways.configure_threads(args.threads)
        except ImportError as err:
            print(f"skip xla: jax not importable ({err}); pip install -e '.[bench]'", flush=True)
            paths.pop("xla")
    load_before = os.getloadavg()
    gen = torch.Generator().manual_seed(0)
    built = {}  # (shape label, path) -> callable
    for label, M, K, N, layout in SHAPES:
        a, b = operands(M, K, N, layout, gen)
        A, B = dense(a, b, layout)
        ref = (A.double() @ B.double())
        for p, make in paths.items():
            t0 = time.perf_counter()
            try:
                fn = make(a, b, layout)
                out = fn()
            except Exception as err:  # a path this build cannot run is reported, not fatal
                notes[f"{p} {label}"] = f"{type(err).__name__}: {str(err)[:200]}"
                print(f"  {p:13s} {label}: unavailable ({type(err).__name__})", flush=True)
                continue
            out = torch.from_numpy(np.asarray(out)) if p == "xla" else out
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-5:
                raise AssertionError(f"{p} on {label}: relative error {err:.2e} against float64")
            built[label, p] = fn
            print(f"  ready {p:13s} {label}: {time.perf_counter() - t0:.1f} s, rel err {err:.1e}", flush=True)
    times = {k: [] for k in built}
    for _ in range(args.rounds):
        for key, fn in built.items():
            fn()
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            times[key].append(statistics.median(ts))
    load_after = os.getloadavg()
    rows = []
    for label, M, K, N, layout in SHAPES:
        flops = 2.0 * M * K * N
        row = {"shape": label, "M": M, "K": K, "N": N, "layout": layout}
        for p in paths:
            if (label, p) in times:
                row[p] = flops / statistics.median(times[label, p]) / 1e9
        rows.append(row)
    head = f"{'shape':26s} {'layout':6s}" + "".join(f"{p:>14s}" for p in paths)
    lines = [f"fp32 GEMM GFLOP/s (median of {args.rounds} rounds x {args.reps} products), {args.threads} thread(s), "
             f"torch {torch.__version__}; load avg before {tuple(round(x, 2) for x in load_before)}, "
             f"after {tuple(round(x, 2) for x in load_after)}", head]
    for r in rows:
        lines.append(f"{r['shape']:26s} {r['layout']:6s}" + "".join(
            f"{r[p]:9.1f} ({r[p] / r['aten_mm']:.2f})" if p in r else f"{'-':>14s}" for p in paths))
    lines.append("(in brackets: rate / aten_mm's on the same shape)")
    text = "\n".join(lines)
    print(text)
    from pimm_fn.bench import machine_info

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/gemm_rate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "machine": machine_info(), "threads": args.threads, "load_avg_before": load_before,
                   "load_avg_after": load_after, "rows": rows, "notes": notes, "table": text}, f, indent=1)


if __name__ == "__main__":
    main()
