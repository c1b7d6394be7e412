"""The notebooks: committed without outputs, one per use, and each runs end to end at smoke size
(KVQUANT_SMOKE=1) without an error and without progress bars in its outputs."""
import numpy as np
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


def _execute(path, workdir, monkeypatch, inject=None):
    """Run a notebook at smoke size in ``workdir`` (results in ``workdir/results``); ``inject``:
    source of a cell placed after the parameters cell, as papermill does. Returns the notebook
    with its outputs."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    env = subprocess_env(KVQUANT_SMOKE=1, KVQUANT_RESULTS=workdir / "results", MPLBACKEND="Agg",
                         OMP_NUM_THREADS=1)
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    nb = nbformat.read(path, as_version=4)
    if inject is not None:
        at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(inject))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    return nb


def _stdout(nb):
    return "".join(o.text for c in _code_cells(nb) for o in c.outputs
                   if o.output_type == "stream" and o.name == "stdout")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_at_smoke_size(path, tmp_path, monkeypatch):
    nb = _execute(path, tmp_path, monkeypatch)
    outputs = [o for c in _code_cells(nb) for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # tqdm's console bar would leave a stream of "\r 40%|####  |" frames in the saved outputs.
    streams = "".join(o.text for o in outputs if o.output_type == "stream")
    assert "%|" not in streams, streams[-2000:]
    # Everything it writes goes to the results folder it was given, figures included.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    assert any((tmp_path / "results").rglob("*.png"))


def test_distortion_notebook_measures_rows_from_a_npy_file(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((300, 128)).astype(np.float32)
    X[:, 7] *= 20.0   # an outlier channel: per-row fp8 scales suffer, rotated codecs do not
    np.save(tmp_path / "mine.npy", X)
    nb = _execute(ROOT / "notebooks" / "03-distortion.ipynb", tmp_path, monkeypatch,
                  inject=f"rows_file = {str(tmp_path / 'mine.npy')!r}\ncodecs = ['kv8', 'tq4']")
    assert "mine.npy: 300 rows of width 128" in _stdout(nb)
    table = next(o.data["text/markdown"] for c in _code_cells(nb) for o in c.outputs
                 if "text/markdown" in o.get("data", {}) and "rel. L2 mean" in o.data["text/markdown"])
    import kvquant
    from kvquant.metrics import relative_l2
    for spec in ("kv8", "tq4"):
        codec = kvquant.get_codec(spec, 128)
        expected = relative_l2(X, codec.decode(codec.encode(X))).mean()
        assert f"| mine.npy | {spec} | {codec.bits_per_value:.3f} | {expected:.4f} |" in table


def test_token_flip_notebook_reuses_what_it_computed(tmp_path, monkeypatch):
    # At smoke size the committed tiny-model table has every codec but one: only that one runs,
    # and a second run in the same results folder runs nothing.
    notebook = ROOT / "notebooks" / "04-token-flips.ipynb"
    first = _stdout(_execute(notebook, tmp_path, monkeypatch))
    assert "to run: tq4:side=unbiased" in first
    assert "flips-tiny-mla-p1.json" in first
    second = _stdout(_execute(notebook, tmp_path, monkeypatch))
    assert "to run: nothing" in second
    assert str(tmp_path / "results" / "token-flips") in second
