"""run_child: call a benchmark script's function in a fresh Python process, for what only a
new process shows (a cold compile, a load from a cache, the first step)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional


def run_child(script: str, call: str, *, env: Optional[dict] = None, timeout: float, label: str) -> dict:
    """Import the module ``script`` (a .py file) in a new interpreter, evaluate ``call`` in it
    (e.g. ``"_child('mlp', 2)"``, the function printing nothing) and return the JSON of its value.

    The child runs in the script's folder, so the ``pimm_fn`` it imports is the installed one
    or ``PYTHONPATH``'s: from a checkout's root, ``python -c`` would put that checkout's
    ``pimm_fn`` first whatever ``PYTHONPATH`` says, and a benchmark of another version would
    measure this one. Raises RuntimeError with the child's stderr when it fails.
    """
    folder, module = os.path.split(os.path.abspath(script))
    code = (f"import sys, json; sys.path.insert(0, {folder!r}); import {os.path.splitext(module)[0]} as m; "
            f"print(json.dumps(m.{call}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=folder)
    if out.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
