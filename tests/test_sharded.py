"""Sharded mode (pimm_fn.sharding): the DTensor layout, errors, world-1 identity and DCP
checkpoints in process; 2 ranks sharded vs 1 rank, compiled, and checkpoints across world
sizes under torchrun (gloo, CPU)."""
import json
import sys
from pathlib import Path

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import pimm_fn.sharding as S
from pimm_fn import checkpoint
from pimm_fn.distributed import DistContext
from pimm_fn.state import TrainState
from pimm_fn.steps.supervised import supervised

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
import _common as C
from test_distributed_torchrun import torchrun


class Gain(C.MLP):
    """C.MLP with a 0-dim learned gain (a Replicate() param)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gain = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, batch):
        out = super().forward({"x": batch["x"] * self.gain, "y": batch["y"]})
        return out


def _state(bn=True, hidden=15, model=None, loss_scale=None):
    """A fresh full state; model: a module class / factory, built after seeding (so two
    calls give the same weights)."""
    torch.manual_seed(0)
    module = model() if model is not None else C.MLP(bn=bn, hidden=hidden)
    return TrainState.create(module, C.optimizer("adamw", 0.05), seed=0, loss_scale=loss_scale)


def _batch(n=16):
    return next(iter(C.loader(C.dataset(n), 8, 0, 1).iter_epoch(0)))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_are_dtensors_in_dtensors_own_uneven_layout(world):
    full = _state(model=lambda: Gain(bn=True, hidden=5))  # 5 rows over 4 ranks: 2, 2, 1, 0
    ranks = [S.shard(full, DistContext(rank=r, world_size=world)) for r in range(world)]
    for k, p in full.params.items():
        for r, sh in enumerate(ranks):
            d, mu, nu = sh.params[k], sh.opt_state.mu[k], sh.opt_state.nu[k]
            assert isinstance(d, DTensor) and d.shape == p.shape and d.device_mesh.size() == world
            assert d.placements == ((Replicate(),) if p.dim() == 0 else (Shard(0),))
            # exactly DTensor's own layout, so DCP and redistribute agree with it
            shape, offset = compute_local_shape_and_global_offset(p.shape, d.device_mesh, d.placements)
            assert tuple(d.to_local().shape) == tuple(shape)
            if p.dim():
                assert S.local_rows(p.shape[0], world, r) == (offset[0], shape[0])
            assert all(isinstance(t, DTensor) and t.placements == d.placements
                       and t.to_local().shape == d.to_local().shape for t in (mu, nu))  # moments mirror it
        rows = [sh.params[k].to_local() for sh in ranks]
        joined = rows[0] if p.dim() == 0 else torch.cat(rows)
        assert torch.equal(joined, p)  # the local rows are the param, no padding kept
    assert [S.local_rows(5, 4, r)[1] for r in range(4)] == [2, 2, 1, 0]
    assert S.is_sharded(ranks[0], world) and not S.is_sharded(full)
    assert not isinstance(ranks[0].opt_state.count, DTensor) and int(ranks[0].opt_state.count) == 0
    assert not isinstance(ranks[0].buffers["bn.running_mean"], DTensor)  # buffers replicated
    bytes_ = [S.state_bytes(sh)["params"] for sh in ranks]
    assert sum(bytes_) == S.state_bytes(full)["params"] + 4 * (world - 1)  # only the 0-dim gain repeats


@pytest.mark.parametrize("loss_scale", [None, True])
def test_world_one_sharded_equals_supervised_bitwise(loss_scale):
    ref = _state(model=lambda: Gain(bn=True), loss_scale=loss_scale)
    sh = S.shard(_state(model=lambda: Gain(bn=True), loss_scale=loss_scale))
    ref_step, step = supervised(clip_grad=0.5), S.sharded(clip_grad=0.5)
    for b in list(C.loader(C.dataset(48), 8, 0, 1).iter_epoch(0)):
        ref, _ = ref_step(ref, b)
        sh, m = step(sh, b)
    assert all(isinstance(v, DTensor) for v in optree.tree_leaves((sh.params, sh.opt_state.mu)))
    full = S.unshard(sh)
    for a, b in zip(optree.tree_leaves((full.params, full.buffers, full.opt_state, full.loss_scale)),
                    optree.tree_leaves((ref.params, ref.buffers, ref.opt_state, ref.loss_scale))):
        assert not isinstance(a, DTensor) and torch.equal(a, b)
    assert set(m) >= {"loss", "grad_norm", "skipped", "samples"}


def test_world_one_sharded_step_compiles_whole():
    # One process, no process group: the mesh has no backend, and dynamo still has to trace
    # the DTensor leaves (it failed on the mesh before; docs/distributed.md's example).
    from pimm_fn.compile import compile_step

    eager, compiled = S.shard(_state()), S.shard(_state())
    step, fast = S.sharded(clip_grad=0.5), compile_step(S.sharded(clip_grad=0.5), cache=False)
    for b in list(C.loader(C.dataset(24), 8, 0, 1).iter_epoch(0)):
        eager, m_eager = step(eager, b)
        compiled, m = fast(compiled, b)
        torch.testing.assert_close(m["loss"], m_eager["loss"])
    assert fast.compile_count == 1
    assert all(isinstance(v, DTensor) for v in compiled.params.values())
    for k, v in compiled.params.items():
        torch.testing.assert_close(v.to_local(), eager.params[k].to_local())


def test_mismatched_states_name_cause_and_fix(tmp_path):
    full = _state()
    with pytest.raises(S.ShardingError, match=r"not sharded; pass sharding.shard\(state\)"):
        S.sharded()(full, _batch())
    other = S.shard(full, DistContext(rank=0, world_size=4))
    with pytest.raises(S.ShardingError, match="sharded over 4 rank.*another world size.*sharding.restore"):
        S.sharded()(other, _batch())
    with pytest.raises(S.ShardingError, match="already sharded"):
        S.shard(other)
    # the data-parallel step names the sharded state instead of DTensor's "mixed torch.Tensor" error
    from pimm_fn.compile import compile_step
    from pimm_fn.steps import data_parallel

    for step in (data_parallel(), compile_step(data_parallel(), cache=False)):
        with pytest.raises(ValueError, match=r"got a sharded state .* pimm_fn.sharding.sharded"):
            step(S.shard(full), _batch())
    # checkpoint.save (and so fit's Checkpoint callback) refuses DTensor shards and writes nothing
    with pytest.raises(checkpoint.CheckpointError, match=r"sharded state .* pimm_fn.sharding.save"):
        checkpoint.save(tmp_path / "raw.pimm", other)
    assert not (tmp_path / "raw.pimm").exists()
    with pytest.raises(checkpoint.CheckpointError, match="sharded state"):
        checkpoint.CheckpointDir(tmp_path / "run").save(other, step=1)
    assert not list((tmp_path / "run").glob("*.ckpt"))
    # fit with a Checkpoint callback refuses a sharded state before its first step, not at
    # the first save after the training it was to keep
    from pimm_fn.callbacks import Checkpoint
    from pimm_fn.fit import fit

    ran = []

    def counted(state, batch):
        ran.append(1)
        return S.sharded()(state, batch)

    with pytest.raises(checkpoint.CheckpointError, match=r"sharded state .* pimm_fn.sharding.save"):
        fit(S.shard(full), [_batch()] * 3, counted, epochs=1, callbacks=[Checkpoint(tmp_path / "fit")])
    assert not ran


def test_dcp_save_restore_round_trip_single_process(tmp_path):
    sh = S.shard(_state())
    sh, _ = S.sharded(clip_grad=0.5)(sh, _batch())
    out = S.save(tmp_path / "c", sh, extra={"k": 1, "t": torch.arange(3)})
    assert out == str(tmp_path / "c") and (tmp_path / "c" / ".metadata").is_file()
    assert not (tmp_path / "c.partial").exists()
    back, extra = S.restore(tmp_path / "c", _state())  # like: a fresh full state
    assert extra["k"] == 1 and torch.equal(extra["t"], torch.arange(3)) and int(back.step) == 1
    assert back.rng == sh.rng and back.cursor == sh.cursor
    for a, b in zip(optree.tree_leaves((back.params, back.opt_state, back.buffers)),
                    optree.tree_leaves((sh.params, sh.opt_state, sh.buffers))):
        assert type(a) is type(b) and torch.equal(a.full_tensor() if isinstance(a, DTensor) else a,
                                                  b.full_tensor() if isinstance(b, DTensor) else b)
    again, _ = S.restore(tmp_path / "c", back)  # like may be sharded for this world size
    assert torch.equal(again.params["fc1.weight"].to_local(), sh.params["fc1.weight"].to_local())
    plain, _ = S.restore(tmp_path / "c", _state(), sharded=False)  # into an unsharded state
    assert not isinstance(plain.params["fc1.weight"], DTensor)
    assert torch.equal(plain.params["fc1.weight"], S.unshard(sh).params["fc1.weight"])
    S.save(tmp_path / "c", back)  # an existing checkpoint is replaced whole
    # a folder given with a trailing slash: staged beside it, not inside the folder it replaces
    assert S.save(f"{tmp_path / 'c'}/", sh) == str(tmp_path / "c")
    assert int(S.restore(tmp_path / "c", _state())[0].step) == 1 and not (tmp_path / "c.old").exists()
    # an engine checkpoint file of a full state is read whole and sharded
    checkpoint.save(tmp_path / "full.pimm", S.unshard(sh))
    from_file, _ = S.restore(tmp_path / "full.pimm", _state())
    assert isinstance(from_file.params["bn.bias"], DTensor)
    assert torch.equal(from_file.params["bn.bias"].to_local(), sh.params["bn.bias"].to_local())


def test_a_mid_epoch_checkpoint_of_another_world_size_warns_about_the_cursor(tmp_path):
    sh = S.shard(_state())
    sh = sh.replace(cursor=sh.cursor.replace(position=3))
    S.save(tmp_path / "c", sh)
    from pimm_fn.sharding.dcp import HOST_FILE

    meta = torch.load(tmp_path / "c" / HOST_FILE, weights_only=True)
    torch.save({**meta, "world_size": 2}, tmp_path / "c" / HOST_FILE)  # as 2 ranks would have written it
    with pytest.warns(UserWarning, match=r"written by 2 rank\(s\) in the middle of epoch 0.*reshard_cursor"):
        back, _ = S.restore(tmp_path / "c", _state())
    assert back.cursor.position == 3  # kept as saved: moving it needs the old run's batch size


def test_restoring_into_a_mismatched_model_names_the_keys_and_the_fix(tmp_path):
    S.save(tmp_path / "c", S.shard(_state(hidden=15)))
    with pytest.raises(S.ShardingError, match=r"(?s)does not fit this state.*params/fc1.weight: checkpoint "
                                              r"\(15, 8\) vs state \(16, 8\).*TrainState.create"):
        S.restore(tmp_path / "c", _state(hidden=16))
    with pytest.raises(S.ShardingError, match=r"(?s)Missing in the checkpoint.*params/gain"):
        S.restore(tmp_path / "c", _state(model=lambda: Gain(bn=True)))
    half = _state(hidden=15)
    half = half.replace(params={k: v.double() for k, v in half.params.items()})
    with pytest.raises(S.ShardingError, match=r"Type mismatches.*params/fc1.weight: checkpoint torch.float32 vs "
                                              r"state torch.float64"):
        S.restore(tmp_path / "c", half)
    (tmp_path / "empty").mkdir()
    with pytest.raises(S.ShardingError, match="not a sharded checkpoint.*sharding.save"):
        S.restore(tmp_path / "empty", _state())
    with pytest.raises(S.ShardingError, match="sharded over 4 rank.*pass a full state"):
        S.restore(tmp_path / "c", S.shard(_state(), DistContext(rank=0, world_size=4)))


def test_two_ranks_sharded_equal_one_rank_unsharded(tmp_path):
    rc, out, _ = torchrun("sharded_equivalence.py", tmp_path)
    assert rc == 0, out[-4000:]
    res = json.loads((tmp_path / "sharded_results.json").read_text())
    print(res)
    assert res["steps"] == 20 and res["compile_count"] == 1 and res["graph_breaks"] == 0
    assert res["explain"] == {"graphs": 1, "graph_breaks": 0, "break_reasons": []}
    fc1 = [layout["fc1.weight"] for layout in res["layout"]]
    assert [r["local"] for r in fc1] == [[8, 8], [7, 8]] and fc1[0]["shape"] == [15, 8]  # uneven rows
    assert all(v["dtensor"] and v["moments_match"] and v["placement"] == "S(0)"
               for layout in res["layout"] for v in layout.values())
    assert res["param_moved"] > 0.1
    assert res["inf_skipped"] == 1.0 and res["inf_unchanged"] and res["inf_compile_count"] == 1
    assert res["vs_one_rank_params"] <= 1e-5
    assert res["vs_data_parallel_params"] <= 1e-5 and res["vs_data_parallel_buffers"] <= 1e-5
    full, per_rank = res["bytes_full"], res["bytes_sharded"]
    assert sum(b["params"] for b in per_rank) == full["params"]  # every row held exactly once
    assert max(b["total"] for b in per_rank) < 0.53 * full["total"]  # 8 of 15 rows at most


def test_four_ranks_with_an_empty_shard_equal_data_parallel(tmp_path):
    rc, out, _ = torchrun("sharded_world4.py", tmp_path, nproc=4, timeout=400)
    assert rc == 0, out[-4000:]
    res = json.loads((tmp_path / "sharded_world4.json").read_text())
    print(res)
    ranks = res["ranks"]
    assert res["steps"] == 10 and [r["rows"]["bn.weight"] for r in ranks] == [2, 2, 1, 0]
    assert all(r["compile_count"] == 1 for r in ranks) and ranks[0]["moved"] > 0.1
    assert max(r["vs_data_parallel_params"] for r in ranks) <= 1e-5


def test_checkpoints_resume_on_another_world_size(tmp_path):
    for nproc, args in ((2, ("w2", "-")), (1, ("w1", "w2")), (1, ("w1", "-")), (2, ("w2", "w1"))):
        rc, out, _ = torchrun("sharded_resume.py", tmp_path, *args, nproc=nproc)
        assert rc == 0, out[-4000:]
    assert sorted(p.name for p in (tmp_path / "w2_step10").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "host.pt"]  # one file of rows per writing rank
    for src, dst, world in (("w2", "w1", 1), ("w1", "w2", 2)):
        res = json.loads((tmp_path / f"resume_{src}_to_{dst}.json").read_text())
        print(res)
        assert res["world_size"] == world and res["restored_step"] == 10 and res["dtensor"]
        assert res["saved_world_size"] == 3 - world
        assert res["local_rows"]["fc1.weight"] == (15 if world == 1 else 8)
        assert res["gain_placement"] == "R"
        assert res["max_param_diff"] <= 1e-5 and res["max_mu_diff"] <= 1e-5, res
    res = json.loads((tmp_path / "resume_w2_to_w1.json").read_text())
    assert not res["plain_is_dtensor"] and res["plain_max_param_diff"] <= 1e-5  # 2 ranks -> plain state


def test_the_sharded_state_holds_no_full_weights():
    # the state's module is structure only (on meta): each rank holds its rows, nothing more
    ref, sh = _state(), S.shard(_state())
    assert all(p.is_meta for p in sh.model.parameters())
    b = _batch()
    ref, _ = supervised(clip_grad=0.5)(ref, b)
    sh, _ = S.sharded(clip_grad=0.5)(sh, b)
    assert all(torch.equal(S.unshard(sh).params[k], ref.params[k]) for k in ref.params)


def test_memory_benchmark_per_rank_state_falls_as_one_over_world(tmp_path):
    # benchmarks/sharded_memory.py itself, on a small MLP: one torchrun launch per world size
    import subprocess

    from test_distributed_torchrun import ROOT, _env

    out = tmp_path / "mem.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sharded_memory.py"), "--worlds", "1", "2", "4",
                           "--sizes", "64", "128", "12", "--json", str(out)],
                          capture_output=True, text=True, timeout=400, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())["results"]
    one = res[0]["per_rank"][0]["total"]
    for r in res:
        w, ranks = r["world_size"], r["per_rank"]
        assert len(ranks) == w and all(x["all_dtensor"] for x in ranks)
        assert r["replicated"]["total"] == one  # data parallel would hold all of it on every rank
        worst = max(x["total"] for x in ranks)
        # 1/world, plus the replicated scalars (AdamW count) every rank keeps
        assert one / w <= worst <= one / w * 1.02, (w, worst, one)
        assert sum(x["params"] for x in ranks) == res[0]["per_rank"][0]["params"]
