"""An opt-in persistent memo of inductor's CPU vector-ISA probes.

Before its first CPU kernel, inductor decides which vector ISAs it may use by compiling a
tiny C++ program per ISA (and per AVX-512 sub-feature) and dlopen-ing each in a child
Python (``VecISA.check_build``), in every process: inductor's own cache keeps the programs,
not the answers (benchmarks/README.md, "ISA probes"). The answers depend only on the
machine, the compiler and torch, so they are kept in a JSON file keyed
by all three -- the CPU's feature flags included, so a home folder shared by cluster nodes
with different CPUs never hands one node another's answer.

Opt-in, because it replaces a torch class method (``check_build``, private) for the
whole process: call :func:`install`, or set ``PIMM_FN_ISA_MEMO=1`` and ``compile_step``
installs it (the CLI and the test suite do). Any error falls back to torch's probe.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from typing import Optional

from .. import torch_compat

_ENV = "PIMM_FN_ISA_MEMO"


def memo_path() -> str:
    """Where the probe answers are kept: ``$XDG_CACHE_HOME/pimm_fn`` (default ``~/.cache/pimm_fn``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "pimm_fn", "inductor_isa_probes.json")


@functools.cache
def cpu_features() -> str:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``), else the processor's name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def probe_key(isa, code: str, features: Optional[str] = None) -> str:
    """The memo key of one probe: torch, compiler fingerprint, ISA and flags, source, CPU."""
    import torch

    cpu_vec_isa = torch_compat.cpu_vec_isa_class()
    flags = isa.build_arch_flags()
    fingerprint = getattr(cpu_vec_isa, "_get_isa_dry_compile_fingerprint", None)
    compiler = fingerprint(flags) if callable(fingerprint) else ""
    parts = [torch.__version__, platform.machine(), compiler, str(isa), flags, code,
             cpu_features() if features is None else features]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            memo = json.load(f)
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: str, memo: dict) -> None:
    from ..atomic import atomic_write

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # concurrent writers: the last complete file wins
        data = json.dumps(memo).encode()
        atomic_write(path, lambda f: f.write(data), durable=False)
    except OSError:
        pass  # a read-only home: the probe simply runs again next time


def opted_in() -> bool:
    """Whether the environment asks for the memo (``PIMM_FN_ISA_MEMO=1``)."""
    return os.environ.get(_ENV, "") == "1"


def install() -> bool:
    """Wrap ``VecISA.check_build`` with the memo (once per process). Returns whether it is on;
    ``PIMM_FN_ISA_MEMO=0`` keeps it off."""
    if os.environ.get(_ENV, "") == "0":
        return False
    try:
        cpu_vec_isa = torch_compat.cpu_vec_isa_class()
    except ImportError:
        return False
    original = getattr(cpu_vec_isa.VecISA, "check_build", None)
    if not callable(original):
        return False
    if getattr(original, "_pimm_fn_memo", False):
        return True
    path = memo_path()
    memo = _load(path)

    @functools.wraps(original)
    def check_build(self, code):
        try:
            key = probe_key(self, code)
        except Exception:  # torch internals moved: probe as torch does
            return original(self, code)
        if isinstance(memo.get(key), bool):
            return memo[key]
        ok = original(self, code)
        memo[key] = bool(ok)
        _store(path, {**_load(path), **memo})
        return ok

    check_build._pimm_fn_memo = True
    check_build._pimm_fn_original = original
    cpu_vec_isa.VecISA.check_build = check_build
    return True
