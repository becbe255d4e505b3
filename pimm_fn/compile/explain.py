"""What stops a step from compiling as one graph: every graph break, where, and the fix.

:func:`explain_step` traces a step's core once with breaks allowed and the
recompile limit lifted, so a loop that recompiles per cloud does not hide the breaks
behind it, and collects dynamo's own graph-break records (each with its user stack) as
:class:`GraphBreak` entries: ``file:line``, the source line, the reason, a kind and a hint.
A frame dynamo could not resume and ran uncompiled is listed too (``skipped=True``).
"""
from __future__ import annotations

import contextlib
import linecache
import logging
import os
import re
from typing import Optional

import attrs
import torch

from .. import torch_compat
from ..frame_room import call_with_frame_room
from ..state import TrainState
from .boundary import as_step, prepare_batch, rank_seed, seeded_rng

# pimm_fn's own step code (not its models): a break placed here follows from one in the
# model (dynamo skipped the frame that called it and traced its comprehensions apart).
_ENGINE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODELS_DIR = os.path.join(_ENGINE_DIR, "models")

__all__ = ["GraphBreak", "StepExplanation", "classify", "collect_breaks", "explain_step"]

# (kind, patterns in dynamo's reason, hint): the constructs users' point models hit.
_KINDS = (
    ("host read", ("tolist", "Tensor.item", "_local_scalar_dense", "Data dependent operator",
                   "data-dependent", "generic_jump", "Data-dependent branching", "__bool__", "__int__"),
     "a tensor's value is read on the host (.tolist(), .item(), int(t), if t:): keep sizes and counts as "
     "tensors, compute them in the collate (the loader's workers) and pass them in the batch, or branch "
     "with torch.where / torch.cond"),
    ("data-dependent size", ("Dynamic shape operator", "dynamic output shape", "nonzero", "unique",
                             "repeat_interleave", "masked_select"),
     "an op whose output size depends on the data (torch.unique, nonzero, boolean-mask indexing, "
     "repeat_interleave by counts): build such index tensors in the collate and pass them in the batch "
     "(as PTv3Collate does), or use a fixed-size form (padding, scatter with a known size)"),
    ("external op", ("skip", "marked as skipped", "non-Tensor", "builtin", "pybind", "C extension",
                     "Unsupported function call", "call_function", "opaque", "torch._C", "not supported by dynamo",
                     "disable"),
     "a function dynamo cannot trace (a C++/CUDA extension such as spconv, torch_scatter, pointops): "
     "register it as an op with pimm_fn.ops.external_op (a custom_op with a fake kernel and autograd); "
     "see docs/external_kernels.md"),
    ("dict mutation", ("STORE_ATTR", "setattr", "__setitem__", "side effect", "mutat"),
     "an object mutated in place (an addict/attribute dict such as Pointcept's Point, a dict updated "
     "inside the model): pass tensors or build new plain dicts instead of mutating one"),
)


@attrs.frozen
class GraphBreak:
    """One graph break: where it is, what dynamo said, what kind of construct, how to fix it.

    location: ``file:line`` of the user's code; code: that source line; reason: dynamo's
    reason (its first lines); kind: "host read", "data-dependent size", "external op",
    "dict mutation", "follow-on" (inside pimm_fn's step code, a consequence of a break
    in the model: fix those first) or "other"; hint: the fix; skipped: dynamo could not resume after it
    and ran the whole frame uncompiled; stack: the user stack, innermost last.
    """

    location: str
    code: str
    reason: str
    kind: str
    hint: str
    skipped: bool = False
    stack: tuple = ()

    def __str__(self):
        flag = " (frame skipped: it ran uncompiled)" if self.skipped else ""
        return f"{self.location}: {self.kind}{flag}\n    {self.code}\n    {self.reason}\n    fix: {self.hint}"


@attrs.frozen
class StepExplanation:
    """The result of :func:`pimm_fn.compile.explain_step`.

    graphs: the graphs dynamo traced (fx GraphModules); graph_count: their number;
    breaks: every distinct :class:`GraphBreak` (``break_reasons`` is the same list);
    graph_break_count: ``len(breaks)``; skipped: the breaks whose frame ran uncompiled.
    ``str()`` gives the report.
    """

    graphs: list
    breaks: list

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    @property
    def graph_break_count(self) -> int:
        return len(self.breaks)

    @property
    def break_reasons(self) -> list:
        return self.breaks

    @property
    def skipped(self) -> list:
        return [b for b in self.breaks if b.skipped]

    def __str__(self):
        head = f"{self.graph_count} graph(s), {self.graph_break_count} graph break(s)"
        if self.skipped:
            head += f", {len(self.skipped)} frame(s) skipped"
        return "\n".join([head, *(f"{i + 1}. {b}" for i, b in enumerate(self.breaks))])


