"""TensorBoard event files from the step metrics, written off the training thread.

The training thread hands buffered rows over (a list append per step, a queue put per
``sync_every`` steps); one writer thread reads the numbers, encodes the events
(:mod:`~pimm_fn.callbacks.event_file`) and writes them. A checkpoint waits until every
row handed over before it is on the file, so a SIGKILL after a checkpoint loses no
step the checkpoint holds.
"""
from __future__ import annotations

import collections
import glob
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from .logging import _Buffered, _numbers

__all__ = ["TensorBoard"]


class TensorBoard(_Buffered):
    """Scalars to TensorBoard event files in ``log_dir`` (tensorboardX's protos, the
    :mod:`~pimm_fn.callbacks.event_file` writer).

    Steps are continuous across resume: a resumed run (state.step = s > 0) starts a new event
    file with a purge marker at step s + 1, so TensorBoard drops what a killed run wrote after
    its last checkpoint and each step appears once. Steps are handed over in batches of
    ``sync_every`` (one host sync and one file write per batch, one event per step holding
    all its scalars); everything is on the file, flushed to the OS, before every checkpoint.

    every_steps: log every n-th step (1: each step, as in Pointcept). Use :meth:`add_scalar`
    for your own scalars.
    background: read the numbers and encode and write the events on one writer thread (the
        default), in the order they were handed over, so the training thread only hands
        rows over; False does it all on the training thread. A writer error is raised on
        the training thread at the next hand-over, flush or close.
    """

    def __init__(self, log_dir, every_steps: int = 1, sync_every: int = 50, background: bool = True):
        super().__init__(every_steps, sync_every)
        self.log_dir = str(log_dir)
        self.background = bool(background)
        self._file = None
        self._encoders: dict = {}  # tags -> ScalarEvents
        self._row_tags: dict = {}  # metric keys -> tags
        self._worker: Optional[ThreadPoolExecutor] = None
        self._queued: collections.deque = collections.deque()

    # ----- the writer thread: every file operation goes through _submit, in order
    def _submit(self, fn, *args) -> None:
        queued = self._queued
        while queued and queued[0].done():
            queued.popleft().result()  # a writer error surfaces here, on the training thread
        if not self.background:
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

    def _open(self, event=None):
        self._submit(self._open_now, event)

    def _open_now(self, event=None):
        if self._file is not None:
            return
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        from .event_file import EventFile

        os.makedirs(self.log_dir, exist_ok=True)
        # TensorBoard reads a directory's files in name order; names carry the second, then
        # this suffix: nanoseconds keep restarts within one second in order.
        self._wait_past_existing()
        self._file = EventFile(self.log_dir, f".{time.time_ns():020d}.{os.getpid()}")
        step = getattr(event, "step", 0) or 0
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
        """Write one scalar, after every row handed over before it (on the writer thread)."""
        self._write(step, {tag: float(value)})

    def _event(self, step: int, wall: float, tags: tuple, values) -> bytes:
        enc = self._encoders.get(tags)
        if enc is None:
            from .event_file import ScalarEvents

            if len(self._encoders) > 64:  # tags that change every step: do not hoard encoders
                self._encoders.clear()
            enc = self._encoders[tags] = ScalarEvents(tags)
        data = enc.encode(int(step), wall, values)
        if data is None:  # a value past float32 (the proto rounds it to inf) or a negative step
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary

            data = Event(step=int(step), wall_time=wall, summary=Summary(value=[
                Summary.Value(tag=t, simple_value=v) for t, v in zip(tags, values)])).SerializeToString()
        return data

    def _write(self, step, scalars):
        if scalars:
            self._submit(self._write_now, step, scalars, time.time())

    def _write_now(self, step, scalars, wall):
        self._open_now()
        self._file.write([self._event(step, wall, tuple(scalars), list(scalars.values()))])

    def _write_rows(self, rows):
        # One event per step holding all its scalars (TensorBoard reads each value under its
        # tag as if written alone), encoded from the floats, one write for the block.
        self._open_now()
        wall = time.time()
        out = []
        row_tags = self._row_tags
        for step, nums in rows:
            if not nums:
                continue
            keys = tuple(nums)
            tags = row_tags.get(keys)
            if tags is None:
                if len(row_tags) > 64:
                    row_tags.clear()
                tags = row_tags[keys] = tuple(self._tag(k) for k in keys)
            out.append(self._event(step, wall, tags, list(nums.values())))
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
