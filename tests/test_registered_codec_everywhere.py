"""A codec defined in a notebook cell (tests/_notebook_codec.py) runs by name in task scoring
(``kvquant tasks``: in this process, in 2 worker processes, on a Dask cluster; the numpy and the
transformers backend) and in the transformers cache (``kvquant.hf.KVQuantCache``), with the
numbers of an independent way to the same codec each time: the same class installed through an
entry point, plain torch attention over the codec's decoded rows, kvquant's numpy forward.

The models are small random-weight ones written by the tests: a llama GGUF
(:func:`kvquant.models.random_gguf.write_random_gguf`, read by the numpy decoder and by
transformers) and transformers models built from a config (tests/test_hf.py's helpers)."""
import json
import warnings
from importlib.metadata import EntryPoint

import numpy as np
import pytest

import kvquant
from kvquant.codecs import registry

from _notebook_codec import code_bytes, notebook_codec

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("kvquant_experiments")

SPECS = ("f32", "halfsign", "halfsign/kv8@sinks=1")
ITEMS = 6


@pytest.fixture
def halfsign():
    with notebook_codec() as name:
        yield name


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random llama GGUF (head_dim 16) and a task of ITEMS three-choice items."""
    from kvquant.models.random_gguf import write_random_gguf
    root = tmp_path_factory.mktemp("registered")
    model = root / "random-llama.gguf"
    write_random_gguf(model, "llama", seed=7)
    task = root / "mine.jsonl"
    rows = [{"context": f"item {i} is", "choices": ["a b", "c", "d e f"], "gold": i % 3}
            for i in range(ITEMS)]
    task.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return model, task


def _kvquant_tasks(capsys, setup, out, *extra, specs=SPECS, model=None):
    """Run ``kvquant tasks`` in this process (where the cell registered the codec) on the
    task of ``setup`` and its model (or ``model``); returns the summary and each spec's item
    records from its log."""
    from kvquant.cli import main
    from kvquant_experiments.common import spec_tag
    from kvquant_experiments.task_runs import read_log
    gguf, task = setup
    model = gguf if model is None else model
    status = main(["tasks", "--model", str(model), "--task", str(task), "--codecs",
                   ",".join(specs), "--out", str(out), "--quiet", "--json", *extra])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    summary = json.loads(captured.out)
    logs = {}
    for spec in specs:
        _, logs[spec], _ = read_log(out / f"{spec_tag(spec)}.jsonl")
    return summary, logs


def _lls(records):
    return [r["lls"] for r in records]


# --------------------------------------------------------------------------------------------
# Task accuracy: kvquant tasks (kvquant_experiments.task_runs, kvquant.tasks)
# --------------------------------------------------------------------------------------------
def test_kvquant_tasks_scores_the_cell_codec_here_and_in_two_worker_processes(
        setup, halfsign, tmp_path, capsys):
    here, here_logs = _kvquant_tasks(capsys, setup, tmp_path / "here", "--workers", "1")
    spawned, spawned_logs = _kvquant_tasks(capsys, setup, tmp_path / "spawned", "--workers", "2")
    # the workers started without the registration; the same items, bit for bit
    for spec in SPECS:
        assert len(here_logs[spec]) == ITEMS
        assert spawned_logs[spec] == here_logs[spec], spec
    # the codec really ran: every item's log-likelihoods moved away from f32's
    for f32, coded in zip(_lls(here_logs["f32"]), _lls(here_logs["halfsign"])):
        assert f32 != coded
    rows = {r["spec"]: r for r in here["rows"]}
    for row in spawned["rows"]:
        assert {k: row[k] for k in ("acc", "acc_norm", "bits_per_value")} == {
            k: rows[row["spec"]][k] for k in ("acc", "acc_norm", "bits_per_value")}
    # its storage as the codec declares it: 2 code bytes + a float32 scale per row of 16
    assert rows["halfsign"]["bits_per_value"] == 8 * code_bytes(16) / 16
    assert rows["halfsign"]["decoded_streams"] == ["k", "v"]
    assert rows["halfsign/kv8@sinks=1"]["decoded_streams"] == ["k"]
    assert rows["halfsign"]["paired"]["acc_norm"]["n"] == ITEMS


def test_kvquant_tasks_scores_the_cell_codec_on_a_dask_cluster(setup, halfsign, tmp_path,
                                                                capsys):
    distributed = pytest.importorskip("distributed")
    specs = ("halfsign", "halfsign/kv8@sinks=1")
    _, here = _kvquant_tasks(capsys, setup, tmp_path / "here", "--workers", "1", specs=specs)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  protocol="tcp", host="127.0.0.1",
                                  dashboard_address=None) as cluster:
        _, remote = _kvquant_tasks(capsys, setup, tmp_path / "dask", "--scheduler",
                                   cluster.scheduler_address, specs=specs)
    for spec in specs:
        assert len(remote[spec]) == ITEMS and remote[spec] == here[spec], spec


def test_the_same_codec_installed_by_an_entry_point_scores_the_same(setup, halfsign,
                                                                    tmp_path, monkeypatch):
    """The cell's class (in ``__main__``) and the same code as an installed package's class
    (``_notebook_codec.HalfSign`` behind an entry point): two ways to the codec, one set of
    log-likelihoods."""
    from kvquant_experiments.executor import open_executor
    from kvquant_experiments.task_runs import run_tasks, task_meta
    monkeypatch.setattr(registry, "_entry_points", {
        "epsign": EntryPoint("epsign", "_notebook_codec:factory", registry.ENTRY_POINT_GROUP)})
    cell_codec, installed = kvquant.get_codec(halfsign, 16), kvquant.get_codec("epsign", 16)
    assert type(cell_codec).__module__ == "__main__"
    assert type(installed).__module__ == "_notebook_codec"
    model, task = setup
    meta = task_meta(str(model), str(task), ITEMS)
    with open_executor("serial") as ex:
        results, _ = run_tasks(meta, ["f32", halfsign, "epsign"], tmp_path / "run",
                               executor=ex, progress=False)
    assert _lls(results[halfsign]) == _lls(results["epsign"])
    assert _lls(results[halfsign]) != _lls(results["f32"])


# --------------------------------------------------------------------------------------------
# The transformers cache (kvquant.hf)
# --------------------------------------------------------------------------------------------
@pytest.fixture
def hf():
    """tests/test_hf.py's small random transformers models and runs (torch needed)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import test_hf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # past_key_values renamed in 5.x
        yield test_hf


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_hf_cache_stores_the_cell_codecs_codes_and_reads_them(hf, halfsign, kind):
    import torch
    from kvquant.hf import KVQuantCache
    from transformers.cache_utils import Cache, DynamicLayer
    model = hf._model(kind, attn="eager")
    cfg = model.config
    ids = hf._prompt(model)
    codec = kvquant.get_codec(halfsign, cfg.head_dim)
    # the reference: plain torch attention over the rows the codec decodes
    ref, tokens = hf._run(model, ids, hf._decoded_cache(model, codec.spec))
    # the float cache, teacher-forced on the same tokens (full layers: every row kept)
    exact_cache = Cache(layers=[DynamicLayer() for _ in range(cfg.num_hidden_layers)])
    exact, _ = hf._run(model, ids, exact_cache, tokens)
    model.set_attn_implementation("kvquant")
    cache = KVQuantCache(cfg, codec.spec)
    got, _ = hf._run(model, ids, cache, tokens)
    hf._assert_logits_close(got, ref, 1e-4)
    assert max(float((a - b).abs().max()) for a, b in zip(got, exact)) > 1e-3

    # what it holds: the cell's codec, its bytes and nothing else
    n = hf.PROMPT + hf.STEPS
    assert cache.specs == [("halfsign", "halfsign")] * cfg.num_hidden_layers
    heads = cfg.num_key_value_heads
    assert cache.bytes_per_token == cfg.num_hidden_layers * heads * 2 * code_bytes(cfg.head_dim)
    assert cache.fixed_bytes == 0 and cache.nbytes == n * cache.bytes_per_token
    # layer 0's keys and values come from the embeddings alone, the same in both runs: the
    # stored codes are the codec's encoding of the float cache's rows, bit for bit
    for name, rows in (("k", exact_cache.layers[0].keys), ("v", exact_cache.layers[0].values)):
        for head in range(heads):
            stream = cache.stream(0, name, head)
            assert type(stream.codec).__module__ == "__main__"
            stored = stream.encoded()
            want = codec.encode(rows[0, head].to(torch.float32).numpy())
            assert stored.codes.shape == (n, codec.code_bytes)
            assert np.array_equal(stored.codes, want.codes), (name, head)
            assert np.array_equal(stored.side, want.side), (name, head)


