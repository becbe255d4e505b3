"""pimm_fn.hyper: a schedule's numbers are inputs of a compiled function, never its constants."""
import pytest
import torch

from pimm_fn import schedules
from pimm_fn.hyper import Hyper, hypers_of

CPU = torch.device("cpu")


def test_a_hyper_gives_the_same_float64_tensors_on_every_call():
    h = Hyper(lr=1e-3, total=100)
    first = h.on(CPU)
    assert first is h.on(CPU)
    assert {k: (v.dtype, v.shape, float(v)) for k, v in first.items()} == {
        "lr": (torch.float64, (), 1e-3), "total": (torch.float64, (), 100.0)}
    assert repr(h) == "Hyper(lr=0.001, total=100.0)"


def test_schedules_list_their_numbers():
    cycle = schedules.one_cycle(100, 1e-3)
    assert len(hypers_of(cycle)) == 1 and hypers_of(0.1) == ()
    warmed = schedules.linear_warmup(cycle, 10, 0.1)
    assert hypers_of(warmed)[1:] == hypers_of(cycle)


class _Holder:
    """A schedule reached through an argument, as a step reaches its state's optimizer."""

    def __init__(self, schedule):
        self.schedule = schedule


def _users_schedule(k):
    """A schedule of one's own, as docs/migration.md describes it: its numbers in a Hyper."""
    h = Hyper(peak=0.1 * k, warm=5 * k)

    def schedule(count):
        n = h.on(count.device)
        return (n["peak"] * torch.clamp(count / n["warm"], max=1.0)).to(torch.float32)

    schedule.hypers = (h,)
    return schedule


FACTORIES = {
    "users_own": _users_schedule,
    "one_cycle": lambda k: schedules.one_cycle(100 * k, 1e-3 * k, pct_start=0.2 + 0.1 * k),
    "one_cycle_momentum": lambda k: schedules.one_cycle_momentum(100 * k, 0.8 + 0.01 * k),
    "cosine": lambda k: schedules.cosine(50 * k, 1e-2 / k, eta_min=1e-5 * k),
    "multistep": lambda k: schedules.multistep(80 * k, 0.1 * k, gamma=0.2 * k),
    "multistep_with_warmup": lambda k: schedules.multistep_with_warmup(90 * k, 0.1 * k, warmup_rate=0.1 * k),
    "poly": lambda k: schedules.poly(60 * k, 0.05 * k),
    "exp": lambda k: schedules.exp(70 * k, 0.05 * k, gamma=0.5 / k),
    "linear_warmup": lambda k: schedules.linear_warmup(schedules.constant(0.1 * k), 7 * k, 0.01 * k),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_other_numbers_reuse_the_compiled_schedule_and_give_their_own_values(name):
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]
    compiled = torch.compile(lambda holder, count: holder.schedule(count), fullgraph=True, backend="eager")
    counts = [torch.tensor(c) for c in (0, 3, 17, 40, 1000)]
    before = frames["unique_graphs"]
    for k in (1, 2, 3):
        schedule = FACTORIES[name](k)
        for count in counts:
            assert torch.equal(compiled(_Holder(schedule), count), schedule(count)), (name, k, int(count))
    assert frames["unique_graphs"] - before == 1, name
