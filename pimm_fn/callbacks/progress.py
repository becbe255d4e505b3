"""A progress bar through ``tqdm.auto``: widgets in a notebook, two stacked bars in a terminal."""
from __future__ import annotations

import time
from typing import Sequence

from .base import Callback


class ProgressBar(Callback):
    """An epoch bar (position 0) over a step bar (position 1) with steps/s, ETA and metrics.

    The step bar is reset each epoch (not re-created), so a terminal keeps exactly two lines
    and a notebook two widgets. It takes the steps in blocks (``fit(block_seconds=...)``)
    and refreshes at most every ``refresh_seconds``; the metrics shown (``metrics``, default
    the loss) are pulled then: one host sync per refresh, not per step. Print from
    other code with ``tqdm.write`` to keep the bars intact.
    """

    def __init__(self, metrics: Sequence[str] = ("loss",), refresh_seconds: float = 0.5, leave: bool = True,
                 file=None, disable: bool = False):
        self.metrics = tuple(metrics)
        self.refresh_seconds = refresh_seconds
        self.leave = leave
        self.file = file
        self.disable = disable
        self.epoch_bar = None
        self.step_bar = None
        self._shown = 0.0
        self._unshown = 0  # steps done but not yet handed to the bar

    def _tqdm(self):
        from tqdm.auto import tqdm

        return tqdm

    def on_train_start(self, event, state):
        tqdm = self._tqdm()
        self.epoch_bar = tqdm(total=event.epochs, initial=event.epoch, desc="epochs", unit="epoch", position=0,
                              leave=self.leave, file=self.file, disable=self.disable, dynamic_ncols=True,
                              mininterval=self.refresh_seconds)

    def _due(self) -> bool:
        """Whether a refresh is due (at most one every refresh_seconds, epochs included:
        a run of 0.1 s epochs must not redraw both bars ten times a second)."""
        now = time.monotonic()
        if now - self._shown < self.refresh_seconds:
            return False
        self._shown = now
        return True

    def on_epoch_start(self, event, state):
        tqdm = self._tqdm()
        desc = f"epoch {event.epoch + 1}" + (f"/{event.epochs}" if event.epochs else "")
        self._unshown = 0
        if self.step_bar is None:
            self.step_bar = tqdm(total=event.iters_per_epoch, initial=event.position, desc=desc, unit="step",
                                 position=1 if self.epoch_bar is not None else 0, leave=False, file=self.file,
                                 disable=self.disable, dynamic_ncols=True, mininterval=self.refresh_seconds)
        else:
            self.step_bar.reset(total=event.iters_per_epoch)
            # A new epoch shows its name at once when a refresh is due, even if its steps are
            # quicker than tqdm's own refresh interval.
            self.step_bar.set_description(desc, refresh=self._due())
            if event.position:
                self.step_bar.update(event.position)

    def on_step_block(self, event, state):
        bar = self.step_bar
        if bar is None:
            return
        # fit hands the steps over a few times a second (StepBlock); tqdm gets them at most
        # every refresh_seconds, with the block's last metrics (one host sync per refresh).
        self._unshown += len(event.rows)
        if not self._due():
            return
        if self.metrics and event.rows:
            last = event.rows[-1][2]
            shown = {k: f"{float(last[k]):.4g}" for k in self.metrics if k in last}
            if shown:
                bar.set_postfix(shown, refresh=False)
        bar.update(self._unshown)
        self._unshown = 0

    def _catch_up(self):
        if self.step_bar is not None and self._unshown:
            self.step_bar.update(self._unshown)
        self._unshown = 0

    def on_epoch_end(self, event, state):
        self._catch_up()
        if self.epoch_bar is not None:
            self.epoch_bar.update(1)
            if event.metrics and self.metrics:
                shown = {k: f"{float(event.metrics[k]):.4g}" for k in self.metrics if k in event.metrics}
                if shown:
                    self.epoch_bar.set_postfix(shown, refresh=self._due())

    def on_end(self, event, state):
        self._catch_up()
        for bar in (self.step_bar, self.epoch_bar):
            if bar is not None:
                bar.refresh()  # what a skipped refresh left unshown
                bar.close()
        self.step_bar = self.epoch_bar = None
