"""One compile run in a background thread while the main thread runs eager steps."""
from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import threading
import time
from typing import Callable

from .. import torch_compat
from ..frame_room import call_with_frame_room

__all__ = ["BackgroundCompile"]

_SLICES_LOCK = threading.Lock()
_SLICES = {"running": 0, "saved": 0.005}  # background compiles running; the interval to restore
_COMPILE_SLICE_S = 1e-4


@contextlib.contextmanager
def _short_gil_slices():
    """A short interpreter switch interval while a background compile runs.

    The compile is Python holding the GIL; an eager step gives the GIL up in every kernel
    and waits to get it back, by default up to 5 ms each time, hundreds of times a step.
    Shorter slices let several times more eager steps run during a compile
    (benchmarks/README.md, "Compiling behind eager steps").
    """
    with _SLICES_LOCK:
        if not _SLICES["running"]:
            _SLICES["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_SLICES["saved"], _COMPILE_SLICE_S))
        _SLICES["running"] += 1
    try:
        yield
    finally:
        with _SLICES_LOCK:
            _SLICES["running"] -= 1
            if not _SLICES["running"]:
                sys.setswitchinterval(_SLICES["saved"])


class BackgroundCompile:
    """``compile_fn()`` run once in a daemon thread: :meth:`start`, :meth:`done`, :meth:`result`.

    ``compile_fn`` must compile without running the step (dynamo's precompile API): the
    main thread's steps then keep torch's generator to themselves, and the thread's own
    calls that would set it (dynamo restores it after each trace) are skipped.
    """

    def __init__(self, compile_fn: Callable, name: str):
        self._fn = compile_fn
        self._name = name
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = None

    def start(self) -> None:
        if self._thread is None:
            torch_compat.trace_inductor_dummy_module()  # on the stepping thread: see there
            self._thread = threading.Thread(target=self._run, name=f"pimm_fn-compile-{self._name}", daemon=True)
            self._thread.start()

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> tuple:
        """``(compile_fn's result, graphs dynamo compiled, seconds)``; starts the compile if it
        has not started and waits for it. Raises what ``compile_fn`` raised."""
        self.start()
        return self._future.result()

    def _run(self) -> None:
        graphs, start = torch_compat.compiled_graph_count(), time.perf_counter()
        try:
            with torch_compat.generator_untouched_by_this_thread(), _short_gil_slices():
                value = call_with_frame_room(self._fn)  # see frame_room
            self._future.set_result((value, torch_compat.compiled_graph_count() - graphs,
                                     time.perf_counter() - start))
        except BaseException as err:
            self._future.set_exception(err)
