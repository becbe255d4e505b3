"""Peak memory of one step.

On CUDA the peak is ``torch.cuda.max_memory_allocated`` over a step, minus what
was allocated before it. On CPU torch keeps no allocator statistics (torch 2.13 has no
``torch.cpu.memory_allocated``), and the resident set cannot see a step in a warm process
(glibc keeps freed blocks mapped, so the RSS before the step already holds them). So the
CPU figure is accounting of torch's CPU allocator: every tensor allocation and free that
the profiler's memory events report (``profile_memory=True``; inductor's kernels allocate
through the same allocator), summed in time order. The profiler does not report frees of blocks allocated before it
started, so the peak of that running sum is the peak of the memory allocated during the
step and still live (activations, gradients, a functional step's new state while the
old one is alive), on top of what was live before. Allocator slack is not included;
``memory_method`` says which method was used. The peak is measured on an extra, untimed
step (the profiler would slow a timed one).
"""
from __future__ import annotations

import os
from typing import Optional

import torch


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _hwm_bytes() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class PeakMemory:
    """Context manager: the peak extra memory of its body, in ``.peak_bytes`` / ``.method``.

    CUDA: ``max_memory_allocated`` minus the allocation before. CPU: the peak of the running
    sum of torch's CPU allocations minus frees, from the profiler's memory events: the
    peak of the memory allocated inside the body and still live (the profiler does not
    see frees of blocks allocated before it started). Where the profiler cannot record memory, peak RSS (``VmHWM``
    after a ``clear_refs`` reset) minus RSS before, which misses memory glibc kept mapped.
    The profiler slows the body: do not time it.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peak_bytes: Optional[int] = None
        self.method = "unavailable"
        self._prof = None
        self._hwm = False

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.method = "cuda max_memory_allocated - allocated before"
            return self
        try:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
            self.method = "cpu: torch allocator accounting (profiler memory events), peak bytes allocated in the step"
            return self
        except Exception:
            self._prof = None
        self._base = _rss_bytes()
        if self._base is not None:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS
                self._hwm = True
                self.method = "cpu peak RSS (VmHWM) - RSS before (misses memory glibc kept mapped)"
            except OSError:
                pass
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device) - self._base)
        elif self._prof is not None:
            self._prof.__exit__(*exc)
            if exc[0] is None:
                self.peak_bytes = _allocator_peak(self._prof)
        elif self._hwm:
            peak = _hwm_bytes()
            self.peak_bytes = None if peak is None else max(0, int(peak - self._base))
        return False


def _allocator_peak(prof) -> int:
    """Peak of the running sum of CPU allocation (+) / free (-) bytes in a profile."""
    cpu = torch.autograd.DeviceType.CPU
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == cpu)
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return int(peak)
