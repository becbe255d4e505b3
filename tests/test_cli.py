"""The ``pimm-fn`` command's run folders, settings layers and error lines, in real subprocesses.

Every run is the smallest experiment, ``digits_cls --quick --set compile=false`` (2 epochs
of 2 steps, ~4 s). Three runs are shared by the whole module: a finished run, that run
extended with ``--resume``, and a folder trained over with ``--overwrite``. Every error case
checks the exit status, that stderr holds one ``pimm-fn: <cause>; <fix>`` line and no
traceback, and, where a run folder is involved, that its every file is byte-identical
after the failed command.

The digits data set must be fetched (``python -m pimm_fn.data.fetch digits``); without it
the module is skipped with that command.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
QUICK = ("--quick", "--no-progress", "--set", "compile=false")
# A Python warning on stderr ("file:line: XWarning: ..." then its indented source line) is
# not an error line; anything else besides the one "pimm-fn:" line is.
_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: |^\s")


def pimm_fn(*args, env=None, timeout=180) -> subprocess.CompletedProcess:
    """``python -m pimm_fn ARGS`` from the repository root, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "pimm_fn", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one ``pimm-fn: cause; fix`` line of a failed command (asserting there is exactly one)."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"exit status {proc.returncode}, expected 1:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("pimm-fn: ")]
    assert len(ours) == 1 and lines[-1] == ours[0], f"expected one pimm-fn: line last on stderr:\n{proc.stderr}"
    others = [line for line in lines[:-1] if not _WARNING.match(line)]
    assert not others, f"stderr holds more than the error line and warnings:\n{proc.stderr}"
    assert "; " in ours[0], f"no '; fix' part: {ours[0]}"
    return ours[0]


def checksums(folder: Path) -> dict:
    """sha256 of every file under ``folder`` by relative path (empty folders listed too)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def steps_in_metrics(save: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A completed ``digits_cls --quick`` run folder (4 steps); tests must not change it."""
    save = tmp_path_factory.mktemp("finished") / "run"
    t0 = time.perf_counter()
    proc = pimm_fn("train", "digits_cls", *QUICK, "--save-path", save)
    if proc.returncode != 0 and "pimm-fn: data set " in proc.stderr:
        pytest.skip("the digits data set is not fetched: " + proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"digits_cls --quick: {time.perf_counter() - t0:.1f} s")
    return save


@pytest.fixture
def unchanged(finished):
    """Asserts, after the test, that the finished run folder is byte-identical."""
    before = checksums(finished)
    yield finished
    assert checksums(finished) == before, "the command changed the run folder"


