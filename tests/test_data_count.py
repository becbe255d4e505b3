"""count_batch: the one rule for samples and points in a batch."""
import pytest
import torch

from pimm_fn.data import BatchCount, count_batch


def test_point_batch_counts_clouds_and_points():
    batch = {"coord": torch.zeros(100, 3), "feat": torch.zeros(100, 6), "offset": torch.tensor([40, 100])}
    assert count_batch(batch) == BatchCount(2, 100)
    assert count_batch({"offset": torch.tensor([3, 9])}) == (2, None)  # no coord: points unknown


def test_image_and_tensor_batches():
    assert count_batch({"label": torch.zeros(7), "image": torch.zeros(5, 3, 2, 2)}) == (5, None)
    assert count_batch({"x": torch.zeros(7, 1), "y": torch.zeros(7)}) == (7, None)
    assert count_batch({"t": torch.tensor(0.5), "x": torch.zeros(4, 2)}).samples == 4  # 0-dim skipped
    assert count_batch(torch.zeros(6, 2)) == (6, None)
    assert count_batch((torch.zeros(5, 2), torch.zeros(5))).samples == 5  # an (x, y) pair
    assert count_batch({"prompts": ["a", "b", "c"]}).samples == 3


def test_micro_batches_are_summed():
    pb = {"coord": torch.zeros(30, 3), "offset": torch.tensor([10, 30])}
    assert count_batch([pb, pb]) == (4, 60)
    assert count_batch([{"x": torch.zeros(3, 1)}, {"x": torch.zeros(5, 1)}]) == (8, None)


def test_uncountable_batch_names_the_fix():
    with pytest.raises(TypeError, match="samples_in"):
        count_batch(3)
    with pytest.raises(TypeError, match="count_fn"):
        count_batch({"name": "x", "n": 3})


def test_counts_inside_a_compiled_function():
    @torch.compile(fullgraph=True, backend="eager")
    def f(batch):
        return batch["coord"].sum() * count_batch(batch).samples

    batch = {"coord": torch.ones(10, 3), "offset": torch.tensor([4, 10])}
    assert float(f(batch)) == 60.0
