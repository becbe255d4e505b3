"""Multi-dataset mixing: ratios, epoch length (seed rule), exact mid-epoch resume."""
import pytest
import torch

from pimm_fn.data import MultiDatasetLoader, SyntheticScenes, build_multi_loader


def names(batches):
    return [tuple(b["name"]) for b in batches]


def make(ratios=(2, 1), sizes=(14, 5), **kw):
    datasets = [SyntheticScenes(n, seed=i, points=(32, 64), name=f"ds{i}") for i, n in enumerate(sizes)]
    return build_multi_loader(datasets, ratios, batch_size=2, seed=4, **kw)


def test_length_and_ratio_schedule():
    loader = make()
    l0 = len(loader.loaders[0])  # 14 samples, batch 2 -> 7
    assert l0 == 7
    assert len(loader) == 7 // 2 * 3 + 7 % 2 == 10
    assert loader.schedule() == [0, 0, 1, 0, 0, 1, 0, 0, 1, 0]
    batches = list(loader.iter_epoch(0, 0))
    assert len(batches) == 10
    sources = [b["name"][0].split("/")[0] for b in batches]
    assert sources == ["ds0", "ds0", "ds1"] * 3 + ["ds0"]
    # the first data set is consumed exactly once per epoch, in its own epoch order
    ds0 = [n for b in batches for n in b["name"] if n.startswith("ds0")]
    assert sorted(ds0) == sorted(f"ds0/{i}" for i in range(14))
    # ds1 (2 batches per own epoch) wraps around into its next own epoch
    assert [b["name"] for b in batches[2::3]][:2] == [b["name"] for b in loader.loaders[1].iter_epoch(0, 0)]


def test_three_datasets_ratio_counts():
    loader = make(ratios=(1, 2, 3), sizes=(6, 4, 8))
    batches = list(loader.iter_epoch(1, 0))
    counts = {f"ds{i}": 0 for i in range(3)}
    for b in batches:
        counts[b["name"][0].split("/")[0]] += 1
    assert counts == {"ds0": 3, "ds1": 6, "ds2": 9} and len(loader) == 18


@pytest.mark.parametrize("start", [1, 4, 9, 10])
def test_mid_epoch_resume_is_exact(start):
    full = list(make(mix_prob=0.5).iter_epoch(2, 0))
    rest = list(make(mix_prob=0.5).iter_epoch(2, start))
    assert len(rest) == len(full) - start
    for x, y in zip(rest, full[start:]):
        assert x["name"] == y["name"]
        assert torch.equal(x["offset"], y["offset"]) and torch.equal(x["coord"], y["coord"])


def test_bad_ratios():
    ds = SyntheticScenes(4)
    loader = make().loaders[0]
    with pytest.raises(ValueError, match="2 ratios"):
        MultiDatasetLoader([loader], [1, 2])
    with pytest.raises(ValueError, match="positive integers"):
        MultiDatasetLoader([loader], [0])
    with pytest.raises(ValueError, match="'empty' is empty"):
        build_multi_loader([ds, SyntheticScenes(0, name="empty")], [1, 1], batch_size=2)


def test_a_mix_whose_first_loader_has_no_whole_cycle_is_refused():
    with pytest.raises(ValueError, match="fewer than its ratio 3: an epoch holds no whole cycle"):
        make(ratios=(3, 1), sizes=(4, 20))


def test_a_mid_epoch_state_with_other_ratios_is_refused_and_an_epoch_end_one_only_warns():
    saved = make(ratios=(1, 2), sizes=(12, 20))
    it = saved.iter_epoch(0, 0)
    for _ in range(3):
        next(it)
    state = saved.state_dict()
    assert (state["position"], state["ratios"]) == (3, [1, 2])
    other = make(ratios=(2, 1), sizes=(12, 20))
    with pytest.raises(ValueError, match=r"ratios=\[1, 2\] \(now \[2, 1\]\).*other data sets"):
        other.load_state_dict(state)
    make(ratios=(1, 2), sizes=(12, 20)).load_state_dict(state)  # the same mix: fine
    for _ in it:
        pass
    ended = saved.state_dict()
    assert ended["position"] == len(saved)
    with pytest.warns(UserWarning, match="resumes at an epoch's start"):
        other.load_state_dict(ended)
