"""ruff over the package, tests, benchmarks, scripts and experiments (configured in pyproject.toml)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                                                       capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: `pip install -e .[test]` (scripts/setup.sh) installs it")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "pimm_fn", "tests", "benchmarks",
                          "scripts", "experiments"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