@pytest.fixture(scope="module")
def hf_llama_gguf(setup):
    """The random llama GGUF of ``setup`` as transformers loads it, keys stored in the file's
    channel order (as kvquant's numpy model stores them), and the numpy model of that file."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvquant.hf import HFModel
    from kvquant.models import load_model
    path, _ = setup
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = HFModel.from_pretrained(str(path.parent), gguf_file=path.name,
                                           key_channels="interleaved")
    return hf_model, load_model(str(path))


def test_the_hf_cache_agrees_with_the_numpy_model_through_the_cell_codec(hf_llama_gguf,
                                                                          halfsign):
    theirs, ours = hf_llama_gguf
    ids = np.random.default_rng(4).integers(0, ours.vocab_size, 40)
    logits = {}
    for spec in ("f32", halfsign):
        ours_cache, their_cache = ours.new_cache(spec), theirs.new_cache(spec)
        logits[spec] = ours.forward(ids, ours_cache), theirs.forward(ids, their_cache)
        assert their_cache.bytes_per_token == ours_cache.bytes_per_token
    # layer 0's rows come from the same embeddings in both forwards (to float rounding): the
    # same sign bits, scales to rounding
    for name in ("k", "v"):
        for head in range(ours.n_kv_heads):
            a, b = (c.stream(0, name, head).encoded() for c in (ours_cache, their_cache))
            assert a.codes.shape == (len(ids), code_bytes(ours.head_dim) - 4)
            assert np.array_equal(a.codes, b.codes), (name, head)
            np.testing.assert_allclose(a.side, b.side, rtol=1e-5)
    ours_f32, _ = logits["f32"]
    ours_coded, theirs_coded = logits[halfsign]
    scale = float(np.abs(ours_coded).max())
    agree = float(np.abs(ours_coded - theirs_coded).max())
    # measured: 2.8e-5 apart on logits up to 31, which the codec moves by 35 from f32's
    assert agree <= 1e-5 * scale
    assert float(np.abs(ours_coded - ours_f32).max()) > 0.1 * scale


def test_kvquant_tasks_on_the_hf_backend_scores_the_cell_codec_as_the_numpy_backend(
        setup, hf_llama_gguf, halfsign, tmp_path, capsys):
    """``kvquant tasks --backend hf`` (in this process) against the numpy backend on the same
    GGUF file and tokens: the same items to float rounding across two attention
    implementations."""
    model, _ = setup
    specs = ("f32", halfsign)
    _, numpy_logs = _kvquant_tasks(capsys, setup, tmp_path / "numpy", "--workers", "1",
                                   specs=specs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, hf_logs = _kvquant_tasks(capsys, setup, tmp_path / "hf", "--backend", "hf",
                                    "--gguf-file", model.name, specs=specs,
                                    model=model.parent)
    for spec in specs:
        for a, b in zip(numpy_logs[spec], hf_logs[spec]):
            assert a["context_tokens"] == b["context_tokens"]
            # measured: 2.5e-5 apart on log-likelihoods down to -170
            np.testing.assert_allclose(b["lls"], a["lls"], rtol=0, atol=1e-3)
    assert _lls(hf_logs[halfsign]) != _lls(hf_logs["f32"])
