"""Point / instance / image collate, Mix3D and input validation."""
import numpy as np
import pytest
import torch

from pimm_fn.data import (
    PointCollate,
    collate,
    image_collate,
    instance_collate,
    mix3d,
    point_collate,
    synthetic_scene,
    validate_point_batch,
)


def cloud(n, first_instance=0, k=2, name=None):
    s = {
        "coord": torch.arange(n * 3, dtype=torch.float32).reshape(n, 3),
        "segment": torch.arange(n) % 3,
        "instance": (torch.arange(n) % k) + first_instance,
    }
    if name:
        s["name"] = name
    return s


def test_collate_concatenates_and_builds_cumulative_offsets():
    batch = point_collate([cloud(3), cloud(5), cloud(2)])
    assert batch["coord"].shape == (10, 3)
    assert batch["offset"].dtype == torch.int64
    assert batch["offset"].tolist() == [3, 8, 10]
    assert torch.equal(batch["segment"][3:8], torch.arange(5) % 3)


def test_collate_numpy_strings_sequences_private_keys():
    samples = [
        {"coord": np.ones((2, 3), np.float32), "name": "a", "_cache": object(), "pair": (np.zeros(2), 1)},
        {"coord": np.ones((4, 3), np.float32), "name": "b", "_cache": object(), "pair": (np.zeros(1), 2)},
    ]
    out = point_collate(samples)
    assert isinstance(out["coord"], torch.Tensor) and out["coord"].shape == (6, 3)
    assert out["name"] == ["a", "b"]
    assert "_cache" not in out
    assert out["pair"][0].shape == (3,) and out["pair"][1].tolist() == [1, 2]
    # a per-sample offset that is a count becomes cumulative ends in the generic collate too
    assert collate([{"offset": torch.tensor([2])}, {"offset": torch.tensor([3])}])["offset"].tolist() == [2, 5]


def test_mix3d_prob_one_merges_pairs_and_shifts_instances():
    clouds = [cloud(3, k=2), cloud(4, k=3), cloud(2, k=1), cloud(5, k=2)]
    plain = point_collate(clouds)
    mixed = point_collate(clouds, mix_prob=1.0, seed=0)
    assert mixed["offset"].tolist() == [7, 14]  # B=4 clouds -> B/2 samples
    assert torch.equal(mixed["coord"], plain["coord"])
    # cloud 1's ids (0..2) are shifted past cloud 0's (max 1): 2..4; likewise cloud 3 past cloud 2
    assert mixed["instance"][:3].tolist() == [0, 1, 0]
    assert mixed["instance"][3:7].tolist() == [2, 3, 4, 2]
    assert mixed["instance"][7:9].tolist() == [0, 0]
    assert mixed["instance"][9:].tolist() == [1, 2, 1, 2, 1]
    first_sample = mixed["instance"][:7]
    assert set(first_sample[:3].tolist()).isdisjoint(first_sample[3:].tolist())


def test_mix3d_keeps_ignore_ids_and_odd_last_cloud():
    a = cloud(3)
    a["instance"] = torch.tensor([-1, 0, 4])
    b = cloud(2)
    b["instance"] = torch.tensor([-1, 1])
    out = mix3d(point_collate([a, b, cloud(2)]))
    assert out["offset"].tolist() == [5, 7]
    assert out["instance"][:5].tolist() == [-1, 0, 4, -1, 6]


def test_mix3d_prob_zero_changes_nothing_and_seed_is_reproducible():
    clouds = [cloud(3), cloud(4), cloud(2), cloud(5)]
    plain = point_collate(clouds)
    zero = point_collate(clouds, mix_prob=0.0, seed=1)
    assert all(torch.equal(plain[k], zero[k]) for k in plain)
    draws = [point_collate(clouds, mix_prob=0.5, seed=s)["offset"].numel() for s in range(40)]
    again = [point_collate(clouds, mix_prob=0.5, seed=s)["offset"].numel() for s in range(40)]
    assert draws == again
    assert set(draws) == {2, 4}  # the probability really is applied, both outcomes occur
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    seq1 = [point_collate(clouds, mix_prob=0.5, generator=g1)["offset"].numel() for _ in range(10)]
    seq2 = [point_collate(clouds, mix_prob=0.5, generator=g2)["offset"].numel() for _ in range(10)]
    assert seq1 == seq2


def test_point_collate_callable_reads_the_batch_seed():
    clouds = [dict(cloud(3), _mix_seed=5), dict(cloud(4), _mix_seed=9)]
    c = PointCollate(0.5)
    assert torch.equal(c(clouds)["offset"], c(clouds)["offset"])
    assert "_mix_seed" not in c(clouds)


def test_zero_points_names_the_sample():
    bad = {"coord": torch.zeros(0, 3), "segment": torch.zeros(0, dtype=torch.long), "name": "scene_17"}
    with pytest.raises(ValueError, match=r"sample 1 \('scene_17'\) has zero points"):
        point_collate([cloud(3), bad])


def test_length_mismatch_names_sample_and_key():
    bad = cloud(4, name="tile_3")
    bad["segment"] = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"sample 0 \('tile_3'\): coord has 4 points but segment has 3"):
        point_collate([bad, cloud(2)])


