"""The README's quick-start code runs as written (one epoch instead of twenty)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_quick_start_runs(tmp_path, monkeypatch):
    text = README.read_text()
    code = re.search(r"## Quick start in code\n\n```python\n(.*?)```", text, re.S).group(1)
    # Shorter horizon only; everything else exactly as the README shows it.
    for long, short in (("epochs=20", "epochs=1"), ("len(loader) * 20", "len(loader) * 1")):
        # each shortening must find its text: a README edit would otherwise run 20 epochs here
        assert code.count(long) == 1, f"the quick start no longer says {long!r}: update this test"
        code = code.replace(long, short)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    losses = scope["history"].values("loss")
    assert len(losses) == len(scope["loader"]) and bool(losses.isfinite().all())
    # static, dynamic, and once more where batch totals cross inductor's N <= 4096 guard
    assert scope["step"].compile_count <= 3, scope["step"].recompile_reasons
    assert (tmp_path / "runs" / "quick" / "ckpt" / "latest").exists()
