"""Checkpoints: bitwise round trip, SIGKILL atomicity, clear errors, no pickle execution,
seed / Pointcept import."""
import os
import pickle
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from pimm_fn import TrainState
from pimm_fn import checkpoint as ck
from pimm_fn.optim.base import GradientTransformation
from pimm_fn.tree import tree_flatten_with_path, tree_map

REPO = Path(__file__).resolve().parents[1]


class TinyState(NamedTuple):
    m: dict
    count: torch.Tensor


def tiny_tx() -> GradientTransformation:
    """A momentum-like transform: enough state structure (NamedTuple, dict, counter)."""

    def init(params):
        return TinyState({k: torch.zeros_like(v) for k, v in params.items()}, torch.zeros((), dtype=torch.int64))

    def update(grads, state, params):
        m = {k: 0.9 * state.m[k] + grads[k] for k in grads}
        return {k: -0.1 * v for k, v in m.items()}, TinyState(m, state.count + 1)

    return GradientTransformation(init, update)


def make_model(hidden=8, out=3):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, out))


def busy_state(hidden=8, out=3, seed=1) -> TrainState:
    """A state whose every leaf differs from its initial value, with awkward dtypes."""
    g = torch.Generator().manual_seed(seed)
    s = TrainState.create(make_model(hidden, out), tiny_tx(), loss_scale=True, seed=5, data_seed=9)

    def rand(t):
        return torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t + 7

    nan_param = dict(tree_map(rand, s.params))
    nan_param["0.bias"] = nan_param["0.bias"].clone()
    nan_param["0.bias"][0] = float("nan")  # NaN must survive bit for bit
    return s.replace(
        step=torch.tensor(123, dtype=torch.int64),
        params=nan_param,
        buffers=tree_map(rand, s.buffers),
        opt_state=tree_map(rand, s.opt_state),
        loss_scale=s.loss_scale._replace(scale=torch.tensor(2.0**13),
                                         growth_tracker=torch.tensor(17, dtype=torch.int32)),
        rng=s.rng.replace(counter=41),
        cursor=s.cursor.replace(epoch=2, position=3, samples_seen=10**12),
        extra={
            "bf": torch.randn(5, generator=g).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 3),
            "half": torch.randn(2, 2, generator=g).half(),
        },
    )


def fresh_like(hidden=8, out=3) -> TrainState:
    """What a resuming run builds before restore: same model, tx and state.extra layout."""
    s = TrainState.create(make_model(hidden, out), tiny_tx(), loss_scale=True)
    return s.replace(extra={k: torch.zeros_like(v) for k, v in busy_state(hidden, out).extra.items()})


def assert_bitwise(a, b, where=""):
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    else:
        assert a == b or (a != a and b != b), (where, a, b)


def assert_states_bitwise(x: TrainState, y: TrainState):
    px, lx, tx = tree_flatten_with_path(x)
    py, ly, ty = tree_flatten_with_path(y)
    assert px == py  # (the treedefs differ only by the static model object)
    for p, a, b in zip(px, lx, ly):
        assert_bitwise(a, b, p)


EXTRA = {
    "best_miou": 0.7123456789012345,
    "loader": {
        "_snapshot": {0: torch.arange(3), "worker_1": [1, 2, (3, 4.5)], "gen": torch.get_rng_state()},
        "epoch": 3,
    },
    "nan": float("nan"),
    "big": 2**70,
    "flag": True,
    "none": None,
    "text": "ok",
    "metric": torch.tensor(0.5, dtype=torch.float64),
}


