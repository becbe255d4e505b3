"""Generated LArTPC events: determinism, classes, sizes, geometry, track physics, loader."""
import time

import numpy as np
import pytest
import torch

from pimm_fn.data import LArTPCEvents, build_train_loader, lartpc_event
from pimm_fn.data import transforms as T
from pimm_fn.data.lartpc import (
    CLASS_NAMES,
    KINDS,
    MICHEL,
    MUON,
    PION,
    PROTON,
    dedx,
    kinetic_energy,
    render_events,
    trace_paths,
    voxelize,
)

GRID = 768


@pytest.fixture(scope="module")
def events():
    """20 events of run 1 with their particle tables (generated once for the module)."""
    return [lartpc_event(1, i, particles=True) for i in range(20)]


def test_same_seed_and_index_give_the_same_event_and_others_differ():
    a, b = lartpc_event(3, 7), lartpc_event(3, 7)
    for key in ("coord", "grid_coord", "energy", "segment"):
        assert np.array_equal(a[key], b[key]), key
    for other in (lartpc_event(3, 8), lartpc_event(4, 7)):
        assert not (len(other["segment"]) == len(a["segment"])
                    and np.array_equal(other["grid_coord"], a["grid_coord"]))


def test_shapes_dtypes_and_units(events):
    for ev in events:
        n = len(ev["segment"])
        assert ev["coord"].shape == (n, 3) and ev["coord"].dtype == np.float32
        assert ev["grid_coord"].shape == (n, 3) and ev["grid_coord"].dtype == np.int64
        assert ev["energy"].shape == (n, 1) and ev["energy"].dtype == np.float32
        assert ev["segment"].dtype == np.int64
        # coord is the voxel centre in voxel units
        assert np.array_equal(ev["coord"], ev["grid_coord"].astype(np.float32) + 0.5)
        assert (ev["energy"] > 0).all()


def test_classes_in_range_and_all_five_appear(events):
    assert CLASS_NAMES == ("shower", "track", "michel", "delta", "low_energy")
    assert LArTPCEvents.class_names == CLASS_NAMES and LArTPCEvents.num_classes == 5
    seen = set()
    for ev in events:
        assert ev["segment"].min() >= 0 and ev["segment"].max() <= 4
        seen |= set(np.unique(ev["segment"]).tolist())
    assert seen == {0, 1, 2, 3, 4}


def test_voxel_counts_in_the_intended_range(events):
    n = np.array([len(ev["segment"]) for ev in events])
    assert 1500 <= n.mean() <= 6000, n  # PILArNet-M: ~5.2B points / ~1.2M events
    assert n.min() >= 100 and n.max() <= 20000, n


def test_coordinates_inside_the_grid_and_unique(events):
    for ev in events:
        g = ev["grid_coord"]
        assert (g >= 0).all() and (g < GRID).all()
        assert len(np.unique(g, axis=0)) == len(g)


def test_smaller_grid_drops_points_outside():
    ev = lartpc_event(0, 3, grid=128)
    assert len(ev["segment"]) > 0
    assert (ev["grid_coord"] >= 0).all() and (ev["grid_coord"] < 128).all()


