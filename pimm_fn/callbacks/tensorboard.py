"""TensorBoard event files from the step metrics.

The training thread buffers rows (a list append per step) and hands them over every
``sync_every`` steps. When the metrics live on an accelerator, one writer thread reads the
numbers (which waits for the device), encodes the events with tensorboardX's protos and
appends them to the file; CPU metrics are encoded on the training thread, since a writer
thread there only competes with the step for the GIL. A checkpoint waits until every row
handed over before it is on the file, so a SIGKILL after a checkpoint loses no step the
checkpoint holds.
"""
from __future__ import annotations

import collections
import glob
import os
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from crc32c import crc32c

from ..tree import all_on_cpu
from .logging import _Buffered, _numbers

__all__ = ["TensorBoard"]


class TensorBoard(_Buffered):
    """Scalars to TensorBoard event files in ``log_dir``.

    Steps are continuous across resume: a resumed run (state.step = s > 0) starts a new event
    file with a purge marker at step s + 1, so TensorBoard drops what a killed run wrote after
    its last checkpoint and each step appears once. Steps are handed over in batches of
    ``sync_every`` (one host sync and one file write per batch, one event per step holding
    all its scalars); everything is on the file, flushed to the OS, before every checkpoint.

    every_steps: log every n-th step (1: each step, as in Pointcept). Use :meth:`add_scalar`
    for your own scalars.
    background: True reads the numbers and encodes and writes the events on one writer
        thread, in the order they were handed over, so the training thread only hands rows
        over; False does it all on the training thread. None (the default) picks the thread
        when the run's state is off the CPU (reading its metrics waits for the device) and
        the training thread for a CPU state, where a writer thread would hold the GIL
        against the step and cost more than the writing itself. A writer error is raised on
        the training thread at the next hand-over, flush or close.
    """

    def __init__(self, log_dir, every_steps: int = 1, sync_every: int = 50, background: Optional[bool] = None):
        super().__init__(every_steps, sync_every)
        if background is not None and not isinstance(background, bool):
            raise TypeError(f"background must be True, False or None (by the state's device), got {background!r}")
        self.log_dir = str(log_dir)
        self.background = background
        self._threaded = bool(background)  # resolved for each run at TrainStart
        self._file: Optional[_EventFile] = None
        self._events: dict = {}  # tags -> the Event refilled for each step with those tags
        self._worker: Optional[ThreadPoolExecutor] = None
        self._queued: collections.deque = collections.deque()

    # ----- the writer thread: every file operation goes through _submit, in order
    def _submit(self, fn, *args) -> None:
        queued = self._queued
        while queued and queued[0].done():
            queued.popleft().result()  # a writer error surfaces here, on the training thread
        if not self._threaded:
            fn(*args)
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="pimm_fn-tensorboard")
        queued.append(self._worker.submit(fn, *args))

    def _wait(self) -> None:
        """Until every handed-over write is on the file (re-raising a writer error)."""
        queued = self._queued
        while queued:
            queued.popleft().result()

    def drain(self) -> None:
        if self._rows:
            rows, self._rows = self._rows, []
            self._submit(self._write_block, rows)

    def _write_block(self, rows) -> None:
        self._write_rows(_numbers(rows))

    def on_train_start(self, event, state):
        if self.background is None:
            self._wait()  # what an earlier run handed over is written before the way may change
            self._threaded = not all_on_cpu(state)
        super().on_train_start(event, state)

    def _open(self, event=None):
        # Imported here, on the training thread: an import on the writer thread while the first
        # step compiles can fail that compile (dynamo iterates sys.modules).
        from tensorboardX.proto import event_pb2, summary_pb2  # noqa: F401

        self._submit(self._open_now, getattr(event, "step", 0) or 0)

    def _open_now(self, step: int = 0):
        if self._file is not None:
            return
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        os.makedirs(self.log_dir, exist_ok=True)
        # TensorBoard reads a directory's files in name order; names carry the second, then
        # this suffix: nanoseconds keep restarts within one second in order.
        self._wait_past_existing()
        self._file = _EventFile(self.log_dir, f".{time.time_ns():020d}.{os.getpid()}")
        if step > 0:
            self._file.write([Event(step=step + 1, wall_time=time.time(),
                                    session_log=SessionLog(status=SessionLog.START)).SerializeToString()])

    def _wait_past_existing(self):
        latest = 0
        for path in glob.glob(os.path.join(self.log_dir, "events.out.tfevents.*")):
            try:
                latest = max(latest, int(os.path.basename(path).split(".")[3]))
            except (IndexError, ValueError):
                continue
        while int(time.time()) < latest:  # a clock behind an existing file: keep order
            time.sleep(0.05)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Write one scalar, after every row handed over before it (on the writer thread, if any)."""
        self._write(step, {tag: float(value)})

    def _event(self, step: int, wall: float, tags: tuple, values) -> bytes:
        """The serialized ``Event(step, wall_time, summary=[Value(tag, simple_value)...])``."""
        event = self._events.get(tags)
        if event is None:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary

            if len(self._events) > 64:  # tags that change every step: do not hoard events
                self._events.clear()
            event = self._events[tags] = Event(summary=Summary(value=[Summary.Value(tag=t) for t in tags]))
        event.step, event.wall_time = step, wall
        for slot, v in zip(event.summary.value, values):
            slot.simple_value = v
        return event.SerializeToString()

    def _write(self, step, scalars):
        if scalars:
            self._submit(self._write_now, step, scalars, time.time())

    def _write_now(self, step, scalars, wall):
        self._open_now()
        self._file.write([self._event(int(step), wall, tuple(scalars), scalars.values())])

    def _write_rows(self, rows):
        # One event per step holding all its scalars (TensorBoard reads each value under its
        # tag as if written alone), one write for the block.
        self._open_now()
        wall = time.time()
        out = [self._event(step, wall, tuple(map(self._tag, nums)), nums.values()) for step, nums in rows if nums]
        if out:
            self._file.write(out)

    def _flush(self):
        self._submit(self._flush_now)
        self._wait()

    def _flush_now(self):
        if self._file is not None:
            self._file.flush()

    def _close(self):
        try:
            self._submit(self._close_now)
            self._wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            self._queued.clear()
            self._close_now()  # after a writer error: still close the file

    def _close_now(self):
        f, self._file = self._file, None  # once only, even when closing fails
        if f is not None:
            f.close()

    def on_already_complete(self, event, state):
        pass  # nothing to write: do not open a file


class _EventFile:
    """An append-only event file, named as tensorboardX names it
    (``events.out.tfevents.<unix seconds>.<host><suffix>``), starting with the file-version
    event TensorBoard looks for. Each event is a TFRecord: its length (uint64), the length's
    masked crc32c, the bytes, their masked crc32c. ``flush`` hands the bytes to the OS (a
    SIGKILL loses nothing after it) without an fsync, which would block a checkpoint."""

    def __init__(self, log_dir: str, suffix: str):
        from tensorboardX.proto.event_pb2 import Event

        self.path = os.path.join(log_dir, f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}{suffix}")
        self._f = open(self.path, "ab")
        self.write([Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()])

    def write(self, events) -> None:
        """Append serialized events, one ``write`` for all of them."""
        self._f.write(b"".join(map(_record, events)))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()


def _record(data: bytes) -> bytes:
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", _masked_crc(head)) + data + struct.pack("<I", _masked_crc(data))


def _masked_crc(data: bytes) -> int:
    x = crc32c(data)
    return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF
