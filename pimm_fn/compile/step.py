"""``compile_step``: a :class:`~pimm_fn.compile.boundary.Step` with its core compiled.

One interface, three ways to run the core:

- whole (the default): the core is one graph, ``torch.compile(fullgraph=True)``; it may be
  saved to and loaded from the step cache (:mod:`.cache`) or replayed as CUDA graphs;
- regions (``fullgraph=False``): the step's Python runs as written, its model call and its
  guarded update compiled (:mod:`.regions`);
- eager: the same boundary, nothing compiled (debugging).

Every call goes through :func:`~.boundary.run_core`, which seeds torch's generator from
the state's key. While a step call is on the stack, each dynamo compile runs under
:func:`pimm_fn.torch_compat.step_tracing_config`, entered from dynamo's own compile-start
callback: a call that finds its graph compiled pays nothing for it. A call sets a
thread-local flag under which inductor's CPU kernels are built in units (:mod:`.kernel_units`).
Compiles are counted with dynamo's counter and their reasons read from its compilation records.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from .. import torch_compat
from ..frame_room import call_with_frame_room
from ..state import TrainState, structure_only
from ..tree import tree_flatten, tree_leaves, tree_unflatten
from ..user_warning import warn
from . import cache as step_cache
from . import isa_memo, kernel_units
from .background import BackgroundCompile
from .boundary import Step, as_step, check_finite, prepare_batch, run_core, validate_first_batch, with_host
from .modes import copy_tensors, mode_patches
from .regions import CompiledRegions

__all__ = ["CompiledStep", "compile_step", "mark_point_batch_dynamic"]

# Step calls on the stack, and the tracing settings entered for the compile under way.
_CALLS = 0
_TRACING: list = []


def _on_compile_start():
    if _CALLS:
        _TRACING.append(torch_compat.step_tracing_config())


def _on_compile_end():
    if _TRACING:
        _TRACING.pop().close()


_ensure_compile_hooks = None  # torch_compat.dynamo_compile_hooks(...), made with the first compiled step


class CompiledStep:
    """A :class:`Step` compiled whole (``fullgraph=True``) or in regions, counting its compilations.

    compile_count: graphs compiled for this step (1 in steady state; each recompile +1;
        a graph-tolerant step counts each piece).
    recompile_reasons: why each recompile happened (dynamo's guard failures).
    compile_seconds: wall time of the calls that compiled (or loaded from the cache).
    graph_breaks: the breaks a ``fullgraph=False`` step was compiled around (first call).
    cache_path / loaded_from_cache: the step-cache artifact used, and whether it was loaded.
    """

    def __init__(self, step: Step, *, eager: bool = False, dynamic: Optional[bool] = None,
                 mode: Optional[str] = None, options: Optional[dict] = None,
                 recompile_limit: Optional[int] = None, cache=None, fullgraph: bool = True,
                 background: bool = False, switch_at: Optional[int] = None):
        if background and (eager or not fullgraph):
            raise ValueError(
                "compile_step(background=True) compiles one whole-step graph behind eager steps; it cannot "
                f"be combined with {'eager=True' if eager else 'fullgraph=False'}")
        if switch_at is not None and (not background or isinstance(switch_at, bool)
                                      or not isinstance(switch_at, int) or switch_at < 0):
            raise ValueError(f"switch_at={switch_at!r}: it pins the step index at which a "
                             "compile_step(background=True) step switches to the compiled graph; pass an int >= 0 "
                             "together with background=True")
        if not fullgraph and not eager and cache not in (None, False):
            raise ValueError(
                "compile_step(fullgraph=False) cannot use the step cache: the cache saves one whole-step "
                "graph, and a graph-tolerant step is compiled in regions around its breaks; drop cache= "
                "or make the step compile fullgraph (see docs/migration.md, 'Bring your model')")
        self.step = step
        self.eager = eager
        self.fullgraph = fullgraph
        # Left None, the cache follows $PIMM_FN_STEP_CACHE for a whole-step compile and is
        # off where it cannot serve (eager, regions, CUDA-graph replay).
        # Who asked for the cache decides what warns (step_cache.precompiled_step's `asked`).
        self._cache_asked = "argument" if cache not in (None, False) else \
            "environment" if cache is None and step_cache.asked_by_environment() else None
        self.cache_dir = None if eager or (cache is None and not fullgraph) else step_cache.resolve_dir(cache)
        self.cache_path: Optional[str] = None
        self.loaded_from_cache = False
        self.compile_count = 0
        self.recompile_reasons: list[str] = []
        self.compile_seconds: list[float] = []
        self.graph_breaks = 0
        # Background mode: the step index (state.step) from which calls run compiled, once
        # known (pinned, loaded from a checkpoint, or the first call after the compile).
        self.background = background
        self.switch_at = switch_at
        self._pending: Optional[BackgroundCompile] = None  # until a call takes its result
        self._eager_model = None  # (the state's module, the eager calls' copy of it)
        self._last_step = self._last_index = None  # the host's count of state.step
        self._dynamic = dynamic
        self._settings = repr((dynamic, mode, sorted((options or {}).items()), recompile_limit))
        self._called = False
        self._points_marked = False  # the first point batch's dims were marked unbacked
        self._precompiled = None  # the cached step, until its guards reject an input
        self._discarded = 0  # graphs of a restarted trace, left out of the next count
        self._first_shapes = None  # the cached step's example batch shapes
        self._restride: Optional[tuple] = None  # state leaves handed back in other strides (found once)
        self._regions: Optional[CompiledRegions] = None
        self._patches = mode_patches(mode, dynamic, options)
        # CUDA graphs (reduce-overhead, max-autotune): see _run_whole.
        self._cudagraphs = not eager and bool(self._patches.get("triton.cudagraphs"))
        if self._cudagraphs and cache is None:  # only an explicit cache=... keeps it for CUDA graphs
            self.cache_dir = None
        if self._cudagraphs and background:
            raise ValueError(f"compile_step(background=True, mode={mode!r}): CUDA-graph replay is not supported "
                             "behind eager steps; use mode=None or background=False")
        self._core = step.core
        if eager:
            return
        global _ensure_compile_hooks
        if _ensure_compile_hooks is None:
            _ensure_compile_hooks = torch_compat.dynamo_compile_hooks(_on_compile_start, _on_compile_end)
        if isa_memo.opted_in():
            isa_memo.install()
        kernel_units.install()
        if not fullgraph:
            if self._cudagraphs:
                raise ValueError(
                    f"compile_step(fullgraph=False, mode={mode!r}): CUDA graphs replay one whole-step graph "
                    "and copy its outputs out of their pool; a step compiled in regions has no such graph. Use "
                    "mode=None (or 'max-autotune-no-cudagraphs') with fullgraph=False")
            self._regions = CompiledRegions(dynamic, self._patches, recompile_limit)
            return
        self._core = torch.compile(step.core, fullgraph=True, dynamic=dynamic, options=self._patches or None,
                                   recompile_limit=recompile_limit, isolate_recompiles=True)

    def __call__(self, state: TrainState, batch):
        if self.step.prepare is None:
            return self._call_core(state, batch)
        inner, prepared = prepare_batch(self.step, state, batch)
        new_state, metrics = self._call_core(inner, prepared)
        return with_host(new_state, state.rng.next(), state.cursor), metrics

    def _call_core(self, state: TrainState, batch):
        global _CALLS
        first = not self._called
        graphs, start = torch_compat.compiled_graph_count(), time.perf_counter()
        breaks = torch_compat.graph_break_count() if first and self._regions is not None else 0
        if not self.eager:
            _ensure_compile_hooks()
        _CALLS += 1
        try:
            with kernel_units.on_this_thread():  # what this call compiles, if anything
                if first and not self.eager:
                    # The call that compiles: see frame_room for why it gets a frame stack of its own.
                    new_state, metrics, graphs = call_with_frame_room(self._dispatch, state, batch, first, graphs)
                else:
                    new_state, metrics, graphs = self._dispatch(state, batch, first, graphs)
        finally:
            _CALLS -= 1
        compiled = 0 if graphs is None else torch_compat.compiled_graph_count() - graphs - self._discarded
        self._discarded = 0
        if compiled:
            if first and self._regions is not None:
                breaks = torch_compat.graph_break_count() - breaks
            self._count_compiles(compiled, time.perf_counter() - start, first, breaks)
        self._called = True
        if self.step.raise_on_nonfinite:
            check_finite(self.step, state, metrics)
        return new_state, metrics

    def _dispatch(self, state: TrainState, batch, first: bool, graphs):
        if first:
            self._before_first_call(state, batch)
        if not self.background:
            return (*self._run(state, batch), graphs)
        waiting = self._pending is not None
        eager = not self._compiled_now(state)
        if eager or first:
            graphs = None  # what compiles meanwhile is the background's, counted there
        elif waiting and self._pending is None:
            # This call took the background's result (waiting for it at a pinned switch):
            # its graphs were counted as it handed them over; count only what compiles next.
            graphs = torch_compat.compiled_graph_count()
        if eager:
            new_state, metrics = self._run_eager_beside_compile(state, batch)
        else:
            new_state, metrics = self._run(state, batch)
        self._last_step, self._last_index = new_state.step, self._last_index + 1
        if self._pending is not None:
            self._pending.start()  # after the first call: it ran with the CPU to itself
        return new_state, metrics, graphs

    def _before_first_call(self, state: TrainState, batch):
        validate_first_batch(batch, self.step.name, state)
        if self.step.check_batch is not None:
            self.step.check_batch(state, batch)
        if self.eager:
            return
        if self._cudagraphs and isinstance(state, TrainState) and state.params and state.device.type != "cuda":
            warn(
                f"compile_step(mode=...) with CUDA graphs: the state of step {self.step.name!r} is on "
                f"{state.device}, where no CUDA graphs are recorded; the step compiles as in the default "
                "mode (pass mode=None to silence this)", UserWarning)
            self._cudagraphs = False
        if self._dynamic is None:
            # Point counts symbolic from the first call. Regions trace them as guarded sizes:
            # unbacked ones fail on the host reads of sizes that mode exists for.
            self._points_marked = mark_point_batch_dynamic(batch, unbacked=self._regions is None)
        if self.background:
            if self.switch_at is None and torch.distributed.is_available() and torch.distributed.is_initialized() \
                    and torch.distributed.get_world_size() > 1:
                # Each rank's compile finishes at its own time: replicas would update eagerly on
                # some ranks and compiled on others, and drift apart in the last bits.
                raise ValueError(
                    f"step {self.step.name!r}: compile_step(background=True) under "
                    f"{torch.distributed.get_world_size()} ranks needs the switch pinned so that every rank "
                    "switches at the same step: pass switch_at=N (or background=False)")
            # Started once this first call has returned, or by a call that must already be
            # compiled (switch_at pinned to it).
            self._pending = BackgroundCompile(lambda: self._precompile(state, batch), self.step.name)
            return
        if self.cache_dir is not None:
            start = time.perf_counter()
            found = self._precompile(state, batch)
            self._use_precompiled(found, time.perf_counter() - start if found.loaded else None)
            self._discarded = found.discarded  # this call's count of graphs leaves them out

    def _precompile(self, state: TrainState, batch) -> step_cache.Precompiled:
        """The step compiled by the precompile API (without running it), or from the cache."""
        found = step_cache.precompiled_step(
            self.step.core, self.step.name, state, batch, self.cache_dir,
            dynamic=self._dynamic, patches=self._patches, settings=self._settings, asked=self._cache_asked)
        if found.fn is not None and self._points_marked:
            # A saved step's guards reject marked inputs: its unbacked point dims are in
            # the artifact, and this batch runs through it like any later one.
            mark_point_batch_dynamic(batch, unbacked=None)
        return found

    def _use_precompiled(self, found: step_cache.Precompiled, seconds: Optional[float]) -> None:
        self._precompiled, self._first_shapes = found.fn, found.first_shapes
        self.cache_path = None if found.path is None else str(found.path)
        self.loaded_from_cache = found.loaded
        if seconds is not None:
            self.compile_seconds.append(seconds)

    # ----- background mode
    def _run_eager_beside_compile(self, state: TrainState, batch):
        # functional_call swaps the tensors of the module it calls while the call runs, and
        # the compile reads the state's module (its guards check the parameters' types): the
        # eager steps call a structure-only copy of their own.
        model = state.model
        if self._eager_model is None or self._eager_model[0] is not model:
            self._eager_model = (model, structure_only(model))
        new_state, metrics = run_core(self.step.core, state.replace(model=self._eager_model[1]), batch)
        return new_state.replace(model=model), metrics

    def _index(self, state: TrainState) -> int:
        # state.step as a host int: counted from the last call's result, read from the state
        # only when it is another (the first call, a resumed state).
        if state.step is not self._last_step:
            self._last_index = int(state.step)
        return self._last_index

    def _compiled_now(self, state: TrainState) -> bool:
        """Background mode: whether this call runs the compiled step (else it runs eagerly)."""
        index = self._index(state)
        if self.switch_at is not None:
            if index < self.switch_at:
                return False
        elif not self._pending.done():
            return False
        else:
            self.switch_at = index
        if self._pending is not None:
            self._take_background()
        return True

    def _take_background(self) -> None:
        pending, self._pending = self._pending, None
        try:
            found, compiled, seconds = pending.result()  # waits where the switch is pinned
        except Exception as err:
            # Compiled again in the foreground by this call, which raises what it raises.
            warn(f"step {self.step.name!r}: the background compile failed ({type(err).__name__}: "
                 f"{str(err).splitlines()[0][:200] if str(err) else ''}); compiling in the foreground",
                 RuntimeWarning)
            return
        compiled -= found.discarded
        self.compile_count += compiled
        self._use_precompiled(found, seconds if compiled or found.loaded else None)

    def state_dict(self) -> Optional[dict]:
        """Background mode: the step index from which the run is compiled (None before the
        switch), kept in checkpoints so that a resumed run switches where the original did."""
        return {"switch_at": self.switch_at} if self.background else None

    def load_state_dict(self, saved: Optional[dict]) -> None:
        if self.background and saved and saved.get("switch_at") is not None:
            self.switch_at = int(saved["switch_at"])

    def _count_compiles(self, compiled: int, seconds: float, first: bool, breaks: int):
        self.compile_count += compiled
        self.compile_seconds.append(seconds)
        self.recompile_reasons.extend(r for r in torch_compat.compilation_reasons(compiled) if r)
        if first and self._regions is not None:
            self.graph_breaks = breaks  # a piece's recompiles meet its breaks again: counted once
            if breaks:
                warn(
                    f"step {self.step.name!r} (fullgraph=False): its model was compiled around {breaks} graph "
                    f"break(s) in {compiled} graphs; explain_step(step, state, batch) lists them with "
                    "file:line and a fix for each", RuntimeWarning)

    def _run(self, state: TrainState, batch):
        if self._regions is not None:
            with self._regions.activate():
                return run_core(self._core, state, batch)
        if self.eager:
            return run_core(self._core, state, batch)
        if self._precompiled is not None:
            try:
                return self._run_whole(self._precompiled, state, batch)
            except RuntimeError as err:
                if not step_cache.is_guard_failure(err):
                    raise
                # A new shape, dtype or guarded value: from now on the step compiles as
                # without a cache. A point batch's point dims are traced unbacked, as on a
                # first call (static, every new count would compile again); otherwise the
                # dims that changed are dynamic (the cached graph was the static one).
                self.recompile_reasons.append(f"the cached step's guards rejected the input: {err}"[:500])
                self._precompiled = None
                if self._points_marked:
                    mark_point_batch_dynamic(batch)
                elif self._dynamic is None:
                    step_cache.mark_changed_dims(self._first_shapes, batch)
        try:
            return self._run_whole(self._core, state, batch)
        except Exception as err:
            if self._points_marked and torch_compat.is_data_dependent_error(err):
                return self._retry_with_guarded_sizes(err, state, batch)
            if torch_compat.is_dynamo_unsupported(err):
                # Dynamo reports a user error raised while tracing (a missing "loss", a shape
                # mismatch) as "Observed exception". The core is pure, so running it eagerly
                # once raises the user's own error.
                try:
                    run_core(self.step.core, state, batch)
                except Exception as user_error:
                    raise user_error from err
            raise

    def _run_whole(self, fn, state: TrainState, batch):
        if not self._cudagraphs:
            new_state, metrics = run_core(fn, state, batch)
            return self._in_input_strides(state, new_state), metrics
        # A CUDA-graph replay writes its outputs into the pool memory of the replay before:
        # without a copy, a state or metrics the caller still holds would be overwritten by
        # the next step. One device copy per step is what mode="reduce-overhead" costs.
        torch.compiler.cudagraph_mark_step_begin()
        new_state, metrics = run_core(fn, state, batch)
        return copy_tensors(new_state), copy_tensors(metrics)

    def _in_input_strides(self, state: TrainState, new_state: TrainState) -> TrainState:
        """``new_state`` with each leaf in the strides it came in with. Inductor may hand back
        a conv weight and its moments channels-last although the step traced them contiguous;
        the next call would fail the compiled step's stride guards and compile it again. The
        leaves that differ are found on the first call; a step without any pays nothing."""
        if self._restride == ():
            return new_state
        old = tree_leaves(state)
        new, spec = tree_flatten(new_state)
        if self._restride is None:
            self._restride = () if len(old) != len(new) else tuple(
                i for i, (a, b) in enumerate(zip(old, new)) if isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor) and a.shape == b.shape and a.stride() != b.stride())
        for i in self._restride:
            a, b = old[i], new[i]
            if b.stride() != a.stride():
                new[i] = torch.empty_strided(a.shape, a.stride(), dtype=b.dtype, device=b.device).copy_(b)
        return tree_unflatten(spec, new) if self._restride else new_state

    def _retry_with_guarded_sizes(self, err: Exception, state: TrainState, batch):
        # The model reads a point count (a branch on a size, a host check): trace the point
        # dims as guarded symbols instead; crossing a guard then recompiles.
        warn(
            f"step {self.step.name!r}: the model needs the value of a point count while tracing "
            f"({str(err).splitlines()[0][:200]}); the point dims are traced with guards instead, so "
            "batches whose sizes cross a guard compile again (see docs/models.md, 'Compiling point models')",
            RuntimeWarning)
        self._points_marked = False
        mark_point_batch_dynamic(batch, unbacked=False)
        return self._run_whole(self._core, state, batch)

    @property
    def name(self) -> str:
        return self.step.name

    def __repr__(self):
        return f"CompiledStep({self.step.name}, compiles={self.compile_count}, eager={self.eager})"


def mark_point_batch_dynamic(batch, unbacked: Optional[bool] = True) -> bool:
    """Mark the leading dim of every tensor of a point batch (one with ``offset``) dynamic
    (``unbacked=None``: remove the unbacked marks).

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
                elif unbacked is None:
                    torch_compat.clear_unbacked(leaf)
                else:
                    torch_compat.clear_unbacked(leaf)
                    torch_compat.mark_backed(leaf, 0)
    return True


def compile_step(step_fn, *, eager: bool = False, dynamic: Optional[bool] = None,
                 mode: Optional[str] = None, options: Optional[dict] = None,
                 recompile_limit: Optional[int] = None, cache=None, fullgraph: bool = True,
                 background: bool = False, switch_at: Optional[int] = None) -> CompiledStep:
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
    recompile_limit: recompiles allowed for this step (dynamo's default otherwise).
    cache: where the first call's compiled step is saved, so that a later process with the
        same step, model, optimizer and input shapes (point counts aside) loads it instead of
        tracing again (see :mod:`pimm_fn.compile.cache`). None (default): on for a
        whole-step compile, in ``$PIMM_FN_STEP_CACHE`` (``off`` disables it) or
        ``~/.cache/pimm_fn/steps``; True: that folder; a folder; False: off.
    background: the first call starts the compile in a background thread and the calls run
        eagerly until it is done; the first call after that runs compiled, and so do all
        calls on states from that step index on (``switch_at``). The first step comes at
        eager speed instead of after the compiler. Eager and compiled steps agree to
        rounding, not bitwise, so the index is part of the run: :class:`~pimm_fn.callbacks.
        Checkpoint` saves it (``state_dict``) and ``resume(..., step=...)`` restores it.
    switch_at: with ``background``, pin the switch to this step index (calls on earlier
        states run eagerly; the first call at it waits for the compile if it is not done):
        a run that must be bitwise reproducible from scratch.
    """
    return CompiledStep(as_step(step_fn), eager=eager, dynamic=dynamic, mode=mode, options=options,
                        recompile_limit=recompile_limit, cache=cache, fullgraph=fullgraph,
                        background=background, switch_at=switch_at)
