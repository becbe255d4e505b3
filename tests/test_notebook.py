"""The quick-start notebook executes end to end in a real Jupyter kernel and draws its plots."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parent.parent / "experiments" / "notebooks" / "quickstart.ipynb"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernel spec that runs this interpreter, in a temporary folder on JUPYTER_PATH
    (the user's kernel specs are left alone)."""
    from ipykernel.kernelspec import install

    name = "pimm-fn-test"
    prefix = tmp_path / "jupyter"
    install(kernel_name=name, prefix=str(prefix))
    spec_file = prefix / "share" / "jupyter" / "kernels" / name / "kernel.json"
    spec = json.loads(spec_file.read_text())
    spec["argv"][0] = sys.executable  # this interpreter, the one with pimm_fn installed
    spec_file.write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    return name


def test_quickstart_notebook_runs_and_plots(kernel_name, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the cell on any error
    print(f"quickstart.ipynb executed in {time.perf_counter() - t0:.1f} s")
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    plots = [c for c in code if "plt.show()" in c.source]
    assert len(plots) == 2, "the notebook should draw the loss curve and a prediction"
    for cell in plots:
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), \
            f"no image/png output from the plot cell:\n{cell.source}"
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.get("output_type") == "stream")
    assert "completed after" in text and "mIoU" in text, text[-2000:]
    print([line for line in text.splitlines() if "mIoU" in line][-1])
