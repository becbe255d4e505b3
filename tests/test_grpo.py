"""The GRPO step: exact micro-batching, compile (0 graph breaks), bitwise resume, bad inputs."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from pimm_fn import checkpoint, optim
from pimm_fn.compile import compile_step, explain_step, seeded_rng
from pimm_fn.state import TrainState
from pimm_fn.steps.grpo import REF_KEY, Rollout, grpo, with_reference
from pimm_fn.tree import tree_leaves

D, A, T, B, G = 3, 4, 6, 3, 4  # obs dim, actions, steps, events, group size


class TinyPolicy(torch.nn.Module):
    """A linear softmax policy over A actions: ``log_probs(obs) -> [..., A]``."""

    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(D, A).to(dtype)

    def log_probs(self, obs):
        return torch.log_softmax(self.lin(obs.to(self.lin.weight.dtype)), -1)


def sample(policy, batch, group_size):
    """G trajectories per event over its fixed observations; lengths from the batch."""
    obs = batch["x"].repeat_interleave(group_size, 0)                  # [N, T, D]
    table = policy(obs)
    u = torch.rand(table.shape, dtype=table.dtype).clamp(1e-10, 1 - 1e-7)
    actions = (table - torch.log(-torch.log(u))).argmax(-1)            # [N, T]
    logp = table.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    lengths = batch["len"].repeat_interleave(group_size)
    mask = torch.arange(obs.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    return Rollout(traj={"obs": obs, "actions": actions, "logp_old": logp, "mask": mask})


def reward(batch, ro):
    """Fraction of valid steps whose action is 1: [B, G]."""
    a, m = ro.traj["actions"], ro.traj["mask"]
    r = ((a == 1) & m).sum(-1).to(torch.float32) / m.sum(-1).clamp(min=1)
    return r.view(-1, G)


def make_batch(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(B, T, D, generator=g, dtype=dtype), "len": torch.tensor([T, 3, 1])}


def make_state(tx=None, dtype=torch.float32, seed=0, ref=False):
    st = TrainState.create(TinyPolicy(dtype), tx or optim.adam(lr=0.05), seed=seed)
    return with_reference(st) if ref else st


def leaves_equal(a, b):
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


STEP_KW = dict(sample=sample, reward=reward, group_size=G, policy_updates=2, kl_coef=0.05)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One compiled GRPO step (P=2, KL on) shared by this module, with the step cache on as
    users have it by default (the suite turns it off elsewhere): a step whose core is a bound
    method compiles without it (it crashed on its first call)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PIMM_FN_STEP_CACHE", raising=False)  # the default folder, under a fresh cache home
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache_home")))
        step = compile_step(grpo(**STEP_KW))
        step(make_state(ref=True), make_batch())  # the first call decides the cache
    return step


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("reduction", ["sequence", "token", "constant"])
def test_microbatched_update_equals_full_batch(reduction):
    # SGD with lr 1: the param change *is* the gradient; float64 so 1e-6 is meaningful.
    batch = make_batch(dtype=torch.float64)
    results = {}
    for m in (0, 1, 3, 4, 5):  # 3 and 5 do not divide G=4; chunks never cross a group
        st = make_state(optim.sgd(lr=1.0), dtype=torch.float64, ref=True)
        step = grpo(sample=sample, reward=reward, group_size=G, microbatch_size=m, reduction=reduction,
                    kl_coef=0.1, max_length=T + 2 if reduction == "constant" else None)
        new, metrics = step(st, batch)
        results[m] = (new, metrics)
    full, full_m = results[0]
    grad_full = {k: make_state(dtype=torch.float64).params[k] - full.params[k] for k in full.params}
    assert max(float(g.abs().max()) for g in grad_full.values()) > 1e-3  # a real gradient
    for new, metrics in results.values():
        for k in full.params:
            torch.testing.assert_close(new.params[k], full.params[k], atol=1e-6, rtol=0)
        torch.testing.assert_close(metrics["loss"], full_m["loss"], atol=1e-9, rtol=0)
        torch.testing.assert_close(metrics["rl_pg_loss"], full_m["rl_pg_loss"], atol=1e-9, rtol=0)
        assert metrics["count"] == full_m["count"]


def test_microbatched_equals_full_batch_over_several_adam_updates():
    batch = make_batch(dtype=torch.float64)
    outs = []
    for m in (0, 3):
        st = make_state(optim.adam(lr=0.05), dtype=torch.float64)
        step = grpo(sample=sample, reward=reward, group_size=G, microbatch_size=m, policy_updates=3)
        for _ in range(2):
            st, _ = step(st, batch)
        outs.append(st)
    for k in outs[0].params:
        torch.testing.assert_close(outs[0].params[k], outs[1].params[k], atol=1e-6, rtol=0)


def test_on_policy_first_update_and_schedule_counts_updates():
    st = make_state(ref=True)
    step = grpo(**STEP_KW)
    new, m = step(st, make_batch())
    assert float(m["rl_ratio_geom_update0"]) == pytest.approx(1.0, abs=1e-6)
    assert float(m["rl_clip_frac_update0"]) == 0.0
    assert float(m["rl_kl_update0"]) == pytest.approx(0.0, abs=1e-6)  # reference == policy
    assert "rl_pg_loss_mean_update" in m and "reward_mean" in m and "reward_std" in m
    # the optimizer's count advances P=2 times per batch; the state's step once
    assert int(new.opt_state.count) == 2 and int(new.step) == 1
    new2, _ = step(new, make_batch(1))
    assert int(new2.opt_state.count) == 4
    # the reference stays frozen, the input state is untouched
    for k in st.params:
        assert torch.equal(new2.extra[REF_KEY][k], st.params[k])
        assert torch.equal(make_state().params[k], st.params[k])


def test_dr_grpo_constant_reduction_first_update_value():
    # On-policy first update: every ratio is 1, so the loss is -mean_i(A_i * len_i / L) with
    # Dr. GRPO's centred (unscaled) advantages and L = max_length, whatever the lengths.
    def varied_lengths(policy, batch, group_size):  # lengths differ inside a group too
        ro = sample(policy, batch, group_size)
        n = ro.traj["actions"].shape[0]
        mask = torch.arange(T).unsqueeze(0) < (1 + torch.arange(n) % T).unsqueeze(1)
        return ro._replace(traj={**ro.traj, "mask": mask})

    st = make_state()
    step = grpo(sample=varied_lengths, reward=reward, group_size=G, advantage="dr_grpo",
                reduction="constant", max_length=10)
    new, m = step(st, make_batch())
    with seeded_rng(st.rng.step_seed()):  # the rollout the call made: prepare runs seeded so
        ro = step.rollout(st, make_batch())
    adv = (ro.rewards - ro.rewards.mean(1, keepdim=True)).reshape(-1)
    lengths = ro.traj["mask"].sum(-1).float()
    expected = -(adv * lengths / 10).mean()
    torch.testing.assert_close(m["rl_pg_loss"], expected)
    assert abs(float(expected)) > 1e-4 and m["count"] == B * G
    # the per-sequence mean (GRPO's default reduction) is another number
    _, m_seq = grpo(sample=varied_lengths, reward=reward, group_size=G, advantage="dr_grpo")(st, make_batch())
    assert not torch.allclose(m_seq["rl_pg_loss"], m["rl_pg_loss"])


def test_kl_zero_runs_without_reference():
    st = make_state(ref=False)
    step = grpo(sample=sample, reward=reward, group_size=G, kl_coef=0.0)
    new, m = step(st, make_batch())
    assert "rl_kl" not in m and float(m["rl_kl_loss"]) == 0.0
    assert REF_KEY not in new.extra


def test_same_state_same_result_and_rng_advances():
    step = grpo(**STEP_KW)
    st = make_state(ref=True)
    a, ma = step(st, make_batch())
    b, mb = step(st, make_batch())
    leaves_equal(a, b)
    assert a.rng.counter == st.rng.counter + 1
    c, _ = step(a, make_batch())
    assert not torch.equal(c.params["lin.weight"], a.params["lin.weight"])


# --------------------------------------------------------------------------- compile


def test_compiled_update_has_no_graph_breaks():
    # micro-batches of 3 over groups of 4: 6 chunks, each a forward/backward in the graph
    step = grpo(**{**STEP_KW, "microbatch_size": 3, "policy_updates": 1})
    st = make_state(ref=True)
    explanation = explain_step(step, st, make_batch())  # runs the rollout, explains the core
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert not explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_step_matches_eager(compiled):
    st = make_state(ref=True)
    eager = grpo(**STEP_KW)
    a, ma = eager(st, make_batch())
    b, mb = compiled(st, make_batch())
    for k in a.params:
        torch.testing.assert_close(a.params[k], b.params[k], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ma["loss"], mb["loss"], atol=1e-5, rtol=1e-5)
    assert compiled.compile_count == 1


# --------------------------------------------------------------------------- resume


def test_resume_from_checkpoint_is_bitwise_equal(compiled, tmp_path):
    batches = [make_batch(i) for i in range(4)]
    st = make_state(ref=True, seed=3)
    for b in batches:
        st, _ = compiled(st, b)
    # interrupted run: two steps, save, then continue from fresh objects
    part = make_state(ref=True, seed=3)
    for b in batches[:2]:
        part, _ = compiled(part, b)
    checkpoint.save(tmp_path / "mid.ckpt", part)
    del part
    like = make_state(ref=True, seed=99)  # a fresh model / state, different values
    resumed, _ = checkpoint.restore(tmp_path / "mid.ckpt", like=like)
    for b in batches[2:]:
        resumed, _ = compiled(resumed, b)
    leaves_equal(st, resumed)


_KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    from pimm_fn import checkpoint
    from test_grpo import STEP_KW, grpo, make_batch, make_state
    step = grpo(**STEP_KW)
    st = make_state(ref=True, seed=5)
    for i in range(4):
        st, _ = step(st, make_batch(i))
        checkpoint.save({path!r}, st)
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no atexit
""")


