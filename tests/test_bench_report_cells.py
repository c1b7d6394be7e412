"""The research layer's speed pieces on the fair bench: a report cell's rows and the attention
benchmark's verdict on the targets. Nothing here asserts a speed."""
import pytest

from _experiments_env import ensure_importable

ensure_importable()
from kvquant_experiments.bench import attention_targets, report_cells  # noqa: E402


def test_a_step_cell_carries_limits_flags_and_the_exemption():
    cell = {"dim": 64, "T": 300, "codecs": ["kv8", "polar4", "nosuch4"], "threads": [1, 2],
            "repeats": 1, "rounds": 1, "warmup_s": 0.0, "bandwidth_mib": 1}
    res = report_cells.step_cell(cell)
    assert res["available"] and "nosuch4" in res["unavailable"]
    rows = {r["codec"]: r for r in res["rows"]}
    assert set(rows) == {"kv8", "polar4"}
    assert rows["polar4"]["speed_exempt"] and not rows["kv8"]["speed_exempt"]
    for r in rows.values():
        for nt in (1, 2):
            assert r[f"limit_s_{nt}t"] == pytest.approx(
                2 * 300 * r["bytes_per_row"] / (1e9 * r[f"bandwidth_gbs_{nt}t"]))
            assert r[f"fraction_{nt}t"] == pytest.approx(r[f"limit_s_{nt}t"] / r[f"codec_s_{nt}t"])
        assert isinstance(r["flags"], str)


def _row(spec, d, m, T, speedup, exempt=False, flags="", rounds=None):
    lo, hi = rounds or (speedup, speedup)
    return {"codec": spec, "dim": d, "queries": m, "T": T, "speedup_2t": speedup,
            "speedup_rounds_lo_2t": lo, "speedup_rounds_hi_2t": hi,
            "speed_exempt": exempt, "flags": flags}


def test_the_verdict_checks_each_target_on_its_own_row():
    rows = [_row("kv8", 512, 1, 131072, 3.7), _row("tq4", 512, 1, 131072, 5.9),
            _row("kv8", 64, 3, 131072, 3.0), _row("tq4", 64, 3, 131072, 6.0),
            _row("tq4", 64, 1, 131072, 5.1, rounds=(4.7, 5.6)),
            _row("kv8", 64, 1, 32768, 0.5),          # not a target row, but below numpy
            _row("polar4", 64, 1, 131072, 0.05, exempt=True, flags="polar4 slower at 2t")]
    text = attention_targets.verdict({"threads": [1, 2], "rows": rows})
    lines = text.splitlines()
    assert ("kv8 at T=131072, d=512, m=1, 2 thread(s): 3.70x numpy f32, rounds 3.70-3.70x "
            "(target 3.6x") in lines[0]
    assert lines[0].endswith(": met") and lines[1].endswith(": NOT met")      # tq4 5.9 < 6
    # a median over the target whose rounds straddle it says so
    assert any("tq4" in ln and "d=64, m=1" in ln and "rounds 4.70-5.60x" in ln
               and ln.endswith(": met (the rounds fall on both sides)") for ln in lines)
    assert any("d=64, m=3" in ln and "kv8" in ln and ln.endswith(": met") for ln in lines)
    assert not any("d=128" in ln for ln in lines)                        # no row, no line
    slow = [ln for ln in lines if ln.startswith("- no codec slower")][0]
    assert "NOT met: kv8 (d=64, m=1, T=32768: 0.50x)" in slow and "polar4" not in slow
    assert lines[-1] == "- 1 row(s) flagged as implausible (see the flags column)"


def test_the_gqa_grid_is_the_issue_shapes():
    g = attention_targets.GRIDS["gqa"]
    assert (g["dims"], g["queries"], g["contexts"]) == ("64,128,256", "1,3,4,8", "131072")
