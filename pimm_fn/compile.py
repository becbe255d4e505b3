"""``compile_step``: a :class:`~pimm_fn.boundary.Step` compiled with ``fullgraph=True``.

The boundary itself (RNG seeding, the host ``prepare``, the cursor) is
:mod:`pimm_fn.boundary`; this module compiles the core, counts its compilations, loads and
saves it through the step cache and explains graph breaks.
"""
from __future__ import annotations

import hashlib
import time
import warnings
from typing import Optional

import torch
import torch._dynamo

from .boundary import (_CPU_GENERATOR, _DYNAMO_CONFIG, Step, _check_finite, _prepare, _rank_seed,
                       _run_core, _run_probed, _run_unseeded, _validate_first_batch, _with_host, as_step,
                       seeded_rng)
from . import torch_compat
from .compile_modes import copy_tensors, mode_patches
from .compile_regions import CompiledRegions
from .graph_breaks import GraphBreak, StepExplanation, collect_breaks
from .state import TrainState
from .tree import tree_leaves

__all__ = ["CompiledStep", "GraphBreak", "Step", "StepExplanation", "as_step", "compile_step", "explain_step",
           "seeded_rng"]


class CompiledStep:
    """A :class:`Step` compiled whole (``fullgraph=True``) or in regions, counting its compilations.

    compile_count: how many graphs were compiled (1 in steady state; each recompile +1;
        a graph-tolerant step counts each piece).
    recompile_reasons: dynamo's guard failures that triggered each recompile.
    compile_seconds: wall time of the calls that compiled.
    graph_breaks: the graph breaks a ``fullgraph=False`` step was compiled around (on its first call).
    """

    def __init__(self, step: Step, *, eager: bool = False, dynamic: Optional[bool] = None,
                 mode: Optional[str] = None, options: Optional[dict] = None,
                 recompile_limit: Optional[int] = None, cache=None, fullgraph: bool = True):
        from . import step_cache

        self.step = step
        self.eager = eager
        self.fullgraph = fullgraph
        if not fullgraph and not eager and cache not in (None, False):
            raise ValueError(
                "compile_step(fullgraph=False) cannot use the step cache: the cache saves one whole-step "
                "graph, and a graph-tolerant step is compiled in regions around its breaks; drop cache= "
                "or make the step compile fullgraph (see docs/migration.md, 'Bring your model')")
        self.cache_dir = None if eager else step_cache.resolve_dir(cache)
        self.graph_breaks = 0
        self._regions: Optional[CompiledRegions] = None
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
        self._points_marked = False  # the first point batch's dims were marked unbacked
        self._dynamic = dynamic
        if eager:
            # Python control flow may draw only sometimes: an eager step seeds every call.
            self._rng_used = True
            self._core = step.core
            return
        from . import isa_memo

        isa_memo.install()  # inductor's CPU ISA probes: ~9 s of a cold compile, answered from disk
        patches = mode_patches(mode, dynamic, options)
        self._patches = patches  # a cached step loads under them too (step_cache.load)
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
        if not fullgraph and self._cudagraphs:
            raise ValueError(
                f"compile_step(fullgraph=False, mode={mode!r}): CUDA graphs replay one whole-step graph and "
                "copy its outputs out of their pool; a step compiled in regions has no such graph. Use mode=None "
                "(or 'max-autotune-no-cudagraphs') with fullgraph=False")
        if not fullgraph:
            # The step's Python runs as written; its model call and update are compiled
            # (pimm_fn.compile_regions). Python between them may draw random numbers only
            # sometimes, so every call is seeded.
            self._regions = CompiledRegions(backend, dynamic, recompile_limit)
            self._rng_used = True
            self._core = step.core
            return

        def on_guard_fail(failure):
            # Dynamo calls this before it re-traces: the one moment besides the first call
            # at which tracing needs the autograd flag (see __call__), and at which an
            # unseeded call must seed the generator for the graph it is about to make.
            self._pending_reasons.append(str(failure.reason))
            self._allow_autograd_tracing()
            self._seed_mid_call()

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
        # Duck shaping is switched off with it: two point counts of a batch that happen to be
        # equal (a level's points and another's patches) would otherwise share one symbol and
        # a guard that they stay equal, and the next batch would recompile.
        if not self._flag_set and not _DYNAMO_CONFIG.trace_autograd_ops:
            _DYNAMO_CONFIG.trace_autograd_ops = True
            torch_compat.set_duck_shaping(False)
            self._flag_set = True

    def __call__(self, state: TrainState, batch):
        if self.step.prepare is None:
            return self._call_core(state, batch)
        inner, prepared = _prepare(self.step, state, batch)
        new_state, metrics = self._call_core(inner, prepared)
        return _with_host(new_state, state.rng.next(), state.cursor), metrics

    def _call_core(self, state: TrainState, batch):
        if self._regions is not None:
            return self._call_regions(state, batch)
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
            self._check_first_call(state, batch)
            if self._dynamic is None and self.cache_dir is None and not self.eager:
                self._points_marked = mark_point_batch_dynamic(batch)
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
                torch_compat.set_duck_shaping(True)
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

    def _check_first_call(self, state: TrainState, batch):
        _validate_first_batch(batch, self.step.name, state)
        if self.step.check_batch is not None:
            self.step.check_batch(state, batch)

    def _call_regions(self, state: TrainState, batch):
        """A call of a ``fullgraph=False`` step: its Python eagerly, its regions compiled."""
        first = not self._traced_once
        if first:
            self._check_first_call(state, batch)
        if first and self._dynamic is None:
            # Point counts symbolic from the first call, as guarded sizes: unbacked ones fail
            # on the host reads of sizes this mode exists for.
            mark_point_batch_dynamic(batch, unbacked=False)
        before, breaks_before, start = self.compile_count, torch_compat.graph_break_count(), time.perf_counter()
        with self._regions.activate():
            new_state, metrics = _run_core(self._core, state, batch)
        self._traced_once = True
        if self.compile_count != before:
            self.compile_seconds.append(time.perf_counter() - start)
            breaks = torch_compat.graph_break_count() - breaks_before
            if first:  # recompiles of a piece meet its breaks again: counted once
                self.graph_breaks = breaks
            if first and breaks:
                warnings.warn(
                    f"step {self.step.name!r} (fullgraph=False): its model was compiled around {breaks} graph "
                    f"break(s) in {self.compile_count} graphs; explain_step(step, state, batch) lists them with "
                    "file:line and a fix for each", RuntimeWarning, stacklevel=4)
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
            return self._run_dynamo_autograd_retry(state, batch, unseeded)
        except Exception as err:
            if not (self._points_marked and torch_compat.is_data_dependent_error(err)):
                raise
            # The model reads a point count (a branch on a size, a host check): trace the
            # point dims as guarded symbols instead; crossing a guard then recompiles.
            warnings.warn(
                f"step {self.step.name!r}: the model needs the value of a point count while tracing "
                f"({str(err).splitlines()[0][:200]}); the point dims are traced with guards instead, so "
                "batches whose sizes cross a guard compile again (see docs/models.md, 'Compiling point models')",
                RuntimeWarning, stacklevel=4)
            self._points_marked = False
            mark_point_batch_dynamic(batch, unbacked=False)
            return self._run_dynamo(state, batch, False)

    def _run_dynamo_autograd_retry(self, state: TrainState, batch, unseeded: bool):
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
                fn = step_cache.load(path, self.step.core, self._patches)
                self.loaded_from_cache = True
                self.compile_seconds.append(time.perf_counter() - start)
                return fn
            except Exception as err:  # noqa: BLE001 - a damaged or foreign file: compile instead
                warnings.warn(f"the cached step {path} could not be loaded ({type(err).__name__}: {err}); "
                              "compiling it again and replacing the file", RuntimeWarning, stacklevel=3)
        # dynamic=None would let dynamo's automatic dynamic shapes follow what this process
        # compiled before (another step over the same core code): the saved artifact would
        # then be static or dynamic by the process's history. It is static (its key holds
        # the shapes) unless the step is dynamic=True; a new shape fails its guards and
        # compiles as without a cache, the changed dims dynamic.
        dynamic = self._dynamic
        if dynamic is None and not _marked_dynamic(batch):  # mark_dynamic'ed dims stay dynamic
            dynamic = False
        compiled = torch.compile(self.step.core, fullgraph=True, backend=self._backend, dynamic=dynamic)
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


