"""Real data sets fetched from the package registry (laspy sdist, pyvista / sklearn wheels).

One module fixture fetches all three into a session cache (pip download; ~10 s warm,
~1.5 min the first time laspy's sdist build backend is installed).
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from pimm_fn.data import (
    DatasetMissingError,
    DigitsImages,
    FrogTissueBlocks,
    LidarBlocks,
    build_train_loader,
    fetch,
    image_collate,
)
from pimm_fn.data import transforms as T

CACHE = os.environ.get("PIMM_FN_TEST_DATA") or os.path.join(
    os.path.expanduser("~"), ".cache", "pimm_fn")


@pytest.fixture(scope="module")
def root():
    t0 = time.perf_counter()
    for name in ("lidar", "frog", "digits"):
        fetch(name, CACHE)
    print(f"fetched in {time.perf_counter() - t0:.1f}s")
    return CACHE


def test_missing_dataset_names_the_fetch_command(tmp_path):
    with pytest.raises(DatasetMissingError, match=r"-m pimm_fn\.data\.fetch lidar"):
        LidarBlocks(root=tmp_path)
    with pytest.raises(DatasetMissingError, match=r"-m pimm_fn\.data\.fetch frog"):
        FrogTissueBlocks(root=tmp_path)
    with pytest.raises(DatasetMissingError, match=r"-m pimm_fn\.data\.fetch digits"):
        DigitsImages(root=tmp_path)


def test_fetch_cli_reports_cached_file(root):
    out = subprocess.run([sys.executable, "-m", "pimm_fn.data.fetch", "digits", "--root", root],
                         capture_output=True, text=True, check=True).stdout
    assert "digits.csv.gz" in out


def test_fetch_all_as_setup_runs_it_prints_no_warning(root):
    # scripts/setup.sh runs `python -m pimm_fn.data.fetch all`; "-W default" shows every
    # warning, runpy's "found in sys.modules" RuntimeWarning and DeprecationWarnings included.
    proc = subprocess.run([sys.executable, "-W", "default", "-m", "pimm_fn.data.fetch", "all"],
                          capture_output=True, text=True, env={**os.environ, "PIMM_FN_DATA": root})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == ["lidar", "frog", "digits"], proc.stdout


def test_lidar_blocks(root):
    train, val = LidarBlocks("train", root=root), LidarBlocks("val", root=root)
    assert (len(train), len(val)) == (20, 4)  # 24 blocks of 10 x 10, every 5th to val
    total = sum(train[i]["coord"].shape[0] for i in range(len(train))) + sum(
        val[i]["coord"].shape[0] for i in range(len(val)))
    assert total == 25408
    seg = torch.cat([train[i]["segment"] for i in range(len(train))])
    assert set(seg.unique().tolist()) <= {-1, 0, 1, 2} and {0, 1, 2} <= set(seg.unique().tolist())
    loader = build_train_loader(
        train, batch_size=4, seed=0, mix_prob=0.5,
        transform=T.compose(T.grid_sample(1.0), T.center_shift(), T.assemble_feat(("coord", "intensity"))))
    batch = next(iter(loader.iter_epoch(0, 0)))
    assert batch["feat"].shape == (batch["coord"].shape[0], 4) and "grid_coord" in batch
    with pytest.raises(ValueError, match=r"data set 'lidar\[train\]' is empty"):
        LidarBlocks("train", root=root, min_points=10**6)


def test_frog_blocks(root):
    train = FrogTissueBlocks("train", root=root)
    s = train[0]
    assert s["coord"].shape[0] <= 8192 and s["coord"].dtype == torch.float32
    assert len(train) > 20
    seg = torch.cat([train[i]["segment"] for i in range(len(train))])
    assert seg.min() >= 0 and seg.max() <= 15 and seg.unique().numel() >= 12


def test_digits(root):
    train, val = DigitsImages("train", root=root), DigitsImages("val", root=root)
    assert len(train) + len(val) == 1797 and len(val) == 359
    loader = build_train_loader(train, batch_size=32, seed=0, collate_fn=image_collate)
    b = next(iter(loader.iter_epoch(0, 0)))
    assert b["image"].shape == (32, 1, 8, 8) and b["image"].max() <= 1.0
    assert loader.samples_in(b) == 32 and b["label"].max() <= 9
