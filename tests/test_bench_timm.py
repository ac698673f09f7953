"""``ropekit bench timm``: the ratios come from the alternated rounds, the report states them, bad settings fail."""

import pytest

pytest.importorskip("timm")

import ropekit.bench.measure as measure  # noqa: E402
from ropekit.bench.cli import main  # noqa: E402
from ropekit.bench.training_step import TIMM_PAIRS, TimmBenchConfig, format_timm_report, run_timm_bench  # noqa: E402


def _fixed_rounds(fns, repeats, warmup, clock=None):
    """ropekit steps 3 ms (cayley 4.5, circulant 3.3), timm steps 4 ms, every round; the last round twice as slow
    for every step (a slow phase of the machine moves both sides of a ratio)."""
    base = {"ropekit cayley": 4.5, "ropekit circulant": 3.3}
    times = {}
    for name in fns:
        t = base.get(name, 4.0 if name.startswith("timm") else 3.0)
        times[name] = [t] * (repeats - 1) + [2 * t]
    return times


def test_ratios_are_those_of_the_alternated_rounds(monkeypatch):
    calls = []
    monkeypatch.setattr(measure, "round_times", lambda fns, *a, **k: calls.append(list(fns)) or _fixed_rounds(fns, *a))
    cfg = TimmBenchConfig(depth=1, image_size=32, batch=2, repeats=5, warmup=0)
    records = run_timm_bench(cfg, log=lambda s: None)
    assert len(calls) == 1  # every step in the same rounds
    assert set(calls[0]) == {f"ropekit {pe}" for _, pe, _ in TIMM_PAIRS} | {f"timm {n}" for *_, n in TIMM_PAIRS} | \
        {"ropekit cayley", "ropekit circulant"}
    by = {r["label"]: r for r in records if r["kind"] in ("timm", "folded")}
    assert [r["kind"] for r in records].count("timm") == 3 and [r["kind"] for r in records].count("folded") == 2
    for label in ("APE", "axial", "RoPE-Mixed"):
        assert by[label]["ratio"] == pytest.approx(0.75) and by[label]["round_ratio_median"] == pytest.approx(0.75)
        assert by[label]["round_ratio_spread"] == pytest.approx(0.0)
    assert by["folded Cayley-STRING"]["ratio"] == pytest.approx(1.5)
    assert by["folded Circulant-STRING"]["ratio"] == pytest.approx(1.1)
    report = format_timm_report(records, command="ropekit bench timm")
    assert "| axial | ropekit axial | 3.0 | timm vit_small_patch16_rope_224 | 4.0 | 0.750 | 0.750 (0%) | 0.750 |" in report
    assert "| folded Cayley-STRING | ropekit cayley | 4.5 | ropekit axial | 3.0 | 1.500 |" in report
    assert "Command: `ropekit bench timm`" in report and "timm " in report.split("Machine:", 1)[1]


def test_real_steps_run_and_settings_are_checked(capsys):
    assert main(["timm", "--depth", "1", "--image-size", "32", "--batch", "2", "--repeats", "1", "--warmup", "0",
                 "--folded", "circulant"]) == 0
    out = capsys.readouterr().out
    assert out.count("| RoPE-Mixed |") == 1 and "folded Circulant-STRING" in out and "Cayley" not in out
    for bad in (dict(image_size=40), dict(depth=0), dict(clock="gpu")):
        with pytest.raises(ValueError):
            TimmBenchConfig(**bad)
