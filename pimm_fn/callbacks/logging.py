"""Metric writers: the buffered-writer base, W&B (optional) and the text log ``train.log``
(TensorBoard: :mod:`pimm_fn.callbacks.tensorboard`).

Tags follow Pointcept: ``train_batch/<k>`` per step, ``params/lr`` for the learning rate,
``train/<k>`` epoch averages, ``val/<k>`` (or ``<name>/<k>``) evaluation metrics.

Step metrics arrive in blocks (:class:`~pimm_fn.events.StepBlock`, a few per second), are
buffered as tensors and pulled in one host sync every ``sync_every`` logged steps (and
whenever a checkpoint is about to be written), so logging every step neither syncs nor
costs an event every step.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Optional

import torch

from .. import events as ev
from .base import Callback, check_every, due


def scalar_tag(key: str) -> str:
    """The seed's tag for a step metric: learning rates under ``params/``, the rest ``train_batch/``."""
    if key == "lr" or key == "lr/default":
        return "params/lr"
    if key.startswith("lr/"):
        return "params/lr/" + key[3:]
    return "train_batch/" + key


def _is_lr(key: str) -> bool:
    return key == "lr" or key.startswith("lr/")


def _numbers(rows):
    """[(step, {k: tensor or number})] -> [(step, {k: float})], one-element values only.

    Tensors off the CPU are read together, in one transfer for the block (one host sync).
    """
    out, on_device = [], []
    for step, metrics in rows:
        nums = {}
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                if v.numel() != 1:
                    continue  # Pointcept leaves larger tensors out of the writers
                if not v.is_cpu:
                    on_device.append((nums, k, v))
                    nums[k] = None  # keeps the key order; filled below
                    continue
            elif not isinstance(v, (int, float)):
                continue
            nums[k] = float(v)
        out.append((step, nums))
    if on_device:
        device = on_device[0][2].device
        values = torch.stack([v.detach().reshape(()).double().to(device) for _, _, v in on_device]).tolist()
        for (nums, k, _), x in zip(on_device, values):
            nums[k] = x
    return out


class _Buffered(Callback):
    """Shared logic: buffer step metrics, write them in batches, write epoch/eval metrics."""

    def __init__(self, every_steps: int = 1, sync_every: int = 50):
        check_every("every_steps", every_steps)
        self.every_steps = every_steps
        self.sync_every = max(1, int(sync_every))
        self._rows: list = []
        self._tags: dict = {}  # metric key -> its tag

    # subclasses implement
    def _write(self, step: int, scalars: dict) -> None: ...
    def _flush(self) -> None: ...
    def _close(self) -> None: ...
    def _open(self, event) -> None: ...

    def drain(self) -> None:
        """Write every buffered step now (one host sync)."""
        if self._rows:
            rows, self._rows = self._rows, []
            self._write_rows(_numbers(rows))

    def _tag(self, key: str) -> str:
        tag = self._tags.get(key)
        if tag is None:
            tag = self._tags[key] = scalar_tag(key)
        return tag

    def _write_rows(self, rows) -> None:
        """[(step, {metric key: float})] under their tags; writers with a faster block path override it."""
        for step, nums in rows:
            self._write(step, {self._tag(k): v for k, v in nums.items()})

    def on_train_start(self, event, state):
        self._open(event)

    def wants(self, event_type) -> bool:
        # Steps arrive in blocks (StepBlock), never one StepEnd at a time.
        if event_type is ev.StepEnd:
            return False
        return event_type is not ev.StepBlock or bool(self.every_steps)

    def on_step_block(self, event, state):
        every = self.every_steps
        if every == 1:
            self._rows.extend((r[0], r[2]) for r in event.rows)
        else:
            self._rows.extend((r[0], r[2]) for r in event.rows if r[0] % every == 0)
        if len(self._rows) >= self.sync_every:
            self.drain()

    def on_epoch_end(self, event, state):
        self.drain()
        metrics = {k: v for k, v in event.metrics.items() if not _is_lr(k)}
        for step, nums in _numbers([(event.step, metrics)]):
            self._write(step, {f"train/{k}": v for k, v in nums.items()})

    def on_eval_end(self, event, state):
        self.drain()
        self._write(event.step, {f"{event.name}/{k}": float(v) for k, v in event.metrics.items()
                                 if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1)})

    def on_save_requested(self, event, state):
        # Everything up to this step reaches the file before the checkpoint is written
        # (Checkpoint runs last): after a SIGKILL the resumed run rewrites only steps after
        # the checkpoint. Flushed to the OS, not fsynced (the fsync is at close): an fsync
        # per checkpoint would block the training thread; a power loss can cost the last
        # logged steps before the checkpoint, never the checkpoint.
        self.drain()
        self._flush()

    def on_end(self, event, state):
        self.drain()
        self._close()


class WandB(_Buffered):
    """Scalars to Weights & Biases (``pip install wandb``; imported only when the run starts).

    mode: ``"offline"`` writes locally (``wandb sync`` uploads later); id + resume="allow"
    continue a run across restarts (wandb drops steps it has already seen). notes: e.g. the
    launch command, as Pointcept does.
    """

    def __init__(self, project: Optional[str] = None, *, name=None, group=None, job_type=None, id=None,
                 resume="allow", notes=None, mode: Optional[str] = None, dir=None, config=None,
                 every_steps: int = 1, sync_every: int = 50):
        super().__init__(every_steps, sync_every)
        self.init_kwargs = dict(project=project, name=name, group=group, job_type=job_type, id=id,
                                resume=resume, notes=notes, mode=mode, dir=dir, config=config)
        self.run = None

    def _open(self, event=None):
        if self.run is not None:
            return
        try:
            import wandb
        except ImportError as err:
            raise ImportError("the WandB callback needs wandb: pip install 'pimm_fn[wandb]'") from err
        self.run = wandb.init(**{k: v for k, v in self.init_kwargs.items() if v is not None})

    def _write(self, step, scalars):
        if scalars:
            self._open()
            self.run.log(dict(scalars), step=int(step))

    def _close(self):
        if self.run is not None:
            self.run.finish()
            self.run = None

    def on_already_complete(self, event, state):
        pass


