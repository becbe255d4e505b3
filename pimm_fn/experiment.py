"""What an experiment file hands the command line: a :class:`Run`.

An experiment is a plain Python file in ``experiments/`` with a ``SETTINGS`` dict (the
defaults ``--set key=value`` overrides) and ``build(settings, ctx) -> Run``. Two optional
dicts go beside ``SETTINGS``:

    QUICK     settings ``--quick`` changes (e.g. ``{"epochs": 2}``); an explicit
              ``--set`` wins over them, and the run's settings.json records the result.
    MINIMUM   the smallest valid value of numeric settings (``{"epochs": 1,
              "batch_size": 1}``): ``--set epochs=0`` is an error naming ``epochs``.

``build`` receives the resolved settings (:func:`experiment_settings`) and never changes
them; ``ctx.quick`` is for what is not a setting (a few iterations per epoch, a smaller
validation subset). The command line adds the standard callbacks (log, TensorBoard,
progress, checkpoints, evaluation) and runs ``fit``; the experiment only says what to
train and how to evaluate it.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import attrs

from .settings import resolve


class ExperimentError(Exception):
    """An experiment file that is missing or lacks what the command line needs."""


class ExperimentNotFoundError(ExperimentError, FileNotFoundError):
    """No experiment file of that name; the message lists the available ones."""


@attrs.frozen
class RunContext:
    """Where and how a run happens: its folder, device and process group."""

    save_path: Path
    device: Any = "cpu"
    rank: int = 0
    world_size: int = 1
    quick: bool = False  # a smoke test: a few iterations per epoch (QUICK holds the settings it changes)


@attrs.frozen
class Run:
    """The pieces of one training run.

    state: the initial TrainState. loader: what ``fit`` folds over. step: the step
    function (compiled or not, as the experiment chose). epochs: the absolute horizon.
    evaluate: the validation: a :class:`pimm_fn.callbacks.Evaluate` (e.g.
    ``recipes.segmentation_eval(...)``), a ``state -> dict of floats`` function, or None.
    best_metric / best_mode: the evaluation metric that picks the best checkpoint.
    callbacks: extra callbacks beside the standard ones. iters_per_epoch: for
    iterable data. render: ``(state, path) -> None`` writes a picture of a prediction.
    """

    state: Any
    loader: Any
    step: Callable
    epochs: int
    evaluate: Any = None
    best_metric: Optional[str] = None
    best_mode: str = "max"
    callbacks: Sequence[Any] = ()
    iters_per_epoch: Optional[int] = None
    render: Optional[Callable[[Any, Path], None]] = None
    eval_every_epochs: int = 1

    def evaluator(self):
        """The validation as an Evaluate callback on the run's schedule (every
        ``eval_every_epochs`` epochs and at the end, named "val"), or None."""
        if self.evaluate is None:
            return None
        import copy

        from .callbacks.evaluation import Evaluate

        if isinstance(self.evaluate, Evaluate):
            out = copy.copy(self.evaluate)
            out.every_steps, out.every_epochs, out.name, out.at_end = None, self.eval_every_epochs, "val", True
            return out
        if not callable(self.evaluate):
            raise TypeError(f"Run.evaluate must be an Evaluate or a function state -> dict, "
                            f"got {type(self.evaluate).__name__}")
        return Evaluate.of(self.evaluate, every_epochs=self.eval_every_epochs, name="val", at_end=True)

    def validate(self, state) -> dict:
        """The validation metrics of ``state`` now (floats)."""
        ev = self.evaluator()
        if ev is None:
            raise ValueError("this run defines no evaluation (Run(evaluate=...))")
        return ev.metrics(state)


def experiments_dir() -> Path:
    """The ``experiments/`` folder beside the package (an editable install) or in the cwd."""
    beside = Path(__file__).resolve().parent.parent / "experiments"
    return beside if beside.is_dir() else Path.cwd() / "experiments"


def available_experiments() -> list[str]:
    """Names of the experiment files."""
    return sorted(p.stem for p in experiments_dir().glob("*.py") if not p.stem.startswith("_"))


def load_experiment(name: str):
    """Import an experiment by name (``experiments/<name>.py``) or by file path."""
    path = Path(name)
    if path.suffix != ".py":
        path = experiments_dir() / f"{name}.py"
    if not path.is_file():
        raise ExperimentNotFoundError(
            f"no experiment {name!r} ({path} does not exist); "
            f"pass one of: {', '.join(available_experiments()) or '(none)'}"
            " or the path of an experiment file"
        )
    spec = importlib.util.spec_from_file_location(f"pimm_fn_experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for attr in ("SETTINGS", "build"):
        if not hasattr(module, attr):
            raise ExperimentError(
                f"experiment {path} defines no {attr}; an experiment needs SETTINGS and build(settings, ctx)"
            )
    for attr in ("QUICK", "MINIMUM"):
        unknown = sorted(set(getattr(module, attr, {})) - set(module.SETTINGS))
        if unknown:
            raise ExperimentError(f"{path}: {attr} names {', '.join(map(repr, unknown))}, which SETTINGS lacks; "
                                f"add them to SETTINGS or drop them from {attr}")
    return module


def experiment_settings(module, overrides: Sequence[str] = (), *, quick: bool = False) -> dict:
    """The settings a run of ``module`` uses: SETTINGS, then QUICK if ``quick``, then ``overrides``.

    overrides: ``key=value`` strings (``--set``); they win over QUICK. The result is
    checked against the module's MINIMUM. Raises :class:`~pimm_fn.settings.SettingsError`.
    """
    return resolve(module.SETTINGS, overrides, quick=getattr(module, "QUICK", None) if quick else None,
                   minimum=getattr(module, "MINIMUM", None))