def classify(reason: str) -> tuple[str, str]:
    """``(kind, hint)`` for a graph-break reason."""
    for kind, patterns, hint in _KINDS:
        if any(p.lower() in reason.lower() for p in patterns):
            return kind, hint
    return "other", "see the reason; dynamo's hint, where it gives one, is in it"


_LOCATION = re.compile(r"Graph break in user code at (.+?):(\d+)\n")
_REASON = re.compile(r"Graph Break Reason: (.*?)(?:\n\s*\n\s*User code traceback:|\nUser code traceback:)", re.S)
_STACK = re.compile(r'File "(.+?)", line (\d+), in (\S+)')


def _parse(record: str) -> Optional[GraphBreak]:
    where = _LOCATION.search(record)
    if where is None:
        return None
    found = _REASON.search(record)
    reason = (found.group(1) if found else record).strip()
    skipped = reason.startswith("Failed to handle graph break gracefully")
    if skipped:
        reason = reason.split("Graph break encountered:", 1)[-1].strip()
    stack = tuple(f"{f}:{n} in {fn}" for f, n, fn in _STACK.findall(record.split("User code traceback:", 1)[-1]))
    # The innermost user frame (not torch's own) is where the fix goes.
    inner = [s for s in stack if "/torch/" not in s.split(":", 1)[0]]
    filename, line = where.group(1), int(where.group(2))
    if inner:
        filename, line_s = inner[-1].rsplit(" in ", 1)[0].rsplit(":", 1)
        line = int(line_s)
    # Dynamo's first line often only says which bytecode it was tracing; its gb_type and
    # explanation follow.
    lines = [ln for ln in reason.splitlines() if ln.strip() and not ln.startswith("Encountered graph break when")]
    summary = "\n    ".join(lines[:3])
    kind, hint = classify(reason)
    if filename.startswith(_ENGINE_DIR + os.sep) and not filename.startswith(_MODELS_DIR + os.sep):
        kind, hint = "follow-on", ("inside pimm_fn's step, after a break in the model made dynamo run the "
                                   "calling frame uncompiled: fix the model's breaks listed before this one")
    return GraphBreak(location=f"{filename}:{line}", code=linecache.getline(filename, line).strip(),
                      reason=summary, kind=kind, hint=hint, skipped=skipped, stack=stack)


class _Collector(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(record.getMessage())


@contextlib.contextmanager
def collect_breaks():
    """Collect dynamo's graph-break records in the block; yields the list of GraphBreaks
    (filled when the block exits), one per distinct place and reason."""
    breaks: list = []
    collector = _Collector()
    with torch_compat.graph_break_records(collector):
        yield breaks
    where: dict = {}  # one entry per place and kind; skipped if dynamo skipped it at any trace
    for record in collector.records:
        entry = _parse(record)
        if entry is None:
            continue
        key = (entry.location, entry.kind)
        if key not in where:
            where[key] = len(breaks)
            breaks.append(entry)
        elif entry.skipped and not breaks[where[key]].skipped:
            breaks[where[key]] = attrs.evolve(breaks[where[key]], skipped=True)


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
    step = as_step(getattr(step_fn, "step", step_fn))  # a CompiledStep explains the Step it runs
    if step.prepare is not None:
        state, batch = prepare_batch(step, state, batch)
    inner = state.replace(rng=None, cursor=None)
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch_compat.reset_dynamo()
    unlimited = dict(recompile_limit=1_000_000, accumulated_recompile_limit=1_000_000)
    try:
        with seeded_rng(rank_seed(state.rng.step_seed())), torch_compat.step_tracing_config(), \
                torch_compat.dynamo_config().patch(**unlimited), collect_breaks() as breaks:
            call_with_frame_room(torch.compile(step.core, backend=keep_graph), inner, batch)  # see frame_room
    finally:
        torch_compat.reset_dynamo()
    return StepExplanation(graphs=graphs, breaks=breaks)
