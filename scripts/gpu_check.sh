#!/usr/bin/env bash
# Check pimm_fn's GPU path on one GPU in under 8 minutes, and print one table:
#
#   1. the CUDA tests (pytest -m cuda tests/test_cuda.py): state placement, pinned
#      non-blocking batch copies, no host syncs in a step, fp16 loss scaling equal to
#      torch.amp.GradScaler (with inf/NaN steps skipped), bf16 autocast, CUDA graphs
#      (mode="reduce-overhead") on a static shape and on variable point counts;
#   2. on a machine with two GPUs or more, data parallelism over nccl (torchrun);
#   3. one step's time and peak memory, pimm_fn compiled vs the seed-style eager trainer
#      vs torch.compile(model), on the three benchmark models (benchmarks/gpu_steps.py).
#
# Usage: scripts/gpu_check.sh            (PYTHON=... picks the interpreter; the output
#        folder is GPU_CHECK_OUT, default ./gpu_check_out: logs, junit XML, JSON)
# Exit status: 0 every check passed; 1 a check failed or timed out; 2 no CUDA GPU here
# (nothing could be checked: the CUDA tests are listed as skipped with their reason).
# Time limits per section (seconds) keep the whole run under 8 minutes even when a
# section hangs: tests 240, nccl 90, benchmark what is left of 450 s (at least 120; it
# starts no model in its last 60). A model not started is listed as such.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${GPU_CHECK_OUT:-gpu_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/$OUT/inductor_cache}"
START=$(date +%s)

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$GPUS" = "0" ]; then
  echo "gpu_check: no CUDA GPU (torch.cuda.is_available() is False, torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)); nothing was checked."
  echo "gpu_check: the CUDA tests skip here, with this reason:"
  "$PY" -m pytest -q -rs -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | grep -m 3 -E "SKIPPED|skipped"
  exit 2
fi
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"

echo "gpu_check: [1/3] CUDA tests (limit 240 s) ..."
timeout -k 10 240 "$PY" -m pytest -q -rs -m cuda tests/test_cuda.py -p no:cacheprovider \
  --junitxml="$OUT/cuda_tests.xml" >"$OUT/cuda_tests.log" 2>&1
TESTS_RC=$?
tail -n 3 "$OUT/cuda_tests.log"

NCCL_RC=skip
if [ "$GPUS" -ge 2 ]; then
  echo "gpu_check: [2/3] data parallel over nccl, two ranks (limit 90 s) ..."
  timeout -k 10 90 "$PY" -m pytest -q -s tests/test_distributed_torchrun.py -k compiled_data_parallel \
    -p no:cacheprovider >"$OUT/nccl.log" 2>&1
  NCCL_RC=$?
  tail -n 2 "$OUT/nccl.log"
else
  echo "gpu_check: [2/3] data parallel over nccl: skipped ($GPUS GPU; it needs 2)"
fi

# The benchmark gets what is left of 450 s (at least 120 s), and starts no model in its
# last 60 s: a model's compiles take up to about a minute.
LEFT=$(( 450 - ($(date +%s) - START) ))
[ "$LEFT" -lt 120 ] && LEFT=120
echo "gpu_check: [3/3] step time and peak memory (limit $LEFT s) ..."
timeout -k 10 "$LEFT" "$PY" benchmarks/gpu_steps.py --rounds 3 --steps 10 --budget-s $(( LEFT - 60 )) \
  --out "$OUT/gpu_steps.json" >"$OUT/gpu_steps.log" 2>&1
BENCH_RC=$?

"$PY" - "$OUT" "$TESTS_RC" "$NCCL_RC" "$BENCH_RC" "$(( $(date +%s) - START ))" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

out, tests_rc, nccl_rc, bench_rc, took = sys.argv[1:6]
rows, failed = [], False
xml = os.path.join(out, "cuda_tests.xml")
if os.path.exists(xml):
    for case in ET.parse(xml).getroot().iter("testcase"):
        kids = {c.tag for c in case}
        result = "FAIL" if kids & {"failure", "error"} else "skip" if "skipped" in kids else "ok"
        failed |= result == "FAIL"
        name = case.get("name")
        label = "AMP: fp16 loss scale == GradScaler" if "grad_scaler" in name else name.replace("test_", "", 1)
        rows.append((label, result, f"{float(case.get('time', 0)):.1f} s"))
else:
    rows.append(("CUDA tests", "FAIL", "no results (see cuda_tests.log)"))
    failed = True
if tests_rc != "0" and not failed:
    rows.append(("CUDA tests", "FAIL", f"pytest exit {tests_rc}" + (" (timed out)" if tests_rc == "124" else "")))
    failed = True
if nccl_rc == "skip":
    rows.append(("nccl data parallel (2 GPUs)", "skip", "fewer than 2 GPUs"))
else:
    rows.append(("nccl data parallel (2 GPUs)", "ok" if nccl_rc == "0" else "FAIL", f"exit {nccl_rc}"))
    failed |= nccl_rc != "0"
width = max(len(r[0]) for r in rows)
print("\n== checks " + "=" * 60)
for label, result, note in rows:
    print(f"{label:<{width}}  {result:<4}  {note}")
print("\n== one step on this GPU (median of rounds; x seed = time / seed-style eager) " + "=" * 4)
try:
    sys.path.insert(0, "benchmarks")
    from gpu_steps import table
    print(table(json.load(open(os.path.join(out, "gpu_steps.json")))["models"]))
except Exception as err:  # the benchmark died before writing a model
    print(f"no benchmark results ({type(err).__name__}: {err}); see {out}/gpu_steps.log")
if bench_rc != "0":
    print(f"benchmark exit {bench_rc}" + (" (timed out)" if bench_rc == "124" else "") + f": see {out}/gpu_steps.log")
    failed = True
print(f"\ngpu_check: {'FAILED' if failed else 'all checks passed'} in {took} s; logs in {out}/")
sys.exit(1 if failed else 0)
EOF
