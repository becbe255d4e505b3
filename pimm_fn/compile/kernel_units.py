"""Compile a graph's C++ kernels in a few translation units instead of one each.

Inductor builds every CPU kernel of a graph as its own shared library: one ``g++`` per
kernel, and each of them first loads inductor's precompiled header (~150 MB), a fixed cost
that outweighs compiling most kernels. A PTv3-class step has a few hundred kernels, so a
cold compile spent most of its compiler time loading that header again and again
(benchmarks/README.md, "Kernels compiled in units"). Here the kernels of one graph are
cut, in their order, into units of about ``_UNIT_CHARS`` of source (so the units and their
cached libraries do not depend on the machine's number of compile workers), each unit one
library with a Python entry per kernel. The kernels' code and flags are inductor's own, so
their results are the same bits.

Only a thread inside a compiled step's call (:func:`on_this_thread`) or a :func:`batched`
block builds units: inductor's ``AsyncCompile`` gets two gated methods when the first
compiled step is made (:func:`install`), and every other caller, other threads included,
compiles as torch does. ``PIMM_FN_KERNEL_UNITS=off`` turns it off. A unit that fails to
compile falls back to one library per kernel, with a warning.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional

from .. import torch_compat
from ..user_warning import warn

__all__ = ["batched", "enabled", "install", "on_this_thread", "stats"]

_ENV = "PIMM_FN_KERNEL_UNITS"
_PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>"
# A unit closes before a kernel that would take it past this much source: a few units for a
# small model, one per few dozen kernels for a large one.
_UNIT_CHARS = 400_000

_LOCAL = threading.local()
_LOCK = threading.Lock()
_TORCH: Optional[tuple] = None  # AsyncCompile's own (cpp_pybinding, wait), once installed
_STATS = {"kernels": 0, "units": 0, "fallbacks": 0}


def enabled() -> bool:
    """Whether kernels are built in units (``PIMM_FN_KERNEL_UNITS`` is not off/0/false/no)."""
    return os.environ.get(_ENV, "").strip().lower() not in ("0", "off", "false", "no")


def stats() -> dict:
    """Counts so far in this process: kernels built (or loaded) in units, units, units that fell back."""
    return dict(_STATS)


def install() -> None:
    """Give inductor's ``AsyncCompile`` the gated methods (once; they defer to torch's own
    unless the calling thread is inside :func:`on_this_thread` or :func:`batched`)."""
    global _TORCH
    with _LOCK:
        if _TORCH is None:
            cls = torch_compat.inductor_cpp_kernels().AsyncCompile
            _TORCH = (cls.cpp_pybinding, cls.wait)
            cls.cpp_pybinding, cls.wait = _cpp_pybinding, _wait


class on_this_thread:
    """``with on_this_thread():`` kernels compiled on this thread in the block are built in
    units (a compiled step's call enters it: cheap, a thread-local flag)."""

    __slots__ = ("_was",)

    def __enter__(self):
        self._was = getattr(_LOCAL, "on", False)
        _LOCAL.on = True

    def __exit__(self, *exc):
        _LOCAL.on = self._was


@contextlib.contextmanager
def batched():
    """:func:`install`, then :class:`on_this_thread` for the block."""
    install()
    with on_this_thread():
        yield


def _cpp_pybinding(self, argtypes, source_code):
    if not (getattr(_LOCAL, "on", False) and enabled() and _fits(argtypes, source_code)):
        return _TORCH[0](self, argtypes, source_code)
    slot = _Kernel(list(argtypes), source_code)
    self.__dict__.setdefault("_pimm_fn_kernels", []).append(slot)

    def result():
        if slot.load is None:
            _flush(self)
        return slot.load()
    future = torch_compat.inductor_cpp_kernels().LambdaFuture(result)
    self.__dict__.setdefault("_pimm_fn_futures", set()).add(id(future))
    return future


def _wait(self, scope):
    _flush(self)  # start the units' compiles before waiting for them
    if torch_compat.inductor_cpp_kernels().compile_threads() <= 1:
        # torch's wait resolves futures only with compile workers; ours are futures anyway
        ours = self.__dict__.pop("_pimm_fn_futures", set())
        for name, value in list(scope.items()):
            if id(value) in ours:
                scope[name] = value.result()
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
    """Compile the kernels gathered so far, cut in their order into units of about ``_UNIT_CHARS``."""
    kernels = compiler.__dict__.pop("_pimm_fn_kernels", [])
    units: list = []
    size = 0
    for k in kernels:
        if units and units[-1] and size + len(k.source) > _UNIT_CHARS:
            units.append([])
            size = 0
        if not units:
            units.append([])
        units[-1].append(k)
        size += len(k.source)
    inductor = torch_compat.inductor_cpp_kernels()
    for unit in units:
        if len(unit) == 1:
            _compile_alone(compiler, unit[0])
            continue
        _STATS["kernels"] += len(unit)
        _STATS["units"] += 1
        library = inductor.CodeCache.load_async(_unit_source(unit), submit_fn=_submit(compiler))
        for j, k in enumerate(unit):
            k.load = _entry(compiler, unit, library, j)


def _submit(compiler):
    """The compile workers' submit; None (compile when first loaded) without workers."""
    return compiler.submit if torch_compat.inductor_cpp_kernels().compile_threads() > 1 else None


def _compile_alone(compiler, k: _Kernel) -> None:
    k.load = torch_compat.inductor_cpp_kernels().CodeCache.load_pybinding_async(
        k.argtypes, k.source, submit_fn=_submit(compiler))


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
