"""The compile boundary: a step's host prelude/epilogue and ``compile_step``.

A step function is pure over the tensor part of a :class:`TrainState`. Two host-side
leaves never enter a compiled graph: the RNG key and the data cursor (Python ints would
be guarded by value and recompile every step). :class:`Step` is the boundary: it seeds
torch's generator from the state's RNG key, calls the pure core on the state without
those leaves, and hands back the state with the key advanced and the cursor untouched.
``compile_step`` compiles the core with ``fullgraph=True`` and counts its compilations.
"""
from __future__ import annotations

import functools
import hashlib
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch._dynamo

from .compile_modes import copy_tensors, device_error, mode_patches
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


class CompiledStep:
    """A :class:`Step` compiled with ``fullgraph=True``, counting its compilations.

    compile_count: how many graphs were compiled (1 in steady state; each recompile +1).
    recompile_reasons: dynamo's guard failures that triggered each recompile.
    compile_seconds: wall time of the calls that compiled.
    """

    def __init__(self, step: Step, *, eager: bool = False, dynamic: Optional[bool] = None,
                 mode: Optional[str] = None, options: Optional[dict] = None,
                 recompile_limit: Optional[int] = None, cache=None):
        from . import step_cache

        self.step = step
        self.eager = eager
        self.cache_dir = None if eager else step_cache.resolve_dir(cache)
        self.cache_path: Optional[str] = None  # the artifact this step was loaded from or saved to
        self.loaded_from_cache = False
        self._precompiled = None  # the cached (loaded or just saved) step, until its guards reject an input
        self._settings = repr((dynamic, mode, sorted((options or {}).items()), recompile_limit))
        self.compile_count = 0
        self.recompile_reasons: list[str] = []
        self.compile_seconds: list[float] = []
        self._pending_reasons: list[str] = []
        self._traced_once = False
        self._flag_set = False
        # RNG: a compiled graph draws the same random numbers on every call (no control
        # flow), so whether it draws at all is seen on its first run. Once every graph of
        # this step ran without drawing, calls skip the generator's save/seed/restore;
        # a graph that draws makes the step seed every call from then on (sticky).
        self._rng_free = False
        self._rng_used = False
        self._current: Optional[TrainState] = None  # an unseeded call's state (seeds a recompile)
        self._reseed = None  # (saved, seeded) generator states of a recompile seeded mid-call
        self._cudagraphs = False
        if eager:
            # Python control flow may draw only sometimes: an eager step seeds every call.
            self._rng_used = True
            self._core = step.core
            return
        from . import isa_memo

        isa_memo.install()  # inductor's CPU ISA probes: ~9 s of a cold compile, answered from disk
        patches = mode_patches(mode, dynamic, options)
        # CUDA graphs (reduce-overhead, max-autotune): see _cudagraph_call.
        self._cudagraphs = bool(patches.get("triton.cudagraphs"))
        self._cudagraph_checked = False

        def backend(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            self.compile_count += 1
            if self.compile_count > 1:
                self.recompile_reasons.extend(self._pending_reasons or ["unknown"])
            return compile_fx(gm, example_inputs, config_patches=patches or None)

        self._backend = backend

        def on_guard_fail(failure):
            # Dynamo calls this before it re-traces: the one moment besides the first call
            # at which tracing needs the autograd flag (see __call__), and at which an
            # unseeded call must seed the generator for the graph it is about to make.
            self._pending_reasons.append(str(failure.reason))
            self._allow_autograd_tracing()
            self._seed_mid_call()

        self._dynamic = dynamic
        self._first_batch = None  # the cached step's example batch (shapes only are read)
        self._core = torch._dynamo.optimize(
            backend, nopython=True, dynamic=dynamic, guard_fail_fn=on_guard_fail,
            recompile_limit=recompile_limit, isolate_recompiles=True,
        )(step.core)

    def _allow_autograd_tracing(self):
        # trace_autograd_ops lets dynamo trace torch.autograd.grad, which (unlike torch.func
        # transforms) handles BatchNorm's in-place buffer updates. Dynamo reads it only while
        # tracing, so it is switched on for the first call and, through guard_fail_fn, for a
        # recompile, not around every call: config.patch costs ~15 us, a cache hit ~0.
        if not self._flag_set and not _DYNAMO_CONFIG.trace_autograd_ops:
            _DYNAMO_CONFIG.trace_autograd_ops = True
            self._flag_set = True

    def __call__(self, state: TrainState, batch):
        if self.step.prepare is None:
            return self._call_core(state, batch)
        inner, prepared = _prepare(self.step, state, batch)
        new_state, metrics = self._call_core(inner, prepared)
        return _with_host(new_state, state.rng.next(), state.cursor), metrics

    def _call_core(self, state: TrainState, batch):
        if self._cudagraphs:
            return self._cudagraph_call(state, batch)
        return self._call_core_plain(state, batch)

    def _cudagraph_call(self, state: TrainState, batch):
        """A call under CUDA graphs: the graph's outputs are copied out of its memory pool.

        A replay writes its outputs into the same pool memory as the replay before: without
        the copy, the state and metrics a step returned would be overwritten by the next
        step (fit, a callback or user code holding step t's state would read step t+1's).
        One device copy of the state and metrics per step keeps every returned tensor
        valid; it is what mode="reduce-overhead" costs besides the graphs' memory.
        """
        if not self._cudagraph_checked:
            self._cudagraph_checked = True
            if isinstance(state, TrainState) and state.params and state.device.type != "cuda":
                warnings.warn(
                    f"compile_step(mode=...) with CUDA graphs: the state of step {self.step.name!r} is on "
                    f"{state.device}, where no CUDA graphs are recorded; the step compiles as in the default "
                    "mode (pass mode=None to silence this)", UserWarning, stacklevel=4)
                self._cudagraphs = False
                return self._call_core_plain(state, batch)
        torch.compiler.cudagraph_mark_step_begin()
        new_state, metrics = self._call_core_plain(state, batch)
        return copy_tensors(new_state), copy_tensors(metrics)

    def _call_core_plain(self, state: TrainState, batch):
        if self._pending_reasons:
            self._pending_reasons = []
        before = self.compile_count
        start = time.perf_counter()
        if not self._traced_once:
            _validate_first_batch(batch, self.step.name, state)
            if self.step.check_batch is not None:
                self.step.check_batch(state, batch)
            self._allow_autograd_tracing()
        unseeded = self._rng_free and not torch.cuda.is_initialized()
        if unseeded:
            self._current = state
        try:
            if self.cache_dir is not None and not self._traced_once:
                self._precompiled = self._from_cache(state, batch)
            out = None
            if self._precompiled is not None:
                try:
                    out = self._run(self._precompiled, state, batch, unseeded)
                except RuntimeError as err:
                    from . import step_cache

                    if not step_cache.is_guard_failure(err):
                        raise
                    # A new shape or dtype: from now on the step compiles as without a cache.
                    reason = f"the cached step's guards rejected the input: {err}"[:500]
                    # The backend records reasons from the second compile on; a loaded step's
                    # first compile is this one.
                    (self.recompile_reasons if self.compile_count == 0 else self._pending_reasons).append(reason)
                    self._precompiled = None
                    if self._dynamic is None:
                        # The sizes vary: mark the dims that differ from the cached step's
                        # dynamic, as dynamo's automatic dynamic would have on this second
                        # shape (its first, static, compile was the cached one).
                        step_cache.mark_changed_dims(self._first_batch, batch)
                    self._allow_autograd_tracing()
                    unseeded = False  # dynamo's first graph: no guard failure will seed it
            if out is not None:
                new_state, metrics = out
            else:
                new_state, metrics = self._run_dynamo(state, batch, unseeded)
        except torch._dynamo.exc.Unsupported as compile_error:
            # Dynamo reports a user error raised while tracing (a missing "loss", a shape
            # mismatch) as "Observed exception". Running the pure core eagerly once turns
            # it back into the user's own error; the inputs are never mutated, so this is safe.
            try:
                _run_core(self.step.core, state, batch)
            except Exception as user_error:
                raise user_error from compile_error
            raise
        finally:
            if self._flag_set:
                _DYNAMO_CONFIG.trace_autograd_ops = False
                self._flag_set = False
            if unseeded:
                self._current = None
                if self._reseed is not None:
                    saved, seeded = self._reseed
                    self._reseed = None
                    if not torch.equal(_CPU_GENERATOR.get_state(), seeded):
                        self._rng_free, self._rng_used = False, True
                    _CPU_GENERATOR.set_state(saved)
        self._traced_once = True
        if self.compile_count != before:
            self.compile_seconds.append(time.perf_counter() - start)
        if self.step.raise_on_nonfinite:
            _check_finite(self.step, state, metrics)
        return new_state, metrics

    def _run(self, fn, state: TrainState, batch, unseeded: bool):
        if unseeded:
            return _run_unseeded(fn, state, batch)
        if self._rng_used:
            return _run_core(fn, state, batch)
        out, drew = _run_probed(fn, state, batch)
        if drew:
            self._rng_free, self._rng_used = False, True
        else:
            self._rng_free = True
        return out

    def _seed_mid_call(self):
        state = self._current
        if state is None or self._reseed is not None:
            return
        saved = _CPU_GENERATOR.get_state()
        _CPU_GENERATOR.manual_seed(_rank_seed(state.rng.step_seed()))
        self._reseed = (saved, _CPU_GENERATOR.get_state())

    def _run_dynamo(self, state: TrainState, batch, unseeded: bool):
        try:
            return self._run(self._core, state, batch, unseeded)
        except torch._dynamo.exc.Unsupported as err:
            # A re-trace dynamo started without a guard failure reaching guard_fail_fn
            # (e.g. a new model on a shared step) meets autograd.grad with the flag off:
            # the failed trace left no cache entry, so trace again with it on (seeded: no
            # guard failure will seed this graph either).
            if self._flag_set or "trace_autograd_ops" not in str(err):
                raise
            self._allow_autograd_tracing()
            if self._reseed is not None:  # the failed trace had seeded mid-call: undo it first
                _CPU_GENERATOR.set_state(self._reseed[0])
                self._reseed = None
            self._current = None
            return self._run(self._core, state, batch, False)

    def _from_cache(self, state: TrainState, batch):
        """The step from the disk cache, or compiled now through dynamo's precompile API and
        saved there. None when the step cannot be precompiled (it then compiles as usual)."""
        from . import step_cache

        start = time.perf_counter()
        inner = state.replace(rng=None, cursor=None)
        self._first_batch = step_cache.shapes_of(batch)
        key = hashlib.sha256("|".join((
            step_cache.fingerprint(self.step.core, state),
            step_cache.leaves_key(inner, batch, shapes=self._dynamic is not True), self._settings,
        )).encode()).hexdigest()
        path = step_cache.artifact_path(self.cache_dir, self.step.name, key)
        self.cache_path = str(path)
        if path.exists():
            try:
                fn = step_cache.load(path, self.step.core)
                self.loaded_from_cache = True
                self.compile_seconds.append(time.perf_counter() - start)
                return fn
            except Exception as err:  # noqa: BLE001 - a damaged or foreign file: compile instead
                warnings.warn(f"the cached step {path} could not be loaded ({type(err).__name__}: {err}); "
                              "compiling it again and replacing the file", RuntimeWarning, stacklevel=3)
        compiled = torch.compile(self.step.core, fullgraph=True, backend=self._backend, dynamic=self._dynamic)
        fn, count = None, self.compile_count
        for attempt in range(2):
            try:
                fn = compiled.aot_compile(((inner, batch), {}))
                break
            except torch._dynamo.exc.TensorifyScalarRestartAnalysis:
                # dynamo's own loop restarts here (it has just specialised a float input);
                # the precompile API does not, so restart it once ourselves. The aborted
                # attempt produced no graph: it does not count as a compile.
                if attempt:
                    raise
                self.compile_count = count
            except Exception as err:  # noqa: BLE001 - not precompilable: compile as without a cache
                warnings.warn(f"the step cannot be saved to the cache ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); it compiles as usual, "
                              "and the next process compiles it again", RuntimeWarning, stacklevel=3)
                return None
        try:
            step_cache.save(fn, path)
        except Exception as err:  # noqa: BLE001 - a read-only or full disk: run without saving
            warnings.warn(f"could not save the compiled step to {path} ({type(err).__name__}: {err}); "
                          "the next process compiles it again", RuntimeWarning, stacklevel=3)
        return fn

    @property
    def name(self) -> str:
        return self.step.name

    def __repr__(self):
        return f"CompiledStep({self.step.name}, compiles={self.compile_count}, eager={self.eager})"


def compile_step(step_fn, *, eager: bool = False, dynamic: Optional[bool] = None,
                 mode: Optional[str] = None, options: Optional[dict] = None,
                 recompile_limit: Optional[int] = None, cache=None) -> CompiledStep:
    """Compile a step with ``torch.compile(fullgraph=True)`` semantics.

    step_fn: a :class:`Step` or a plain core function over TrainState.
    eager: run uncompiled (for debugging) behind the same interface.
    dynamic: torch.compile's ``dynamic``; the default (None) compiles static first and
        makes a varying dimension (the point count) dynamic on the first recompile.
    mode / options: inductor mode and config patches. ``mode="reduce-overhead"`` records
        CUDA graphs: use it on CUDA with a static batch shape and a small step whose time
        is kernel launches (it replays the whole step in one launch; each call also copies
        the new state out of the graph's memory pool). With a dynamic dimension (variable
        point counts) the dynamic graph runs without CUDA graphs (no re-recording per
        size). On the CPU there are no CUDA graphs: the step compiles as in the default
        mode, with a warning. See docs/gpu.md.
    cache: True (``~/.cache/pimm_fn/steps``, or under ``$XDG_CACHE_HOME``) or a folder: the
        first call's compiled step is saved there and a later process with the same step,
        model, optimizer and input shapes loads it instead of tracing again (see
        :mod:`pimm_fn.step_cache`; ~1 s instead of ~3 s for a small step). Off by default.
    Any graph break is an error (``fullgraph``), naming the offending operation.
    """
    return CompiledStep(as_step(step_fn), eager=eager, dynamic=dynamic, mode=mode,
                        options=options, recompile_limit=recompile_limit, cache=cache)


def explain_step(step_fn, state: TrainState, batch):
    """``torch._dynamo.explain`` over a step's pure core: graphs, graph breaks and reasons.

    Returns dynamo's ExplainOutput. A clean step has ``graph_break_count == 0`` and an
    empty ``break_reasons`` (both matter: the count alone can read 0 while a reason is
    listed). The state is not mutated and the caller's generator is left as it was.
    step_fn may be a core function, any :class:`Step` or a :class:`CompiledStep`; a step
    with a host ``prepare`` (GRPO's rollout) runs it exactly as a call would, and its core
    is explained (only the core is ever compiled). Explaining resets dynamo.
    """
    step, state, batch = _explain_target(step_fn, state, batch)
    inner = state.replace(rng=None, cursor=None)
    with seeded_rng(_rank_seed(state.rng.step_seed())), torch._dynamo.config.patch(trace_autograd_ops=True):
        return torch._dynamo.explain(step.core)(inner, batch)


def _explain_target(step_fn, state: TrainState, batch):
    """The :class:`Step` a step runs, with the state and batch its core sees."""
    if isinstance(step_fn, CompiledStep):
        step_fn = step_fn.step
    step = as_step(step_fn)
    if step.prepare is not None:
        state, batch = _prepare(step, state, batch)
    return step, state, batch
