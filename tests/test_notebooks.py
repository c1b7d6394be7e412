"""The notebooks: committed without outputs, and each one runs end to end at smoke size."""
from pathlib import Path

import pytest

from _experiments_env import ROOT, subprocess_env

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = ["01-codecs-tour", "02-distortion-sweep", "03-token-flips", "04-attention-speed"]


def test_the_four_notebooks_are_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    assert [p.stem for p in NOTEBOOKS] == EXPECTED
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name
                # Thin: notebooks call the research package, they do not define it.
                assert "def " not in cell.source, f"{path.name} defines a function: move it " \
                                                  "to experiments/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_at_smoke_size(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    env = subprocess_env(KVQUANT_SMOKE=1, KVQUANT_RESULTS=tmp_path / "results", MPLBACKEND="Agg",
                         OMP_NUM_THREADS=1)
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    assert any(Path(tmp_path / "results").rglob("*.png"))
