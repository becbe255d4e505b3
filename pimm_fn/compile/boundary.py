"""The step boundary: what a step does on the host around its pure core.

A step function is pure over the tensor part of a :class:`TrainState`. Two host-side
leaves never enter a compiled graph: the RNG key and the data cursor (Python ints would
be guarded by value and recompile every step). :class:`Step` is the boundary: it seeds
torch's generator from the state's RNG key, runs the optional host ``prepare`` (GRPO's
rollout), calls the pure core on the state without those leaves, and hands back the state
with the key advanced and the cursor untouched. :mod:`pimm_fn.compile.step` compiles the core.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch

from ..state import RngKey, TrainState
from .modes import device_error

_CPU_GENERATOR = torch.default_generator

StepCore = Callable[[TrainState, Any], tuple]


def rank_seed(seed: int) -> int:
    # Under data parallelism every rank holds the same key; folding the rank in gives each
    # rank its own dropout masks / samples while keeping them a pure function of the state.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
        seed = (seed + rank * 0x9E3779B97F4A7C15) & 0x7FFFFFFFFFFFFFFF
    return seed


class seeded_rng:
    """Run the block with torch's generator seeded to ``seed``, then put it back.

    The step's randomness is a function of the state alone, and a step leaves the caller's
    global RNG stream as it found it (model construction or data code after a step draws
    the same numbers whether or not, and on which rank, steps ran).

    The generator's state is saved and the generator seeded directly rather than through
    ``torch.random.fork_rng`` + ``torch.manual_seed``, which cost far more per call and grow
    with the caller's stack depth (benchmarks/README.md, "Engine overhead"). Inductor's
    compiled random ops draw their seeds from this same default generator, so eager and
    compiled steps are governed alike.
    """

    __slots__ = ("seed", "_cpu", "_cuda")

    def __init__(self, seed: int):
        self.seed = seed
        self._cpu = self._cuda = None

    def __enter__(self):
        self._cpu = _CPU_GENERATOR.get_state()
        _CPU_GENERATOR.manual_seed(self.seed)
        # CUDA's generator only once CUDA is in use: querying it would initialise CUDA.
        if torch.cuda.is_initialized():
            gen = torch.cuda.default_generators[torch.cuda.current_device()]
            self._cuda = (gen, gen.get_state())
            gen.manual_seed(self.seed)
        return self

    def __exit__(self, *exc):
        _CPU_GENERATOR.set_state(self._cpu)
        if self._cuda is not None:
            gen, state = self._cuda
            gen.set_state(state)
        self._cpu = self._cuda = None
        return False


def with_host(state: TrainState, rng, cursor) -> TrainState:
    """``state`` with its host leaves (the RNG key and the cursor) set."""
    return state.replace(rng=rng, cursor=cursor)


def run_core(core: StepCore, state: TrainState, batch):
    """Call a pure ``core`` on ``state`` without its host leaves, seeded from its key.

    Randomness inside a step (dropout, sampling) comes from torch's generator, seeded from
    the state's key on every call: the same state and batch always give the same result,
    whichever graph (eager, compiled, recompiled) runs. Returns the new state with the key
    advanced and the cursor as it was, and the metrics.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"a step takes a TrainState as its first argument, got {type(state).__name__}")
    rng, cursor = state.rng, state.cursor
    seed = rank_seed(rng.step_seed())
    if torch.cuda.is_initialized():
        seeding = seeded_rng(seed)
        seeding.__enter__()
    else:  # seeded_rng for the CPU generator alone, inline: this runs every call
        seeding, saved = None, _CPU_GENERATOR.get_state()
        _CPU_GENERATOR.manual_seed(seed)
    try:
        new_state, metrics = core(with_host(state, None, None), batch)
    except RuntimeError as err:
        device_error(err, state, batch)
        raise
    finally:
        if seeding is None:
            _CPU_GENERATOR.set_state(saved)
        else:
            seeding.__exit__(None, None, None)
    return with_host(new_state, rng.next(), cursor), metrics


