"""compile_step(cache=...): a compiled step saved to disk and loaded by the next CompiledStep."""
import pytest
import torch

from pimm_fn import TrainState, compile_step, optim, schedules, steps
from pimm_fn.compile import cache as step_cache
from pimm_fn.models import MLPClassifier

THRESHOLD = 1e-3  # a module-level constant the user core below reads


def _state(lr=1e-3, wd=0.01, hidden=32, seed=0, total=100, tx=None):
    torch.manual_seed(seed)
    model = MLPClassifier(8, 3, hidden=(hidden,))
    return TrainState.create(model, tx or optim.adamw(schedules.one_cycle(total, lr), weight_decay=wd), seed=seed)


def _batch(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 8, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def _run(step, state, batches):
    for b in batches:
        state, metrics = step(state, b)
    return state, metrics


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("step_cache")
    step = compile_step(steps.supervised(clip_grad=1.0), cache=folder)
    state, metrics = _run(step, _state(), [_batch(seed=i) for i in range(3)])
    return folder, step, state, metrics


def test_a_second_step_loads_the_saved_one_and_matches_bitwise(saved):
    folder, first, state_a, metrics_a = saved
    assert not first.loaded_from_cache and first.compile_count == 1
    files = list(folder.iterdir())
    assert [f.name for f in files] == [first.cache_path.split("/")[-1]]
    again = compile_step(steps.supervised(clip_grad=1.0), cache=folder)
    state_b, metrics_b = _run(again, _state(), [_batch(seed=i) for i in range(3)])
    assert again.loaded_from_cache and again.compile_count == 0 and again.cache_path == first.cache_path
    for k in state_a.params:
        assert torch.equal(state_a.params[k], state_b.params[k])
    assert all(torch.equal(metrics_a[k], metrics_b[k]) for k in metrics_a)
    assert state_b.rng == state_a.rng and int(state_b.step) == 3
    # inputs its guards reject (a new batch size) compile as without a cache, and agree with eager
    b = _batch(n=10, seed=7)
    new, m = again(state_b, b)
    ref, m_ref = steps.supervised(clip_grad=1.0)(state_b, b)
    assert again.compile_count == 1 and "guards rejected" in again.recompile_reasons[0]
    assert torch.allclose(m["loss"], m_ref["loss"], atol=1e-6)


def test_anything_baked_into_the_step_changes_the_key():
    core = steps.supervised(clip_grad=1.0).core
    base = step_cache.fingerprint(core, _state())
    assert step_cache.fingerprint(steps.supervised(clip_grad=1.0).core, _state()) == base
    assert step_cache.fingerprint(core, _state(seed=3)) == base  # weights and seeds are inputs, not code
    # The schedules' and the optimizer's numbers are inputs of the step (pimm_fn.hyper), not code.
    assert step_cache.fingerprint(core, _state(lr=1e-2, total=300, wd=0.1)) == base
    adam = optim.adam(schedules.one_cycle(100, 1e-3))
    changed = {
        "clip_grad": step_cache.fingerprint(steps.supervised(clip_grad=0.5).core, _state()),
        "no weight decay": step_cache.fingerprint(core, _state(wd=0.0)),
        "b2": step_cache.fingerprint(core, _state(tx=optim.adamw(schedules.one_cycle(100, 1e-3), b2=0.99))),
        "adam": step_cache.fingerprint(core, _state(tx=adam)),
        "three phases": step_cache.fingerprint(core, _state(tx=optim.adamw(schedules.one_cycle(
            100, 1e-3, three_phase=True)))),
        "width": step_cache.fingerprint(core, _state(hidden=16)),
        "accumulate": step_cache.fingerprint(steps.supervised(clip_grad=1.0, accumulate=2).core, _state()),
        "loss key": step_cache.fingerprint(steps.supervised(clip_grad=1.0, loss_key="nll").core, _state()),
    }
    evaluating = _state()
    evaluating.model.eval()
    changed["eval mode"] = step_cache.fingerprint(core, evaluating)
    for what, key in changed.items():
        assert key != base, what

    # A setting kept as a plain attribute of the model (the loss a forward picks) is part of the
    # step. The hasher once recorded the ids of temporaries it had freed, so a later dict
    # could take such an id and hash as already seen: these two keys came out equal.
    class _Configured(torch.nn.Module):
        def __init__(self, loss):
            super().__init__()
            self.fc, self.loss = torch.nn.Linear(16, 4), loss

        def forward(self, batch):
            return {"loss": self.fc(batch["x"]).logsumexp(1).mean()}

    def configured(loss):
        return TrainState.create(_Configured(loss), optim.sgd(0.1), seed=0)

    assert step_cache.fingerprint(core, configured("ce")) != step_cache.fingerprint(core, configured("ce+lovasz"))

    # A schedule in the core's own closure is hashed by value: there its numbers may be constants.
    def weighted(weight):
        return lambda state, batch: (state, {"w": weight(state.step)})

    assert step_cache.fingerprint(weighted(schedules.constant(0.5)), _state()) != \
        step_cache.fingerprint(weighted(schedules.constant(0.25)), _state())

    def user_core(state, batch):
        return state, {"t": torch.tensor(THRESHOLD)}

    before = step_cache.fingerprint(user_core, _state())
    globals()["THRESHOLD"] = 2e-3
    try:
        assert step_cache.fingerprint(user_core, _state()) != before  # a global the code reads
    finally:
        globals()["THRESHOLD"] = 1e-3
    inner = _state().replace(rng=None, cursor=None)
    assert step_cache.leaves_key(inner, _batch(16)) != step_cache.leaves_key(inner, _batch(8))
    assert step_cache.leaves_key(inner, _batch(16)) == step_cache.leaves_key(inner, _batch(16, seed=5))
    # a dynamic=True step's artifact serves any size its guards accept: sizes are not in the key
    unshaped = step_cache.leaves_key(inner, _batch(16), shapes=False)
    assert unshaped == step_cache.leaves_key(inner, _batch(8), shapes=False)


def test_other_learning_rate_and_length_load_the_saved_step_and_use_their_numbers(saved):
    """The peak lr, the run's length and the weight decay are the step's inputs: a run with
    other values loads the saved step, and computes with its own values, as eager does."""
    folder, first, _, _ = saved
    again = compile_step(steps.supervised(clip_grad=1.0), cache=folder)
    state = eager = _state(lr=3e-2, total=7, wd=0.2)
    eager_step = compile_step(steps.supervised(clip_grad=1.0), eager=True)
    for i in range(3):
        state, metrics = again(state, _batch(seed=i))
        eager, eager_metrics = eager_step(eager, _batch(seed=i))
        assert torch.equal(metrics["lr"], eager_metrics["lr"])
    assert again.loaded_from_cache and again.compile_count == 0 and again.cache_path == first.cache_path
    assert float(metrics["lr"]) == pytest.approx(float(schedules.one_cycle(7, 3e-2)(torch.tensor(2))))
    for k in state.params:
        torch.testing.assert_close(state.params[k], eager.params[k], rtol=1e-5, atol=1e-6)


def test_a_damaged_file_is_compiled_again_and_replaced(saved, tmp_path):
    folder, first, _, _ = saved
    broken = tmp_path / "c"
    broken.mkdir()
    target = broken / first.cache_path.split("/")[-1]
    target.write_bytes(b"not a compiled step")
    step = compile_step(steps.supervised(clip_grad=1.0), cache=broken)
    with pytest.warns(RuntimeWarning, match="could not be loaded") as caught:
        step(_state(), _batch())
    assert [w.filename for w in caught if "could not be loaded" in str(w.message)] == [__file__]
    assert not step.loaded_from_cache and step.compile_count == 1
    assert target.read_bytes() != b"not a compiled step"
    with pytest.raises(TypeError, match="cache"):
        compile_step(steps.supervised(), cache=3)


def test_the_key_is_the_same_in_every_process(tmp_path):
    # Hash seeds and object addresses differ per process; the key must not depend on them.
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from pimm_fn import TrainState, optim, schedules, steps\nfrom pimm_fn.compile import cache as step_cache\n"
        "from pimm_fn.models import PointSegNet, PTv3\n"
        "torch.manual_seed(0)\n"
        "for m in (PointSegNet(in_channels=4, num_classes=3), PTv3(4, 3, loss='ce+lovasz')):\n"
        "    s = TrainState.create(m, optim.adamw(schedules.one_cycle(100, 1e-3)), seed=0)\n"
        "    print(step_cache.fingerprint(steps.supervised(clip_grad=1.0).core, s))\n"
    )
    # ... nor on the working directory (dynamo's config names a debug folder under it).
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, cwd=cwd).stdout.strip()
            for seed, cwd in (("1", None), ("2", "/"), ("3", tmp_path))}
    assert len(keys) == 1