def assert_extra_equal(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_extra_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_extra_equal(u, v)
    else:
        assert_bitwise(a, b)


# --------------------------------------------------------------------------- round trip


def test_round_trip_is_bitwise(tmp_path):
    state = busy_state()
    path = ck.save(tmp_path / "a.ckpt", state, extra=EXTRA)
    assert path == tmp_path / "a.ckpt"
    like = fresh_like()
    restored, extra = ck.restore(path, like)
    assert_states_bitwise(restored, state)
    assert_extra_equal(extra, EXTRA)
    assert restored.model is like.model and restored.tx is like.tx
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    # the restored state is usable: one tx update runs on it
    restored.tx.update(restored.params, restored.opt_state, restored.params)


def test_file_is_plain_safetensors(tmp_path):
    """Any safetensors reader opens it: the format is data, not code."""
    from safetensors.torch import load_file

    state = busy_state()
    path = ck.save(tmp_path / "a.ckpt", state)
    tensors = load_file(str(path))
    assert_bitwise(tensors["state/params/3.weight"], state.params["3.weight"])
    assert_bitwise(tensors["state/opt_state/0/0.weight"], state.opt_state.m["0.weight"])
    assert_bitwise(tensors["state/extra/bf"], state.extra["bf"])


def test_restore_goes_to_like_device(tmp_path):
    path = ck.save(tmp_path / "a.ckpt", busy_state())
    like = fresh_like()
    like = like.replace(params=tree_map(lambda t: t.to("meta"), like.params))
    restored, _ = ck.restore(path, like)
    assert all(t.device.type == "meta" for t in restored.params.values())
    assert all(t.device.type == "cpu" for t in restored.buffers.values())


def test_loss_scale_none_round_trips(tmp_path):
    s = TrainState.create(make_model(), tiny_tx())
    restored, extra = ck.restore(ck.save(tmp_path / "a.ckpt", s), TrainState.create(make_model(), tiny_tx()))
    assert restored.loss_scale is None and extra is None
    assert_states_bitwise(restored, s)


def test_unsaveable_extra_is_named(tmp_path):
    with pytest.raises(ck.CheckpointError, match=r"extra\['bad'\].*object"):
        ck.save(tmp_path / "a.ckpt", busy_state(), extra={"bad": object()})
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------- bad inputs


def test_missing_path_lists_existing(tmp_path):
    like = busy_state()
    ck.save(tmp_path / "step_1.ckpt", like)
    ck.save(tmp_path / "step_2.ckpt", like)
    with pytest.raises(ck.CheckpointNotFoundError,
                       match=r"step_9\.ckpt does not exist(.|\n)*step_2\.ckpt(.|\n)*step_1\.ckpt"):
        ck.restore(tmp_path / "step_9.ckpt", like)
    with pytest.raises(FileNotFoundError, match="nor does its folder"):
        ck.restore(tmp_path / "nope" / "x.ckpt", like)
    with pytest.raises(ck.CheckpointNotFoundError, match="is a folder"):
        ck.restore(tmp_path, like)


def test_other_model_lists_keys_and_shapes(tmp_path):
    path = ck.save(tmp_path / "a.ckpt", busy_state(hidden=8, out=3))
    other = TrainState.create(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 5),
                            torch.nn.Linear(5, 2)),
        tiny_tx(),
        loss_scale=True,
    )
    with pytest.raises(ck.CheckpointMismatchError) as e:
        ck.restore(path, other)
    msg = str(e.value)
    assert "Missing in the checkpoint" in msg and "params/4.weight" in msg
    assert "Shape mismatches" in msg and "params/3.weight: checkpoint (3, 8) vs model (5, 8)" in msg
    like = TrainState.create(make_model(), tiny_tx())  # no loss scale: checkpoint has extra leaves
    with pytest.raises(ck.CheckpointMismatchError, match=r"Unexpected in the checkpoint(.|\n)*loss_scale/0"):
        ck.restore(path, like)


def test_dtype_mismatch_is_reported(tmp_path):
    path = ck.save(tmp_path / "a.ckpt", busy_state())
    like = busy_state()
    like = like.replace(params={k: v.double() for k, v in like.params.items()})
    with pytest.raises(ck.CheckpointMismatchError, match="checkpoint dtype float32 vs model float64"):
        ck.restore(path, like)