def mark_point_batch_dynamic(batch, unbacked: bool = True) -> bool:
    """Mark the leading dim of every tensor of a point batch (one with ``offset``) dynamic.

    Point counts change with every batch (and a U-Net's topology holds one count per level):
    compiled static first, a point model would compile twice, and with guarded symbolic
    sizes again whenever a batch crosses a size the compiler chose by (inductor's CPU
    reductions switch at 4,096 rows). Unbacked sizes (at least 2 rows) compile once for all
    batches. ``offset`` (one row per cloud) keeps its size; other batches are left alone.
    Returns whether anything was marked.
    """
    if not isinstance(batch, dict) or "offset" not in batch:
        return False
    for key, value in batch.items():
        if key == "offset":
            continue
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                if unbacked:
                    torch_compat.mark_unbacked(leaf, 0)
                else:
                    torch_compat.clear_unbacked(leaf)
                    torch_compat.mark_backed(leaf, 0)
    return True


def _marked_dynamic(batch) -> bool:
    """Whether a tensor of ``batch`` carries dims marked with ``torch._dynamo.mark_dynamic``."""
    return any(getattr(t, "_dynamo_dynamic_indices", None) for t in tree_leaves(batch) if isinstance(t, torch.Tensor))


def compile_step(step_fn, *, eager: bool = False, dynamic: Optional[bool] = None,
                 mode: Optional[str] = None, options: Optional[dict] = None,
                 recompile_limit: Optional[int] = None, cache=None, fullgraph: bool = True) -> CompiledStep:
    """Compile a step with ``torch.compile(fullgraph=True)`` semantics, or in regions.

    step_fn: a :class:`Step` or a plain core function over TrainState.
    eager: run uncompiled (for debugging) behind the same interface.
    fullgraph: True (default): the whole step is one graph and any graph break is an
        error naming the offending operation. False: for a model that cannot be one graph
        (host reads, Python loops over clouds, external kernels): the step's Python runs
        as written, the model is compiled with its breaks (the pieces and their backward
        compiled) and the guarded update (clip, optimizer, loss scale) is one compiled
        graph; a warning says how many breaks were compiled around. The state contract is
        unchanged (pure, seeded every call). See docs/migration.md, "Bring your model".
    dynamic: torch.compile's ``dynamic``. The default (None): on a point batch (a dict
        with ``offset``) every tensor's leading dim (the point counts, a U-Net topology's
        per-level counts) is traced as an unknown size from the first call, so the step
        compiles once for all batches; a model that reads such a size falls back, with a
        warning, to guarded symbolic sizes. Other batches compile static first and make a
        varying dimension dynamic on the first recompile.
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
    """
    return CompiledStep(as_step(step_fn), eager=eager, dynamic=dynamic, mode=mode, options=options,
                        recompile_limit=recompile_limit, cache=cache, fullgraph=fullgraph)


