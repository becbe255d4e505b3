"""``call_with_frame_room``: run a call with room reserved on CPython's frame stack.

CPython 3.11+ keeps a thread's Python frames on a stack of 16 KiB chunks, maps a new chunk
when a call does not fit in the current one, and unmaps it as soon as the frame at its base
returns. A loop whose calls happen to straddle a chunk's end therefore maps and unmaps a
chunk, and faults its pages in again, on every call. Where the ends fall depends on how deep
the caller's stack is, so the same code runs fast or slow by where it is called from: a
compiler pass that loops over hundreds of thousands of calls, or a training loop whose step
maps a chunk or more every step (benchmarks/README.md, "CPython's frame stack").

The call here runs inside one frame whose code reserves 1 MiB of value stack it never
uses: CPython gives that frame a chunk of its own, and the frames of everything it calls
fit in the ~1 MiB after it until the call returns. Mapping that chunk costs a few
microseconds, so it wraps long calls (a compile, a training loop), not each step. pimm_fn
wraps compile_step's first call, the background compile, explain_step and fit's epochs; a
hand-written loop of steps can wrap itself.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["CHUNKED_FRAME_STACK", "call_with_frame_room"]

# Whether this interpreter keeps frames on a chunked stack (elsewhere the room is not needed).
CHUNKED_FRAME_STACK = sys.version_info >= (3, 11) and sys.implementation.name == "cpython"

_ROOM_SLOTS = 1 << 17  # 8-byte slots: 1 MiB reserved, ~1 MiB left for the callees' frames


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


if CHUNKED_FRAME_STACK:
    # An unused value stack: only the frame's size grows, its pages are never touched.
    _call.__code__ = _call.__code__.replace(co_stacksize=_call.__code__.co_stacksize + _ROOM_SLOTS)


def call_with_frame_room(fn: Callable, /, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``, its frames on a frame-stack chunk of their own (CPython 3.11+;
    elsewhere a plain call)::

        def train(state):
            for batch in batches:
                state, metrics = step(state, batch)
            return state

        state = call_with_frame_room(train, state)
    """
    return _call(fn, args, kwargs)
