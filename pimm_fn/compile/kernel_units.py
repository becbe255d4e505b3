"""Compile a graph's C++ kernels in a few translation units instead of one each.

Inductor builds every CPU kernel of a graph as its own shared library: one ``g++`` per
kernel, and each of them first loads inductor's precompiled header (~150 MB), a fixed cost
that outweighs compiling most kernels. A PTv3-class step has a few hundred kernels, so a
cold compile spent most of its compiler time loading that header again and again
(benchmarks/README.md, "Kernels compiled in units"). Here the kernels of one graph are
compiled in as many units as inductor has compile workers, balanced by size, each unit one
library with a Python entry per kernel. The kernels' code and flags are inductor's own, so
their results are the same bits.

Active only on a thread inside :func:`batched` (compile_step enters it around its
compiles and the step cache's loads); everything else, other threads included, compiles
as torch does. ``PIMM_FN_KERNEL_UNITS=off`` turns it off. A unit that fails to compile
falls back to one library per kernel, with a warning.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional

from .. import torch_compat
from ..user_warning import warn

__all__ = ["batched", "enabled", "stats"]

_ENV = "PIMM_FN_KERNEL_UNITS"
_PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>"
# A unit's fixed cost (loading the header) in characters of kernel source, for balancing.
_UNIT_COST = 20_000

_LOCAL = threading.local()
_LOCK = threading.Lock()
_USERS = 0
_TORCH: Optional[tuple] = None  # AsyncCompile's own (cpp_pybinding, wait), read once
_STATS = {"kernels": 0, "units": 0, "fallbacks": 0}


def enabled() -> bool:
    """Whether compile_step batches kernels (``PIMM_FN_KERNEL_UNITS`` is not off/0/false)."""
    return os.environ.get(_ENV, "").strip().lower() not in ("0", "off", "false", "no")


def stats() -> dict:
    """Counts so far in this process: kernels built (or loaded) in units, units, units that fell back."""
    return dict(_STATS)


@contextlib.contextmanager
def batched():
    """Kernels compiled on this thread inside the block are compiled in units (if enabled)."""
    if getattr(_LOCAL, "on", False) or not enabled():
        yield
        return
    _acquire()
    _LOCAL.on = True
    try:
        yield
    finally:
        _LOCAL.on = False
        _release()


# Installed on AsyncCompile while any thread is inside `batched`, removed after the last.
def _acquire() -> None:
    global _USERS, _TORCH
    with _LOCK:
        if _USERS == 0:
            cls = torch_compat.inductor_cpp_kernels().AsyncCompile
            if _TORCH is None:
                _TORCH = (cls.cpp_pybinding, cls.wait)
            cls.cpp_pybinding, cls.wait = _cpp_pybinding, _wait
        _USERS += 1


def _release() -> None:
    global _USERS
    with _LOCK:
        _USERS -= 1
        if _USERS == 0:
            cls = torch_compat.inductor_cpp_kernels().AsyncCompile
            cls.cpp_pybinding, cls.wait = _TORCH


def _cpp_pybinding(self, argtypes, source_code):
    inductor = torch_compat.inductor_cpp_kernels()
    if not getattr(_LOCAL, "on", False) or inductor.compile_threads() <= 1 or not _fits(argtypes, source_code):
        return _TORCH[0](self, argtypes, source_code)
    slot = _Kernel(list(argtypes), source_code)
    self.__dict__.setdefault("_pimm_fn_kernels", []).append(slot)

    def result():
        if slot.load is None:
            _flush(self)
        return slot.load()
    return inductor.LambdaFuture(result)


def _wait(self, scope):
    _flush(self)  # start the units' compiles before waiting for them
    return _TORCH[1](self, scope)


class _Kernel:
    __slots__ = ("argtypes", "source", "load")

    def __init__(self, argtypes: list, source: str):
        self.argtypes, self.source, self.load = argtypes, source, None


def _fits(argtypes, source: str) -> bool:
    """A kernel of the form inductor's CPU codegen writes: the prefix header, then one
    ``extern "C" void kernel(...)`` with pointer and integer arguments, nothing else at file scope."""
    text = source.strip()
    if not text.startswith(_PREFIX) or not all(_argument(t, 0) for t in argtypes):
        return False
    lines = text[len(_PREFIX):].strip().splitlines()
    return bool(lines) and lines[0].startswith('extern "C"') and all(
        not line or line[0].isspace() or line in ("{", "}") for line in lines[1:])


def _argument(argtype: str, n: int) -> Optional[str]:
    t = argtype.replace("const ", "").strip()
    item = f"PyTuple_GET_ITEM(args, {n})"
    if t.endswith("*"):
        return f"static_cast<{t}>(pimm_fn_data_ptr({item}))"
    if t in ("int64_t", "long"):
        return f"pimm_fn_int({item})"
    return None


def _flush(compiler) -> None:
    """Compile the kernels gathered so far: one unit per compile worker, largest kernels first."""
    kernels = compiler.__dict__.pop("_pimm_fn_kernels", [])
    if not kernels:
        return
    inductor = torch_compat.inductor_cpp_kernels()
    units: list = [[] for _ in range(min(len(kernels), inductor.compile_threads()))]
    sizes = [0] * len(units)
    for k in sorted(kernels, key=lambda k: -len(k.source)):
        i = sizes.index(min(sizes))
        units[i].append(k)
        sizes[i] += len(k.source) + _UNIT_COST
    order = {id(k): i for i, k in enumerate(kernels)}
    for unit in units:
        unit.sort(key=lambda k: order[id(k)])  # the same source, so the same cached library, each run
        if len(unit) == 1:
            _compile_alone(compiler, unit[0])
            continue
        _STATS["kernels"] += len(unit)
        _STATS["units"] += 1
        library = inductor.CodeCache.load_async(_unit_source(unit), submit_fn=compiler.submit)
        for j, k in enumerate(unit):
            k.load = _entry(compiler, unit, library, j)


def _compile_alone(compiler, k: _Kernel) -> None:
    inductor = torch_compat.inductor_cpp_kernels()
    k.load = inductor.CodeCache.load_pybinding_async(k.argtypes, k.source, submit_fn=compiler.submit)


def _entry(compiler, unit: list, library, j: int):
    def load():
        try:
            return getattr(library(), f"kernel_{j}")
        except Exception as err:
            # Each kernel of the unit is compiled on its own now (and raises torch's own
            # error if that fails too); the other kernels' futures find their new loaders.
            _STATS["fallbacks"] += 1
            first_line = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            warn(f"pimm_fn compiled {len(unit)} inductor kernels as one unit and that failed "
                 f"({type(err).__name__}: {first_line}); they are compiled one by one instead "
                 f"(set {_ENV}=off to skip units)", RuntimeWarning)
            for k in unit:
                _compile_alone(compiler, k)
            return unit[j].load()
    return load


def _unit_source(unit: list) -> str:
    """One translation unit: the header once, each kernel renamed, and a Python module
    ``kernel`` with an entry ``kernel_<j>`` per kernel (inductor loads it by that name)."""
    parts = [_PREFIX, "#define PY_SSIZE_T_CLEAN", "#include <Python.h>", "#include <cstdlib>",
             "#include <stdexcept>"]
    for j, k in enumerate(unit):
        parts += [f"#define kernel pimm_fn_kernel_{j}", k.source.strip()[len(_PREFIX):], "#undef kernel"]
    parts += [
        "static void* (*pimm_fn_data_ptr)(PyObject*);",
        "static int64_t pimm_fn_int(PyObject* o) {",
        "  Py_ssize_t v = PyLong_AsSsize_t(o);",
        '  if (v == -1 && PyErr_Occurred()) throw std::runtime_error("expected an int argument");',
        "  return v;",
        "}",
    ]
    table = []
    for j, k in enumerate(unit):
        call = ", ".join(_argument(t, n) for n, t in enumerate(k.argtypes))
        parts += [
            f"static PyObject* pimm_fn_entry_{j}(PyObject*, PyObject* args) {{",
            "  try {",
            f"    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {len(k.argtypes)})",
            f'      throw std::runtime_error("kernel_{j} takes {len(k.argtypes)} arguments");',
            f"    pimm_fn_kernel_{j}({call});",
            "    Py_RETURN_NONE;",
            "  } catch (std::exception const& e) {",
            "    PyErr_SetString(PyExc_RuntimeError, e.what());",
            "  } catch (...) {",
            '    PyErr_SetString(PyExc_RuntimeError, "unhandled C++ exception in a kernel");',
            "  }",
            "  return nullptr;",
            "}",
        ]
        table.append(f'  {{"kernel_{j}", pimm_fn_entry_{j}, METH_VARARGS, ""}},')
    parts += [
        "static PyMethodDef pimm_fn_methods[] = {", *table, "  {nullptr, nullptr, 0, nullptr}};",
        'static struct PyModuleDef pimm_fn_module = {PyModuleDef_HEAD_INIT, "kernel", nullptr, -1, pimm_fn_methods};',
        "PyMODINIT_FUNC PyInit_kernel(void) {",
        # set by inductor's loader (CppPythonBindingsCodeCache) before it imports the library
        '  const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");',
        "  if (!address) {",
        '    PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");',
        "    return nullptr;",
        "  }",
        "  pimm_fn_data_ptr = reinterpret_cast<void* (*)(PyObject*)>(std::strtoull(address, nullptr, 10));",
        "  return PyModule_Create(&pimm_fn_module);",
        "}",
    ]
    return "\n".join(parts) + "\n"