def test_truncated_names_intact_previous(tmp_path):
    state = busy_state()
    ck.save(tmp_path / "step_1.ckpt", state)
    time.sleep(0.01)
    bad = ck.save(tmp_path / "step_2.ckpt", state)
    data = bad.read_bytes()
    for cut in (len(data) - 10, 100, 5):
        bad.write_bytes(data[:cut])
        with pytest.raises(ck.CheckpointCorruptError, match=r"truncated(.|\n)*step_1\.ckpt is intact"):
            ck.restore(bad, state)


def test_bitflip_is_corrupt(tmp_path):
    state = busy_state()
    bad = ck.save(tmp_path / "only.ckpt", state)
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0x10
    bad.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointCorruptError, match="checksum(.|\n)*No other intact checkpoint"):
        ck.restore(bad, state)
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ck.CheckpointCorruptError, match="corrupt or not a pimm_fn checkpoint"):
        ck.restore(bad, state)


def test_newer_schema_is_refused(tmp_path):
    import json
    import struct

    path = ck.save(tmp_path / "a.ckpt", busy_state())
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    payload = json.loads(header["__metadata__"]["pimm_fn"])
    payload["schema"] = ck.SCHEMA_VERSION + 1
    header["__metadata__"]["pimm_fn"] = json.dumps(payload)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n :])
    with pytest.raises(ck.CheckpointCorruptError, match="Upgrade pimm_fn"):
        ck.restore(path, busy_state())


class _Evil:
    """Unpickling this runs a shell command (the classic pickle attack)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_never_runs(tmp_path):
    marker = tmp_path / "PWNED"
    like = busy_state()
    raw = tmp_path / "evil.ckpt"
    raw.write_bytes(pickle.dumps({"state_dict": _Evil(marker)}, protocol=2))
    zipped = tmp_path / "evil.pth"
    torch.save({"state_dict": _Evil(marker), "epoch": 1}, zipped)

    with pytest.raises(ck.UnsafeCheckpointError, match="never unpickles"):
        ck.restore(raw, like)
    with pytest.raises(ck.UnsafeCheckpointError, match="torch.save"):
        ck.restore(zipped, like)
    for p in (raw, zipped):
        with pytest.raises(ck.UnsafeCheckpointError, match=r"trust_pickle=True") as e:
            ck.import_seed_checkpoint(p, like)
    assert "system" in str(e.value)  # names the offending global
    assert not marker.exists()

    # Control: the payload is real, so the refusals above are what kept it from running.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ck.CheckpointError):
            ck.import_seed_checkpoint(zipped, like, trust_pickle=True)
    assert marker.exists()


# --------------------------------------------------------------------------- CheckpointDir


def test_dir_latest_keep_last_and_best(tmp_path):
    d = ck.CheckpointDir(tmp_path / "run", keep_last=2)
    assert d.latest() is None and d.best() is None
    state = busy_state()
    for n in range(1, 7):
        d.save(state.replace(step=torch.tensor(n)), extra={"n": n}, best=(n == 2))
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["best.ckpt", "latest", "step_2.ckpt", "step_5.ckpt", "step_6.ckpt"]
    assert d.latest().name == "step_6.ckpt"
    _, extra = ck.restore(d.best(), state)
    assert extra == {"n": 2}
    # a custom name is not pruned and becomes latest
    p = d.save(state, name="final", keep_last=1)
    assert p.name == "final.ckpt" and d.latest() == p
    assert (tmp_path / "run" / "final.ckpt").exists() and (tmp_path / "run" / "step_2.ckpt").exists()
    assert not (tmp_path / "run" / "step_5.ckpt").exists()
    # best moves: the old best step file is now prunable, best.ckpt follows
    d.save(state, step=7, best=True, keep_last=1)
    assert not (tmp_path / "run" / "step_2.ckpt").exists()
    assert ck.restore(d.best(), state)[1] is None


def test_prune_never_deletes_latest_target(tmp_path):
    d = ck.CheckpointDir(tmp_path)
    state = busy_state()
    for n in (10, 20, 30):
        d.save(state, step=n)
    (tmp_path / "latest").write_text("step_10.ckpt\n")  # e.g. resumed from an older one
    d.prune(0)
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["step_10.ckpt"]


def test_latest_falls_back_and_ignores_tmp(tmp_path):
    d = ck.CheckpointDir(tmp_path)
    state = busy_state()
    d.save(state, step=1)
    time.sleep(0.01)
    d.save(state, step=2)
    # garbage a killed writer could leave: never a checkpoint
    (tmp_path / ".step_3.ckpt.999999.deadbeef.tmp").write_bytes(b"partial")
    (tmp_path / "step_4.ckpt.tmp").write_bytes(b"partial")
    assert d.latest().name == "step_2.ckpt"
    # pointer to a truncated file -> newest complete file
    data = (tmp_path / "step_2.ckpt").read_bytes()
    (tmp_path / "step_2.ckpt").write_bytes(data[: len(data) // 2])
    assert d.latest().name == "step_1.ckpt"
    # pointer empty (its bytes never reached the disk) or missing -> scan
    (tmp_path / "latest").write_bytes(b"")
    assert d.latest().name == "step_1.ckpt"
    (tmp_path / "latest").unlink()
    assert d.latest().name == "step_1.ckpt"
    assert all(not p.name.endswith(".tmp") for p in d.checkpoints())
    # the next save removes the dead writer's temp file (pid 999999 is not running)
    d.save(state, step=5)
    assert not (tmp_path / ".step_3.ckpt.999999.deadbeef.tmp").exists()


def test_write_order_is_durable(tmp_path, monkeypatch):
    """fsync(file) before its rename, the pointer renamed only after that, one fsync(dir) for both.

    The pointer's bytes are not fsynced: after a power loss it may read empty, and latest()
    then takes the newest complete file (test_latest_falls_back_and_ignores_tmp)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"
        events.append(("fsync", kind))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(dst).name))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    ck.CheckpointDir(tmp_path).save(busy_state(), step=3)
    assert events == [
        ("fsync", "file"),
        ("replace", "step_3.ckpt"),
        ("replace", "latest"),
        ("fsync", "dir"),
    ]


