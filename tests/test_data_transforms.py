"""Point transforms (pure, generator-driven) and the dynamic-shape helpers."""
import math

import pytest
import torch

from pimm_fn.data import mark_point_dims_dynamic, pad_points_to_bucket, point_collate, synthetic_scene
from pimm_fn.data import transforms as T
from pimm_fn.data.dynamic import bucket_size


def scene(i=0):
    return synthetic_scene(i, points=(300, 400))


def gen(s=0):
    return torch.Generator().manual_seed(s)


def test_transforms_are_pure_and_seeded():
    s = scene()
    before = {k: v.clone() for k, v in s.items()}
    aug = T.compose(T.random_rotate(), T.random_scale(), T.random_flip(), T.random_jitter(),
                    T.crop_points(200), T.grid_sample(0.1), T.center_shift(), T.assemble_feat())
    a, b, c = aug(s, gen(1)), aug(s, gen(1)), aug(s, gen(2))
    assert all(torch.equal(s[k], before[k]) for k in s)  # input untouched
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["coord"], c["coord"]) or a["coord"].shape != c["coord"].shape
    assert a["feat"].shape == (a["coord"].shape[0], 6)


def test_normalize_color_maps_0_255_to_minus_1_1():
    out = T.normalize_color()({"color": torch.tensor([[0.0, 127.5, 255.0]])}, gen())
    assert torch.equal(out["color"], torch.tensor([[-1.0, 0.0, 1.0]]))
    no_color = {"coord": torch.zeros(2, 3)}
    assert T.normalize_color()(no_color, gen()) is no_color


def test_rotate_preserves_norms_and_z():
    s = scene()
    r = T.random_rotate(angle=(math.pi / 2, math.pi / 2))(s, gen())
    assert torch.allclose(r["coord"][:, 2], s["coord"][:, 2])
    assert torch.allclose(r["coord"][:, 0], -s["coord"][:, 1], atol=1e-5)
    assert torch.allclose(r["coord"][:, 1], s["coord"][:, 0], atol=1e-5)


def test_grid_sample_one_point_per_voxel_and_inverse():
    s = scene(3)
    out = T.grid_sample(0.25, mode="test")(s, gen())
    gc = out["grid_coord"]
    assert gc.dtype == torch.int64 and torch.unique(gc, dim=0).shape[0] == gc.shape[0]
    assert out["segment"].shape[0] == gc.shape[0] < s["coord"].shape[0]
    # every original point maps to the sampled point of its own voxel
    cell = torch.floor((s["coord"] - s["coord"].min(0).values) / 0.25).long()
    assert torch.equal(gc[out["inverse"]], cell)
    assert torch.equal(out["origin_segment"], s["segment"])
    train = T.grid_sample(0.25)(s, gen(5))
    assert train["coord"].shape[0] == gc.shape[0] and "inverse" not in train


def test_crop_keeps_max_points_and_alignment():
    s = scene()
    for mode in ("random", "center", "subsample"):
        out = T.crop_points(100, mode)(s, gen())
        assert out["coord"].shape[0] == 100 == out["segment"].shape[0] == out["instance"].shape[0]
    with pytest.raises(ValueError):
        T.crop_points(10, "nope")


def test_random_dropout_keeps_a_seeded_share_of_aligned_points():
    s = scene()
    n = s["coord"].shape[0]
    out = T.random_dropout(0.25, p=1.0)(s, gen(3))
    assert out["coord"].shape[0] == int(n * 0.75) == out["segment"].shape[0] == out["instance"].shape[0]
    rows = {tuple(r) for r in s["coord"].tolist()}
    assert all(tuple(r) in rows for r in out["coord"].tolist())  # a subset, points whole
    assert torch.equal(out["coord"], T.random_dropout(0.25, p=1.0)(s, gen(3))["coord"])
    assert T.random_dropout(0.25, p=0.0)(s, gen(3)) is s
    with pytest.raises(ValueError, match="ratio must be in"):
        T.random_dropout(1.0)


def test_center_and_feat():
    s = T.center_shift(apply_z=False)(scene(), gen())
    lo, hi = s["coord"].min(0).values, s["coord"].max(0).values
    assert torch.allclose((lo + hi)[:2] / 2, torch.zeros(2), atol=1e-5) and abs(float(lo[2])) < 1e-6
    f = T.assemble_feat(("coord", "segment"))(s, gen())
    assert f["feat"].shape[1] == 4
    with pytest.raises(KeyError, match="no 'normal'"):
        T.assemble_feat(("normal",))(s, gen())


def test_mark_dynamic_marks_point_tensors_only():
    b = point_collate([scene(0), scene(1)])
    mark_point_dims_dynamic(b)
    assert 0 in getattr(b["coord"], "_dynamo_dynamic_indices", set())
    assert 0 in getattr(b["segment"], "_dynamo_dynamic_indices", set())
    assert not getattr(b["offset"], "_dynamo_dynamic_indices", set())


def test_pad_to_bucket():
    b = point_collate([scene(0), scene(1)])
    n = b["coord"].shape[0]
    m = bucket_size(n, (256, 1024, 2048))
    p = pad_points_to_bucket(b, (256, 1024, 2048))
    assert p["coord"].shape[0] == m and int(p["point_mask"].sum()) == n
    assert (p["segment"][n:] == -1).all() and torch.equal(p["offset"], b["offset"])
    with pytest.raises(ValueError, match="largest bucket"):
        pad_points_to_bucket(b, (16,))


def test_integer_coordinates_are_refused_where_a_transform_would_truncate_them():
    g = torch.Generator().manual_seed(0)
    voxels = {"coord": torch.tensor([[10, 20, 30], [40, 50, 60]])}
    for t in (T.random_scale((0.9, 1.1)), T.random_jitter(), T.random_rotate()):
        with pytest.raises(TypeError, match="needs floating-point coord, got torch.int64"):
            t(voxels, g)
    assert torch.equal(T.random_flip()(voxels, g)["coord"].abs(), voxels["coord"])  # exact on integers
    with pytest.raises(ValueError, match="axis must be 'x', 'y' or 'z'"):
        T.random_rotate(axis="w")
    with pytest.raises(ValueError, match="max_points must be >= 1"):
        T.crop_points(-1)
    with pytest.raises(TypeError, match="max_points must be an int"):
        T.crop_points(2.5)
    for t in (T.center_shift(), T.grid_sample(0.1)):
        with pytest.raises(ValueError, match="a cloud with no points"):
            t({"coord": torch.zeros(0, 3)}, g)


def test_the_inverse_map_of_test_sampling_follows_later_transforms_or_refuses_them():
    g = torch.Generator().manual_seed(0)
    cloud = {"coord": torch.rand(60, 3, generator=g), "segment": torch.randint(0, 3, (60,), generator=g)}
    once = T.grid_sample(0.2, "test")(cloud, g)
    with pytest.raises(ValueError, match="dropping points after grid_sample"):
        T.crop_points(3)(once, g)
    # a permutation keeps every point: the map follows it
    perm = torch.randperm(once["coord"].shape[0], generator=g)
    moved = T.select_points(once, perm)
    assert torch.equal(moved["coord"][moved["inverse"]], once["coord"][once["inverse"]])
    # a second test sampling composes the maps: every original point names its final representative
    twice = T.grid_sample(0.5, "test")(once, g)
    again = T.grid_sample(0.5, "test")({k: v for k, v in once.items() if k != "inverse"}, g)
    assert torch.equal(twice["inverse"], again["inverse"][once["inverse"]])
    assert twice["inverse"].numel() == 60 and torch.equal(twice["origin_segment"], cloud["segment"])
