"""Sharded mode (pimm_fn.sharding): pieces and padding, errors, world-1 identity in process;
2 ranks sharded vs 1 rank, and checkpoints across world sizes under torchrun (gloo, CPU)."""
import json
import math
import sys
from pathlib import Path

import optree
import pytest
import torch

import pimm_fn.sharding as S
from pimm_fn import checkpoint
from pimm_fn.distributed import DistContext
from pimm_fn.state import TrainState
from pimm_fn.steps.supervised import supervised

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
import _common as C  # noqa: E402
from test_distributed_torchrun import torchrun  # noqa: E402


def _state(bn=True, hidden=15):
    torch.manual_seed(0)
    return TrainState.create(C.MLP(bn=bn, hidden=hidden), C.optimizer("adamw", 0.05), seed=0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pieces_pad_and_cover_every_param(world):
    full = _state()
    pieces = [S.shard(full, DistContext(rank=r, world_size=world)) for r in range(world)]
    for k, p in full.params.items():
        s = S.shard_len(p.numel(), world)
        assert all(tuple(sh.params[k].shape) == (s,) for sh in pieces)
        joined = torch.cat([sh.params[k] for sh in pieces])
        assert torch.equal(joined[:p.numel()].view(p.shape), p)  # the pieces are the param
        assert not joined[p.numel():].any()  # padding (world not dividing numel) is zeros
        assert all(tuple(sh.opt_state.mu[k].shape) == (s,) for sh in pieces)  # moments sharded too
    assert S.is_sharded(pieces[0], world) and not S.is_sharded(full, world)
    assert int(pieces[0].opt_state.count) == 0  # scalars stay replicated


def test_world_one_sharded_equals_supervised_bitwise():
    ref, sh = _state(), S.shard(_state())
    ref_step, step = supervised(clip_grad=0.5), S.sharded(clip_grad=0.5)
    for b in list(C.loader(C.dataset(48), 8, 0, 1).iter_epoch(0)):
        ref, _ = ref_step(ref, b)
        sh, m = step(sh, b)
    full = S.unshard(sh)
    for a, b in zip(optree.tree_leaves((full.params, full.buffers, full.opt_state)),
                    optree.tree_leaves((ref.params, ref.buffers, ref.opt_state))):
        assert torch.equal(a, b)
    assert set(m) >= {"loss", "grad_norm", "skipped", "samples"}


def test_mismatched_states_name_cause_and_fix(tmp_path):
    full = _state()
    batch = next(iter(C.loader(C.dataset(16), 8, 0, 1).iter_epoch(0)))
    with pytest.raises(S.ShardingError, match="not sharded; pass sharding.shard"):
        S.sharded()(full, batch)
    other = S.shard(full, DistContext(rank=0, world_size=4))
    with pytest.raises(S.ShardingError, match="another world size"):
        S.sharded()(other, batch)
    with pytest.raises(S.ShardingError, match="already sharded"):
        S.shard(other)
    # checkpoint.save (and so fit's Checkpoint callback) refuses one rank's pieces and writes nothing
    with pytest.raises(checkpoint.CheckpointError, match=r"sharded state .* pimm_fn.sharding.save"):
        checkpoint.save(tmp_path / "raw.pimm", other)
    assert not (tmp_path / "raw.pimm").exists()
    with pytest.raises(checkpoint.CheckpointError, match="sharded state"):
        checkpoint.CheckpointDir(tmp_path / "run").save(other, step=1)
    assert not list((tmp_path / "run").glob("*.ckpt"))


def test_save_restore_round_trip_single_process(tmp_path):
    sh = S.shard(_state())
    sh, _ = S.sharded(clip_grad=0.5)(sh, next(iter(C.loader(C.dataset(16), 8, 0, 1).iter_epoch(0))))
    S.save(tmp_path / "c.pimm", sh, extra={"k": 1})
    back, extra = S.restore(tmp_path / "c.pimm", sh)  # like may be sharded
    assert extra == {"k": 1} and int(back.step) == 1
    for a, b in zip(optree.tree_leaves((back.params, back.opt_state)), optree.tree_leaves((sh.params, sh.opt_state))):
        assert torch.equal(a, b)
    plain, _ = checkpoint.restore(tmp_path / "c.pimm", _state())  # full tensors: loads unsharded too
    assert plain.params["fc1.weight"].shape == (15, C.IN)


def test_two_ranks_sharded_equal_one_rank_unsharded(tmp_path):
    rc, out, _ = torchrun("sharded_equivalence.py", tmp_path)
    assert rc == 0, out[-4000:]
    res = json.loads((tmp_path / "sharded_results.json").read_text())
    print(res)
    assert res["steps"] == 20 and res["compile_count"] == 1
    assert res["param_moved"] > 0.1
    assert res["inf_skipped"] == 1.0 and res["inf_unchanged"]
    assert res["vs_one_rank_params"] <= 1e-5
    assert res["vs_data_parallel_params"] <= 1e-5 and res["vs_data_parallel_buffers"] <= 1e-5
    full, half = res["bytes_full"]["total"], res["bytes_sharded"]["total"]
    assert half < 0.52 * full  # each rank holds half (plus padding)


def test_checkpoints_resume_on_another_world_size(tmp_path):
    for nproc, args in ((2, ("w2", "-")), (1, ("w1", "w2")), (1, ("w1", "-")), (2, ("w2", "w1"))):
        rc, out, _ = torchrun("sharded_resume.py", tmp_path, *args, nproc=nproc)
        assert rc == 0, out[-4000:]
    for src, dst, world in (("w2", "w1", 1), ("w1", "w2", 2)):
        res = json.loads((tmp_path / f"resume_{src}_to_{dst}.json").read_text())
        assert res["world_size"] == world and res["restored_step"] == 10
        assert res["saved_world_size"] == 3 - world
        assert res["local_numel"]["fc1.weight"] == math.ceil(15 * C.IN / world)
        assert res["max_param_diff"] <= 1e-5 and res["max_mu_diff"] <= 1e-5, res


def test_step_runs_with_the_module_on_meta():
    # the module is structure only: moving it to meta frees its own full weights
    ref, sh = _state(), S.shard(_state())
    sh.model.to("meta")
    b = next(iter(C.loader(C.dataset(16), 8, 0, 1).iter_epoch(0)))
    ref, _ = supervised(clip_grad=0.5)(ref, b)
    sh, _ = S.sharded(clip_grad=0.5)(sh, b)
    assert all(torch.equal(S.unshard(sh).params[k], ref.params[k]) for k in ref.params)