def test_sigkilled_run_resumes_bitwise(tmp_path):
    path = str(tmp_path / "run.ckpt")
    script = _KILLED_RUN.format(tests=os.path.dirname(__file__), path=path)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    step = grpo(**STEP_KW)
    resumed, _ = checkpoint.restore(path, like=make_state(ref=True, seed=0))
    assert int(resumed.step) == 2
    for i in (2, 3):
        resumed, _ = step(resumed, make_batch(i))
    st = make_state(ref=True, seed=5)
    for i in range(4):
        st, _ = step(st, make_batch(i))
    leaves_equal(st, resumed)


# --------------------------------------------------------------------------- bad input


def test_group_size_one_is_rejected():
    with pytest.raises(ValueError, match="G = 1"):
        grpo(sample=sample, reward=reward, group_size=1)


def test_reward_with_wrong_shape():
    step = grpo(sample=sample, reward=lambda b, ro: torch.zeros(B * G), group_size=G)
    with pytest.raises(ValueError, match=r"shape \[B, G\]"):
        step(make_state(), make_batch())
    step = grpo(sample=sample, reward=lambda b, ro: torch.zeros(G, B), group_size=G)
    with pytest.raises(ValueError, match="configured for"):
        step(make_state(), make_batch())


def test_reward_with_nan():
    def bad(batch, ro):
        r = reward(batch, ro)
        r[1, 2] = float("nan")
        return r

    with pytest.raises(ValueError, match=r"NaN.*\[\[1, 2\]\]"):
        grpo(sample=sample, reward=bad, group_size=G)(make_state(), make_batch())


