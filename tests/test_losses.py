"""Lovasz-softmax: equal to a plain per-class reference (values and gradients), exact
handling of ignored points, compiles fullgraph with dynamic N; CE + Lovasz."""
import pytest
import torch
import torch.nn.functional as F

from pimm_fn.models._common import masked_cross_entropy
from pimm_fn.models.losses import cross_entropy_lovasz, lovasz_softmax


def straightforward_lovasz_softmax(logits, target, ignore_index=-1, classes="present"):
    """The loss as the paper describes it: drop ignored points, then for each class sort
    its errors, take the Jaccard-loss increments along that order and dot them."""
    probs = torch.softmax(logits.float(), dim=1)
    keep = target != ignore_index
    probs, target = probs[keep], target[keep]
    picked = range(logits.shape[1]) if classes in ("present", "all") else classes
    losses = []
    for c in picked:
        fg = (target == c).float()
        if classes == "present" and fg.sum() == 0:
            continue
        errors = (fg - probs[:, c]).abs()
        errors_sorted, order = torch.sort(errors, descending=True)
        fg_sorted = fg[order]
        p = len(fg_sorted)
        gts = fg_sorted.sum()
        intersection = gts - fg_sorted.cumsum(0)
        union = gts + (1 - fg_sorted).cumsum(0)
        jaccard = 1.0 - intersection / union
        if p > 1:
            jaccard[1:p] = jaccard[1:p] - jaccard[0:-1].clone()
        losses.append(torch.dot(errors_sorted, jaccard))
    if not losses:
        return logits.sum() * 0.0
    return torch.stack(losses).mean()


def make_case(n, k, seed, ignore_frac=0.0, absent=()):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k, generator=g, dtype=torch.float64) * 2
    present = [c for c in range(k) if c not in absent]
    target = torch.tensor(present)[torch.randint(len(present), (n,), generator=g)]
    ignored = torch.rand(n, generator=g) < ignore_frac
    return logits, torch.where(ignored, torch.full_like(target, -1), target)


CASES = [
    (1, 2, 0, 0.0, ()), (7, 3, 1, 0.0, ()), (50, 5, 2, 0.2, ()), (200, 4, 3, 0.5, (1,)),
    (333, 13, 4, 0.1, (0, 5, 12)), (64, 6, 5, 0.0, (2, 3)), (1000, 20, 6, 0.3, (7,)),
]


@pytest.mark.parametrize("classes", ["present", "all", "first_and_last"])
@pytest.mark.parametrize("n,k,seed,ignore_frac,absent", CASES)
def test_equals_reference_values_and_gradients(n, k, seed, ignore_frac, absent, classes):
    logits, target = make_case(n, k, seed, ignore_frac, absent)
    if classes == "first_and_last":
        classes = [0, k - 1]
    a = logits.float().requires_grad_()
    b = logits.float().requires_grad_()
    ours = lovasz_softmax(a, target, classes=classes)
    ref = straightforward_lovasz_softmax(b, target, classes=classes)
    assert ours.dim() == 0
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), abs=1e-6)
    ours.backward()
    ref.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6), (a.grad - b.grad).abs().max()


def test_ignored_points_are_exactly_dropped():
    logits, target = make_case(300, 5, 7, ignore_frac=0.4)
    keep = target != -1
    full = logits.float().requires_grad_()
    loss = lovasz_softmax(full, target)
    loss.backward()
    dropped = logits.float()[keep].requires_grad_()
    loss_dropped = lovasz_softmax(dropped, target[keep])
    loss_dropped.backward()
    assert float(loss.detach()) == pytest.approx(float(loss_dropped.detach()), abs=1e-7)
    assert torch.equal(full.grad[~keep], torch.zeros_like(full.grad[~keep]))
    assert torch.allclose(full.grad[keep], dropped.grad, atol=1e-7)
    # a custom ignore value works the same way
    relabelled = torch.where(keep, target, torch.full_like(target, 255))
    assert float(lovasz_softmax(logits.float(), relabelled, ignore_index=255)) == pytest.approx(
        float(loss_dropped.detach()), abs=1e-7)


def test_every_point_ignored_gives_zero():
    logits = torch.randn(10, 3, requires_grad=True)
    loss = lovasz_softmax(logits, torch.full((10,), -1))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits.grad))


def test_zero_for_perfect_confident_predictions_positive_otherwise():
    target = torch.tensor([0, 1, 2, 2, 1, 0, 3, 3])
    confident = F.one_hot(target, 4).float() * 1000.0  # softmax gives exact 0 / 1
    assert float(lovasz_softmax(confident, target)) == 0.0
    assert float(lovasz_softmax(confident, target, classes="all")) == 0.0
    assert float(lovasz_softmax(torch.zeros(8, 4), target)) > 0.0
    wrong = F.one_hot((target + 1) % 4, 4).float() * 1000.0
    assert float(lovasz_softmax(wrong, target)) == pytest.approx(1.0)


def test_bad_classes_argument():
    with pytest.raises(ValueError):
        lovasz_softmax(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), classes="some")


def test_compiles_fullgraph_once_for_two_sizes():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lovasz_softmax, backend=counter, fullgraph=True, dynamic=True)
    for n, seed in ((257, 0), (130, 1)):
        logits, target = make_case(n, 5, seed, ignore_frac=0.2, absent=(3,))
        logits = logits.float()
        got = compiled(logits, target)
        assert float(got) == pytest.approx(float(lovasz_softmax(logits, target)), abs=1e-6)
    assert counter.frame_count == 1  # one graph for both sizes: no recompile, no break


def test_cross_entropy_lovasz_combines_both_terms():
    logits, target = make_case(120, 4, 9, ignore_frac=0.25)
    logits = logits.float()
    ce = masked_cross_entropy(logits, target, ignore_index=-1)
    lv = lovasz_softmax(logits, target)
    assert float(cross_entropy_lovasz(logits, target, -1)) == pytest.approx(float(ce + lv), abs=1e-6)
    assert float(cross_entropy_lovasz(logits, target, -1, lovasz_weight=0.5)) == pytest.approx(
        float(ce + 0.5 * lv), abs=1e-6)
    assert float(cross_entropy_lovasz(logits, target, -1, lovasz_weight=0.0)) == pytest.approx(float(ce))
