"""What an experiment file hands the command line: a :class:`Run`.

An experiment is a plain Python file in ``experiments/`` with a ``SETTINGS`` dict (the
defaults ``--set key=value`` overrides) and ``build(settings, ctx) -> Run``. The command
line adds the standard callbacks (log, TensorBoard, progress, checkpoints, evaluation)
and runs ``fit``; the experiment only says what to train and how to evaluate it.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import attrs


@attrs.frozen
class RunContext:
    """Where and how a run happens: its folder, device and process group."""

    save_path: Path
    device: Any = "cpu"
    rank: int = 0
    world_size: int = 1
    quick: bool = False  # tests ask for a few steps only


@attrs.frozen
class Run:
    """The pieces of one training run.

    state: the initial TrainState. loader: what ``fit`` folds over. step: the step
    function (compiled or not, as the experiment chose). epochs: the absolute horizon.
    evaluate: ``state -> dict of floats`` over the validation data, or None.
    best_metric / best_mode: the evaluation metric that picks the best checkpoint.
    callbacks: extra callbacks beside the standard ones. iters_per_epoch: for
    iterable data. render: ``(state, path) -> None`` writes a picture of a prediction.
    """

    state: Any
    loader: Any
    step: Callable
    epochs: int
    evaluate: Optional[Callable[[Any], dict]] = None
    best_metric: Optional[str] = None
    best_mode: str = "max"
    callbacks: Sequence[Any] = ()
    iters_per_epoch: Optional[int] = None
    render: Optional[Callable[[Any, Path], None]] = None
    eval_every_epochs: int = 1


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
        raise FileNotFoundError(
            f"no experiment {name!r}: {path} does not exist; available: {', '.join(available_experiments()) or '(none)'}"
        )
    spec = importlib.util.spec_from_file_location(f"pimm_fn_experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for attr in ("SETTINGS", "build"):
        if not hasattr(module, attr):
            raise AttributeError(f"experiment {path} defines no {attr}; an experiment needs SETTINGS and build(settings, ctx)")
    return module