# A zygote imports torch once and forks one writer per round, so several kill rounds cost
# one interpreter start-up. Each writer is a real process, killed with a real SIGKILL; the
# zygote reaps it and reports how it died.
_ZYGOTE = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    import torch
    torch.set_num_threads(1)
    from typing import NamedTuple
    from pimm_fn import TrainState, checkpoint as ck
    from pimm_fn.optim.base import GradientTransformation
    from pimm_fn.tree import tree_map

    class TinyState(NamedTuple):
        m: dict
        count: torch.Tensor

    tx = GradientTransformation(
        lambda p: TinyState({k: torch.zeros_like(v) for k, v in p.items()}, torch.zeros((), dtype=torch.int64)),
        None,
    )
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    like = TrainState.create(model, tx, loss_scale=True)

    def writer(mode):
        d = ck.CheckpointDir(sys.argv[2], keep_last=3)
        latest = d.latest()
        start = 0 if latest is None else ck.restore(latest, like)[1]["i"] + 1
        now = [start]

        def hang(what):
            print(what, flush=True)
            time.sleep(600)

        if mode == "hang_in_write":  # data written, neither fsynced nor renamed
            real = os.fsync
            os.fsync = lambda fd: (
                hang("in_write") if now[0] > start and not os.path.isdir(f"/proc/self/fd/{fd}") else real(fd)
            )
        if mode == "hang_before_pointer":  # checkpoint renamed, pointer not yet moved
            real_r = os.replace
            os.replace = lambda s, t: hang("before_pointer") if now[0] > start and t.name == "latest" else real_r(s, t)
        for i in range(start, start + 100_000):
            now[0] = i
            s = like.replace(
                step=torch.tensor(i),
                params=tree_map(lambda t: torch.full_like(t, float(i)), like.params),
                opt_state=tree_map(lambda t: torch.full_like(t, i), like.opt_state),
                cursor=like.cursor.replace(position=i),
            )
            d.save(s, step=i, extra={"i": i})
            print(f"saved {i}", flush=True)

    print("ready", flush=True)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                writer(line.strip())
            finally:
                os._exit(3)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.WIFSIGNALED(status) and os.WTERMSIG(status)}", flush=True)
    """
)


def _wait_line(proc, want, timeout=120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r, _, _ = select.select([proc.stdout], [], [], 0.5)
        if r:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"process exited before printing {want!r}: {proc.stderr.read()}")
            if line.startswith(want):
                return line.strip()
    raise AssertionError(f"no {want!r} within {timeout}s")


def test_sigkill_at_any_moment_leaves_a_restorable_latest(tmp_path):
    script = tmp_path / "zygote.py"
    script.write_text(_ZYGOTE)
    root = tmp_path / "run"
    rng = random.Random(1234)
    modes = ["random"] * 5 + ["hang_in_write", "hang_before_pointer"] + ["random"] * 3
    like = TrainState.create(
        torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)),
        GradientTransformation(tiny_tx().init, None),
        loss_scale=True,
    )
    zygote = subprocess.Popen(
        [sys.executable, str(script), str(REPO), str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen_tmp = 0
    last_i = -1
    try:
        _wait_line(zygote, "ready")
        for mode in modes:
            zygote.stdin.write(mode + "\n")
            zygote.stdin.flush()
            pid = int(_wait_line(zygote, "pid").split()[1])
            _wait_line(zygote, "saved")  # at least one new checkpoint this round
            if mode == "random":
                time.sleep(rng.uniform(0.0, 0.25))
            else:
                _wait_line(zygote, mode.removeprefix("hang_"))
            os.kill(pid, signal.SIGKILL)
            assert _wait_line(zygote, "exit") == f"exit {int(signal.SIGKILL)}"

            leftovers = [p for p in root.iterdir() if p.name.endswith(".tmp")]
            seen_tmp += bool(leftovers)
            if mode == "hang_in_write":
                assert leftovers, "the kill during a write must leave an unfinished temp file"
            d = ck.CheckpointDir(root)
            latest = d.latest()
            assert latest is not None and latest.suffix == ".ckpt" and latest.name.startswith("step_")
            assert all(p.suffix == ".ckpt" for p in d.checkpoints())
            state, extra = ck.restore(latest, like)
            i = extra["i"]
            assert latest.name == f"step_{i}.ckpt" and i > last_i
            assert int(state.step) == i and state.cursor.position == i
            assert all(bool((t == float(i)).all()) for t in state.params.values())
            assert all(bool((t == i).all()) for t in state.opt_state.m.values())
            if mode == "hang_before_pointer":
                # the newer file is complete but uncommitted: latest stays on the committed one
                assert (root / f"step_{i + 1}.ckpt").exists()
            last_i = i
    finally:
        zygote.kill()
        zygote.wait()
    assert seen_tmp >= 1


# --------------------------------------------------------------------------- seed import


def _train_seed_model(steps=3):
    """A real torch run: AdamW, GradScaler, BatchNorm buffers, like the seed trainer's."""
    torch.manual_seed(3)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(16, 4)).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    return model, opt, sched, scaler


