"""Shared test set-up: one inductor cache for the whole session, deterministic threads."""
import os
import tempfile

# A per-session inductor/FX cache: compiled steps shared across test modules (and across
# the subprocesses tests launch) warm-start instead of compiling from scratch.
os.environ.setdefault("PIMM_FN_ISA_MEMO", "1")  # inductor's CPU probes answered from disk (opt-in)
_CACHE = os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "pimm_fn_test_inductor_cache")
)

import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
