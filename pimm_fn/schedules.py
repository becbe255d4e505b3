"""Learning-rate and momentum schedules: pure functions of the optimizer's step count.

A schedule maps a 0-dim int64 ``count`` tensor (the number of updates already applied)
to a 0-dim float64 tensor: the value the next update uses. That is what a torch
scheduler's ``get_last_lr()`` holds after ``count`` calls to ``scheduler.step()``.

Values are computed in float64, as torch's schedulers compute in Python floats, and kept
in float64: the optimizers round them where torch's kernels round the Python float (so a
float64 model gets torch's numbers too); metrics log them as float32.
Every factory checks its horizon once, on the host; the returned function is
plain tensor code that traces under ``torch.compile(fullgraph=True)``. Its numbers (the
learning rates, the horizon, the phase boundaries) are a :class:`~pimm_fn.hyper.Hyper`,
listed in the function's ``hypers``: a compiled step takes them as inputs, so a schedule
with other numbers but the same shape (the strategy, the number of phases or milestones)
reuses the compiled step.

Past its horizon a schedule holds its final value (torch raises or wraps around
instead), so extending a run by raising the number of epochs is defined behaviour.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence, Union

import torch

from .hyper import Hyper, hypers_of

Schedule = Callable[[torch.Tensor], torch.Tensor]

__all__ = [
    "Schedule",
    "constant",
    "cosine",
    "exp",
    "linear_warmup",
    "multistep",
    "multistep_with_warmup",
    "one_cycle",
    "one_cycle_momentum",
    "poly",
]


def _check_total_steps(total_steps, where: str, lr=None) -> int:
    """``total_steps`` as a positive int, or a ValueError that says what usually went wrong."""
    if lr is not None and isinstance(lr, int) and not isinstance(total_steps, (bool, int)) \
            and isinstance(total_steps, float) and int(total_steps) != total_steps:
        raise TypeError(
            f"{where}(total_steps, base_lr, ...): got total_steps={total_steps!r}, base_lr={lr!r}, which "
            f"looks like the old order (base_lr, total_steps). Every schedule takes the run's length "
            f"first, as one_cycle and cosine do: {where}({lr!r}, {total_steps!r}, ...)."
        )
    if isinstance(total_steps, bool) or int(total_steps) != total_steps:
        raise TypeError(f"{where}: total_steps must be an integer, got {total_steps!r}")
    total_steps = int(total_steps)
    if total_steps <= 0:
        raise ValueError(
            f"{where}: total_steps must be positive, got {total_steps}. total_steps is "
            "usually (optimizer steps per epoch) * epochs, so 0 means the training data "
            "loader yields no batches: check the dataset path and split, and that the "
            "dataset has at least batch_size samples per rank when drop_last=True."
        )
    return total_steps


def _steps(count: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The step as float64, held at ``last`` past the horizon (and at 0 below it)."""
    return torch.minimum(count.to(torch.float64).clamp(min=0), last)


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


def _schedule(fn: Schedule, *hypers: Hyper) -> Schedule:
    fn.hypers = hypers
    return fn


def constant(value: float) -> Schedule:
    """A schedule that always returns ``value``."""
    h = Hyper(value=value)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        return _f64(h.on(count.device)["value"])

    return _schedule(schedule, h)


# ---------------------------------------------------------------------------- OneCycle


def _one_cycle_pct(total_steps: int, pct_start: float) -> float:
    """pct_start as a fraction; a value above 1 is a step count, as Pointcept reads it."""
    pct_start = float(pct_start)
    if pct_start < 0:
        raise ValueError(f"one_cycle: pct_start must be >= 0, got {pct_start}")
    if pct_start > 1:
        if pct_start > total_steps:
            raise ValueError(
                f"one_cycle: pct_start={pct_start:g} read as a number of warm-up steps "
                f"exceeds total_steps={total_steps}"
            )
        pct_start = pct_start / total_steps
    return pct_start


