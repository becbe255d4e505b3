"""Sampler order vs DistributedSampler, loader protocol, exact mid-epoch resume, iterable data."""
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from pimm_fn.data import (
    EpochLoader,
    SyntheticScenes,
    SyntheticStream,
    build_eval_loader,
    build_train_loader,
    epoch_order,
    image_collate,
)
from pimm_fn.data import transforms as T
from pimm_fn.state import Cursor


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n", [1, 3, 10, 13])
def test_order_equals_distributed_sampler(world_size, drop_last, n):
    data = list(range(n))
    for epoch in (0, 3):
        for rank in range(world_size):
            ref = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=11, drop_last=drop_last)
            ref.set_epoch(epoch)
            ours = epoch_order(n, seed=11, epoch=epoch, rank=rank, world_size=world_size,
                               drop_last=drop_last)
            assert ours == list(ref), (rank, epoch)
    unshuffled = DistributedSampler(data, num_replicas=world_size, rank=world_size - 1, shuffle=False,
                                    drop_last=drop_last)
    assert epoch_order(n, seed=0, epoch=0, rank=world_size - 1, world_size=world_size, shuffle=False,
                       drop_last=drop_last) == list(unshuffled)


AUG = T.compose(T.random_rotate(), T.random_scale((0.8, 1.2)), T.random_jitter(0.01),
                T.grid_sample(0.05), T.assemble_feat(("coord", "color")))


def make_loader(num_workers, mix_prob=0.5, seed=3):
    ds = SyntheticScenes(22, seed=1, points=(200, 400))
    return build_train_loader(ds, batch_size=3, seed=seed, transform=AUG, mix_prob=mix_prob,
                              num_workers=num_workers, world_size=2, rank=1)


def assert_batches_equal(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


def test_loader_protocol_and_lengths():
    loader = make_loader(0)
    # 22 samples, global batch 6 < 22 -> drop_last; 11 per rank -> 3 full batches
    assert (len(loader), loader.batch_size, loader.world_size) == (3, 3, 2)
    batches = list(loader.iter_epoch(0, 0))
    assert len(batches) == 3
    assert all(loader.samples_in(b) == int(b["offset"].numel()) for b in batches)
    assert sum(loader.samples_in(b) for b in batches) <= 9  # Mix3D halves some batches
    # the loader yields exactly the indices of the pure order (names carry the index)
    plain = build_train_loader(SyntheticScenes(22, seed=1, points=(200, 400)), batch_size=3, seed=3,
                               world_size=2, rank=1)
    names = [n for b in plain.iter_epoch(2, 0) for n in b["name"]]
    order = epoch_order(22, seed=3, epoch=2, rank=1, world_size=2, drop_last=True)[:9]
    assert names == [f"synthetic/{i}" for i in order]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(workers):
    full = list(make_loader(0).iter_epoch(1, 0))  # the uninterrupted reference, no workers
    cursor = Cursor(epoch=1, position=2, seed=3)
    resumed_loader = make_loader(workers, seed=cursor.seed)
    rest = list(resumed_loader.iter_epoch(cursor.epoch, cursor.position))
    assert_batches_equal(rest, full[2:])
    # and the next epoch from 0 is the same as uninterrupted too: no state carried over
    assert_batches_equal(list(resumed_loader.iter_epoch(2, 0)), list(make_loader(0).iter_epoch(2, 0)))


def test_resuming_with_a_loader_that_holds_other_samples_is_refused():
    first = make_loader(0)
    it = first.iter_epoch(1, 0)
    next(it), next(it)
    mid = first.state_dict()
    assert (mid["batch_size"], mid["seed"], mid["batches"]) == (3, 3, 3)
    make_loader(0).load_state_dict(mid)  # the same loader: fine
    with pytest.raises(ValueError, match=r"had seed=3 \(now 4\); the run stopped after batch 2 of epoch 1"):
        make_loader(0, seed=4).load_state_dict(mid)
    other_batch = build_train_loader(SyntheticScenes(22, seed=1, points=(200, 400)), batch_size=2, seed=3,
                                     world_size=2, rank=1)
    with pytest.raises(ValueError, match=r"had batch_size=3 \(now 2\), batches=3 \(now 5\)"):
        other_batch.load_state_dict(mid)
    # At an epoch's end another seed is a choice, not a mistake: said, not refused.
    with pytest.warns(UserWarning, match="resumes at an epoch's start and draws other batches"):
        make_loader(0, seed=4).load_state_dict(dict(mid, epoch=2, position=0))
    with pytest.warns(UserWarning, match="resumes at an epoch's start"):
        make_loader(0, seed=4).load_state_dict(dict(mid, position=3))  # the epoch's last batch done


def test_epochs_differ_and_augmentation_is_keyed_by_epoch():
    loader = make_loader(0, mix_prob=0.0)
    e0, e1 = list(loader.iter_epoch(0, 0)), list(loader.iter_epoch(1, 0))
    assert [b["name"] for b in e0] != [b["name"] for b in e1]
    again = list(loader.iter_epoch(0, 0))
    assert_batches_equal(e0, again)


def test_empty_dataset_names_it():
    with pytest.raises(ValueError, match=r"data set 'empty_scenes' is empty"):
        build_train_loader(SyntheticScenes(0, name="empty_scenes"), batch_size=2)
    with pytest.raises(ValueError, match=r"'empty_scenes' is empty"):
        build_eval_loader(SyntheticScenes(0, name="empty_scenes"), batch_size=2)


def test_drop_last_follows_global_batch():
    small = build_train_loader(SyntheticScenes(5), batch_size=4, world_size=2)
    assert not small.drop_last and len(small) == 1  # 5 <= 8: keep the partial batch
    big = build_train_loader(SyntheticScenes(9), batch_size=4, world_size=2)
    assert big.drop_last and len(big) == 1  # 9 > 8: 4 per rank after truncation
    with pytest.raises(ValueError, match="fewer than one batch"):
        EpochLoader(SyntheticScenes(3), batch_size=4, drop_last=True)


def test_eval_loader_is_distributed_and_unshuffled():
    ds = SyntheticScenes(7)
    parts = [list(build_eval_loader(ds, batch_size=2, rank=r, world_size=2)) for r in range(2)]
    names = [[n for b in p for n in b["name"]] for p in parts]
    assert names[0] == [f"synthetic/{i}" for i in (0, 2, 4, 6)]
    assert names[1] == [f"synthetic/{i}" for i in (1, 3, 5, 0)]  # padded by repetition
    assert len(build_eval_loader(ds, batch_size=2)) == 4


def test_image_batches_count_leading_dim():
    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"image": torch.full((1, 4, 4), float(i)), "label": torch.tensor(i % 3)}

    loader = build_train_loader(Images(), batch_size=4, seed=0, collate_fn=image_collate)
    b = next(iter(loader.iter_epoch(0, 0)))
    assert b["image"].shape == (4, 1, 4, 4) and loader.samples_in(b) == 4