class Step:
    """A step ``(state, batch) -> (state, metrics)``: an optional host ``prepare`` and a pure core.

    core: the pure function over the state's tensor leaves. It must not read
        ``state.rng`` or ``state.cursor`` (they are None inside) and should advance
        ``state.step``. Calling a Step runs it eagerly; ``compile_step`` compiles the core.
    prepare: optional ``prepare(state, batch) -> batch'`` run eagerly on the host before the
        core, never compiled (any Python: GRPO's rollout sampling and rewards). torch's
        generator is seeded from the state's key while it runs, so what it draws is a
        function of the state (resume stays exact); the core then sees ``batch'`` and its
        own key split off this step's key (its dropout does not replay prepare's stream).
    check_batch: optional ``(state, batch) -> None`` that raises on a batch the step cannot
        use; a compiled step runs it on the host before its first trace (on ``batch'``).
    """

    def __init__(self, core: StepCore, *, name: Optional[str] = None, raise_on_nonfinite: bool = False,
                 check_batch: Optional[Callable] = None, prepare: Optional[Callable] = None):
        if prepare is not None and not callable(prepare):
            raise TypeError(f"prepare must be a function prepare(state, batch) -> batch, got {type(prepare).__name__}")
        self.core = core
        self.name = name or getattr(core, "__name__", "step")
        self.raise_on_nonfinite = raise_on_nonfinite
        # check_batch(state, batch): host checks a compiled step runs before its first trace.
        self.check_batch = check_batch
        self.prepare = prepare
        functools.update_wrapper(self, core, updated=())

    def __call__(self, state: TrainState, batch):
        if self.prepare is None:
            new_state, metrics = run_core(self.core, state, batch)
        else:
            inner, prepared = prepare_batch(self, state, batch)
            new_state, metrics = run_core(self.core, inner, prepared)
            new_state = with_host(new_state, state.rng.next(), state.cursor)
        check_finite(self, state, metrics)
        return new_state, metrics

    def __repr__(self):
        return f"Step({self.name})"


def prepare_batch(step: "Step", state: TrainState, batch):
    """Run ``step.prepare`` on the host: ``(the state the core gets, the core's batch)``.

    The core's state carries a key split off this step's key; the caller hands back the
    state with the step's own key advanced (as a step without prepare does).
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"a step takes a TrainState as its first argument, got {type(state).__name__}")
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"step {step.name!r} has a host prepare phase and cannot be traced whole; "
            "compile it with compile_step(step), which compiles its core and runs prepare eagerly"
        )
    seed = state.rng.step_seed()
    with seeded_rng(rank_seed(seed)):
        prepared = step.prepare(state, batch)
    if prepared is None:
        raise TypeError(
            f"the prepare function of step {step.name!r} returned None; it must return the batch "
            "its core takes (prepare(state, batch) -> batch'): is a `return` missing?"
        )
    if isinstance(prepared, TrainState) or (
            isinstance(prepared, tuple) and prepared and isinstance(prepared[0], TrainState)):
        raise TypeError(
            f"the prepare function of step {step.name!r} returned a TrainState; prepare returns only "
            "the batch its core takes (prepare(state, batch) -> batch') and cannot change the state: "
            "move state updates into the core"
        )
    return with_host(state, RngKey(seed=seed, counter=0), state.cursor), prepared


def check_finite(step: "Step", state: TrainState, metrics: dict):
    # Only when the user chose to raise: reading the flag is a host sync. Under loss scaling
    # a skipped step is the scale's overflow, which GradScaler skips and backs off from.
    if step.raise_on_nonfinite and getattr(state, "loss_scale", None) is None and "skipped" in metrics \
            and bool(metrics["skipped"]):
        raise FloatingPointError(
            f"non-finite loss or gradients at step {int(state.step)} "
            f"(loss={float(metrics.get('loss', float('nan')))}); the update was not applied. "
            "Lower the learning rate, enable clipping or loss scaling, or build the step with "
            "nonfinite='skip' to skip such steps and count them."
        )


def validate_first_batch(batch, name: str, state: Optional[TrainState] = None) -> None:
    # Before the first trace: a batch whose keys disagree (32 inputs, 30 labels) would
    # otherwise fail inside fake-tensor tracing with a message about symbolic sizes, and a
    # batch on another device than the state with one about fake-tensor device propagation.
    from ..data.collate import validate_batch
    from ..data.device import check_batch_device

    try:
        validate_batch(batch)
        if state is not None and state.params:
            check_batch_device(batch, state.device)
    except ValueError as err:
        raise ValueError(f"the batch handed to step {name!r} is malformed: {err}") from None


def check_step_function(fn, role: str = "step") -> None:
    """A TypeError naming the mistake when ``fn`` cannot be called as ``fn(state, batch)``
    (most often a step builder passed uncalled: ``steps.supervised`` for ``steps.supervised()``)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    if not callable(fn):
        raise TypeError(f"the {role} must be a function step(state, batch) -> (state, metrics), got {name}")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise TypeError(
            f"the {role} {name} cannot be called as {name}(state, batch); a step builder such as "
            f"pimm_fn.steps.supervised must be called first: {name}(...) returns the step") from None
    except ValueError:
        pass  # no signature to read (a builtin): let the call say


def as_step(fn) -> Step:
    """Wrap a plain core function as a :class:`Step` (a Step is returned unchanged)."""
    if isinstance(fn, Step):
        return fn
    check_step_function(fn)
    return Step(fn)
