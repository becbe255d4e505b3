"""pimm_fn: a functional, JAX-style training engine for point-cloud models on PyTorch.

    state = TrainState.create(model, optim.adamw(lr=schedules.one_cycle(T, 1e-3)))
    step = compile_step(steps.supervised(clip_grad=1.0))
    state, history = fit(state, loader, step, epochs=10, callbacks=[ProgressBar()])
"""
from . import amp, callbacks, checkpoint, data, distributed, events, metrics, models, optim, rl, schedules, sharding, steps
from .amp import Autocast, LossScaleConfig, LossScaleState
from .callbacks import (
    Callback, Checkpoint, EarlyStopping, Evaluate, ProgressBar, StopOnNonFinite, TensorBoard, TextLog, Trace,
    WandB, on, restore_latest, resume,
)
from .checkpoint import CheckpointDir, import_seed_checkpoint, restore, save
from .compile import CompiledStep, Step, compile_step, explain_step
from .events import (
    AlreadyComplete, EpochEnd, EpochStart, EvalEnd, Failed, Interrupted, SaveNow, StepBlock, StepEnd, Stop, TrainEnd,
    TrainStart,
)
from .fit import FitResult, History, StateMutationError, fit, fit_epoch
from .state import Cursor, RngKey, TrainState
from .steps import grpo, supervised

__version__ = "0.1.0"

__all__ = [
    "AlreadyComplete", "Autocast", "Callback", "Checkpoint", "CheckpointDir", "CompiledStep", "Cursor",
    "EarlyStopping", "EpochEnd", "EpochStart", "EvalEnd", "Evaluate", "Failed", "FitResult", "History",
    "Interrupted", "LossScaleConfig", "LossScaleState", "ProgressBar", "RngKey", "SaveNow", "StateMutationError",
    "Step", "StepBlock", "StepEnd", "Stop", "StopOnNonFinite", "TensorBoard", "TextLog", "Trace", "TrainEnd", "TrainStart",
    "TrainState", "WandB", "amp", "callbacks", "checkpoint", "compile_step", "data", "distributed", "events",
    "explain_step", "fit", "fit_epoch", "grpo", "import_seed_checkpoint", "metrics", "models", "on", "optim",
    "restore", "restore_latest", "resume", "rl", "save", "schedules", "sharding", "steps", "supervised",
]