@pytest.fixture(scope="module")
def extended(finished, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A copy of the finished run resumed with ``--quick --set epochs=3`` (the explicit epochs win)."""
    save = tmp_path_factory.mktemp("extended") / "run"
    shutil.copytree(finished, save)
    return save, pimm_fn("train", "digits_cls", *QUICK, "--save-path", save, "--resume", "--set", "epochs=3")


@pytest.fixture(scope="module")
def overwritten(finished, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A copy of the finished run, plus files of the user's, trained over with ``--overwrite``."""
    save = tmp_path_factory.mktemp("overwritten") / "run"
    shutil.copytree(finished, save)
    (save / "notes.txt").write_text("mine")
    (save / "checkpoints" / "mine.txt").write_text("mine too")
    return save, pimm_fn("train", "digits_cls", *QUICK, "--save-path", save, "--overwrite", "--set", "epochs=1")


# --------------------------------------------------------------------------- run folders


def test_finished_run_records_the_settings_it_ran(finished):
    settings = json.loads((finished / "settings.json").read_text())
    assert settings["experiment"] == "digits_cls" and settings["compile"] is False
    assert settings["epochs"] == 2  # digits_cls's QUICK, not the default 15
    assert json.loads((finished / "summary.json").read_text())["step"] == 4


def test_train_into_a_run_folder_refuses(unchanged):
    line = error_line(pimm_fn("train", "digits_cls", *QUICK, "--save-path", unchanged))
    assert f"pimm-fn: {unchanged} already holds a run (settings.json, " in line, line
    for choice in ("--resume", "a new --save-path", "--overwrite"):
        assert choice in line, line


@pytest.mark.parametrize("mark", ["settings.json", "metrics.jsonl", "summary.json", "checkpoints/"])
def test_any_file_of_a_run_makes_a_run_folder(mark, tmp_path):
    save = tmp_path / "run"
    save.mkdir()
    (save / "notes.txt").write_text("not a run's")
    if mark.endswith("/"):
        (save / mark).mkdir()
    else:
        (save / mark).write_text("{}")
    before = checksums(save)
    line = error_line(pimm_fn("train", "digits_cls", *QUICK, "--save-path", save))
    assert f"already holds a run ({mark})" in line, line
    assert checksums(save) == before


def test_a_folder_without_run_files_is_not_refused(tmp_path):
    """A folder of the user's own files is not a run: the command goes on (to the data, here missing)."""
    save = tmp_path / "run"
    save.mkdir()
    (save / "notes.txt").write_text("mine")
    line = error_line(pimm_fn("train", "digits_cls", *QUICK, "--save-path", save,
                              env={"PIMM_FN_DATA": str(tmp_path / "no_data")}))
    assert "data set 'digits' not found" in line, line
    assert sorted(os.listdir(save)) == ["notes.txt"]


@pytest.mark.parametrize("args, expected", [
    (("--resume", "--set", "width=16"),
     "does not fit experiment 'digits_cls' with these settings"),
    (("--resume", "--set", "batch_size=-1"),
     "pimm-fn: setting 'batch_size' must be >= 1, got -1; pass --set batch_size=N with N >= 1"),
    (("--resume", "--set", "epochs=0"),
     "pimm-fn: setting 'epochs' must be >= 1, got 0; pass --set epochs=N with N >= 1"),
    (("--overwrite", "--set", "width=-4"),
     "pimm-fn: setting 'width' must be >= 1, got -4; pass --set width=N with N >= 1"),
], ids=["shape-mismatch", "negative-batch", "zero-epochs", "overwrite-negative-width"])
def test_failed_start_leaves_the_folder_byte_identical(unchanged, args, expected):
    line = error_line(pimm_fn("train", "digits_cls", *QUICK, "--save-path", unchanged, *args))
    assert expected in line, line


def test_shape_mismatch_on_resume_names_the_setting_that_differs(unchanged):
    line = error_line(pimm_fn("train", "digits_cls", *QUICK, "--save-path", unchanged, "--resume", "--set", "width=16"))
    assert "checkpoint (32, 1, 3, 3) vs model (16, 1, 3, 3)" in line, line
    assert "settings.json differs: width=32 (now 16)" in line and "a new --save-path" in line, line


def test_overwrite_with_a_missing_data_set_clears_nothing(unchanged, tmp_path):
    """--overwrite clears the folder only once the run is built: a build that fails leaves it."""
    proc = pimm_fn("train", "digits_cls", *QUICK, "--save-path", unchanged, "--overwrite",
                   env={"PIMM_FN_DATA": str(tmp_path / "no_data")})
    assert "data set 'digits' not found" in error_line(proc)


def test_overwrite_clears_only_what_a_run_writes(overwritten):
    save, proc = overwritten
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--overwrite: cleared" in proc.stdout, proc.stdout
    assert (save / "notes.txt").read_text() == "mine"
    assert (save / "checkpoints" / "mine.txt").read_text() == "mine too"
    assert not (save / "checkpoints" / "step_4.ckpt").exists(), "the earlier run's step 4 checkpoint stayed"
    assert max(steps_in_metrics(save)) == 2, "metrics.jsonl still holds the earlier run's rows"
    summary = json.loads((save / "summary.json").read_text())
    assert summary["step"] == 2 and summary["settings"]["epochs"] == 1
    assert len(list((save / "tensorboard").glob("events.out.tfevents.*"))) == 1


def test_resume_and_overwrite_together_refuse(unchanged):
    line = error_line(pimm_fn("train", "digits_cls", *QUICK, "--save-path", unchanged, "--resume", "--overwrite"))
    assert "--resume and --overwrite contradict each other" in line, line


# --------------------------------------------------------------------------- --quick and --set


def test_explicit_set_wins_over_quick_and_resume_rewrites_settings(extended):
    """The 'already complete' hint (raise --set epochs=N) works under --quick: epochs=3 trains a third epoch."""
    save, proc = extended
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pimm-fn: resuming from step 4" in proc.stdout and "completed at step 6" in proc.stdout, proc.stdout
    assert json.loads((save / "settings.json").read_text())["epochs"] == 3
    assert json.loads((save / "summary.json").read_text())["epoch"] == 3


def test_experiment_settings_layers(tmp_path):
    """SETTINGS < QUICK < --set, and MINIMUM is checked on the result, for every experiment."""
    from pimm_fn.experiment import available_experiments, experiment_settings, load_experiment
    from pimm_fn.settings import SettingsError

    for name in available_experiments():
        mod = load_experiment(name)
        quick = experiment_settings(mod, quick=True)
        assert quick == {**mod.SETTINGS, **mod.QUICK}, name
        assert experiment_settings(mod) == mod.SETTINGS, name
        for key, low in mod.MINIMUM.items():
            assert quick[key] >= low and mod.SETTINGS[key] >= low, (name, key)
            with pytest.raises(SettingsError, match=f"setting '{key}' must be >= {low}"):
                experiment_settings(mod, [f"{key}={low - 1}"], quick=True)
        key = next(iter(mod.QUICK))
        value = mod.SETTINGS[key] + 1
        assert experiment_settings(mod, [f"{key}={value}"], quick=True)[key] == value, name


# --------------------------------------------------------------------------- one-line errors


@pytest.fixture(scope="module")
def corrupt_copy(finished, tmp_path_factory) -> Path:
    """The finished run's checkpoints copied, with step_4.ckpt truncated (step_2.ckpt intact)."""
    folder = tmp_path_factory.mktemp("corrupt") / "checkpoints"
    shutil.copytree(finished / "checkpoints", folder)
    data = (folder / "step_4.ckpt").read_bytes()
    (folder / "step_4.ckpt").write_bytes(data[: len(data) // 2])
    return folder


def test_unknown_key():
    line = error_line(pimm_fn("train", "digits_cls", "--set", "epochz=3"))
    assert line.startswith("pimm-fn: unknown setting 'epochz' (did you mean epochs?); valid keys: "), line
    assert "batch_size=64" in line, line


def test_wrong_type():
    line = error_line(pimm_fn("train", "digits_cls", "--set", "compile=maybe"))
    assert line == ("pimm-fn: setting 'compile' is bool (default True), got 'maybe'; "
                    "use --set compile=true or --set compile=false"), line


def test_unknown_experiment():
    line = error_line(pimm_fn("train", "digits_cl"))
    assert "no experiment 'digits_cl'" in line and "digits_cls" in line, line


def test_missing_data_set(tmp_path):
    save = tmp_path / "run"
    line = error_line(pimm_fn("train", "digits_cls", *QUICK, "--save-path", save,
                              env={"PIMM_FN_DATA": str(tmp_path / "no_data")}))
    assert f"data set 'digits' not found at {tmp_path / 'no_data'}" in line, line
    assert "fetch it with: " in line and "-m pimm_fn.data.fetch digits" in line, line
    assert not save.exists(), "a run that never started created its folder"


def test_eval_corrupt_checkpoint_names_the_intact_one(corrupt_copy):
    line = error_line(
        pimm_fn("eval", "digits_cls", "--set", "compile=false", "--checkpoint", corrupt_copy / "step_4.ckpt")
    )
    assert f"{corrupt_copy / 'step_4.ckpt'} is truncated" in line, line
    assert f"the earlier checkpoint {corrupt_copy / 'step_2.ckpt'} is intact: use it" in line, line


def test_eval_not_a_checkpoint(tmp_path):
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"\x00" * 64)
    line = error_line(pimm_fn("eval", "digits_cls", "--set", "compile=false", "--checkpoint", junk))
    assert str(junk) in line and "pass another checkpoint to --checkpoint" in line, line


def test_eval_wrong_model_checkpoint(unchanged):
    line = error_line(pimm_fn("eval", "digits_cls", "--quick", "--set", "compile=false", "--set", "width=16",
                              "--checkpoint", unchanged / "checkpoints" / "best.ckpt"))
    assert "does not fit experiment 'digits_cls' with these settings" in line, line
    assert "settings.json differs: width=32 (now 16)" in line, line


def test_eval_missing_checkpoint_lists_the_ones_there(unchanged):
    line = error_line(pimm_fn("eval", "digits_cls", "--checkpoint", unchanged / "checkpoints" / "step_9.ckpt"))
    assert "step_9.ckpt does not exist" in line and "best.ckpt, step_2.ckpt, step_4.ckpt are in" in line, line


def test_finished_run(unchanged):
    line = error_line(pimm_fn("train", "digits_cls", *QUICK, "--save-path", unchanged, "--resume"))
    assert "is already complete (epoch 2 >= epochs 2); nothing was trained; raise --set epochs=N" in line, line


def test_debug_shows_the_traceback():
    proc = pimm_fn("train", "digits_cls", "--set", "epochs=ten", "--debug")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "SettingsError: setting 'epochs' is int" in proc.stderr, proc.stderr


def test_a_save_path_that_cannot_be_a_folder_is_refused_before_anything_is_built(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for save, says in ((blocker, "is a file, not a folder"), (blocker / "run", f"lies under the file {blocker}")):
        proc = pimm_fn("train", "lidar_seg", "--quick", "--save-path", save)
        assert proc.returncode == 1 and says in error_line(proc) and "pass a folder path" in error_line(proc)
        assert "Traceback" not in proc.stderr