class NoLogProbs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, A)

    def forward(self, obs):
        return self.lin(obs)


class RawLogits(NoLogProbs):
    def log_probs(self, obs):
        return self.lin(obs) * 3.0  # forgot the log_softmax


def test_policy_without_log_probabilities():
    step = grpo(sample=sample, reward=reward, group_size=G)
    with pytest.raises(TypeError, match="has no log_probs"):
        step(TrainState.create(NoLogProbs(), optim.adam(lr=0.1)), make_batch())
    with pytest.raises(ValueError, match="did not return log-probabilities"):
        step(TrainState.create(RawLogits(), optim.adam(lr=0.1)), make_batch())


def test_kl_without_reference_and_bad_rollout():
    with pytest.raises(KeyError, match="with_reference"):
        grpo(**STEP_KW)(make_state(ref=False), make_batch())

    def no_logp(policy, batch, g):
        ro = sample(policy, batch, g)
        return Rollout(traj={k: v for k, v in ro.traj.items() if k != "logp_old"})

    with pytest.raises(KeyError, match="logp_old"):
        grpo(sample=no_logp, reward=reward, group_size=G)(make_state(), make_batch())


# --------------------------------------------------------------------------- loss scaling, BatchNorm

def test_fp16_grpo_loss_scale_follows_grad_scaler_and_skips_inf_updates():
    from pimm_fn.amp import LossScaleConfig
    from pimm_fn.steps.grpo import grpo_objective

    base = grpo_objective()

    def poisoned_loss(out, chunk, p):
        loss, metrics = base(out, chunk, p)
        # traj["poison"] is 0 or inf per trajectory: inf makes every gradient non-finite
        return loss + chunk["traj"]["poison"][0] * out["logp"].float().sum(), metrics

    def poisoned_sample(policy, batch, group_size):
        ro = sample(policy, batch, group_size)
        n = ro.traj["obs"].shape[0]
        return Rollout(traj={**ro.traj, "poison": batch["poison"].expand(n).clone()})

    bad = {2, 3, 7}
    batches = []
    for t in range(10):
        b = make_batch(seed=t)
        b["poison"] = torch.tensor([float("inf") if t in bad else 0.0])
        batches.append(b)
    cfg = LossScaleConfig(growth_interval=2)
    step = grpo(sample=poisoned_sample, reward=reward, group_size=G, loss=poisoned_loss,
                autocast="float16", loss_scale_config=cfg)
    state = TrainState.create(TinyPolicy(), optim.adam(lr=0.05), seed=0, loss_scale=True)
    scales, skipped, params_before = [], [], []
    for b in batches:
        params_before.append({k: v.clone() for k, v in state.params.items()})
        new, m = step(state, b)
        scales.append(float(m["loss_scale"]))
        skipped.append(bool(m["skipped"]))
        if skipped[-1]:  # a skipped update leaves the params exactly as they were
            assert all(torch.equal(new.params[k], state.params[k]) for k in state.params)
        state = new
    # torch's GradScaler on the same finite / non-finite sequence
    w = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    ref_scales = []
    for t in range(10):
        opt.zero_grad()
        ref_scales.append(scaler.get_scale())
        scaler.scale(w * (float("inf") if t in bad else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    assert scales == ref_scales and skipped == [t in bad for t in range(10)]
    assert float(state.loss_scale.scale) == scaler.get_scale()


class BNPolicy(torch.nn.Module):
    """A softmax policy with BatchNorm over its logits (training mode moves its statistics)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(D, A)
        self.bn = torch.nn.BatchNorm1d(A)

    def log_probs(self, obs):
        h = self.lin(obs)
        return torch.log_softmax(self.bn(h.reshape(-1, A)).reshape(h.shape), -1)


def test_a_training_mode_policys_batchnorm_statistics_come_back_in_the_new_state():
    state = TrainState.create(BNPolicy(), optim.adam(lr=0.05), seed=0)
    before = {k: v.clone() for k, v in state.buffers.items()}
    b = make_batch(seed=1)
    new, m = grpo(sample=sample, reward=reward, group_size=G)(state, b)
    assert all(torch.equal(state.buffers[k], before[k]) for k in before)  # the input state is untouched
    # one update forward over the rollout's observations, as the module would have made it
    # (the sampling pass ran on copies and moved nothing)
    ref = BNPolicy()
    ref.load_state_dict({**{k: v for k, v in state.params.items()}, **before})
    ref.train()
    ref.log_probs(b["x"].repeat_interleave(G, 0))
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.allclose(new.buffers[k].float(), ref.state_dict()[k].float(), atol=1e-6), k
    assert int(new.buffers["bn.num_batches_tracked"]) == 1


@pytest.mark.parametrize("bad, error, match", [
    ({"group_size": 2.7}, TypeError, "group_size must be an int, got 2.7"),
    ({"policy_updates": 1.5}, TypeError, "policy_updates must be an int"),
    ({"microbatch_size": 2.5}, TypeError, "microbatch_size must be an int"),
    ({"group_size": 1}, ValueError, "group_size must be >= 2, got 1: GRPO compares"),
    ({"clip_low": -0.2}, ValueError, r"clip_low must be in \[0, 1\)"),
    ({"clip_low": 1.5}, ValueError, r"clip_low must be in \[0, 1\)"),
    ({"clip_high": -0.1}, ValueError, "clip_high must be >= 0"),
    ({"kl_estimator": "k2"}, ValueError, "kl_estimator must be one of"),
    ({"level": "bogus"}, ValueError, "level must be 'token' or 'sequence'"),
    ({"level": "sequence", "reduction": "token"}, ValueError, "use reduction='sequence'"),
])
def test_settings_are_checked_when_the_step_is_built(bad, error, match):
    with pytest.raises(error, match=match):
        grpo(**{**STEP_KW, **bad})


def test_a_rollout_without_observations_or_with_a_vector_metric_is_named():
    def no_obs(policy, batch, group_size):
        ro = sample(policy, batch, group_size)
        return Rollout(traj={k: v for k, v in ro.traj.items() if k != "obs"})

    with pytest.raises(ValueError, match=r"no 'obs'\) and Rollout.shared is None"):
        grpo(**{**STEP_KW, "sample": no_obs})(make_state(ref=True), make_batch())

    def vector_metric(policy, batch, group_size):
        return sample(policy, batch, group_size)._replace(metrics={"returns": torch.ones(3)})

    with pytest.raises(ValueError, match=r"Rollout.metrics\['returns'\] has shape \(3,\)"):
        grpo(**{**STEP_KW, "sample": vector_metric})(make_state(ref=True), make_batch())


def test_restoring_a_run_with_a_reference_policy_into_a_plain_state_names_with_reference(tmp_path):
    checkpoint.save(tmp_path / "ref.ckpt", make_state(ref=True))
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"Only state.extra differs.*with_reference\(like\)"):
        checkpoint.restore(tmp_path / "ref.ckpt", make_state())
