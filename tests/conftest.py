"""Shared test set-up: one inductor cache for the whole session, deterministic threads."""
import os
import tempfile

# A per-session inductor/FX cache: compiled steps shared across test modules (and across
# the subprocesses tests launch) warm-start instead of compiling from scratch.
os.environ.setdefault("PIMM_FN_ISA_MEMO", "1")  # inductor's CPU probes answered from disk (opt-in)
# The step cache (on by default) off: tests count compiles, and a step another test saved
# would load instead. tests/test_step_cache.py turns it on where it is the subject.
os.environ.setdefault("PIMM_FN_STEP_CACHE", "off")
_CACHE = os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "pimm_fn_test_inductor_cache")
)

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny tensors: a second only adds spinning on a
    busy machine. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