def explain_step(step_fn, state: TrainState, batch) -> StepExplanation:
    """Every graph break of a step's pure core, with ``file:line``, the reason and a fix.

    Traces the core once with breaks allowed and the recompile limit lifted (a per-cloud
    loop that would recompile cannot hide the breaks after it), with dynamo's own eager
    backend (nothing is compiled by inductor). Returns a :class:`StepExplanation`:
    ``graph_count``, ``graph_break_count``, ``breaks`` (:class:`GraphBreak`: location,
    source line, reason, kind, hint, and whether dynamo skipped the whole frame), and
    ``graphs``; ``print(explanation)`` gives the report. A clean step has 0 breaks and 1
    graph. The state is not mutated and the caller's generator is left as it was.
    step_fn may be a core function, any :class:`Step` or a :class:`CompiledStep`; a step
    with a host ``prepare`` (GRPO's rollout) runs it exactly as a call would, and its core
    is explained (only the core is ever compiled). Explaining resets dynamo.
    """
    step, state, batch = _explain_target(step_fn, state, batch)
    inner = state.replace(rng=None, cursor=None)
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    limits = dict(recompile_limit=1_000_000, accumulated_recompile_limit=1_000_000)
    try:
        with seeded_rng(_rank_seed(state.rng.step_seed())), \
                torch._dynamo.config.patch(trace_autograd_ops=True, **limits), collect_breaks() as breaks:
            torch._dynamo.optimize(keep_graph, nopython=False)(step.core)(inner, batch)
    finally:
        torch._dynamo.reset()
    return StepExplanation(graphs=graphs, breaks=breaks)


def _explain_target(step_fn, state: TrainState, batch):
    """The :class:`Step` a step runs, with the state and batch its core sees."""
    if isinstance(step_fn, CompiledStep):
        step_fn = step_fn.step
    step = as_step(step_fn)
    if step.prepare is not None:
        state, batch = _prepare(step, state, batch)
    return step, state, batch