def _seed_ckpt(model, opt, sched, scaler, prefix="module."):
    return {
        "epoch": 4,
        "state_dict": {prefix + k: v for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
    }


def test_import_seed_checkpoint(tmp_path):
    """A real torch run (AdamW, GradScaler, BatchNorm, DDP prefix) imports into a TrainState."""
    from pimm_fn.optim import adamw

    model, opt, sched, scaler = _train_seed_model()
    path = tmp_path / "model_last.pth"
    torch.save(_seed_ckpt(model, opt, sched, scaler), path)
    like = TrainState.create(make_model(), adamw(1e-2, weight_decay=0.05), loss_scale=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a full match warns about nothing
        state = ck.import_seed_checkpoint(path, like)
    for k, v in model.named_parameters():
        assert_bitwise(state.params[k], v.detach())
    for k, v in model.named_buffers():
        assert_bitwise(state.buffers[k], v)
    assert int(state.buffers["1.num_batches_tracked"]) == 3
    # optimizer moments through pimm_fn.optim.torch_interop, in named_parameters order
    torch_state = opt.state_dict()["state"]
    for i, (k, _) in enumerate(model.named_parameters()):
        assert_bitwise(state.opt_state.mu[k], torch_state[i]["exp_avg"])
        assert_bitwise(state.opt_state.nu[k], torch_state[i]["exp_avg_sq"])
    assert int(state.opt_state.count) == 3
    assert float(state.loss_scale.scale) == scaler.get_scale() == 65536.0
    assert state.loss_scale.scale.dtype == torch.float32
    assert int(state.loss_scale.growth_tracker) == 3 and state.loss_scale.growth_tracker.dtype == torch.int32
    assert state.cursor.epoch == 4
    # the imported state round-trips through a pimm_fn checkpoint
    restored, _ = ck.restore(ck.save(tmp_path / "a.ckpt", state), like)
    assert_states_bitwise(restored, state)


def test_import_seed_optimizer_adapter(monkeypatch):
    """A custom importer gets the torch state and the count; a missing interop only warns."""
    model, opt, sched, scaler = _train_seed_model()
    like = TrainState.create(make_model(), tiny_tx(), loss_scale=True)
    seen = {}

    def importer(sd, template, count):
        seen.update(sd=sd, template=template, count=count)
        return template._replace(count=torch.tensor(7))

    state = ck.import_seed_checkpoint(_seed_ckpt(model, opt, sched, scaler), like, optimizer_importer=importer)
    assert seen["template"] is like.opt_state and seen["count"] is None  # AdamW carries its step
    assert set(seen["sd"]) == {"state", "param_groups"} and int(state.opt_state.count) == 7
    # SGD saves no step: the seed scheduler's last_epoch is the count
    sgd_sd = {"state": {}, "param_groups": [{"params": [0, 1, 2, 3, 4, 5]}]}
    ck.import_seed_checkpoint(
        {"state_dict": model.state_dict(), "optimizer": sgd_sd, "scheduler": {"last_epoch": 11}},
        like,
        optimizer_importer=importer,
    )
    assert seen["count"] == 11

    monkeypatch.setitem(sys.modules, "pimm_fn.optim.torch_interop", None)  # as if not written yet
    with pytest.warns(UserWarning, match="optimizer state not imported"):
        state = ck.import_seed_checkpoint(_seed_ckpt(model, opt, sched, scaler), like)
    assert state.opt_state is like.opt_state  # fresh optimizer state, weights imported
    assert_bitwise(state.params["0.weight"], model[0].weight.detach())
    assert int(state.loss_scale.growth_tracker) == 3 and state.cursor.epoch == 4


def test_import_weights_only_rename_and_shape_skip(tmp_path):
    model, opt, sched, scaler = _train_seed_model()
    ckpt = _seed_ckpt(model, opt, sched, scaler, prefix="module.backbone.")
    bigger_head = TrainState.create(make_model(out=5), tiny_tx(), loss_scale=True)

    with pytest.raises(ck.CheckpointMismatchError, match=r"nothing was loaded(.|\n)*rename="):
        ck.import_seed_checkpoint(ckpt, bigger_head, resume=False)
    with pytest.warns(UserWarning) as rec:
        state = ck.import_seed_checkpoint(ckpt, bigger_head, rename={"backbone.": ""}, resume=False)
    msg = "\n".join(str(w.message) for w in rec)
    assert "3.weight: checkpoint (3, 8) vs model (5, 8)" in msg and "3.bias: checkpoint (3,) vs model (5,)" in msg
    assert_bitwise(state.params["0.weight"], model[0].weight.detach())
    assert_bitwise(state.params["3.weight"], bigger_head.params["3.weight"])  # skipped: kept as initialised
    assert state.cursor.epoch == 0 and state.loss_scale is bigger_head.loss_scale  # resume=False
    with pytest.raises(ck.CheckpointMismatchError, match="strict=True"):
        ck.import_seed_checkpoint(ckpt, bigger_head, rename={"backbone.": ""}, strict=True)
    # a callable rename, and a bare state_dict file (pretrained weights)
    bare = tmp_path / "weights.pth"
    torch.save({"net." + k: v for k, v in model.state_dict().items()}, bare)
    like = TrainState.create(make_model(), tiny_tx())
    state = ck.import_seed_checkpoint(bare, like, rename=lambda k: k.removeprefix("net."))
    assert_bitwise(state.buffers["1.running_var"], model[1].running_var)


def test_import_seed_bad_inputs(tmp_path):
    like = busy_state()
    torch.save({"x": 1}, tmp_path / "model_best.pth")
    with pytest.raises(ck.CheckpointNotFoundError, match=r"model_last\.pth does not exist(.|\n)*model_best\.pth"):
        ck.import_seed_checkpoint(tmp_path / "model_last.pth", like)
    with pytest.raises(ck.CheckpointError, match=r"no 'state_dict'.*'x'"):
        ck.import_seed_checkpoint(tmp_path / "model_best.pth", like)
    model, opt, sched, scaler = _train_seed_model(1)
    torch.save(_seed_ckpt(model, opt, sched, scaler), tmp_path / "cut.pth")
    data = (tmp_path / "cut.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(ck.CheckpointCorruptError, match="truncated or corrupt"):
        ck.import_seed_checkpoint(tmp_path / "cut.pth", like)
    mine = ck.save(tmp_path / "mine.ckpt", like)
    with pytest.raises(ck.CheckpointError, match="use restore|load it with restore"):
        ck.import_seed_checkpoint(mine, like)


# --------------------------------------------------------------------------- the file format


def test_shared_memory_leaves_round_trip(tmp_path):
    """Leaves that share memory (tied weights, a leaf kept in extra too) are saved, each
    with its own bytes; the safetensors library alone would refuse them."""
    state = busy_state()
    tied = dict(state.params)
    tied["3.bias"] = tied["0.weight"][0, :3]  # a view into another leaf's storage
    state = state.replace(params=tied)
    extra = {"w": state.params["0.weight"], "again": state.params["0.weight"]}
    like = fresh_like().replace(params={**fresh_like().params, "3.bias": torch.zeros(3)})
    restored, got = ck.restore(ck.save(tmp_path / "a.ckpt", state, extra=extra), like)
    assert_states_bitwise(restored, state)
    assert_bitwise(got["w"], state.params["0.weight"]) and assert_bitwise(got["again"], state.params["0.weight"])
    assert got["w"].untyped_storage().data_ptr() != restored.params["0.weight"].untyped_storage().data_ptr()


def test_schema_1_files_still_restore(tmp_path):
    """A schema 1 file (pimm_fn's own writer: tensors back to back in payload order, the
    checksum over the data in file order) restores bitwise under schema 2's rules."""
    import hashlib
    import json
    import struct

    from safetensors.torch import load_file

    state = busy_state()
    new = ck.save(tmp_path / "new.ckpt", state, extra=EXTRA)
    raw = new.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    payload = json.loads(meta["pimm_fn"])
    payload["schema"] = 1
    payload_raw = json.dumps(payload, separators=(",", ":")).encode()
    tensors = load_file(str(new))
    digest, header, blobs, offset = hashlib.sha256(payload_raw), {}, [], 0
    for key, leaf in payload["leaves"].items():
        if leaf["kind"] != "tensor":
            continue
        t = tensors[key]
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        code = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32", "bool": "BOOL",
                "uint8": "U8", "float64": "F64"}[leaf["dtype"]]
        header[key] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        digest.update(blob)
        blobs.append(blob)
    header["__metadata__"] = {"pimm_fn": payload_raw.decode(), "pimm_fn_sha256": digest.hexdigest()}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    old = tmp_path / "old.ckpt"
    old.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    restored, extra = ck.restore(old, fresh_like())
    assert_states_bitwise(restored, state)
    assert_extra_equal(extra, EXTRA)
    data = bytearray(old.read_bytes())
    data[-3] ^= 0x10
    old.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointCorruptError, match="checksum"):
        ck.verify(old)