def _fmt_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


class TextLog(Callback):
    """A text log in ``save_path/train.log`` (appended when the run is resumed).

    Every ``every_steps`` steps a line with the epoch/iteration, data time, step time and
    iteration time (current and mean), the remaining time and the metrics; epoch averages,
    evaluations, checkpoints and the run's end are logged too. Each line is flushed.
    """

    def __init__(self, save_path, every_steps: int = 1, filename: str = "train.log", echo: bool = False):
        check_every("every_steps", every_steps)
        self.path = os.path.join(str(save_path), filename)
        self.every_steps = every_steps
        self.echo = echo
        self._f = None
        self._reset()

    def _reset(self):
        self._n = 0
        self._sums = [0.0, 0.0, 0.0]
        self._epochs = None

    def _open(self, append: bool):
        if self._f is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._f = open(self.path, "a" if append else "w", encoding="utf-8")

    def log(self, message: str) -> None:
        self.log_lines([message])

    def log_lines(self, messages) -> None:
        """Append lines with one time stamp; flushed at once."""
        if self._f is None:
            self._open(True)
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        self._f.write("".join(f"[{stamp}] {m}\n" for m in messages))
        self._f.flush()
        if self.echo:
            try:
                from tqdm.auto import tqdm

                for m in messages:
                    tqdm.write(m)
            except ImportError:
                print("\n".join(messages))

    def on_train_start(self, event, state):
        self._open(append=event.resumed)
        self._reset()
        self._epochs = event.epochs
        self._ipe = event.iters_per_epoch
        self._left_at_start = (event.epochs - event.epoch) * event.iters_per_epoch - event.position
        where = f"resuming at epoch {event.epoch} position {event.position} (step {event.step})" \
            if event.resumed else "from scratch"
        self.log(f">>> Start training {where}: {event.epochs} epochs x {event.iters_per_epoch} steps, "
                 f"host {socket.gethostname()}")

    def on_step_block(self, event, state):
        # One host sync and one write per block; a step's iteration time is its data time
        # plus its step time (fit measures data time from the previous step's end).
        lines = []
        due_rows = []
        left = getattr(self, "_left_at_start", None)
        epochs = f"/{event.epochs}" if event.epochs is not None else ""
        for step, iteration, metrics, _, data_time, step_time in event.rows:
            iter_time = data_time + step_time
            self._n += 1
            sums = self._sums
            sums[0] += data_time
            sums[1] += step_time
            sums[2] += iter_time
            if due(step, self.every_steps):
                means = [x / self._n for x in sums]
                eta = f" Remain {_fmt_eta(means[2] * (left - self._n))}" if left is not None else ""
                due_rows.append((step, metrics))
                lines.append(
                    f"Train: [{event.epoch + 1}{epochs}][{iteration + 1}/{event.iters_per_epoch}] step {step} "
                    f"Data {data_time:.3f} ({means[0]:.3f}) Step {step_time:.3f} ({means[1]:.3f}) "
                    f"Iter {iter_time:.3f} ({means[2]:.3f}){eta}"
                )
        if not lines:
            return
        for i, (_, nums) in enumerate(_numbers(due_rows)):
            text = " ".join(f"{k}: {v:.4f}" if not _is_lr(k) else f"{k}: {v:.6g}" for k, v in nums.items())
            lines[i] += " " + text
        self.log_lines(lines)

    def on_epoch_end(self, event, state):
        nums = _numbers([(event.step, dict(event.metrics))])[0][1]
        text = " ".join(f"{k}: {v:.4f}" for k, v in nums.items() if not _is_lr(k))
        tail = " (loader exhausted)" if event.exhausted else ""
        self.log(f"Train result epoch {event.epoch + 1}: {text}{tail}")

    def on_eval_end(self, event, state):
        text = " ".join(f"{k}: {v:.4f}" for k, v in event.metrics.items() if isinstance(v, (int, float)))
        self.log(f"Eval {event.name} at step {event.step}: {text}")

    def on_checkpoint_saved(self, event, state):
        self.log(f"Saved checkpoint {event.path}{' (best)' if event.best else ''}")

    def on_train_end(self, event, state):
        why = f" ({event.stop_reason})" if event.stop_reason else ""
        self.log(f"<<< Training {event.reason}{why} at step {event.step}, epoch {event.epoch}")

    def on_interrupted(self, event, state):
        self.log(f"<<< Interrupted (KeyboardInterrupt) after step {event.step}")

    def on_failed(self, event, state):
        self.log(f"<<< Failed at step {event.step}: {type(event.error).__name__}: {event.error}")

    def on_already_complete(self, event, state):
        self._open(append=True)
        self.log(f"Training already complete: epoch {event.epoch} >= epochs {event.epochs}; "
                 "nothing to run")

    def on_end(self, event, state):
        if self._f is not None:
            self._f.close()
            self._f = None
