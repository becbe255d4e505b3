"""The JAX benchmark way's checks (tests/jax_checks.py), in a process of their own.

JAX starts threads when it is imported; this suite forks data-loader workers later, which
is unsafe in a process holding them. So the checks run in a subprocess.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_jax_way_computes_what_the_torch_step_computes():
    for name in ("jax", "optax"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"the JAX benchmark way needs the bench extra ({name} is absent): pip install -e '.[bench]'")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(HERE, "jax_checks.py")],
                          cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-2000:]