def test_stopping_muon_deposits_rise_toward_its_end():
    # dE/dx follows the Bragg power law: several tracks, each binned per cm of residual range
    for seed in range(5):
        rng = np.random.default_rng(seed)
        tr = trace_paths(rng, [[1000.0, 1000.0, 1000.0]], [[1.0, 0.3, 0.2]], 600.0, MUON, step_mm=1.0)
        per_cm = np.bincount((tr["residual"] // 10).astype(np.int64), tr["energy"])
        last, near, mid, far = per_cm[0], per_cm[1:3].mean(), per_cm[3:8].mean(), per_cm[20:50].mean()
        assert last > near > mid > far, (seed, per_cm[:10])
        assert last > 3 * far and 1.7 < far < 2.9  # MIP 2.1 MeV/cm far from the end
        # the deposits add up to the kinetic energy the range implies
        assert tr["energy"].sum() == pytest.approx(kinetic_energy(60.0, MUON), rel=0.05)
        # per voxel: the voxels at the stopping end hold several times a mid-track voxel
        grid_coord, vox_e, _ = voxelize(tr["pos"], tr["energy"], np.zeros(len(tr["energy"]), np.int64),
                                        np.array([1]))
        cheb = np.abs(grid_coord - np.floor(tr["end"][0] / 3.0)).max(1)
        assert vox_e[cheb <= 1].mean() > 3 * vox_e[(cheb >= 30) & (cheb <= 100)].mean()


def test_dedx_and_kinetic_energy_are_consistent():
    r = np.linspace(0.05, 200.0, 8000)  # past where every power law meets the MIP floor
    for sp in (MUON, PROTON, PION):
        loss = dedx(r, sp)
        assert (np.diff(loss) <= 0).all() and loss[-1] == pytest.approx(2.1) and loss.min() >= 2.1
        # kinetic_energy is the integral of dedx over the residual range
        assert np.allclose(np.gradient(kinetic_energy(r, sp), r)[5:-5], loss[5:-5], rtol=1e-2)
    # protons: ~10 cm of range for ~110 MeV (the published range-energy relation)
    assert 95 < kinetic_energy(10.0, PROTON) < 125


def test_michel_electrons_start_at_stopping_muon_or_pion_ends(events):
    found = adjacent = 0
    for ev in events:
        p = ev["particles"]
        g, seg = ev["grid_coord"], ev["segment"]
        for j in np.flatnonzero(p["kind"] == KINDS.index("michel")):
            parent = p["parent"][j]
            assert p["kind"][parent] in (MUON, PION)
            assert np.array_equal(p["start"][j], p["end"][parent])
            end_voxel = np.floor(p["end"][parent] / 3.0)
            assert ((end_voxel >= 0) & (end_voxel < GRID)).all()  # only stopping (contained) ends
            found += 1
            # a Michel-labelled voxel touches the end voxel (unless the electron ran back
            # along the track, whose Bragg-peak voxels then keep the track label)
            adjacent += bool((seg[np.abs(g - end_voxel).max(1) <= 2] == MICHEL).any())
    assert found >= 20
    assert adjacent >= 0.9 * found, (adjacent, found)


def test_delta_rays_leave_muon_and_pion_tracks(events):
    n = 0
    for ev in events:
        p = ev["particles"]
        for j in np.flatnonzero(p["kind"] == KINDS.index("delta")):
            assert p["kind"][p["parent"][j]] in (MUON, PION)
            n += 1
    assert n >= 20


def test_dataset_splits_are_disjoint_and_random_access():
    train, val = LArTPCEvents("train", num_events=1_000_000), LArTPCEvents("val", num_events=1_000_000)
    assert len(train) == 1_000_000
    assert {train.event_seed, LArTPCEvents("train", seed=1).event_seed}.isdisjoint(
        {val.event_seed, LArTPCEvents("val", seed=1).event_seed})
    s = train[999_999]
    assert s["name"] == "lartpc[train]/999999"
    assert torch.equal(s["feat"], s["energy"]) and s["coord"].dtype == torch.float32
    assert not torch.equal(train[0]["grid_coord"][:50], val[0]["grid_coord"][:50])
    with pytest.raises(IndexError):
        train[1_000_000]
    with pytest.raises(ValueError):
        LArTPCEvents("test")


def test_train_loader_over_a_million_events():
    ds = LArTPCEvents(num_events=1_000_000)
    transform = T.compose(T.random_rotate(axis="z"), T.grid_sample(1.0),
                          T.assemble_feat(("energy", "coord")))
    t0 = time.perf_counter()
    loader = build_train_loader(ds, batch_size=2, transform=transform, num_workers=0)
    assert len(loader) == 500_000  # no event generated to know it
    batch = next(iter(loader.iter_epoch(0, 0)))
    assert time.perf_counter() - t0 < 30  # one shuffled epoch order + two events, not a million
    for key in ("coord", "grid_coord", "energy", "feat", "segment", "offset"):
        assert key in batch, key
    n = batch["coord"].shape[0]
    assert batch["offset"].shape == (2,) and int(batch["offset"][-1]) == n
    assert batch["feat"].shape == (n, 4) and batch["segment"].shape == (n,)
    assert batch["segment"].min() >= 0 and batch["segment"].max() < 5


def test_generation_time_is_bounded():
    lartpc_event(2, 0)  # warm-up (imports, first allocations)
    t0 = time.perf_counter()
    for i in range(20):
        lartpc_event(2, i)
    assert (time.perf_counter() - t0) / 20 < 0.05  # loose: typically a few ms on one core


def test_render_events_writes_a_png(tmp_path):
    path = tmp_path / "events.png"
    render_events(path, seed=0, indices=(2,))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
