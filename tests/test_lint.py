"""ruff over the package, tests, benchmarks, scripts and experiments (configured in pyproject.toml)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                                                       capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: `pip install -e .[test]` (scripts/setup.sh) installs it")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "pimm_fn", "tests", "benchmarks",
                          "scripts", "experiments"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def _private_torch_uses(path: Path, root: Path = ROOT) -> list:
    """``file:line name`` of every private torch name a module reaches: an attribute chain
    from ``torch`` with a ``_name`` in it, or an import of one (``__version__`` is public)."""
    import ast

    def private(dotted: str) -> bool:
        return any(part.startswith("_") and part != "__version__" for part in dotted.split(".")[1:])

    def dotted(node) -> str:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else ""

    tree = ast.parse(path.read_text(), str(path))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # report whole chains only
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            names.append(dotted(node))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names
                  if n.split(".")[0] == "torch" and private(n)]
    return found


def test_torch_internals_only_in_torch_compat():
    # Issue 37: every use of a torch internal lives in pimm_fn/torch_compat.py, the one module
    # to change when torch moves them.
    uses = [u for p in sorted((ROOT / "pimm_fn").rglob("*.py")) if p.name != "torch_compat.py"
            for u in _private_torch_uses(p)]
    assert not uses, "private torch names outside pimm_fn/torch_compat.py:\n" + "\n".join(uses)


def test_the_internals_check_sees_attributes_and_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nfrom torch.distributed import _functional_collectives\n"
                   "x = torch._dynamo.config\ny = torch.__version__\n'torch._C in a string'\n")
    assert _private_torch_uses(src, root=tmp_path) == ["m.py:2 torch.distributed._functional_collectives",
                                                       "m.py:3 torch._dynamo.config"]
