"""pimm_fn.distributed in one process: the context, init without torchrun, the in-step
pieces' single-process behaviour and the world-size-change resume rule.

The multi-process behaviour (real gloo process groups under torchrun) is in
tests/test_distributed_torchrun.py.
"""
import warnings

import pytest
import torch

import pimm_fn.distributed as D
from pimm_fn.data.sampler import epoch_order
from pimm_fn.state import Cursor, TrainState


def test_single_process_context_without_torchrun():
    ctx = D.init_from_env(env={}, device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend) == (0, 1, 0, None)
    assert ctx.is_main and not ctx.is_distributed and ctx.group is None
    assert ctx.device == torch.device("cpu")
    assert D.world() is ctx and D.is_main()
    # every host helper is a no-op / identity in one process
    D.barrier()
    assert D.broadcast_object({"a": 1}) == {"a": 1}
    assert D.on_main(lambda x: x + 1, 1) == 2
    assert D.global_count(7) == 7
    D.assert_in_sync({"w": torch.ones(3)})
    D.shutdown()
    assert D.world() == D.DistContext()


def test_torchrun_world_of_one_stays_single_process():
    ctx = D.init_from_env(env={"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, device="cpu")
    assert not ctx.is_distributed and not torch.distributed.is_initialized()


def test_partial_torchrun_environment_names_the_missing_variables():
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT not set.*torchrun"):
        D.init_from_env(env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, device="cpu")
    with pytest.raises(ValueError, match="RANK=5 out of range"):
        D.init_from_env(env={"WORLD_SIZE": "2", "RANK": "5", "LOCAL_RANK": "0", "MASTER_ADDR": "x",
                             "MASTER_PORT": "1"}, device="cpu")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        D.init_from_env(env={}, timeout_s=0)


def test_timeout_from_environment():
    assert D.init_from_env(env={D.TIMEOUT_ENV: "12.5"}, device="cpu").timeout_s == 12.5
    assert D.init_from_env(env={}, device="cpu").timeout_s == D.DEFAULT_TIMEOUT_S


def test_backend_is_gloo_without_cuda_and_nccl_with_it(monkeypatch):
    assert D.choose_backend("cpu") == "gloo" and D.choose_backend(torch.device("meta")) == "gloo"
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert D.choose_backend("cuda:1") == "cpu:gloo,cuda:nccl"  # gloo stays for CPU-tensor collectives
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    with pytest.raises(RuntimeError, match="nccl backend, which this torch build lacks.*device='cpu'"):
        D.choose_backend("cuda:0")


def test_default_device_cpu_without_cuda_and_one_gpu_per_rank_with_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert D.default_device(1, 2) == torch.device("cpu")
    ctx = D.init_from_env(env={})  # no device given: chosen by availability
    assert ctx.device == torch.device("cpu") and ctx.backend is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert D.default_device(1, 2) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.warns(RuntimeWarning, match="2 ranks on this machine but 1 GPU.*gloo"):
        assert D.default_device(1, 2) == torch.device("cpu")  # nccl cannot share one GPU between ranks


class _Lin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 1)

    def forward(self, batch):
        return {"loss": (self.fc(batch["x"]) ** 2).mean(), "out_max": batch["x"].max()}


def test_data_parallel_in_one_process_is_supervised_plus_sample_count():
    from pimm_fn.optim import sgd
    from pimm_fn.steps.supervised import supervised

    state = TrainState.create(_Lin(), sgd(0.1), seed=0)
    batch = {"x": torch.randn(5, 3)}
    plain_state, plain = supervised(clip_grad=1.0)(state, batch)
    dp_state, dp = D.data_parallel(clip_grad=1.0)(state, batch)
    assert float(dp.pop("samples")) == 5.0
    assert plain.keys() == dp.keys()
    for k in plain:
        assert torch.equal(plain[k], dp[k]), k
    for k in plain_state.params:
        assert torch.equal(plain_state.params[k], dp_state.params[k]), k
    # a user grad_transform still runs (after the all-reduce)
    _, zeroed = D.data_parallel(grad_transform=lambda g: {k: v * 0 for k, v in g.items()})(state, batch)
    assert float(zeroed["grad_norm"]) == 0.0


def test_reduce_metrics_is_identity_in_one_process():
    m = {"loss": torch.tensor(2.0), "x_min": torch.tensor(1.0)}
    out, extra = D.reduce_metrics(m, D.DistContext(), [torch.tensor(3.0)])
    assert out == m and float(extra[0]) == 3.0


def _consumed(n, seed, epoch, world, batch, position):
    """Samples the ranks of a (world, batch) run consumed in the first ``position`` steps."""
    return sorted(i for r in range(world)
                  for i in epoch_order(n, seed=seed, epoch=epoch, rank=r, world_size=world)[:position * batch])


def _remaining(n, seed, epoch, world, batch, position):
    return sorted(i for r in range(world)
                  for i in epoch_order(n, seed=seed, epoch=epoch, rank=r, world_size=world)[position * batch:])


def test_reshard_exact_when_the_prefix_is_whole_new_global_batches():
    n, seed = 96, 3
    cursor = Cursor(epoch=2, position=6, seed=seed, samples_seen=999)  # 2 ranks x 4 x 6 = 48 used
    for world, batch in ((1, 8), (4, 2), (3, 4), (1, 48)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # exact: no warning
            new = D.reshard_cursor(cursor, {"world_size": 2, "batch_size": 4}, batch_size=batch,
                                   world_size=world)
        assert new.position * batch * world == 48 and (new.epoch, new.samples_seen) == (2, 999)
        done = _consumed(n, seed, 2, 2, 4, 6)
        rest = _remaining(n, seed, 2, world, batch, new.position)
        # every sample of the epoch exactly once: none skipped, none repeated
        assert sorted(done + rest) == list(range(n)), (world, batch)


def test_reshard_rounds_down_with_a_warning_otherwise():
    n, seed = 96, 3
    cursor = Cursor(epoch=0, position=5, seed=seed)  # 2 x 4 x 5 = 40 used; new global batch 12
    with pytest.warns(UserWarning, match="4 samples of this epoch are trained on twice"):
        new = D.reshard_cursor(cursor, {"world_size": 2, "batch_size": 4}, batch_size=4, world_size=3)
    assert new.position == 3
    done = _consumed(n, seed, 0, 2, 4, 5)
    rest = _remaining(n, seed, 0, 3, 4, new.position)
    assert set(done) | set(rest) == set(range(n))  # nothing skipped
    assert len(done) + len(rest) - n == 4  # the documented repeat


def test_reshard_same_world_is_unchanged_and_epoch_end_rolls_over():
    c = Cursor(epoch=1, position=3)
    assert D.reshard_cursor(c, {"world_size": 2, "batch_size": 4}, batch_size=4, world_size=2) is c
    # a state that does not say the old run's layout (a MultiDatasetLoader's) is named, not a KeyError
    with pytest.raises(ValueError, match=r"saved must say the old run's world_size.*got \['loaders'\]"):
        D.reshard_cursor(c, {"loaders": []}, batch_size=4, world_size=1)
    rolled = D.reshard_cursor(Cursor(epoch=1, position=10), {"world_size": 2, "batch_size": 4},
                              batch_size=8, world_size=1, epoch_len=10)
    assert (rolled.epoch, rolled.position) == (2, 0)


def test_dist_meta_records_world_and_batch():
    assert D.dist_meta(6, D.DistContext(world_size=3, rank=1)) == {"world_size": 3, "batch_size": 6}


def test_guard_passes_through_in_one_process_and_non_peer_errors():
    with pytest.raises(ValueError):
        with D.guard():
            raise ValueError("user bug")
    with pytest.raises(RuntimeError, match="connection reset by peer"):
        with D.guard():  # single process: nothing to translate
            raise RuntimeError("connection reset by peer")
