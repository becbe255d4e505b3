"""Models: Pointcept calling convention, learning signal, gradients, policies, and the
segmentation net compiled fullgraph inside the pure supervised step with varying N."""
import math

import pytest
import torch
import torch.nn.functional as F

from pimm_fn.compile import compile_step
from pimm_fn.models import (
    CategoricalMLPPolicy,
    ImageClassifier,
    MLPClassifier,
    PointLabelPolicy,
    PointSegNet,
    Policy,
    batch_index,
    per_cloud_sum,
    voxel_groups,
)
from pimm_fn.models.point_seg import group_max, group_mean, segment_pool, voxel_segments
from pimm_fn.optim import adamw
from pimm_fn.state import TrainState
from pimm_fn.steps import supervised
from pimm_fn.tree import tree_flatten_with_path

try:
    from pimm_fn.optim import sgd
except ImportError:  # the optim layer is built in parallel; a plain SGD is enough here
    from pimm_fn.optim.base import GradientTransformation
    from pimm_fn.tree import tree_map

    def sgd(lr, momentum=0.0):
        return GradientTransformation(lambda p: (), lambda g, s, p: (tree_map(lambda x: -lr * x, g), s))


VOXEL = 0.05


def shapes_cloud(points_per_cloud, seed=0, num_shapes=12):
    """Clouds of small planes, lines and blobs at random places; label = the shape's kind.

    The features are constant, so only local geometry (the neighbourhood's shape around a
    point) tells the kinds apart: a real learning signal for neighbourhood features.
    """
    g = torch.Generator().manual_seed(seed)
    coords, labels = [], []
    for n in points_per_cloud:
        per = [n // num_shapes + (1 if i < n % num_shapes else 0) for i in range(num_shapes)]
        for i, m in enumerate(per):
            kind = (i + seed) % 3
            centre = torch.rand(3, generator=g) * 3.0
            u = torch.rand(m, 3, generator=g) - 0.5
            if kind == 0:  # plane patch
                u[:, 2] = 0.0
            elif kind == 1:  # line segment
                u[:, 1:] = 0.0
            # kind 2: a filled blob
            coords.append(centre + 0.4 * u)
            labels.append(torch.full((m,), kind, dtype=torch.int64))
    coord = torch.cat(coords)
    n = coord.shape[0]
    return {
        "coord": coord,
        "grid_coord": torch.div(coord, VOXEL, rounding_mode="floor").long(),
        "feat": torch.ones(n, 1),
        "offset": torch.tensor(points_per_cloud).cumsum(0),
        "segment": torch.cat(labels),
    }


def small_net(**kw):
    torch.manual_seed(0)
    return PointSegNet(1, 3, **{"width": 16, "strides": (2, 4), **kw})


# ----------------------------------------------------------------- point segmentation


def test_batch_index_from_offset():
    offset = torch.tensor([3, 3, 7])  # the middle cloud is empty
    assert batch_index(offset, 7).tolist() == [0, 0, 0, 2, 2, 2, 2]


def test_voxel_groups_partition_points_like_unique_per_cloud():
    g = torch.Generator().manual_seed(1)
    grid = torch.randint(-20, 20, (500, 3), generator=g)
    batch = torch.cat([torch.zeros(250, dtype=torch.int64), torch.ones(250, dtype=torch.int64)])
    grid[250:] = grid[:250]  # same voxels in both clouds must still be different groups
    group = voxel_groups(grid, batch, 4)
    key = torch.cat([batch[:, None], torch.div(grid, 4, rounding_mode="floor")], 1)
    _, expected = torch.unique(key, dim=0, return_inverse=True)
    assert group.min() >= 0 and group.max() < 500
    # Same partition: the two labellings are a bijection of each other.
    pairs = torch.unique(torch.stack([group, expected], 1), dim=0)
    assert len(pairs) == len(torch.unique(group)) == len(torch.unique(expected))
    assert not set(group[:250].tolist()) & set(group[250:].tolist())


def test_seg_net_train_and_eval_outputs():
    net = small_net()
    batch = shapes_cloud([300, 200])
    out = net(batch)
    assert set(out) == {"loss", "acc", "seg_logits"}
    assert out["seg_logits"].shape == (500, 3) and out["loss"].shape == () and out["acc"].shape == ()
    net.eval()
    eval_batch = {k: v for k, v in batch.items() if k != "segment"}
    out = net(eval_batch)
    assert set(out) == {"seg_logits"} and out["seg_logits"].shape == (500, 3)


def test_seg_net_ignores_label_minus_one_and_weights_classes():
    net = small_net(class_weights=[1.0, 2.0, 0.5])
    batch = shapes_cloud([300, 200])
    seg = batch["segment"].clone()
    seg[::3] = -1
    out = net({**batch, "segment": seg})
    ref = F.cross_entropy(out["seg_logits"], seg, weight=torch.tensor([1.0, 2.0, 0.5]), ignore_index=-1)
    torch.testing.assert_close(out["loss"], ref)
    valid = seg != -1
    acc = (out["seg_logits"].argmax(1)[valid] == seg[valid]).float().mean()
    torch.testing.assert_close(out["acc"], acc)
    # A batch with every point ignored gives a finite zero loss.
    out_all_ignored = net({**batch, "segment": torch.full_like(seg, -1)})
    assert out_all_ignored["loss"].item() == 0.0  # not NaN: an unlabelled crop cannot poison a run


def test_seg_net_gradients_reach_every_parameter():
    net = small_net(strides=(2, 4, 8))
    net(shapes_cloud([300, 200]))["loss"].backward()
    dead = [n for n, p in net.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead, f"no gradient reaches {dead}"


def test_seg_net_rejects_wrong_feature_width():
    net = small_net()
    batch = shapes_cloud([100])
    with pytest.raises(ValueError, match="in_channels=1"):
        net({**batch, "feat": torch.ones(100, 4)})


def test_seg_net_learns_local_geometry_in_eager_steps():
    net = small_net()
    batch = shapes_cloud([600, 600], seed=3)
    state = TrainState.create(net, sgd(0.1, momentum=0.9))
    step = supervised()
    losses, accs = [], []
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        accs.append(float(metrics["acc"]))
    assert losses[-1] < 0.5 * losses[0], losses
    assert accs[-1] > 0.8, accs
    assert all(math.isfinite(loss) for loss in losses)


@pytest.fixture(scope="module")
def compiled_run():
    """Six compiled steps on point batches of six different sizes (all > 4096 points: see below)."""
    net = small_net(width=8)
    state = TrainState.create(net, sgd(0.05))
    # dynamic=True marks the point dimension dynamic from the first call: one compile.
    # (The default, dynamic=None, compiles a static graph first and a dynamic one on the
    # first new size: 2 compiles, twice the cold compile time of this test.)
    step = compile_step(supervised(), dynamic=True)
    # Inductor's CPU codegen guards reductions on N <= 4096, so a run that crosses 4096
    # points recompiles once more; real point batches (24k-40k) sit on one side of it.
    sizes = [(2600, 2500), (2900, 2300), (3100, 3000), (2400, 2450), (4000, 1500), (2700, 2800)]
    eager_state, eager_metrics = supervised()(state, shapes_cloud(list(sizes[0]), seed=0))
    metrics = []
    for i, size in enumerate(sizes):
        state, m = step(state, shapes_cloud(list(size), seed=i))
        metrics.append(m)
    return step, state, metrics, eager_state, eager_metrics


def test_seg_net_compiles_fullgraph_with_variable_point_counts(compiled_run):
    step, state, metrics, _, _ = compiled_run
    assert step.compile_count <= 2, step.recompile_reasons
    assert int(state.step) == 6
    assert all(torch.isfinite(m["loss"]) and m["skipped"] == 0 for m in metrics)
    assert {"loss", "acc", "grad_norm", "avg_pts"} <= set(metrics[0])


def test_compiled_seg_step_matches_eager(compiled_run):
    _, _, metrics, eager_state, eager_metrics = compiled_run
    torch.testing.assert_close(metrics[0]["loss"], eager_metrics["loss"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(metrics[0]["grad_norm"], eager_metrics["grad_norm"], rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------- deterministic mode


def test_segment_pool_equals_scatter_pooling_values_and_gradients():
    batch = shapes_cloud([700, 500], seed=2)
    points = batch_index(batch["offset"], 1200)
    seg = voxel_segments(batch["grid_coord"], points, 2)
    group = voxel_groups(batch["grid_coord"], points, 2)
    assert torch.equal(seg.group, group)
    assert torch.equal(seg.lengths, torch.bincount(group, minlength=1200))
    assert torch.equal(group[seg.perm], torch.sort(group).values)  # perm lists the segments in order
    g = torch.Generator().manual_seed(0)
    # Rounded values: ties inside a voxel, where max pooling splits the gradient. None is 0:
    # scatter_reduce's backward counts its zero-initialised table as one more tie there.
    x = ((torch.randn(1200, 5, generator=g) * 2).round() + 0.5).requires_grad_(True)
    w = torch.randn(1200, 5, generator=g)
    for reduce, scatter_pool in (("mean", group_mean), ("max", group_max)):
        out = segment_pool(x, seg, reduce)
        ref = scatter_pool(x, group)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        grad, = torch.autograd.grad((out * w).sum(), x)
        ref_grad, = torch.autograd.grad((ref * w).sum(), x)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="reduce"):
        segment_pool(x, seg, "sum")
    # same parameters in both modes: a checkpoint of one loads into the other
    assert small_net().state_dict().keys() == small_net(deterministic=True).state_dict().keys()


DET_SIZES = [(2600, 2500), (2900, 2300), (3100, 3000), (2400, 2450)]  # all > 4096: see compiled_run


def _train(step, deterministic, threads=2):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        state = TrainState.create(small_net(deterministic=deterministic), adamw(1e-2))
        metrics = []
        for i, size in enumerate(DET_SIZES):
            state, m = step(state, shapes_cloud(list(size), seed=i))
            metrics.append(m)
        return state, metrics
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def deterministic_runs():
    """Two identical runs of the compiled deterministic step on 2 threads (one compile)."""
    step = compile_step(supervised(clip_grad=1.0), dynamic=True)
    first = _train(step, True)
    second = _train(step, True)
    return step, first, second


def _tensors(state):
    return tree_flatten_with_path((state.params, state.buffers, state.opt_state))


def test_deterministic_seg_step_is_bitwise_repeatable_on_two_threads(deterministic_runs):
    step, (a, ma), (b, mb) = deterministic_runs
    assert step.compile_count <= 2, step.recompile_reasons  # fullgraph, dynamic point count
    assert int(a.step) == len(DET_SIZES) and all(float(m["skipped"]) == 0 for m in ma)
    paths, leaves_a, _ = _tensors(a)
    _, leaves_b, _ = _tensors(b)
    for path, x, y in zip(paths, leaves_a, leaves_b):
        assert torch.equal(x, y), f"{path} differs between two identical deterministic runs"
    for x, y in zip(ma, mb):
        assert all(torch.equal(x[k], y[k]) for k in x)
    # the runs trained (the check above is not vacuous)
    assert not torch.equal(a.params["head.1.weight"], small_net().head[1].weight)


def test_deterministic_seg_step_follows_the_default_step():
    """Eager, 1 thread: the deterministic mode computes the same step up to float rounding."""
    runs = [_train(supervised(clip_grad=1.0), det, threads=1) for det in (False, True)]
    (ref, ref_m), (det, det_m) = runs
    for x, y in zip(ref_m, det_m):
        torch.testing.assert_close(x["loss"], y["loss"], rtol=1e-5, atol=1e-6)
    for k in ref.params:
        torch.testing.assert_close(ref.params[k], det.params[k], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------- image / MLP classifiers


def test_image_classifier_outputs_and_learns():
    torch.manual_seed(0)
    net = ImageClassifier(3, 4, width=8)
    g = torch.Generator().manual_seed(0)
    label = torch.arange(16) % 4
    # Class = which quadrant is bright: learnable by a conv net, not by chance.
    image = torch.rand(16, 3, 16, 16, generator=g) * 0.1
    for i, c in enumerate(label.tolist()):
        image[i, :, (c // 2) * 8:(c // 2) * 8 + 8, (c % 2) * 8:(c % 2) * 8 + 8] += 1.0
    out = net({"image": image, "label": label})
    assert set(out) == {"loss", "acc", "cls_logits"} and out["cls_logits"].shape == (16, 4)
    assert set(net.eval()({"image": image})) == {"cls_logits"}
    net.train()
    net({"image": image, "label": label})["loss"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    state = TrainState.create(net, sgd(0.1, momentum=0.9))
    step = supervised()
    first = None
    for _ in range(15):
        state, m = step(state, {"image": image, "label": label})
        first = first if first is not None else float(m["loss"])
    assert float(m["loss"]) < 0.5 * first
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        net({"image": torch.zeros(2, 1, 8, 8)})


def test_mlp_classifier_matches_cross_entropy_and_learns():
    torch.manual_seed(0)
    net = MLPClassifier(5, 3, hidden=(16,))
    x = torch.randn(64, 5)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    out = net({"x": x, "y": y})
    torch.testing.assert_close(out["loss"], F.cross_entropy(out["cls_logits"], y))
    assert set(net({"x": x})) == {"cls_logits"}
    state = TrainState.create(net, sgd(0.5))
    step = supervised()
    state, m0 = step(state, {"x": x, "y": y})
    for _ in range(30):
        state, m = step(state, {"x": x, "y": y})
    assert float(m["loss"]) < float(m0["loss"]) and float(m["acc"]) > 0.8
    # one hidden width may be given as a number (as CategoricalMLPPolicy takes it)
    assert repr(MLPClassifier(5, 3, 16)) == repr(MLPClassifier(5, 3, hidden=(16,)))


# ----------------------------------------------------------------- policies


def test_point_label_policy_log_probs_and_sampling():
    torch.manual_seed(0)
    policy = PointLabelPolicy(1, 3, width=16, strides=(2, 4))
    assert isinstance(policy, Policy)
    # Same parameter names as the segmentation net: a supervised checkpoint loads as is.
    policy.load_state_dict(small_net().state_dict())
    batch = shapes_cloud([200, 100])
    logp = policy.log_probs(batch)
    assert logp.shape == (300, 3)
    torch.testing.assert_close(logp.exp().sum(1), torch.ones(300))
    torch.manual_seed(1)
    actions = policy.sample(batch)
    assert actions.shape == (300,) and actions.dtype == torch.int64 and 0 <= actions.min() and actions.max() < 3
    assert torch.equal(policy.sample(batch, greedy=True), logp.argmax(1))
    out = policy({**batch, "action": actions})
    assert {"logits", "log_probs", "action_log_prob", "seg_logits", "loss", "acc"} <= set(out)
    torch.testing.assert_close(out["action_log_prob"], logp.gather(1, actions[:, None]).squeeze(1))
    torch.testing.assert_close(policy.log_prob(batch, actions), out["action_log_prob"])
    per_cloud = per_cloud_sum(out["action_log_prob"], batch["offset"])
    torch.testing.assert_close(per_cloud, torch.stack([out["action_log_prob"][:200].sum(),
                                                       out["action_log_prob"][200:].sum()]))
    # The labelling's log-probability is differentiable in every parameter.
    per_cloud.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


def test_categorical_mlp_policy_samples_its_distribution_and_improves():
    torch.manual_seed(0)
    policy = CategoricalMLPPolicy(4, 2, hidden=32)
    assert isinstance(policy, Policy)
    obs = torch.randn(4000, 4)
    probs = policy.log_probs(obs).exp()
    assert (probs - 0.5).abs().max() < 0.05  # starts near uniform: every action explored
    torch.manual_seed(0)
    actions = policy.sample(obs)
    assert abs(actions.float().mean().item() - probs[:, 1].mean().item()) < 0.03
    out = policy({"obs": obs, "action": actions})
    assert set(out) == {"logits", "log_probs", "action_log_prob"}
    torch.testing.assert_close(out["action_log_prob"], policy.log_prob(obs, actions))
    # REINFORCE with reward = (action == 1) raises the probability of action 1.
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    for _ in range(20):
        a = policy.sample(obs)
        reward = (a == 1).float()
        loss = -((reward - reward.mean()) * policy.log_prob(obs, a)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert policy.log_probs(obs).exp()[:, 1].mean() > 0.8
    with pytest.raises(ValueError, match=r"\[\.\.\., 4\]"):
        policy.log_probs(torch.zeros(3, 5))


def test_image_classifier_channels_last_is_a_layout_not_a_model():
    """channels_last (the default, for the compiled step's speed) changes only rounding."""
    torch.manual_seed(0)
    cl = ImageClassifier(3, 5, width=8, depth=3)
    nchw = ImageClassifier(3, 5, width=8, depth=3, channels_last=False)
    nchw.load_state_dict(cl.state_dict())
    batch = {"image": torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(1)),
             "label": torch.tensor([0, 1, 2, 3])}
    a, b = cl(batch), nchw(batch)
    torch.testing.assert_close(a["cls_logits"], b["cls_logits"], rtol=1e-4, atol=1e-5)
    a["loss"].backward(), b["loss"].backward()
    for (name, p), q in zip(cl.named_parameters(), nchw.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_float_labels_are_named_not_failed_inside_gather():
    from pimm_fn.models import MLPClassifier

    model = MLPClassifier(4, 3, hidden=8)
    with pytest.raises(TypeError, match=r"batch\['y'\] holds torch.float32 values; class labels are integers"):
        model({"x": torch.randn(5, 4), "y": torch.rand(5)})


def test_a_compiled_cnn_step_compiles_once_and_keeps_its_weights_layout():
    # Inductor hands conv weights (and their moments) back channels-last; fed in again so,
    # they failed the step's stride guards and the step compiled a second time.
    torch.manual_seed(0)
    state = TrainState.create(ImageClassifier(3, 4, width=8, depth=2), adamw(1e-3))
    step = compile_step(supervised(clip_grad=1.0), cache=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = {"image": torch.randn(4, 3, 8, 8, generator=g), "label": torch.randint(0, 4, (4,), generator=g)}
        new, _ = step(state, batch)
        assert all(new.params[k].stride() == v.stride() for k, v in state.params.items())
        state = new
    assert step.compile_count == 1, step.recompile_reasons
