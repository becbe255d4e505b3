"""Tests for pimm_fn.rl: advantages, clipped surrogate, KL, metric rules, micro-batching."""
import math

import pytest
import torch

from pimm_fn import rl

# --------------------------------------------------------------------------- helpers

D, A, T = 3, 4, 5  # feature dim, actions, max steps


def _rollout(n, seed=0):
    """A tiny rollout: features [n, T, D], actions [n, T], a padding mask [n, T]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, D, generator=g, dtype=torch.float64)
    actions = torch.randint(0, A, (n, T), generator=g)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    lengths[0] = 0  # one empty trajectory: must contribute nothing and not NaN
    mask = torch.arange(T).view(1, T) < lengths.view(n, 1)
    return x, actions, mask


def _logp(w, x, actions):
    """Linear policy with log-softmax: log pi(a_t | x_t)."""
    logits = x @ w
    return torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------- advantages

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 5.0]], dtype=torch.float64)


def test_grpo_advantages_hand_computed():
    # group 0: mean 0.5, population std 0.5; group 1: mean 2.75, population std
    # sqrt(6.75 / 4) = 1.299038..., Bessel std sqrt(6.75 / 3) = 1.5.
    eps = 1e-6
    s1 = math.sqrt(6.75 / 4)
    expected = torch.tensor(
        [[0.5 / (0.5 + eps), -0.5 / (0.5 + eps), -0.5 / (0.5 + eps), 0.5 / (0.5 + eps)],
         [-0.75 / (s1 + eps), -0.75 / (s1 + eps), -0.75 / (s1 + eps), 2.25 / (s1 + eps)]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(rl.grpo_advantages(REWARDS, eps=eps), expected)

    s0u = math.sqrt(1 / 3)  # Bessel std of [1, 0, 0, 1]
    expected_u = torch.tensor(
        [[0.5 / (s0u + eps), -0.5 / (s0u + eps), -0.5 / (s0u + eps), 0.5 / (s0u + eps)],
         [-0.75 / (1.5 + eps), -0.75 / (1.5 + eps), -0.75 / (1.5 + eps), 2.25 / (1.5 + eps)]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(rl.grpo_advantages(REWARDS, eps=eps, unbiased=True), expected_u)


def test_dr_grpo_and_batch_scaling_hand_computed():
    dr = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.75, -0.75, -0.75, 2.25]], dtype=torch.float64)
    torch.testing.assert_close(rl.grpo_advantages(REWARDS, scale=False), dr)
    # batch: all 8 rewards [1,0,0,1,2,2,2,5], mean 13/8, sum of squares 39 ->
    # population var 39/8 - (13/8)^2 = 143/64; the mean stays per group.
    sb = math.sqrt(143 / 64)
    torch.testing.assert_close(
        rl.grpo_advantages(REWARDS, eps=0.0, scale_by="batch"), dr / sb
    )


def test_rloo_advantages_hand_computed():
    # r_i minus the mean of the other three: group 0 -> 1 - 1/3, 0 - 2/3, ...;
    # group 1 -> 2 - 3 = -1 (others 2, 2, 5), 5 - 2 = 3.
    expected = torch.tensor(
        [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [-1.0, -1.0, -1.0, 3.0]], dtype=torch.float64
    )
    torch.testing.assert_close(rl.rloo_advantages(REWARDS), expected)


def test_equal_rewards_give_zero_advantage():
    r = torch.full((2, 3), 0.7)
    assert torch.equal(rl.grpo_advantages(r), torch.zeros(2, 3))
    assert torch.equal(rl.rloo_advantages(r), torch.zeros(2, 3))


def test_step_advantages_hand_computed():
    # One event, two trajectories, T=3; trajectory 1 has 2 steps (last is padding).
    r = torch.tensor([[[1.0, 0.0, 2.0], [0.0, 1.0, 9.0]]], dtype=torch.float64)
    m = torch.tensor([[[1, 1, 1], [1, 1, 0]]], dtype=torch.bool)
    # gamma 0.5: returns-to-go traj0 [1 + 0 + 0.5, 0 + 1, 2] = [1.5, 1, 2], traj1 [0.5, 1].
    # Valid returns [1.5, 1, 2, 0.5, 1]: mean 1.2, population var (0.09+0.04+0.64+0.49+0.04)/5 = 0.26.
    out = rl.step_advantages(r, m, gamma=0.5, eps=0.0)
    s = math.sqrt(0.26)
    expected = torch.tensor(
        [[[0.3 / s, -0.2 / s, 0.8 / s], [-0.7 / s, -0.2 / s, 0.0]]], dtype=torch.float64
    )
    torch.testing.assert_close(out, expected)
    # Unscaled and undiscounted: returns [3, 2, 2, 1, 1], mean 1.8.
    out = rl.step_advantages(r, m, gamma=1.0, scale=False)
    expected = torch.tensor([[[1.2, 0.2, 0.2], [-0.8, -0.8, 0.0]]], dtype=torch.float64)
    torch.testing.assert_close(out, expected)
    # Rewards-first (process supervision): valid rewards [1, 0, 2, 0, 1], mean 0.8,
    # population var (0.04+0.64+1.44+0.64+0.04)/5 = 0.56; returns of normalised rewards.
    out = rl.step_advantages(r, m, gamma=1.0, eps=0.0, normalise="rewards")
    s = math.sqrt(0.56)
    n0, n1 = torch.tensor([0.2, -0.8, 1.2]) / s, torch.tensor([-0.8, 0.2]) / s
    expected = torch.tensor(
        [[[n0.sum(), n0[1:].sum(), n0[2]], [n1.sum(), n1[1], 0.0]]], dtype=torch.float64
    )
    torch.testing.assert_close(out, expected)


# --------------------------------------------------------------------------- bad input


def test_group_of_one_is_rejected():
    with pytest.raises(ValueError, match="G=1.*no group to compare"):
        rl.grpo_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="G=1"):
        rl.rloo_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="G=1"):
        rl.validate_rewards(torch.ones(3, 1))


def test_wrong_shape_rewards_are_rejected():
    with pytest.raises(ValueError, match=r"shape \[B, G\].*\(8,\)"):
        rl.grpo_advantages(torch.ones(8))
    with pytest.raises(ValueError, match=r"\(2, 4\) but the rollout was configured for \(2, 5\)"):
        rl.validate_rewards(torch.ones(2, 4), expected_shape=(2, 5))
    with pytest.raises(ValueError, match=r"\[B, G, T\]"):
        rl.step_advantages(torch.ones(2, 4), torch.ones(2, 4))


def test_nan_rewards_are_rejected_host_side():
    r = torch.ones(2, 4)
    r[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite.*\[\[1, 2\]\]"):
        rl.validate_rewards(r, expected_shape=(2, 4))
    rl.validate_rewards(torch.ones(2, 4), expected_shape=(2, 4))  # good input passes


def test_surrogate_shape_errors():
    with pytest.raises(ValueError, match="advantages must be"):
        rl.clipped_surrogate(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(5))
    with pytest.raises(ValueError, match="level='sequence'"):
        rl.clipped_surrogate(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4, 3), level="sequence")


# --------------------------------------------------------------------------- surrogate


@pytest.mark.parametrize("reduction", ["sequence", "token"])
def test_on_policy_first_update_is_the_policy_gradient(reduction):
    n = 6
    x, actions, mask = _rollout(n)
    adv = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(D, A, dtype=torch.float64, requires_grad=True)
    logp = _logp(w, x, actions)
    loss, metrics = rl.clipped_surrogate(logp, logp.detach(), adv, mask, reduction=reduction)

    assert metrics["rl_clip_frac"] == 0 and metrics["rl_clip_frac_low"] == 0
    assert metrics["rl_clip_frac_high"] == 0
    assert metrics["rl_ratio_geom"] == 1 and metrics["rl_log_ratio"] == 0
    assert metrics["rl_log_ratio_min"] == 0 and metrics["rl_log_ratio_max"] == 0

    adv_t = adv.view(n, 1).expand(n, T)
    # Value: the surrogate at ratio 1 is -mean(A), i.e. the log-likelihood form written
    # with exp(logp - logp.detach()) == 1; -(A * logp).mean() itself has another value
    # (the log-probs) but the same gradient.
    ratio_one = torch.exp(logp - logp.detach())
    torch.testing.assert_close(loss, -rl.masked_mean(adv_t * ratio_one, mask, reduction))
    pg = -rl.masked_mean(adv_t * logp, mask, reduction)
    (g_loss,) = torch.autograd.grad(loss, w, retain_graph=True)
    (g_pg,) = torch.autograd.grad(pg, w)
    torch.testing.assert_close(g_loss, g_pg, atol=1e-12, rtol=0)
    assert g_pg.abs().sum() > 0


def test_clipping_bounds_and_fractions():
    # Four one-step trajectories; ratios 0.5, 0.9, 1.1, 1.5; clip [0.8, 1.3].
    logp_old = torch.zeros(4, 1)
    ratios = torch.tensor([[0.5], [0.9], [1.1], [1.5]])
    logp_new = ratios.log().requires_grad_()
    adv = torch.tensor([-1.0, 1.0, 2.0, 1.0])
    loss, m = rl.clipped_surrogate(logp_new, logp_old, adv, clip_low=0.2, clip_high=0.3)
    # Per-token surrogate min(rA, clip(r)A): [-0.8 (clipped low, A<0), 0.9, 2.2, 1.3 (clipped high)].
    torch.testing.assert_close(loss, -torch.tensor(0.8 * -1 + 0.9 + 2.2 + 1.3) / 4)
    assert m["rl_clip_frac_low"] == 0.25 and m["rl_clip_frac_high"] == 0.25
    assert m["rl_clip_frac"] == 0.5
    torch.testing.assert_close(m["rl_log_ratio_min"], math.log(0.5) * torch.ones(()))
    torch.testing.assert_close(m["rl_log_ratio_max"], math.log(1.5) * torch.ones(()))
    assert m["rl_advantage_abs_max"] == 2.0 and m["count"] == 4
    (g,) = torch.autograd.grad(loss, logp_new)
    # The clipped tokens get no gradient; the others get -r*A/4.
    torch.testing.assert_close(g.view(-1), torch.tensor([0.0, -0.9 / 4, -2.2 / 4, 0.0]))


def test_constant_length_normalisation_hand_computed():
    # Dr. GRPO: each trajectory's summed surrogate over its valid steps / one constant L,
    # then the mean over trajectories; clip bounds [0.8, 1.3].
    logp_old = torch.zeros(2, 3)
    ratios = torch.tensor([[0.5, 1.1, 2.0], [0.9, 1.5, 1.0]])
    logp_new = ratios.log().requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    # per-step min(rA, clip(r)A): row 0 (A=1): 0.5, 1.1, [pad]; row 1 (A=-1): -0.9, -1.5, -1.0.
    # sums: 1.6 and -3.4, whatever the lengths (2 and 3) are.
    loss, m = rl.clipped_surrogate(logp_new, logp_old, adv, mask, clip_low=0.2, clip_high=0.3,
                                   reduction="constant", max_length=10)
    torch.testing.assert_close(loss, torch.tensor(-(1.6 / 10 - 3.4 / 10) / 2))  # 0.09
    assert m["count"] == 2 and m["rl_clip_frac"] == 0  # 2.0 is a pad: not counted as clipped
    torch.testing.assert_close(m["rl_pg_loss"], loss.detach())
    (g,) = torch.autograd.grad(loss, logp_new)
    # d loss / d logp = -r * A / (N * L) on valid unclipped steps, 0 on the pad.
    torch.testing.assert_close(g, torch.tensor([[-0.5, -1.1, 0.0], [0.9, 1.5, 1.0]]) / 20)
    # max_length=None divides by the padded length T = 3; the other reductions differ.
    default, _ = rl.clipped_surrogate(logp_new, logp_old, adv, mask, 0.2, 0.3, reduction="constant")
    torch.testing.assert_close(default, torch.tensor(-(1.6 / 3 - 3.4 / 3) / 2))
    seq, _ = rl.clipped_surrogate(logp_new, logp_old, adv, mask, 0.2, 0.3, reduction="sequence")
    torch.testing.assert_close(seq, torch.tensor(-(1.6 / 2 - 3.4 / 3) / 2))
    torch.testing.assert_close(rl.masked_mean(ratios, mask, "constant", max_length=4),
                               torch.tensor((1.6 / 4 + 3.4 / 4) / 2))
    with pytest.raises(ValueError, match="max_length=10 is the divisor"):
        rl.clipped_surrogate(logp_new, logp_old, adv, mask, reduction="token", max_length=10)
    with pytest.raises(ValueError, match="max_length must be a positive"):
        rl.masked_mean(ratios, mask, "constant", max_length=0)


def test_sequence_level_ratio_is_geometric_mean():
    logp_old = torch.zeros(2, 3)
    logp_new = torch.tensor([[0.1, 0.3, 9.0], [-0.2, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    loss, m = rl.clipped_surrogate(logp_new, logp_old, adv, mask, level="sequence")
    # seq log ratios: mean(0.1, 0.3) = 0.2 (pad ignored), mean(-0.2, 0, 0) = -0.2/3.
    s0, s1 = math.exp(0.2), math.exp(-0.2 / 3)
    torch.testing.assert_close(loss, torch.tensor(-(min(s0, 1.2) * 1 + s1 * -1) / 2))
    torch.testing.assert_close(m["rl_log_ratio_max"], torch.tensor(0.2))
    torch.testing.assert_close(m["rl_ratio_geom"], torch.tensor(math.exp((0.2 - 0.2 / 3) / 2)))


def test_kl_estimators_and_grpo_loss_terms():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    ref = torch.tensor([[-1.5, -2.0], [-0.5, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    d = ref - logp
    k3 = d.exp() - d - 1
    # sequence reduction: mean over trajectories of per-trajectory means of valid steps.
    torch.testing.assert_close(rl.kl_k3(logp, ref, mask), (k3[0].mean() + k3[1, 0]) / 2)
    torch.testing.assert_close(rl.kl_k1(logp, ref, mask, "token"), -(d[0].sum() + d[1, 0]) / 3)
    assert rl.kl_k3(logp, logp) == 0

    adv = torch.tensor([1.0, -1.0])
    base, m0 = rl.grpo_loss(logp, logp, None, adv, mask, kl_coef=0.1)
    assert "rl_kl" not in m0 and m0["rl_kl_loss"] == 0
    off, _ = rl.grpo_loss(logp, logp, ref, adv, mask, kl_coef=0.0)
    assert torch.equal(off, base)  # kl_coef 0: no reference term at all
    with_kl, m1 = rl.grpo_loss(logp, logp, ref, adv, mask, kl_coef=0.1)
    torch.testing.assert_close(with_kl, base + 0.1 * rl.kl_k3(logp, ref, mask))
    torch.testing.assert_close(m1["rl_kl"], rl.kl_k3(logp, ref, mask))
    torch.testing.assert_close(m1["loss"], with_kl)


# --------------------------------------------------------------------------- micro-batching


@pytest.mark.parametrize("level,reduction", [("token", "sequence"), ("token", "token"), ("token", "constant"),
                                             ("sequence", "sequence")])
def test_microbatched_gradient_equals_full_batch(level, reduction):
    b, g = 2, 5
    n = b * g
    x, actions, mask = _rollout(n, seed=3)
    gen = torch.Generator().manual_seed(4)
    w_old = torch.randn(D, A, dtype=torch.float64, generator=gen)
    w_ref = torch.randn(D, A, dtype=torch.float64, generator=gen)
    # Off-policy by a visible margin, so some ratios clip and the min() branch matters.
    w = (w_old + 0.5 * torch.randn(D, A, dtype=torch.float64, generator=gen)).requires_grad_()
    rewards = torch.randn(b, g, dtype=torch.float64, generator=gen)
    adv = rl.grpo_advantages(rewards).reshape(-1)  # on the whole group, before slicing
    with torch.no_grad():
        logp_old, logp_ref = _logp(w_old, x, actions), _logp(w_ref, x, actions)

    def loss_of(s, e):
        loss, metrics = rl.grpo_loss(
            _logp(w, x[s:e], actions[s:e]), logp_old[s:e], logp_ref[s:e], adv[s:e], mask[s:e],
            clip_low=0.2, clip_high=0.28, kl_coef=0.05, level=level, reduction=reduction,
        )
        return loss, metrics

    full_loss, full_metrics = loss_of(0, n)
    assert full_metrics["rl_clip_frac"] > 0  # the test exercises clipping
    (full_grad,) = torch.autograd.grad(full_loss, w)
    counts = mask.sum(-1) if reduction == "token" else None
    for size in (1, 2, 3, 4, 5, 7, 0):
        for group_size in (None, g):
            chunks = rl.microbatch_slices(n, size, group_size=group_size, counts=counts)
            assert chunks[0].start == 0 and chunks[-1].end == n
            assert all(a.end == b_.start for a, b_ in zip(chunks, chunks[1:]))
            if group_size and size:  # never crosses an event boundary
                assert all((c.start // g) == ((c.end - 1) // g) for c in chunks)
            grad = torch.zeros_like(w)
            outs, total = [], 0.0
            for c in chunks:
                loss, metrics = loss_of(c.start, c.end)
                (gc,) = torch.autograd.grad(loss * c.weight, w)
                grad = grad + gc
                total = total + loss.detach() * c.weight
                outs.append((metrics, metrics["count"]))
            torch.testing.assert_close(grad, full_grad, atol=1e-6, rtol=0)
            torch.testing.assert_close(total, full_loss.detach(), atol=1e-6, rtol=0)
            # Combined metrics: means match the full batch, extremes too.
            comb = rl.combine_microbatches(outs)
            for k in ("loss", "rl_pg_loss", "rl_kl", "rl_clip_frac", "rl_log_ratio_min",
                      "rl_log_ratio_max", "rl_advantage_abs_max", "rl_logprob", "count"):
                torch.testing.assert_close(comb[k], full_metrics[k], atol=1e-9, rtol=0)


def test_microbatch_slices_values():
    assert [tuple(c) for c in rl.microbatch_slices(5, 2)] == [(0, 2, 2, 0.4), (2, 4, 2, 0.4), (4, 5, 1, 0.2)]
    assert [(c.start, c.end) for c in rl.microbatch_slices(6, 2, group_size=3)] == [
        (0, 2), (2, 3), (3, 5), (5, 6)]
    assert [(c.start, c.end, c.weight) for c in rl.microbatch_slices(4, 0)] == [(0, 4, 1.0)]
    with pytest.raises(ValueError, match="does not divide"):
        rl.microbatch_slices(5, 2, group_size=2)


# --------------------------------------------------------------------------- metric rules


def test_reduce_op_substring_rules():
    assert rl.reduce_across_ranks_op("rl_log_ratio_min") == "min"
    assert rl.reduce_across_ranks_op("x_min_update0") == "min"
    assert rl.reduce_across_ranks_op("rl_log_ratio_min_mean_update") == "min"
    assert rl.reduce_across_ranks_op("rl_log_ratio_max_last") == "max"
    assert rl.reduce_across_ranks_op("abs_max") == "max"  # no leading underscore needed
    assert rl.reduce_across_ranks_op("a_min_b_max") == "min"  # _min is checked first
    assert rl.reduce_across_ranks_op("rl_kl") == "mean"
    assert rl.reduce_across_ranks_op("minimum") == "mean"  # no underscore: not a min key
    assert rl.reduce_across_ranks_op("count") == "sum"


def test_combine_microbatches_seed_rules():
    t = torch.tensor
    outs = [
        ({"loss": t(1.0), "x_min_update0": t(3.0), "rl_log_ratio_max": t(0.1),
          "rl_advantage_abs_max": t(2.0), "count": t(1.0), "tag": "a"}, 1),
        ({"loss": t(4.0), "x_min_update0": t(-1.0), "rl_log_ratio_max": t(0.7),
          "rl_advantage_abs_max": t(5.0), "count": t(3.0), "tag": "b"}, 3),
    ]
    c = rl.combine_microbatches(outs)
    assert c["loss"] == (1.0 * 1 + 4.0 * 3) / 4  # count-weighted mean
    assert c["x_min_update0"] == -1.0  # substring rule: min
    assert c["rl_log_ratio_max"] == 0.7 and c["rl_advantage_abs_max"] == 5.0
    assert c["count"] == 4.0 and c["tag"] == "a"
    # Tensor counts work the same.
    c2 = rl.combine_microbatches([(m, t(float(k))) for m, k in outs])
    assert c2["loss"] == c["loss"]
    with pytest.raises(ValueError, match="no micro-batch"):
        rl.combine_microbatches([])


def test_combine_updates_seed_rules():
    t = torch.tensor
    ups = [
        {"loss": t(1.0), "rl_kl": t(0.1), "rl_log_ratio_min": t(-0.5), "other": t(7.0)},
        {"loss": t(2.0), "rl_kl": t(0.2), "rl_log_ratio_min": t(-0.1), "other": t(8.0)},
        {"loss": t(6.0), "rl_kl": t(0.6), "rl_log_ratio_min": t(-0.3), "other": t(9.0)},
    ]
    c = rl.combine_updates(ups)
    assert c["loss"] == 3.0  # averaged over updates
    assert c["other"] == 9.0 and c["rl_kl"] == 0.6  # last value by default
    assert c["rl_kl_update0"] == 0.1 and c["rl_kl_last"] == 0.6
    torch.testing.assert_close(c["rl_kl_mean_update"], t(0.3))
    # An rl_*_min key over updates is the last value (seed), not the min of the updates.
    assert c["rl_log_ratio_min"] == -0.3 and c["rl_log_ratio_min_update0"] == -0.5
    assert "other_update0" not in c
    assert set(c) == {"loss", "other", "rl_kl", "rl_log_ratio_min"} | {
        f"{k}_{s}" for k in ("rl_kl", "rl_log_ratio_min") for s in ("update0", "last", "mean_update")}


def test_rollout_metrics():
    m = rl.rollout_metrics(REWARDS)
    torch.testing.assert_close(m["reward_mean"], torch.tensor(13 / 8, dtype=torch.float64))
    # mean of the per-group population stds 0.5 and sqrt(6.75 / 4)
    torch.testing.assert_close(
        m["reward_std"], torch.tensor((0.5 + math.sqrt(6.75 / 4)) / 2, dtype=torch.float64))
    assert m["count"] == 8 and all(v.dim() == 0 for v in m.values())


# --------------------------------------------------------------------------- compile


def test_grpo_loss_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    n = 8
    x, actions, mask = _rollout(n, seed=5)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(D, A, dtype=torch.float64, generator=gen)
    logp_new = _logp(w, x, actions).float()
    logp_old = _logp(w + 0.3, x, actions).float()
    logp_ref = _logp(w - 0.3, x, actions).float()
    adv = rl.grpo_advantages(torch.randn(2, 4, generator=gen)).reshape(-1)

    def fn(lp_new, lp_old, lp_ref, a, m):
        return rl.grpo_loss(lp_new, lp_old, lp_ref, a, m, 0.2, 0.28, 0.04, "k3", "token", "sequence")

    eager_loss, eager_m = fn(logp_new, logp_old, logp_ref, adv, mask)
    compiled = torch.compile(fn, fullgraph=True)
    loss, m = compiled(logp_new, logp_old, logp_ref, adv, mask)
    torch.testing.assert_close(loss, eager_loss, atol=1e-6, rtol=1e-6)
    assert set(m) == set(eager_m)
    for k in m:
        torch.testing.assert_close(m[k], eager_m[k], atol=1e-6, rtol=1e-6)
