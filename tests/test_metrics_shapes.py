"""Predictions in shapes a segmentation metric must not misread (each scored silently wrong before)."""
import pytest
import torch

from pimm_fn.metrics import Accuracy, SegmentationMetric, accuracy_counts, intersection_and_union

TARGET = torch.tensor([0, 1, 2, 1, 0, 2, 2, 1])


def test_labels_with_a_trailing_one_are_labels_not_one_class_logits():
    labels = TARGET.unsqueeze(-1)  # argmax(-1, keepdim=True)
    assert [int(x) for x in accuracy_counts(labels, TARGET)] == [8, 8]
    inter, union, _ = intersection_and_union(labels, TARGET, 3)
    assert torch.equal(inter, union)
    metric = SegmentationMetric(3)
    stats = metric.update(metric.init(), {"pred": labels, "target": TARGET})
    assert metric.compute(metric.reduce(stats))["mIoU"] == pytest.approx(1.0)
    acc = Accuracy()
    assert acc.compute(acc.reduce(acc.update(acc.init(), {"pred": labels, "target": TARGET})))["acc"] == 1.0


def test_logits_and_labels_still_score_and_other_shapes_are_named():
    logits = torch.nn.functional.one_hot(TARGET, 3).float()
    assert [int(x) for x in accuracy_counts(logits, TARGET)] == [8, 8]
    with pytest.raises(ValueError, match=r"pred has shape \(2, 3, 4\) and target \(2, 4\)"):
        accuracy_counts(torch.randn(2, 3, 4), TARGET.reshape(2, 4))  # the class dim not last
    with pytest.raises(ValueError, match="pred has shape"):
        intersection_and_union(torch.randn(8, 1), TARGET, 3)  # one float per point: not logits of 3 classes


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_classes=0), ValueError, "num_classes"), (dict(num_classes=2.5), TypeError, "num_classes"),
    (dict(num_classes=3, names=["ground", "veg"]), ValueError, "2 names for 3 classes"),
    (dict(num_classes=3, classes=[]), ValueError, "at least one"),
    (dict(num_classes=3, classes=[1, 1]), ValueError, "at most once"),
])
def test_segmentation_metric_names_bad_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        SegmentationMetric(**kwargs)