class _DropoutBN(torch.nn.Module):
    """Dropout (the boundary's RNG) and BatchNorm (buffers) through a cached step."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.3)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, batch):
        logits = self.out(self.drop(torch.relu(self.bn(self.fc(batch["x"])))))
        return {"loss": torch.nn.functional.cross_entropy(logits, batch["y"])}


def test_dropout_and_batchnorm_through_a_loaded_step_equal_the_plain_compiled_step(tmp_path):
    def fresh():
        torch.manual_seed(1)
        return TrainState.create(_DropoutBN(), optim.adamw(schedules.one_cycle(100, 1e-3)), seed=4)

    batches = [_batch(seed=i) for i in range(3)]
    plain, _ = _run(compile_step(steps.supervised(clip_grad=1.0)), fresh(), batches)
    _run(compile_step(steps.supervised(clip_grad=1.0), cache=tmp_path), fresh(), batches)
    loaded = compile_step(steps.supervised(clip_grad=1.0), cache=tmp_path)
    got, _ = _run(loaded, fresh(), batches)
    assert loaded.loaded_from_cache
    for group in ("params", "buffers"):
        for k, v in getattr(plain, group).items():
            assert torch.equal(v, getattr(got, group)[k]), (group, k)


def test_a_step_loads_under_the_inductor_options_it_was_compiled_with(tmp_path):
    # A load re-derives every kernel's inductor-cache key from the inductor config in force,
    # so a step compiled with options= and loaded without them would miss all its kernels
    # and compile them again. Two fresh processes on a fresh inductor cache: the second
    # loads the step and must add no kernel to that cache.
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from pimm_fn import TrainState, compile_step, optim, schedules, steps\n"
        "from pimm_fn.models import MLPClassifier\n"
        "torch.manual_seed(0)\n"
        "s = TrainState.create(MLPClassifier(8, 3, hidden=(24,)), optim.adamw(schedules.constant(1e-3)), seed=0)\n"
        "step = compile_step(steps.supervised(), cache=sys.argv[1],\n"
        "                    options={'cpp_cache_precompile_headers': False})\n"
        "s, m = step(s, {'x': torch.ones(12, 8), 'y': torch.zeros(12, dtype=torch.long)})\n"
        "print(step.loaded_from_cache, step.compile_count, float(m['loss']))\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def run():
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "steps")], capture_output=True,
                             text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.split()

    def kernels():
        return sorted(p.name for p in (tmp_path / "inductor").rglob("*.so"))

    first = run()
    built = kernels()
    assert first[:2] == ["False", "1"] and built
    second = run()
    assert second == ["True", "0", first[2]]
    assert kernels() == built


def test_the_folder_is_bounded_least_recently_used_first(tmp_path, monkeypatch):
    import os

    paths = []
    for i in range(4):
        p = tmp_path / f"step-{i}.pt2step"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (1000 + i, 1000 + i))
        paths.append(p)
    os.utime(paths[0], (2000, 2000))  # loaded lately: the most recently used
    dead = tmp_path / ".step-9.pt2step.999999999.0123abcd.tmp"  # a writer that is gone
    dead.write_bytes(b"partial")
    mine = tmp_path / f".step-8.pt2step.{os.getpid()}.0123abcd.tmp"  # a writer still running
    mine.write_bytes(b"partial")
    removed = step_cache.prune(tmp_path, limit=2500, keep=paths[3])
    assert sorted(p.name for p in removed) == sorted([dead.name, "step-1.pt2step", "step-2.pt2step"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, "step-0.pt2step", "step-3.pt2step"])
    monkeypatch.setenv("PIMM_FN_STEP_CACHE_MAX_MB", "lots")
    with pytest.raises(ValueError, match="PIMM_FN_STEP_CACHE_MAX_MB"):
        step_cache.max_bytes()
    # ... and a step with the cache on says so at its first call (it claimed a failed save)
    with pytest.raises(ValueError, match="PIMM_FN_STEP_CACHE_MAX_MB='lots' is not a number of MiB"):
        compile_step(steps.supervised(), cache=tmp_path / "steps")(_state(), _batch())
    monkeypatch.setenv("PIMM_FN_STEP_CACHE_MAX_MB", "0.5")
    assert step_cache.max_bytes() == 1 << 19


def test_the_cache_is_on_by_default_for_a_whole_step_and_the_environment_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.delenv("PIMM_FN_STEP_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    core = steps.supervised()
    assert compile_step(core).cache_dir == tmp_path / "pimm_fn" / "steps"
    for off in (compile_step(core, cache=False), compile_step(core, eager=True),
                compile_step(core, fullgraph=False)):
        assert off.cache_dir is None
    monkeypatch.setenv("PIMM_FN_STEP_CACHE", str(tmp_path / "mine"))
    assert compile_step(core).cache_dir == tmp_path / "mine"
    # CUDA-graph steps keep the cache off unless compile_step itself is given one
    assert compile_step(core, mode="reduce-overhead").cache_dir is None
    assert compile_step(core, mode="reduce-overhead", cache=tmp_path / "cg").cache_dir == tmp_path / "cg"
    monkeypatch.setenv("PIMM_FN_STEP_CACHE", "off")
    assert compile_step(core).cache_dir is None
    assert compile_step(core, cache=True).cache_dir == tmp_path / "pimm_fn" / "steps"


def test_a_cache_folder_the_environment_names_but_cannot_hold_warns_and_names_no_artifact(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("PIMM_FN_STEP_CACHE", str(blocker / "steps"))  # under a file: never a folder
    step = compile_step(steps.supervised(clip_grad=1.0))
    with pytest.warns(RuntimeWarning, match="could not save the compiled step to .*a_file/steps"):
        state, _ = _run(step, _state(), [_batch(seed=0), _batch(seed=1)])
    assert int(state.step) == 2 and step.cache_path is None and not step.loaded_from_cache


class _Counter:
    """A step whose core is a bound method (as GRPO's is): the precompile API cannot save it."""

    def core(self, state, batch):
        return state.replace(step=state.step + 1), {"total": batch["x"].sum()}


def test_a_step_the_cache_cannot_hold_warns_only_when_compile_step_was_given_the_cache(tmp_path, monkeypatch):
    import warnings

    from pimm_fn.compile import Step

    monkeypatch.setenv("PIMM_FN_STEP_CACHE", str(tmp_path / "env"))  # a setting for every step: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        quiet = compile_step(Step(_Counter().core, name="counter"))
        quiet(_state(), _batch())
    assert quiet.cache_path is None and int(quiet(_state(), _batch())[0].step) == 1
    asked = compile_step(Step(_Counter().core, name="counter"), cache=tmp_path / "arg")
    with pytest.warns(RuntimeWarning, match="bound method"):
        asked(_state(), _batch())


class _PointHead(torch.nn.Module):
    """A point model: per-point layers, a per-cloud mean through ``offset``, a cloud label."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 16)
        self.out = torch.nn.Linear(32, 3)

    def forward(self, batch):
        h = torch.relu(self.fc(batch["feat"]))
        offset = batch["offset"]
        counts = torch.diff(offset, prepend=offset.new_zeros(1))
        cloud = torch.repeat_interleave(torch.arange(offset.shape[0]), counts, output_size=h.shape[0])
        means = torch.zeros(offset.shape[0], 16).index_add_(0, cloud, h) / counts[:, None]
        logits = self.out(torch.cat([h, means[cloud]], dim=1))
        return {"loss": torch.nn.functional.cross_entropy(logits, batch["segment"])}


def _points(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    return {"feat": torch.randn(n, 4, generator=g), "segment": torch.randint(0, 3, (n,), generator=g),
            "offset": torch.tensor(sizes).cumsum(0), "name": [f"batch{seed}/cloud{i}" for i in range(len(sizes))]}


@pytest.mark.usefixtures("one_thread")  # the gather's backward scatters: bitwise only on one thread
def test_one_saved_point_step_serves_every_point_count_in_the_next_process(tmp_path):
    def fresh():
        torch.manual_seed(2)
        return TrainState.create(_PointHead(), optim.adamw(schedules.one_cycle(100, 1e-3)), seed=0)

    batches = [_points(s, seed=i) for i, s in enumerate([(70, 50), (33, 91), (120, 7), (64, 64)])]
    first = compile_step(steps.supervised(), cache=tmp_path)
    state_a, _ = _run(first, fresh(), batches)
    assert first.compile_count == 1 and not first.loaded_from_cache, first.recompile_reasons
    assert len(list(tmp_path.glob("*.pt2step"))) == 1
    again = compile_step(steps.supervised(), cache=tmp_path)
    state_b, _ = _run(again, fresh(), batches)
    assert again.loaded_from_cache and again.compile_count == 0, again.recompile_reasons
    for k in state_b.params:  # the same kernels: bitwise what the process that saved it computed
        assert torch.equal(state_a.params[k], state_b.params[k])
    b = _points((9, 200), seed=9)  # a point count neither process has seen
    new, m = again(state_b, b)
    ref, m_ref = steps.supervised()(state_b, b)
    assert again.compile_count == 0 and torch.allclose(m["loss"], m_ref["loss"], atol=1e-6)
    # Another run (a new seed, a resumed epoch) starts on other clouds: their names are not
    # read by the step, so the same artifact serves it.
    shuffled = compile_step(steps.supervised(), cache=tmp_path)
    _run(shuffled, fresh(), batches[2:] + batches[:2])
    assert shuffled.loaded_from_cache and shuffled.compile_count == 0, shuffled.recompile_reasons


def test_a_dynamic_step_is_loaded_and_serves_every_batch_size_without_compiling(tmp_path):
    # A dynamic step's shape guards look up dynamo's module aliases, which a loaded
    # artifact's guard scope lacked: every call failed them and compiled the step again.
    batches = [_batch(16, seed=0), _batch(10, seed=1)]
    first = compile_step(steps.supervised(), dynamic=True, cache=tmp_path)
    state_a, _ = _run(first, _state(), batches)
    assert first.compile_count == 1, first.recompile_reasons  # dynamo's restarted trace is not a compile
    again = compile_step(steps.supervised(), dynamic=True, cache=tmp_path)
    state_b, _ = _run(again, _state(), batches)
    assert again.loaded_from_cache and again.compile_count == 0, again.recompile_reasons
    for k in state_a.params:
        assert torch.equal(state_a.params[k], state_b.params[k])
    _run(again, state_b, [_batch(7, seed=2)])
    assert again.compile_count == 0, again.recompile_reasons


class _ReadsMode(torch.nn.Module):
    """Branches on a string of the batch."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, batch):
        loss = torch.nn.functional.cross_entropy(self.fc(batch["x"]), batch["y"])
        return {"loss": loss * 2 if batch["mode"] == "double" else loss}


def test_a_step_that_reads_a_string_of_the_batch_is_never_served_the_other_value(tmp_path):
    def fresh():
        torch.manual_seed(0)
        return TrainState.create(_ReadsMode(), optim.sgd(0.1), seed=0)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    _, doubled = compile_step(steps.supervised(), cache=tmp_path)(fresh(), {"x": x, "y": y, "mode": "double"})
    single = compile_step(steps.supervised(), cache=tmp_path)
    _, m = single(fresh(), {"x": x, "y": y, "mode": "single"})
    # Strings are not in the key; the artifact's own guard on the value rejects it.
    assert single.compile_count >= 1 and "guards rejected" in single.recompile_reasons[0]
    assert float(m["loss"]) == pytest.approx(float(doubled["loss"]) / 2, rel=1e-6)


class _PointsReadMode(_PointHead):
    """A point model that branches on a string of the batch."""

    def forward(self, batch):
        out = super().forward(batch)
        return {"loss": out["loss"] * 2 if batch["mode"] == "double" else out["loss"]}


def test_a_point_step_the_cached_one_rejects_compiles_once_for_every_point_count(tmp_path):
    def fresh():
        torch.manual_seed(2)
        return TrainState.create(_PointsReadMode(), optim.sgd(0.1), seed=0)

    batches = [{**_points(s, seed=i), "mode": "single"} for i, s in enumerate([(70, 50), (33, 91), (120, 7)])]
    compile_step(steps.supervised(), cache=tmp_path)(fresh(), {**batches[0], "mode": "double"})
    step = compile_step(steps.supervised(), cache=tmp_path)
    state, _ = _run(step, fresh(), batches)
    # The saved step's guard on the string rejects the first batch; what compiles then serves
    # every point count (it used to compile static, and again for each new count).
    assert step.compile_count == 1 and "guards rejected" in step.recompile_reasons[0], step.recompile_reasons
    ref, _ = _run(steps.supervised(), fresh(), batches)
    for k in ref.params:
        assert torch.allclose(state.params[k], ref.params[k], atol=1e-6)


def test_a_cache_folder_given_with_a_tilde_is_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert step_cache.resolve_dir("~/steps") == tmp_path / "steps"  # as $PIMM_FN_STEP_CACHE reads it
