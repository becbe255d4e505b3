"""pimm_fn.atomic: the one write-temp / fsync / replace sequence (checkpoints, data caches, fetch)."""
import os

import pytest

from pimm_fn.atomic import TMP_RE, atomic_write, replace_dir, tmp_name


def test_replaces_whole_and_leaves_no_temp(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    assert atomic_write(target, lambda f: f.write(b"new contents")) == target
    assert target.read_bytes() == b"new contents"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temp(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def half_then_fail(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_temp_names_are_per_process_and_call(tmp_path):
    # two ranks writing the same cache file never share a temp file (the old fixed ".part" did)
    a, b = tmp_name(tmp_path / "x.npz"), tmp_name(tmp_path / "x.npz")
    assert a != b and a.parent == tmp_path
    m = TMP_RE.match(a.name)
    assert m and m["name"] == "x.npz" and int(m["pid"]) == os.getpid()


def test_replace_dir_swaps_a_whole_folder(tmp_path):
    final, staged = tmp_path / "ckpt", tmp_path / "ckpt.partial"
    for folder, text in ((final, "old"), (staged, "new")):
        folder.mkdir()
        (folder / "f").write_text(text)
    assert replace_dir(staged, final) == final
    assert (final / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the staged and the old folder are gone