def _one_cycle_phases(total_steps: int, pct: float, three_phase: bool, values):
    """[(start_step, end_step, start_value, end_value)] as torch's OneCycleLR lays them out."""
    if three_phase:
        ends = [float(pct * total_steps) - 1, float(2 * pct * total_steps) - 2, total_steps - 1]
    else:
        ends = [float(pct * total_steps) - 1, total_steps - 1]
    phases, start = [], 0.0
    for end, (a, b) in zip(ends, values):
        phases.append((start, float(end), a, b))
        start = float(end)
    return phases


def _anneal(strategy: str):
    if strategy == "cos":
        # torch: end + (start - end) / 2 * (cos(pi * pct) + 1), in this order.
        return lambda a, b, pct: b + (a - b) / 2.0 * (torch.cos(math.pi * pct) + 1)
    if strategy == "linear":
        return lambda a, b, pct: (b - a) * pct + a
    raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {strategy!r}")


_PHASE = ("start", "end", "a", "b")


def _piecewise(total_steps: int, phases, anneal) -> Schedule:
    h = Hyper(last=total_steps - 1, **{f"{k}{i}": v for i, phase in enumerate(phases) for k, v in zip(_PHASE, phase)})
    n_phases = len(phases)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        n = h.on(count.device)
        # Hold the last step's value past the end: torch's value at total_steps is an
        # overshoot of the final phase (negative for 'linear' with a short horizon).
        s = _steps(count, n["last"])
        # The first phase whose end_step is >= s, else the last one (torch's rule); each
        # phase is evaluated and the right one selected, so there is no host branch. A
        # zero-length phase (OneCycle's warm-up when pct_start * total_steps == 1, where
        # torch divides by zero) is at its end value.
        out = None
        for i in reversed(range(n_phases)):
            start, end, a, b = (n[f"{k}{i}"] for k in _PHASE)
            span = end - start
            pct = torch.where(span > 0, (s - start) / torch.where(span > 0, span, torch.ones_like(span)),
                              torch.ones_like(s))
            value = anneal(a, b, pct)
            out = value if out is None else torch.where(s <= end, value, out)
        return _f64(out)

    return _schedule(schedule, h)


def one_cycle(
    total_steps: int,
    max_lr: float,
    pct_start: float = 0.3,
    anneal_strategy: str = "cos",
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    three_phase: bool = False,
) -> Schedule:
    """The learning rate of torch's ``OneCycleLR`` for one parameter group.

    total_steps: the number of optimizer updates of the whole run.
    max_lr: the peak; the cycle starts at ``max_lr / div_factor`` and ends at
        ``max_lr / div_factor / final_div_factor``.
    pct_start: fraction of the run spent warming up; a value > 1 is a number of steps
        (Pointcept's convention).
    anneal_strategy: 'cos' or 'linear'.
    three_phase: warm up, anneal back to the initial lr symmetrically, then to the minimum.
    Give each param group its own ``one_cycle`` for torch's per-group ``max_lr`` list.
    """
    total_steps = _check_total_steps(total_steps, "one_cycle")
    pct = _one_cycle_pct(total_steps, pct_start)
    initial = float(max_lr) / div_factor
    minimum = initial / final_div_factor
    if three_phase:
        values = [(initial, float(max_lr)), (float(max_lr), initial), (initial, minimum)]
    else:
        values = [(initial, float(max_lr)), (float(max_lr), minimum)]
    phases = _one_cycle_phases(total_steps, pct, three_phase, values)
    return _piecewise(total_steps, phases, _anneal(anneal_strategy))


