"""The notebooks: committed without outputs, one per use, and each runs end to end at smoke size
(KVQUANT_SMOKE=1) without an error and without progress bars in its outputs."""
import pytest

from _experiments_env import ROOT, subprocess_env

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = ["01-tour", "02-codebooks", "03-distortion", "04-token-flips", "05-attention-speed"]


def _code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def test_the_notebooks_are_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    assert [p.stem for p in NOTEBOOKS] == EXPECTED
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3"
        for cell in _code_cells(nb):
            assert cell.outputs == [] and cell.execution_count is None, path.name
            # Thin: notebooks call the library and the research package, they do not define it.
            assert "def " not in cell.source, f"{path.name} defines a function: move it " \
                                              "to kvquant/ or experiments/"
            # Progress as a widget in Jupyter: tqdm.auto, never the console bar.
            imports = [line.strip() for line in cell.source.splitlines()
                       if line.lstrip().startswith(("import tqdm", "from tqdm"))]
            assert all(line.startswith("from tqdm.auto import") for line in imports), path.name
        tagged = [c for c in _code_cells(nb) if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: one parameters cell (papermill-style)"
        assert "results" in tagged[0].source, f"{path.name}: the results folder is a parameter"


def test_every_notebook_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        assert f"(notebooks/{path.name})" in readme, path.name


def test_the_results_folder_is_ignored_by_git():
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").split()
    assert "notebooks/results/" in ignored and "/results/" in ignored


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_at_smoke_size(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    results = tmp_path / "results"
    env = subprocess_env(KVQUANT_SMOKE=1, KVQUANT_RESULTS=results, MPLBACKEND="Agg",
                         OMP_NUM_THREADS=1)
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    outputs = [o for c in _code_cells(nb) for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # tqdm's console bar would leave a stream of "\r 40%|####  |" frames in the saved outputs.
    streams = "".join(o.text for o in outputs if o.output_type == "stream")
    assert "%|" not in streams, streams[-2000:]
    # Everything it writes goes to the results folder it was given, figures included.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    assert any(results.rglob("*.png"))