# ----------------------------------------------------------------- iterable / streaming


def test_iterable_epoch_length_rules():
    stream = SyntheticStream(40, world_size=2)
    assert len(build_train_loader(stream, batch_size=3, world_size=2)) == 40 // 2 // 3
    assert len(build_train_loader(stream, batch_size=3, world_size=2, iters_per_epoch=4)) == 4

    class NoLength(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(ValueError, match="needs iters_per_epoch=... or a num_samples"):
        build_train_loader(NoLength(), batch_size=2)
    with pytest.raises(ValueError, match=r"no full batch per epoch"):
        build_train_loader(SyntheticStream(5, world_size=2), batch_size=4, world_size=2)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_cut_drop_last_and_resume(workers):
    def loader():
        return build_train_loader(SyntheticStream(48, seed=2), batch_size=4, num_workers=workers,
                                  iters_per_epoch=5)

    full = list(loader().iter_epoch(1, 0))
    assert len(full) == 5  # cut at iters_per_epoch although the stream has 12 batches
    assert all(b["offset"].numel() == 4 for b in full)
    # resume without saved state: set_epoch + skip
    assert_batches_equal(list(loader().iter_epoch(1, 3)), full[3:])
    # resume from the saved worker state
    first = loader()
    it = first.iter_epoch(1, 0)
    head = [next(it), next(it)]
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    second = loader()
    second.load_state_dict(state)
    assert_batches_equal(head + list(second.iter_epoch(1, 2)), full)


@pytest.mark.parametrize("bad, error, match", [
    ({"batch_size": 2.7}, TypeError, "batch_size must be an int, got 2.7"),
    ({"batch_size": True}, TypeError, "batch_size must be an int"),
    ({"seed": 1.9}, TypeError, "seed must be an int"),
    ({"seed": None}, TypeError, "seed must be an int"),
    ({"seed": 2**64}, ValueError, r"seed must be in \[0, 9223372036854775808\)"),
    ({"rank": 2, "world_size": 2}, ValueError, r"rank must be in \[0, 2\), got 2 \(the rank counts from 0"),
    ({"iters_per_epoch": 0}, ValueError, "iters_per_epoch must be >= 1, got 0"),
    ({"iters_per_epoch": -3}, ValueError, "iters_per_epoch must be >= 1"),
    ({"shuffle": False}, TypeError, "build_train_loader sets shuffle itself.*build_eval_loader"),
    ({"sampler": []}, TypeError, "sets sampler itself"),
])
def test_loader_arguments_that_would_be_truncated_or_fail_late_are_refused(bad, error, match):
    data = SyntheticScenes(num_scenes=8, seed=0, points=(50, 60))
    with pytest.raises(error, match=match):
        build_train_loader(data, **{"batch_size": 2, **bad})


@pytest.mark.parametrize("n, batch, workers, cap", [(64, 8, 2, None), (60, 8, 2, None), (8, 2, 0, 100), (64, 8, 2, 3)])
def test_a_stream_counts_the_batches_its_workers_make(n, batch, workers, cap):
    # Each worker drops its own partial last batch: a length over what the epoch yields ends
    # every epoch early and leaves a schedule sized by len(loader) unfinished.
    loader = build_train_loader(SyntheticStream(n, points=(20, 30)), batch_size=batch, num_workers=workers,
                                iters_per_epoch=cap)
    assert len(loader) == sum(1 for _ in loader.iter_epoch(0, 0))


def test_a_stream_sharded_for_another_rank_is_refused():
    with pytest.raises(ValueError, match="shards itself with rank=0 but the loader was built with rank=1"):
        build_train_loader(SyntheticStream(64), batch_size=4, rank=1, world_size=2)


def test_a_mid_epoch_state_from_another_world_size_is_refused_even_with_the_same_epoch_length():
    data = SyntheticScenes(num_scenes=16, seed=0, points=(20, 30))
    two = build_train_loader(data, batch_size=2, world_size=2, rank=0, iters_per_epoch=3)
    it = two.iter_epoch(0, 0)
    next(it), next(it)
    state = two.state_dict()
    one = build_train_loader(data, batch_size=2, iters_per_epoch=3)  # 3 batches an epoch too
    assert len(one) == len(two) and 0 < state["position"] < len(two)
    with pytest.raises(ValueError, match=r"world_size=2 \(now 1\).*reshard_cursor"):
        one.load_state_dict(state)