def one_cycle_momentum(
    total_steps: int,
    base_momentum: float = 0.85,
    max_momentum: float = 0.95,
    pct_start: float = 0.3,
    anneal_strategy: str = "cos",
    three_phase: bool = False,
) -> Schedule:
    """The momentum (SGD) or beta1 (Adam/AdamW) that torch's ``OneCycleLR`` cycles.

    It runs inversely to the lr: from ``max_momentum`` down to ``base_momentum`` while the
    lr warms up, then back. Pass it as ``momentum=`` to sgd or ``b1=`` to adam / adamw;
    use the same total_steps, pct_start, anneal_strategy and three_phase as the lr.
    """
    total_steps = _check_total_steps(total_steps, "one_cycle_momentum")
    pct = _one_cycle_pct(total_steps, pct_start)
    lo, hi = float(base_momentum), float(max_momentum)
    if three_phase:
        values = [(hi, lo), (lo, hi), (hi, hi)]
    else:
        values = [(hi, lo), (lo, hi)]
    phases = _one_cycle_phases(total_steps, pct, three_phase, values)
    return _piecewise(total_steps, phases, _anneal(anneal_strategy))


# ------------------------------------------------------------------- Pointcept's others


def cosine(total_steps: int, base_lr: float, eta_min: float = 0.0) -> Schedule:
    """torch's ``CosineAnnealingLR`` with ``T_max = total_steps`` (closed form).

    base_lr: the value at step 0; eta_min: the value at total_steps and after.
    """
    total_steps = _check_total_steps(total_steps, "cosine")
    h = Hyper(total=total_steps, base_lr=base_lr, eta_min=eta_min)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        n = h.on(count.device)
        s = _steps(count, n["total"])
        eta_min = n["eta_min"]
        return _f64(eta_min + (n["base_lr"] - eta_min) * (1 + torch.cos(s * math.pi / n["total"])) / 2)

    return _schedule(schedule, h)


def _milestone_steps(milestones: Sequence[float], total_steps: int, where: str, whole: bool = True) -> list:
    """The steps ``r * total_steps``, rounded down (``whole``: MultiStepLR's int milestones) or not."""
    steps = []
    for r in milestones:
        if not 0 <= float(r) <= 1:
            raise ValueError(
                f"{where}: milestones are fractions of total_steps in [0, 1], got {r!r}"
            )
        step = float(r) * total_steps
        steps.append(int(step) if whole else step)
    return sorted(steps)


def _step_decay_numbers(steps: list, gamma: float, start: float) -> dict:
    """The milestones and ``start * gamma ** k`` for each k, multiplied on the host as torch does."""
    numbers, value = {"decay0": start}, start
    for k, m in enumerate(steps):
        value *= gamma
        numbers[f"milestone{k}"], numbers[f"decay{k + 1}"] = m, value
    return numbers


def _step_decay(s: torch.Tensor, n: dict, n_milestones: int) -> torch.Tensor:
    """The decayed value for k milestones reached (numbers from :func:`_step_decay_numbers`)."""
    out = n["decay0"]
    for k in range(n_milestones):
        out = torch.where(s >= n[f"milestone{k}"], n[f"decay{k + 1}"], out)
    return out


def multistep(
    total_steps: int, base_lr: float, milestones: Sequence[float] = (0.6, 0.9), gamma: float = 0.1
) -> Schedule:
    """torch's ``MultiStepLR`` at Pointcept's milestones ``int(r * total_steps)``.

    milestones: fractions of the run; the lr is multiplied by ``gamma`` at each.
    """
    total_steps = _check_total_steps(total_steps, "multistep", base_lr)
    steps = _milestone_steps(milestones, total_steps, "multistep")
    h = Hyper(total=total_steps, **_step_decay_numbers(steps, float(gamma), float(base_lr)))

    def schedule(count: torch.Tensor) -> torch.Tensor:
        n = h.on(count.device)
        return _f64(_step_decay(_steps(count, n["total"]), n, len(steps)))

    return _schedule(schedule, h)


