"""scripts/gpu_check.sh and benchmarks/gpu_steps.py on a machine without CUDA; the workloads' device.

On a GPU machine the script itself is the check (it runs tests/test_cuda.py); here what
is checked is that it says why it checks nothing and exits 2, and that the benchmark
workloads it times are made on the device they are given.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pimm_fn.bench import workloads as W

ROOT = Path(__file__).resolve().parents[1]
no_cuda_only = pytest.mark.skipif(torch.cuda.is_available(),
                                  reason="this machine has CUDA: gpu_check.sh really runs there")


@no_cuda_only
def test_gpu_check_without_cuda_says_so_and_exits_2():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "PYTHON": sys.executable})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU" in proc.stdout and "needs a CUDA GPU" in proc.stdout


@no_cuda_only
def test_gpu_steps_without_cuda_exits_2():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_steps.py"), "--models", "mlp"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stdout and "--device cpu" in proc.stdout


@pytest.mark.parametrize("name", ["mlp", "pointseg", "cnn"])
def test_workloads_are_made_on_the_given_device(name):
    cpu = W.WORKLOADS[name](n_batches=2)
    meta = W.WORKLOADS[name](n_batches=2, device="meta")
    assert meta.state.device.type == "meta" and next(meta.model.parameters()).device.type == "meta"
    for b_cpu, b_meta in zip(cpu.batches, meta.batches):
        for k, v in b_meta.items():
            assert v.device.type == "meta" and v.shape == b_cpu[k].shape
    assert cpu.state.device.type == "cpu" and meta.notes["device"] == "meta"
