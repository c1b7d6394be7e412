"""The benchmarks' lists of specs split where a spec ends (kvquant.specs.split_spec_text): a
codec option after a comma stays with its spec, and the ';' lists docs/speed.md records still
split on ';'. Tiny runs; nothing here asserts a speed."""
import json

import pytest

from _experiments_env import ensure_importable

ensure_importable()
from kvquant_experiments.bench import codec_throughput, encode_paths  # noqa: E402
from kvquant_experiments.bench import forward_attention, gqa_reads  # noqa: E402

# a spec whose options hold a comma, between two others
LIST = "kv8,tq3:side_dtype=f16,seed=7,tq4"
SPECS = ["kv8", "tq3:side_dtype=f16,seed=7", "tq4"]


@pytest.mark.parametrize("codecs", [LIST, ";".join(SPECS)])
def test_codec_throughput_keeps_an_option_with_its_spec(codecs, tmp_path):
    assert codec_throughput.main(["--dims", "64", "--rows", "128", "--ref-rows", "16",
                                  "--repeats", "1", "--ref-repeats", "1", "--yard-rows", "0",
                                  "--codecs", codecs, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("codec_throughput_*.json")
    assert [r["codec"] for r in json.loads(path.read_text())["results"]] == SPECS


@pytest.mark.parametrize("codecs", [LIST, ";".join(SPECS)])
def test_encode_paths_keeps_an_option_with_its_spec(codecs, capsys):
    encode_paths.main(["--dims", "64", "--rows", "256", "--repeats", "1", "--paths", "auto",
                       "--codecs", codecs])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[0] for line in lines] == [f"d=64 {s}" for s in SPECS]


def test_gqa_reads_keeps_an_option_with_its_spec(capsys):
    gqa_reads.main(["--dims", "64", "--queries", "1", "--rows", "256", "--threads", "1",
                    "--repeats", "1", "--codecs", LIST])
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("d=64")]
    assert [cell.split(" ")[0] for cell in line.split(" | ")[1:]] == SPECS


def test_forward_attention_keeps_an_option_with_its_spec(tmp_path, capsys):
    path = str(tmp_path / "tiny.gguf")
    forward_attention.write_shape_gguf(path, dict(
        forward_attention.SMOLLM2_SHAPE, n_layers=1, hidden=64, ffn=64, n_heads=2, n_kv=1,
        head_dim=32, vocab=64, context=256))
    assert forward_attention.main(["--worker", "--file", path, "--remedies", "cache1",
                                   "--codecs", LIST, "--tokens", "16", "--steps", "1",
                                   "--warmup", "0", "--rounds", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["codecs"] == SPECS and set(result["methods"]) == {"numpy", *SPECS}


def test_decode_threads_keeps_an_option_with_its_spec(tmp_path, capsys):
    pytest.importorskip("gguf", reason="the models extra (gguf) is not installed")
    pytest.importorskip("threadpoolctl")
    from kvquant.models.random_gguf import write_random_gguf
    from kvquant_experiments.bench import decode_threads
    path = str(tmp_path / "llama.gguf")
    write_random_gguf(path, "llama", seed=3)
    decode_threads.main(["--model", path, "--tokens", "4", "--steps", "1", "--rounds", "1",
                         "--codecs", LIST])
    cached = [line.split(": ")[0] for line in capsys.readouterr().out.splitlines()
              if "tokens cached" in line]
    assert cached == SPECS
