"""compile_step(mode=...): the modes it accepts, what reduce-overhead does without CUDA.

The CUDA graph side (replays, a static batch shape, dynamic point counts) is in
tests/test_cuda.py.
"""
import pytest
import torch

from pimm_fn import optim
from pimm_fn.compile import compile_step
from pimm_fn.compile.modes import copy_tensors, mode_patches
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, batch):
        return {"loss": ((self.lin(batch["x"]) - batch["y"]) ** 2).mean()}


def test_mode_patches_forward_the_mode_and_keep_cuda_graphs_off_dynamic_graphs():
    ro = mode_patches("reduce-overhead", None, None)
    assert ro["triton.cudagraphs"] is True and ro["triton.cudagraph_skip_dynamic_graphs"] is True
    # the user's options win over the mode's
    assert mode_patches("reduce-overhead", None, {"triton.cudagraph_skip_dynamic_graphs": False})[
        "triton.cudagraph_skip_dynamic_graphs"] is False
    assert "triton.cudagraphs" not in mode_patches("max-autotune-no-cudagraphs", None, None)
    assert mode_patches(None, None, {"max_autotune": True}) == {"max_autotune": True}
    with pytest.raises(ValueError, match="unknown mode 'fast'.*'reduce-overhead'"):
        compile_step(supervised(), mode="fast")


def test_reduce_overhead_on_cpu_warns_and_compiles_as_the_default_mode():
    torch.manual_seed(0)
    state = TrainState.create(Net(), optim.adamw(1e-2))
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 3, generator=g)} for _ in range(3)]
    eager = supervised()
    step = compile_step(eager, mode="reduce-overhead")
    ref = comp = state
    with pytest.warns(UserWarning, match="on cpu, where no CUDA graphs are recorded") as caught:
        comp, _ = step(comp, batches[0])
    # attributed to the caller's line, however deep the compiling call ran
    assert [w.filename for w in caught if "no CUDA graphs" in str(w.message)] == [__file__]
    ref, _ = eager(ref, batches[0])
    # Alone in a process the first call compiles once; after other steps over the same core
    # code, dynamo's automatic-dynamic history can add a second graph inside that first call
    # (reason 'unknown'). Either way nothing compiles after it: the default mode's steady state.
    first_call = step.compile_count
    assert first_call in (1, 2), step.recompile_reasons
    for b in batches[1:]:
        comp, cm = step(comp, b)
        ref, rm = eager(ref, b)
    assert step.compile_count == first_call, step.recompile_reasons
    for k in ref.params:
        torch.testing.assert_close(comp.params[k], ref.params[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cm["loss"], rm["loss"])


def test_copy_tensors_copies_every_tensor_of_a_state():
    state = TrainState.create(Net(), optim.sgd(0.1), loss_scale=True)
    out = copy_tensors(state)
    assert isinstance(out, TrainState) and out.rng == state.rng and out.cursor == state.cursor
    for k in state.params:
        assert torch.equal(out.params[k], state.params[k])
        assert out.params[k].data_ptr() != state.params[k].data_ptr()
    assert out.loss_scale.scale.data_ptr() != state.loss_scale.scale.data_ptr()
