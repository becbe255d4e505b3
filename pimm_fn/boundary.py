"""The step boundary: what a step does on the host around its pure core.

A step function is pure over the tensor part of a :class:`TrainState`. Two host-side
leaves never enter a compiled graph: the RNG key and the data cursor (Python ints would
be guarded by value and recompile every step). :class:`Step` is the boundary: it seeds
torch's generator from the state's RNG key, runs the optional host ``prepare`` (GRPO's
rollout), calls the pure core on the state without those leaves, and hands back the state
with the key advanced and the cursor untouched. :mod:`pimm_fn.compile` compiles the core.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch._dynamo

from .compile_modes import device_error
from .state import RngKey, TrainState

_DYNAMO_CONFIG = torch._dynamo.config
_CPU_GENERATOR = torch.default_generator

StepCore = Callable[[TrainState, Any], tuple]


def _rank_seed(seed: int) -> int:
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

    Why not ``torch.random.fork_rng`` + ``torch.manual_seed``: on torch 2.13 they cost
    ~80-90 us per call and grow with the caller's stack depth (``manual_seed`` formats the
    Python stack); saving the generator's state and seeding the generator object directly
    costs ~2 us and gives the same stream. Inductor's compiled random ops draw their seeds
    from this same default generator, so eager and compiled steps are governed alike.
    """

    __slots__ = ("seed", "_saved")

    def __init__(self, seed: int):
        self.seed = seed
        self._saved = None

    def __enter__(self):
        gens = [torch.default_generator]
        # CUDA's generator only once CUDA is in use: querying it would initialise CUDA.
        if torch.cuda.is_initialized():
            gens.append(torch.cuda.default_generators[torch.cuda.current_device()])
        self._saved = [(g, g.get_state()) for g in gens]
        for g in gens:
            g.manual_seed(self.seed)
        return self

    def __exit__(self, *exc):
        for g, st in self._saved:
            g.set_state(st)
        self._saved = None
        return False


def _with_host(state: TrainState, rng, cursor) -> TrainState:
    # state.replace(rng=..., cursor=...) without its field check: this runs twice per call.
    new = object.__new__(TrainState)
    fields = new.__dict__
    fields.update(state.__dict__)
    fields["rng"] = rng
    fields["cursor"] = cursor
    return new


def _run_core(core: StepCore, state: TrainState, batch):
    if not isinstance(state, TrainState):
        raise TypeError(f"a step takes a TrainState as its first argument, got {type(state).__name__}")
    # Randomness inside a step (dropout, sampling) comes from torch's generator, seeded
    # from the state's key: the same state and batch always give the same result.
    rng, cursor = state.rng, state.cursor
    seed = _rank_seed(rng.step_seed())
    if torch.cuda.is_initialized():
        with seeded_rng(seed):
            try:
                new_state, metrics = core(_with_host(state, None, None), batch)
            except RuntimeError as err:
                device_error(err, state, batch)
                raise
    else:  # seeded_rng inlined for the CPU generator alone: this path runs every call
        saved = _CPU_GENERATOR.get_state()
        _CPU_GENERATOR.manual_seed(seed)
        try:
            new_state, metrics = core(_with_host(state, None, None), batch)
        except RuntimeError as err:
            device_error(err, state, batch)
            raise
        finally:
            _CPU_GENERATOR.set_state(saved)
    return _with_host(new_state, rng.next(), cursor), metrics


def _run_unseeded(core: StepCore, state: TrainState, batch):
    # For a compiled step seen to draw no random numbers: the generator is neither saved,
    # seeded nor restored (~8 us of the boundary on a 2-core machine).
    if not isinstance(state, TrainState):
        raise TypeError(f"a step takes a TrainState as its first argument, got {type(state).__name__}")
    new_state, metrics = core(_with_host(state, None, None), batch)
    return _with_host(new_state, state.rng.next(), state.cursor), metrics


def _run_probed(core: StepCore, state: TrainState, batch):
    """``_run_core``, also saying whether the core drew from the generator (CUDA: assumed)."""
    if torch.cuda.is_initialized() or not isinstance(state, TrainState):
        return _run_core(core, state, batch), True
    rng, cursor = state.rng, state.cursor
    saved = _CPU_GENERATOR.get_state()
    _CPU_GENERATOR.manual_seed(_rank_seed(rng.step_seed()))
    seeded = _CPU_GENERATOR.get_state()
    try:
        new_state, metrics = core(_with_host(state, None, None), batch)
        drew = not torch.equal(_CPU_GENERATOR.get_state(), seeded)
    finally:
        _CPU_GENERATOR.set_state(saved)
    return (_with_host(new_state, rng.next(), cursor), metrics), drew


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
            new_state, metrics = _run_core(self.core, state, batch)
        else:
            inner, prepared = _prepare(self, state, batch)
            new_state, metrics = _run_core(self.core, inner, prepared)
            new_state = _with_host(new_state, state.rng.next(), state.cursor)
        _check_finite(self, state, metrics)
        return new_state, metrics

    def __repr__(self):
        return f"Step({self.name})"


def _prepare(step: "Step", state: TrainState, batch):
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
    with seeded_rng(_rank_seed(seed)):
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
    return _with_host(state, RngKey(seed=seed, counter=0), state.cursor), prepared


def _check_finite(step: "Step", state: TrainState, metrics: dict):
    # Only when the user chose to raise: reading the flag is a host sync.
    if step.raise_on_nonfinite and "skipped" in metrics and bool(metrics["skipped"]):
        raise FloatingPointError(
            f"non-finite loss or gradients at step {int(state.step)} "
            f"(loss={float(metrics.get('loss', float('nan')))}); the update was not applied. "
            "Lower the learning rate, enable clipping or loss scaling, or build the step with "
            "nonfinite='skip' to skip such steps and count them."
        )


def _validate_first_batch(batch, name: str, state: Optional[TrainState] = None) -> None:
    # Before the first trace: a batch whose keys disagree (32 inputs, 30 labels) would
    # otherwise fail inside fake-tensor tracing with a message about symbolic sizes, and a
    # batch on another device than the state with one about fake-tensor device propagation.
    from .data.collate import validate_batch
    from .data.device import check_batch_device

    try:
        validate_batch(batch)
        if state is not None and state.params:
            check_batch_device(batch, state.device)
    except ValueError as err:
        raise ValueError(f"the batch handed to step {name!r} is malformed: {err}") from None


def as_step(fn) -> Step:
    """Wrap a plain core function as a :class:`Step` (a Step is returned unchanged)."""
    return fn if isinstance(fn, Step) else Step(fn)