def multistep_with_warmup(
    total_steps: int,
    base_lr: float,
    milestones: Sequence[float] = (0.6, 0.9),
    gamma: float = 0.1,
    warmup_rate: float = 0.05,
    warmup_scale: float = 1e-6,
) -> Schedule:
    """The seed's MultiStepWithWarmup: multistep decay times a linear warm-up.

    The factor is ``gamma ** k`` (k milestones ``r * total_steps`` reached, not rounded, as
    the seed compares them), times
    ``1 - (1 - s / (warmup_rate * T)) * (1 - warmup_scale)`` while
    ``s <= warmup_rate * T``: it rises from ``warmup_scale`` to 1 over the warm-up.
    warmup_rate=0 means no warm-up (Pointcept divides by zero there).
    """
    total_steps = _check_total_steps(total_steps, "multistep_with_warmup", base_lr)
    steps = _milestone_steps(milestones, total_steps, "multistep_with_warmup", whole=False)
    warmup_end = float(warmup_rate) * total_steps
    warms = warmup_end > 0
    h = Hyper(total=total_steps, base_lr=base_lr, warmup_end=warmup_end, warmup_rate=float(warmup_rate),
              warmup_scale=warmup_scale, **_step_decay_numbers(steps, float(gamma), 1.0))

    def schedule(count: torch.Tensor) -> torch.Tensor:
        n = h.on(count.device)
        s = _steps(count, n["total"])
        decay = _step_decay(s, n, len(steps))
        if warms:
            ramp = 1 - (1 - s / n["warmup_rate"] / n["total"]) * (1 - n["warmup_scale"])  # the seed's divisions
            decay = decay * torch.where(s <= n["warmup_end"], ramp, torch.ones_like(ramp))
        return _f64(n["base_lr"] * decay)

    return _schedule(schedule, h)


def poly(total_steps: int, base_lr: float, power: float = 0.9) -> Schedule:
    """The seed's PolyLR: ``base_lr * (1 - s / (total_steps + 1)) ** power``."""
    total_steps = _check_total_steps(total_steps, "poly", base_lr)
    power = float(power)  # the curve's shape: a Python number, which torch.pow special-cases
    h = Hyper(total=total_steps, base_lr=base_lr)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        n = h.on(count.device)
        s = _steps(count, n["total"])
        return _f64(n["base_lr"] * (1 - s / (n["total"] + 1)) ** power)  # an integer + 1: exact

    return _schedule(schedule, h)


def exp(total_steps: int, base_lr: float, gamma: float) -> Schedule:
    """The seed's ExpLR: ``base_lr * gamma ** (s / total_steps)``."""
    total_steps = _check_total_steps(total_steps, "exp", base_lr)
    h = Hyper(total=total_steps, base_lr=base_lr, gamma=gamma)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        n = h.on(count.device)
        s = _steps(count, n["total"])
        return _f64(n["base_lr"] * n["gamma"] ** (s / n["total"]))

    return _schedule(schedule, h)


def linear_warmup(
    schedule: Union[Schedule, float], warmup_steps: int, start_factor: float
) -> Schedule:
    """``schedule`` scaled by a factor rising linearly from start_factor to 1.

    The factor is ``start_factor + (1 - start_factor) * min(s, warmup_steps) / warmup_steps``,
    torch's ``LinearLR(start_factor, end_factor=1, total_iters=warmup_steps)``.
    schedule: a schedule or a constant.
    """
    if isinstance(warmup_steps, bool) or int(warmup_steps) != warmup_steps or warmup_steps < 0:
        raise ValueError(f"linear_warmup: warmup_steps must be an int >= 0, got {warmup_steps!r}")
    warmup_steps = int(warmup_steps)
    inner = schedule if callable(schedule) else constant(schedule)
    if warmup_steps == 0:
        return inner
    h = Hyper(warmup=warmup_steps, start_factor=start_factor)

    def warmed(count: torch.Tensor) -> torch.Tensor:
        n = h.on(count.device)
        s = _steps(count, n["warmup"])
        factor = n["start_factor"] + (1.0 - n["start_factor"]) * s / n["warmup"]
        return _f64(inner(count).to(torch.float64) * factor)

    return _schedule(warmed, h, *hypers_of(inner))
