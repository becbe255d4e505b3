"""docs/writing_a_step.md runs as written: its python blocks, in order, in one namespace."""
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "writing_a_step.md"


def test_tutorial_code_runs_as_written(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 4, "the tutorial lost its code blocks"
    namespace = {"__name__": "writing_a_step"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{DOC.name}[block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "graph breaks: 0" in out
    # the variant itself is small: the whole-step section's code, without blank lines
    whole_step = [l for l in blocks[2].splitlines() if l.strip()]
    assert len(whole_step) < 100
