"""Per-step scalars are computed once per compiled step, not once per vector of every leaf,
and hoisting them changes no number."""
import math

import torch
from torch._inductor.utils import run_and_get_code

from pimm_fn import TrainState, compile_step, optim, steps
from pimm_fn.compile.hoist import hoist
from pimm_fn.schedules import one_cycle


def test_hoist_returns_its_input_exactly_in_eager_and_compiled_code():
    values = torch.tensor([-0.0, 0.0, 1.5e-8, -3.0, math.inf, math.nan])
    compiled = torch.compile(lambda x: hoist(x) * 1.0, fullgraph=True)
    for v in values:
        assert hoist(v) is v  # eager: untouched
        out = compiled(v.clone())
        if math.isnan(v):
            assert math.isnan(out)
        else:
            assert torch.equal(out, v) and math.copysign(1.0, out) == math.copysign(1.0, v)  # -0.0 stays -0.0
    flags = torch.compile(lambda b: hoist(b) & True, fullgraph=True)
    assert flags(torch.tensor(True)).item() is True and flags(torch.tensor(False)).item() is False


def _calls_inside_loops(code: str, calls) -> int:
    """How many of ``calls`` sit inside a ``for`` loop of inductor's C++ kernels."""
    depth, loop_depths, found = 0, [], 0
    for line in code.splitlines():
        if "for(" in line:
            loop_depths.append(depth)
        if loop_depths:
            found += sum(line.count(c) for c in calls)
        depth += line.count("{") - line.count("}")
        while loop_depths and depth <= loop_depths[-1] and "for(" not in line:
            loop_depths.pop()
    return found


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 3)

    def forward(self, batch):
        logits = self.out(torch.relu(self.fc(batch["x"])))
        return {"loss": torch.nn.functional.cross_entropy(logits, batch["y"])}


def test_the_compiled_adamw_step_evaluates_its_schedule_once_not_in_every_leaf_loop():
    # one_cycle's lr is two float64 cosines; inlined, inductor put them (and Adam's bias
    # corrections) inside every parameter's element loop, evaluated once per 16 elements.
    torch.manual_seed(0)
    state = TrainState.create(_Net(), optim.adamw(one_cycle(100, 1e-2)), seed=0)
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(32, 64, generator=g), "y": torch.randint(0, 3, (32,), generator=g)}
    eager = compile_step(steps.supervised(clip_grad=1.0), eager=True)
    compiled = compile_step(steps.supervised(clip_grad=1.0))
    with torch._inductor.config.patch(fx_graph_cache=False):
        (new, _), codes = run_and_get_code(compiled, state, batch)
    in_loops = _calls_inside_loops("\n".join(codes), ("std::cos(", "std::pow(", "std::sqrt("))
    assert in_loops == 0, f"{in_loops} per-step scalar calls inside element loops"
    ref, _ = eager(state, batch)
    for name in ref.params:
        torch.testing.assert_close(new.params[name], ref.params[name], rtol=0, atol=1e-6)
