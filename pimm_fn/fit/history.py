"""History: what a run's steps reported, kept as tensors until read."""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["History"]


class History:
    """What a run's steps reported, kept as tensors until read.

    Per epoch, the step metrics are stacked into 1-D tensors when the epoch ends (no host
    sync); reading a value (``epoch_averages()``, ``values(k)``) is what syncs.
    """

    def __init__(self):
        self.records: list[dict] = []  # {"epoch", "steps": 1-D int64, "metrics": {k: 1-D}}
        self._pending: list[tuple[int, Any]] = []
        self._pending_epoch: Optional[int] = None

    def _open(self, epoch: int) -> list:
        """The list ``fit`` appends ``(step, metrics)`` to during ``epoch``."""
        if self._pending_epoch != epoch:
            self._close()
            self._pending_epoch = epoch
        return self._pending

    def _close(self) -> Optional[dict]:
        """Stack the pending epoch's metrics into a record; returns its averages (tensors)."""
        if not self._pending:
            self._pending_epoch = None
            return None
        columns: dict = {}
        for _, m in self._pending:
            for k, v in m.items():
                columns.setdefault(k, []).append(v)
        metrics = {}
        for k, values in columns.items():
            try:
                column = torch.stack(values)  # a step's metrics are 0-dim tensors
            except (TypeError, RuntimeError):  # numbers, or tensors of different shapes
                column = None
            if column is None or column.numel() != len(values):
                # one-element values only; larger tensors are left out
                values = [torch.as_tensor(v).reshape(()) for v in values
                          if isinstance(v, (int, float)) or isinstance(v, torch.Tensor) and v.numel() == 1]
                if not values:
                    continue
                column = torch.stack(values)
            metrics[k] = column.detach().reshape(-1)
        return self._record(metrics)

    def _record(self, metrics: dict) -> dict:
        rec = {
            "epoch": self._pending_epoch,
            "steps": torch.tensor([s for s, _ in self._pending], dtype=torch.int64),
            "metrics": metrics,
        }
        last = self.records[-1] if self.records else None
        if last is not None and last["epoch"] == rec["epoch"] and set(last["metrics"]) == set(metrics):
            # The rest of an epoch a resumed run restored the first part of: one record, and
            # its averages are the whole epoch's, as in the run that was not interrupted.
            last["steps"] = torch.cat([last["steps"], rec["steps"]])
            last["metrics"] = metrics = {k: torch.cat([last["metrics"][k], v]) for k, v in metrics.items()}
        else:
            self.records.append(rec)
        self._pending, self._pending_epoch = [], None
        return {k: v.float().mean() for k, v in metrics.items()}

    def _averages_of(self, epoch: int) -> Optional[dict]:
        """The averages of ``epoch``'s record if it is the last one (a resume at its very end)."""
        last = self.records[-1] if self.records else None
        if last is None or last["epoch"] != epoch:
            return None
        return {k: v.float().mean() for k, v in last["metrics"].items()}

    def state_dict(self) -> dict:
        """The records so far (the open epoch's steps included), as tensors: what a
        checkpoint carries so that a resumed run can hand back the whole run's history."""
        records = [dict(r) for r in self.records]
        if self._pending:
            snapshot = History()
            snapshot._pending, snapshot._pending_epoch = list(self._pending), self._pending_epoch
            snapshot._close()
            records += snapshot.records
        keys = [sorted(r["metrics"]) for r in records]
        if records and all(k == keys[0] for k in keys) and all(
                len(v) == len(r["steps"]) for r in records for v in r["metrics"].values()):
            # One tensor per column, whatever the run's length: a checkpoint stays a handful
            # of entries, not six per epoch. (A metric some steps lacked keeps the long form.)
            return {
                "epochs": [r["epoch"] for r in records],
                "lengths": [len(r["steps"]) for r in records],
                "steps": torch.cat([r["steps"] for r in records]),
                "metrics": {k: torch.cat([r["metrics"][k] for r in records]) for k in keys[0]},
            }
        return {"records": [{"epoch": r["epoch"], "steps": r["steps"], "metrics": dict(r["metrics"])}
                            for r in records]}

    def load_state_dict(self, state: dict) -> None:
        if "lengths" in state:
            bounds = [0]
            for n in state["lengths"]:
                bounds.append(bounds[-1] + int(n))
            self.records = [
                {"epoch": int(e), "steps": state["steps"][a:b],
                 "metrics": {k: v[a:b] for k, v in state["metrics"].items()}}
                for e, a, b in zip(state["epochs"], bounds, bounds[1:])
            ]
        else:
            self.records = [{"epoch": int(r["epoch"]), "steps": r["steps"], "metrics": dict(r["metrics"])}
                            for r in state.get("records", [])]
        self._pending, self._pending_epoch = [], None

    @property
    def epochs(self) -> list[int]:
        return [r["epoch"] for r in self.records]

    @property
    def steps(self) -> list[int]:
        """Step numbers recorded (as ``StepEnd.step`` numbers them)."""
        return [s for r in self.records for s in r["steps"].tolist()] + [s for s, _ in self._pending]

    def values(self, key: str) -> torch.Tensor:
        """One metric over every recorded step, as a 1-D tensor (steps lacking it are left out)."""
        parts = [r["metrics"][key] for r in self.records if key in r["metrics"]]
        parts += [torch.as_tensor(m[key]).reshape(1) for _, m in self._pending if key in m]
        if not parts:
            raise KeyError(f"no step reported metric {key!r}; known: {sorted(self.keys())}")
        return torch.cat([p.reshape(-1) for p in parts])

    def keys(self) -> set:
        out = set()
        for r in self.records:
            out.update(r["metrics"])
        for _, m in self._pending:
            out.update(m)
        return out

    def epoch_averages(self) -> list[dict]:
        """Per recorded epoch: ``{"epoch": e, <metric>: mean float, ...}`` (pulls numbers)."""
        return [
            {"epoch": r["epoch"], **{k: float(v.float().mean()) for k, v in r["metrics"].items()}}
            for r in self.records
        ]

    def __len__(self) -> int:
        return sum(len(r["steps"]) for r in self.records) + len(self._pending)

    def __repr__(self) -> str:
        return f"History(steps={len(self)}, epochs={self.epochs}, metrics={sorted(self.keys())})"

