"""``ropekit bench`` reads: help states each default once, ratios carry their spread over interleaved rounds and a
row whose spread makes its ratio meaningless is refused, the output starts with a short summary, and the targets
table lists only what was measured (the rest counted in one line)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ropekit.bench import BenchConfig, format_report, run_bench
from ropekit.bench.measure import ratio_spread, too_noisy
from ropekit.bench.report import evaluate_targets, format_summary
from ropekit.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--batch", "1", "--heads", "2", "--head-dim", "8", "--grid", "3", "--threads", "1", "--no-memory"]


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _option_blocks(text: str):
    """``(option, its help text)`` for every option of an argparse help page."""
    blocks, current = [], None
    for line in text.split("\n\n", 1)[-1].splitlines():
        m = re.match(r"^  (-{1,2}[\w-]+)", line)
        if m:
            current = [m.group(1), line]
            blocks.append(current)
        elif current is not None and line.startswith("    "):
            current[1] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.parametrize("sub", [(), ("data",), ("packing",)])
def test_help_states_each_default_once(capsys, sub):
    text = _help(capsys, "bench", *sub)
    blocks = _option_blocks(text)
    assert len(blocks) > 8, text
    for opt, block in blocks:
        assert len(re.findall(r"[(;] ?default\b", block)) <= 1, block  # "(default: 14)", "(...; default all)"
        # argparse's bare defaults of flags and unset options say nothing to a reader
        for noise in ("(default: None)", "(default: False)", "(default: True)"):
            assert noise not in block, block
    if not sub:
        grid = dict(blocks)["--grid"]
        assert grid.endswith("(default: 14)")  # a real default is still stated
        assert "(default: grid2d rgbd3d; quick: grid2d)" in dict(blocks)["--cases"]


def test_ratio_spread_against_numpy_quartiles():
    # closed form: ratios 2, 4, 6, 8: median 5, quartiles (inclusive, linear) 3.5 and 6.5 -> spread 3 / 5
    assert ratio_spread([2, 4, 6, 8], [1, 1, 1, 1]) == pytest.approx((5.0, 0.6), rel=1e-12)
    for seed in range(50):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(2, 30))
        num, den = rng.uniform(0.1, 10, n), rng.uniform(0.1, 10, n)
        ratios = num / den
        med, spread = ratio_spread(list(num), list(den))
        q1, q3 = np.percentile(ratios, [25, 75])  # numpy's linear method is the inclusive quartile
        assert med == pytest.approx(np.median(ratios), rel=1e-12)
        assert spread == pytest.approx((q3 - q1) / np.median(ratios), rel=1e-9, abs=1e-12)


def test_ratio_spread_edge_cases():
    # interleaved rounds: a slow phase that moves both sides leaves the ratio, and so the spread, unchanged
    assert ratio_spread([1.0, 10.0, 100.0], [0.5, 5.0, 50.0]) == (2.0, 0.0)
    assert ratio_spread([3.0], [1.5]) == (2.0, 0.0)  # one round: no spread to speak of
    med, spread = ratio_spread([], [])
    assert np.isnan(med) and spread == float("inf")
    assert ratio_spread([1.0, 2.0, 5.0], [0.0, 1.0, 1.0]) == (3.5, pytest.approx(1.5 / 3.5))  # den 0 left out
    assert ratio_spread([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])[1] == float("inf")  # median 0: no relative spread


def test_too_noisy_refuses_above_the_limit_only():
    steady = ([2.0, 2.1, 1.9, 2.0], [1.0, 1.0, 1.0, 1.0])
    wild = ([2.0, 9.0, 1.0, 6.0], [1.0, 1.0, 1.0, 1.0])
    assert too_noisy("x floor", *steady, 0.5) is None
    msg = too_noisy("x floor", *wild, 0.5)
    assert msg.startswith("refused: x floor varied by ") and "4 interleaved rounds, limit 50%" in msg
    assert too_noisy("x floor", *wild, None) is None  # never refuse
    spread = ratio_spread(*wild)[1]
    assert too_noisy("x floor", *wild, spread) is None  # at the limit: kept (a tie is not above it)


def _fake_rounds(noisy: str = ""):
    """A ``measure.round_times`` replacement: fixed times (fwd 1, fwd+bwd 3, references 1 ms), except that with ``noisy``
    "rows" the floor swings by 10x between rounds, and with "vit" the ViT step does."""
    def fake(fns, repeats, warmup, clock=None):
        times = {name: [1.0] * repeats for name in fns}
        swing = [1.0, 10.0] * (repeats // 2) + [1.0] * (repeats % 2)
        if "fwdbwd" in fns:
            times["fwdbwd"] = [3.0] * repeats
            if noisy == "rows":
                times["floor"] = [0.2 * s for s in swing]
        if "step" in fns and noisy == "vit":
            times["step"] = swing
        return times
    return fake


def _cfg(**kw) -> BenchConfig:
    base = dict(rows=("axial", "mixed"), cases=("grid2d",), batch=1, heads=2, head_dim=8, grid=3, threads=1,
                vit=(), memory=False, repeats=4)
    base.update(kw)
    return BenchConfig.quick_config(**base)


def test_a_row_whose_spread_is_too_large_is_refused_and_reported(monkeypatch):
    import ropekit.bench.measure as measure

    monkeypatch.setattr(measure, "round_times", _fake_rounds("rows"))
    logs = []
    records = run_bench(_cfg(), log=logs.append)
    pe = [r for r in records if r["kind"] in ("pe", "train")]
    assert pe and all(r["skipped"].startswith("refused: x floor varied by") for r in pe)
    assert all("x_floor" not in r and r["x_floor_spread"] > 0.5 for r in pe)
    assert any("refused: x floor" in line for line in logs)
    summary = format_summary(records)
    assert "0 of 2 rows measured, 2 refused as too noisy (axial, mixed)" in summary
    report = format_report(records)
    assert "*axial* not run: refused: x floor varied by" in report

    # the same rounds with a steady floor: measured, ratio of medians and a spread of 0
    monkeypatch.setattr(measure, "round_times", _fake_rounds())
    records = run_bench(_cfg(), log=lambda s: None)
    axial = next(r for r in records if r["label"] == "axial")
    assert "skipped" not in axial and axial["x_floor"] == 3.0 and axial["x_floor_spread"] == 0.0
    assert "| axial | 1.00 | 3.00 | 3.00 | 3.00 | 0% |" in format_report(records)


def test_a_vit_row_whose_spread_is_too_large_is_refused(monkeypatch):
    import ropekit.bench.measure as measure

    monkeypatch.setattr(measure, "round_times", _fake_rounds("vit"))
    records = run_bench(_cfg(rows=("none",), cases=(), vit=("tiny",), vit_pes=("axial",), vit_batch=2,
                             vit_repeats=4), log=lambda s: None)
    (vit,) = records
    assert vit["skipped"].startswith("refused: x absolute varied by") and "x_absolute" not in vit
    assert "vit-tiny eager training step: 0 of 1 rows measured" in format_summary(records)


def test_targets_table_lists_measured_targets_only(monkeypatch):
    import ropekit.bench.measure as measure

    monkeypatch.setattr(measure, "round_times", _fake_rounds())
    records = run_bench(_cfg(), log=lambda s: None)
    targets = evaluate_targets(records)
    measured = [t for t in targets if t["value"] is not None]
    assert 0 < len(measured) < len(targets)
    section = format_report(records).split("### Targets", 1)[1]
    table = [line for line in section.splitlines() if line.startswith("| ") and "target |" not in line]
    assert len(table) == len(measured)
    assert "not measured" not in "\n".join(table) and "–" not in "\n".join(table)
    assert f"{len(targets) - len(measured)} of {len(targets)} targets not measured in this run" in section
    # axial at 3x the floor: measured, and missed (bound 2x) -- named in the summary
    summary = format_summary(records)
    assert f"targets: 0 of {len(measured)} measured met; not met: axial fwd+bwd <= 2x elementwise floor" in summary


def _cli(args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ropekit.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.slow
def test_cli_prints_a_short_summary_and_writes_the_details(tmp_path):
    """As a user runs it (a subprocess in a temporary folder, tiny sizes, memory profile on so the profiler runs):
    stdout is a short summary and where the details are, the tables are in the markdown, the spreads in the JSON."""
    args = ["bench", "--quick", "--rows", "axial", "--cases", "grid2d", *TINY[:-1], "--no-vit", "--max-spread", "0"]
    proc = _cli([*args, "--json", "b.json", "--markdown", "b.md"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()
    assert out[0] == "### Summary" and len(out) <= 8, proc.stdout
    assert out[-1] == "Details (every table and target): b.md and b.json"
    assert "USDT" not in proc.stdout and "profiler" not in proc.stdout and "|" not in proc.stdout
    md = (tmp_path / "b.md").read_text()
    assert md.index("### Summary") < md.index("### Encoding alone") and "| spread |" in md
    assert "not measured |" not in md
    recs = json.loads((tmp_path / "b.json").read_text())
    assert recs[0]["label"] == "axial" and recs[0]["x_floor_spread"] >= 0

    # without files stdout is the only copy: the whole report, the summary first
    proc = _cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.index("### Summary") < proc.stdout.index("### Encoding alone") < proc.stdout.index("### Targets")


def test_quick_is_the_reduced_run_its_help_describes():
    """--quick: grid2d only, no memory profile, no naive or heavy rows, tiny ViT, 3 rounds (what made it take half
    the time of the run that measured both cases with memory profiles); explicit options still win."""
    import argparse

    from ropekit.bench.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--quick"]))
    assert cfg.cases == ("grid2d",) and cfg.memory is False and cfg.vit == ("tiny",) and cfg.repeats == 3
    assert not any(r.kind == "naive" or r.heavy for r in cfg.selected_rows())
    assert {r.pe for r in cfg.selected_rows() if r.kind == "pe"} >= {"axial", "mixed", "cayley", "liere"}
    cfg = config_from_args(parser.parse_args(["--quick", "--cases", "grid2d", "rgbd3d"]))
    assert cfg.cases == ("grid2d", "rgbd3d")
    full = config_from_args(parser.parse_args([]))
    assert full.cases == ("grid2d", "rgbd3d") and full.memory is True and full.max_spread == 0.5
    assert config_from_args(parser.parse_args(["--max-spread", "0"])).max_spread is None
    help_text = parser.format_help()
    assert "under two minutes" not in help_text and "207 s of CPU time" in help_text