def test_nan_coordinates_name_the_sample():
    bad = cloud(4, name="nanny")
    bad["coord"][2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"sample 1 \('nanny'\) has 1 point\(s\) with NaN"):
        point_collate([cloud(2), bad])
    batch = point_collate([cloud(2), cloud(3)])
    batch["coord"][3, 0] = float("nan")
    with pytest.raises(ValueError, match="cloud 1 of the batch has NaN"):
        validate_point_batch(batch)


def test_non_increasing_offsets_rejected():
    batch = point_collate([cloud(2), cloud(3), cloud(1)])
    batch["offset"] = torch.tensor([2, 2, 6])
    with pytest.raises(ValueError, match="strictly increasing: cloud 1"):
        validate_point_batch(batch)
    batch["offset"] = torch.tensor([2, 4, 5])
    with pytest.raises(ValueError, match="last offset 5 != number of points 6"):
        validate_point_batch(batch)


def test_instance_collate_flattens_views_and_keeps_targets_per_cloud():
    def sample(n, k):
        s = synthetic_scene(n, points=(64, 96), max_objects=k)
        kk = int(s["instance"].max()) + 1
        s["gt_classes"] = torch.arange(kk)
        return s

    items = [[sample(1, 2), sample(2, 3)], sample(3, 2)]  # item 0 has two views
    out = instance_collate(items)
    assert out["offset"].numel() == 3
    assert len(out["gt_classes"]) == 3
    mixed = instance_collate(items, mix_prob=1.0, seed=0)
    assert mixed["offset"].numel() == 2
    # the merged pair's targets line up with its shifted instance ids 0..K0+K1-1
    n0 = int(mixed["offset"][0])
    assert len(mixed["gt_classes"][0]) == int(mixed["instance"][:n0].max()) + 1


def test_image_collate_stacks_and_names_bad_shapes():
    imgs = [{"image": torch.rand(1, 8, 8), "label": torch.tensor(i), "_mix_seed": 1} for i in range(3)]
    out = image_collate(imgs)
    assert out["image"].shape == (3, 1, 8, 8) and out["label"].tolist() == [0, 1, 2]
    assert "_mix_seed" not in out
    imgs[2] = {"image": torch.rand(1, 9, 8), "label": torch.tensor(2)}
    with pytest.raises(ValueError, match=r"sample 2: image has shape \(1, 9, 8\)"):
        image_collate(imgs)


def test_point_collate_makes_inverse_index_the_batch_and_adds_origin_offset():
    from pimm_fn.data import transforms as T

    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (300, 500, 200):
        raw = {"coord": torch.rand(n, 3, generator=g) * 2, "segment": torch.randint(0, 3, (n,), generator=g)}
        samples.append(T.grid_sample(0.25, mode="test")(raw, g))
    batch = point_collate(samples)
    assert batch["origin_offset"].tolist() == [300, 800, 1000]
    starts = [0] + batch["origin_offset"][:-1].tolist()
    for i, s in enumerate(samples):  # each original point finds its own voxel in the batch
        rows = batch["inverse"][starts[i]:batch["origin_offset"][i]]
        assert torch.equal(batch["coord"][rows], s["coord"][s["inverse"]])
        assert torch.equal(batch["origin_segment"][starts[i]:batch["origin_offset"][i]], s["origin_segment"])
    merged = mix3d(batch)  # pairs of clouds become one: original points merge alike
    assert merged["origin_offset"].tolist() == [800, 1000] and merged["offset"].tolist()[-1] == batch["offset"][-1]


def test_samples_with_other_keys_widths_or_dtypes_are_named_in_either_order():
    from pimm_fn.data.collate import collate

    labelled = {"coord": torch.rand(5, 3), "segment": torch.zeros(5, dtype=torch.long)}
    bare = {"coord": torch.rand(4, 3)}
    for batch in ([bare, labelled], [labelled, bare]):  # one order dropped the labels silently
        with pytest.raises(ValueError, match=r"sample 1 has keys .* every sample of a batch needs the same keys"):
            point_collate(batch)
    with pytest.raises(ValueError, match=r"sample 1: feat is .*\(6,\).*same feature width"):
        point_collate([{"coord": torch.rand(5, 3), "feat": torch.rand(5, 4)},
                       {"coord": torch.rand(3, 3), "feat": torch.rand(3, 6)}])
    with pytest.raises(ValueError, match=r"feat is torch.float64"):  # would promote the batch
        point_collate([{"coord": torch.rand(5, 3), "feat": torch.rand(5, 4)},
                       {"coord": torch.rand(3, 3), "feat": torch.rand(3, 4, dtype=torch.float64)}])
    with pytest.raises(ValueError, match=r"missing \['y'\]"):
        collate([{"x": torch.zeros(2), "y": 1}, {"x": torch.zeros(2)}])


def test_an_inverse_map_outside_its_cloud_is_refused():
    cloud = {"coord": torch.rand(5, 3), "inverse": torch.tensor([0, 1, 7])}
    with pytest.raises(ValueError, match=r"inverse map names points 0..7 of a cloud of 5"):
        point_collate([cloud])


def test_a_coord_that_is_not_n_by_3_is_named_as_such():
    for coord in (torch.rand(5), torch.rand(5, 2)):
        with pytest.raises(ValueError, match=r"sample 0: coord must be \[N, 3\]"):
            point_collate([{"coord": coord}])
    with pytest.raises(ValueError, match="has zero points"):
        point_collate([{"coord": torch.zeros(0, 3)}])
