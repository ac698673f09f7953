"""``ropekit experiment verify``: the reading rule, the comparison of a re-run sample with a committed study, and
the command end to end on a tiny study."""

from __future__ import annotations

import csv
import json

import pytest

from ropekit.cli import main
from ropekit_studies.verify import compare_readings, parse_sample, reading, verify_study


@pytest.mark.parametrize("diffs,expected", [
    # t = mean / (sd / sqrt(n)); holds: two-sided p < 0.05 (|t| > t_{0.975, n-1}); trend: |t| > t_{0.9, n-1}
    ([0.03, 0.02, 0.04], ("holds", 1)),                # t = 5.20 > t_{0.975,2} = 4.30
    ([-0.05, -0.04, 0.01, -0.06], ("trend", -1)),      # t = -2.26: inside 3.18, beyond t_{0.9,3} = 1.64
    ([-0.05, -0.04, -0.045, -0.06], ("reversed", -1)),  # t = -10.4, against the claimed (positive) sign
    ([0.3, 0.3, 0.3, -0.001, -0.001], ("trend", 1)),   # t = 2.44: inside 2.78, beyond t_{0.9,4} = 1.53
    ([0.08, -0.001], ("null", 1)),                     # t = 0.98 < t_{0.9,1} = 3.08
    ([-0.007, 0.008, 0.026, 0.033, 0.008], ("trend", 1)),  # t = 1.88
    ([0.033, -0.02, 0.024, 0.034, 0.002], ("null", 1)),  # t = 1.41
    ([0.03, -0.02, 0.0], ("null", 1)),                 # mean 0.003 against a spread of 0.025
    ([0.01], ("not assessable", 1)),                   # one seed: no spread, no interval
    ([0.0, 0.0], ("null", 0)),
])
def test_reading_follows_the_rule(diffs, expected):
    assert reading(diffs) == expected


def test_reading_of_nothing_and_bad_samples_are_errors():
    with pytest.raises(ValueError):
        reading([])
    assert parse_sample("3x2") == (3, 2)
    for bad in ("2", "axb", "0x2"):
        with pytest.raises(ValueError, match="--sample"):
            parse_sample(bad)


def _rows(values):
    """Study rows as a CSV reader gives them: {(pe, fraction): [acc per seed]}."""
    return [{"pe": pe, "fraction": str(frac), "seed": str(s), "test_acc": str(v), "run": f"{pe}-{frac}-{s}-x{v}",
             "wall_time": str(10 + s)}
            for (pe, frac), accs in values.items() for s, v in enumerate(accs)]


COMMITTED = {("a", 0.5): [0.80, 0.82, 0.78], ("b", 0.5): [0.85, 0.88, 0.84],
             ("a", 1.0): [0.90, 0.91, 0.89], ("b", 1.0): [0.90, 0.92, 0.88]}


def test_an_identical_rerun_keeps_every_reading():
    rerun = _rows({k: v[:2] for k, v in COMMITTED.items()})
    doc = compare_readings(_rows(COMMITTED), rerun, ["a", "b"])
    assert doc["conditions"] == ["fraction"]  # the run hash and the wall time differ per seed: not conditions
    assert (doc["holds"], doc["total"]) == (6, 6)  # 4 levels + 2 differences
    assert (doc["runs_compared"], doc["runs_identical"], doc["largest_run_difference"]) == (8, 8, 0)
    pair = next(p for p in doc["pairs"] if p["condition"] == {"fraction": "0.5"})
    assert pair["committed_reading"] == ["holds", 1] and pair["spliced_reading"] == ["holds", 1]
    assert pair["committed_mean"] == pytest.approx((0.05 + 0.06 + 0.06) / 3)


def test_a_moved_mean_and_a_turned_difference_are_reported():
    moved = {k: list(v[:2]) for k, v in COMMITTED.items()}
    moved[("b", 0.5)] = [0.78, 0.80]  # b drops below a at fraction 0.5 on the sampled seeds
    doc = compare_readings(_rows(COMMITTED), _rows(moved), ["a", "b"])
    failed = [(r["arm"], r["condition"]["fraction"]) for r in doc["levels"] if not r["holds"]]
    assert failed == [("b", "0.5")]
    pair = next(p for p in doc["pairs"] if p["condition"] == {"fraction": "0.5"})
    assert pair["committed_reading"] == ["holds", 1] and pair["spliced_reading"][0] != "holds" and not pair["holds"]
    # the untouched condition keeps its readings
    assert all(p["holds"] for p in doc["pairs"] if p["condition"] == {"fraction": "1.0"})
    assert (doc["holds"], doc["total"]) == (4, 6)
    assert doc["runs_identical"] == 6 and doc["largest_run_difference"] == pytest.approx(0.08)


def test_rows_without_a_committed_counterpart_or_metric_are_errors():
    with pytest.raises(ValueError, match="no committed counterpart"):
        compare_readings(_rows(COMMITTED), _rows({("c", 0.5): [0.5]}), ["a", "c"])
    with pytest.raises(ValueError, match="no column 'loss'"):
        compare_readings(_rows(COMMITTED), _rows(COMMITTED), ["a", "b"], metric="loss")


def test_verify_needs_a_folder(capsys):
    assert main(["experiment", "verify"]) == 2
    assert "needs the committed study folder" in capsys.readouterr().err
    assert main(["experiment", "classify", "docs/results/classify", "--quick"]) == 2
    assert "only verify does" in capsys.readouterr().err


@pytest.mark.slow
def test_verify_end_to_end_on_a_tiny_study(tmp_path, capsys, monkeypatch):
    """A tiny committed study re-run on the same machine keeps every reading (exit 0, report written); the same
    study with one arm's accuracies moved beyond their spread fails against the kept re-run (exit 1)."""
    monkeypatch.setattr("sys.argv", ["ropekit", "experiment", "classify", "--quick", "--pe", "absolute,mixed",
                                     "--seeds", "0,1,2", "--out", str(tmp_path / "study")])
    assert main(["experiment", "classify", "--quick", "--pe", "absolute,mixed", "--seeds", "0,1,2", "--no-progress",
                 "--out", str(tmp_path / "study"), "--cache-dir", str(tmp_path / "cache")]) == 0
    doc = json.loads((tmp_path / "study" / "config.json").read_text())
    assert doc["command"].startswith("ropekit experiment classify --quick")
    report = tmp_path / "verify.md"
    assert main(["experiment", "verify", str(tmp_path / "study"), "--sample", "2x2", "--report", str(report),
                 "--out", str(tmp_path / "rerun")]) == 0
    text = report.read_text()
    assert "**3 of 3 readings hold**" in text and "mixed − absolute" in text and "## test_acc" in text
    capsys.readouterr()

    path = tmp_path / "study" / "classify.csv"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        if r["pe"] == "mixed":
            r["test_acc"] = str(float(r["test_acc"]) + 0.5)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    # the kept re-run compared again without training: the moved arm's level and the difference fail
    assert main(["experiment", "verify", str(tmp_path / "study"), "--rerun", str(tmp_path / "rerun")]) == 1
    out = capsys.readouterr().out
    assert "**no**" in out and "compared without training" in out
    other = json.loads((tmp_path / "rerun" / "config.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({**other, "study": "mqa"}))
    with pytest.raises(ValueError, match="is a 'mqa' study"):
        verify_study(tmp_path / "study", rerun=tmp_path / "other")


def test_coordinate_study_arms_select_encodings_and_conventions():
    """Arms ``ENCODING/CONVENTION`` (classify-coords, video-coords) re-run as ``--pe`` and ``--coord-modes``."""
    from ropekit_studies.verify import _arm_argv

    assert _arm_argv(["mixed", "cayley"]) == ["--pe", "mixed,cayley"]
    assert _arm_argv(["liere/grid", "liere/normalized"]) == ["--pe", "liere", "--coord-modes", "grid,normalized"]
    assert _arm_argv(["liere/grid", "comrope-ld/grid"]) == ["--pe", "liere,comrope-ld", "--coord-modes", "grid"]
    with pytest.raises(ValueError, match="mix plain encodings"):
        _arm_argv(["liere", "liere/grid"])


def test_a_recorded_coord_modes_is_kept_unless_the_arms_select_conventions():
    """Plain arms re-run a study (e.g. resolution) with the conventions its command recorded; arms
    ``ENCODING/CONVENTION`` replace them."""
    from ropekit_studies.verify import _arm_argv, _drop_replaced

    recorded = ["resolution", "--coord-modes", "grid", "--pe", "axial", "--seeds=0,1", "--no-progress"]
    assert _drop_replaced(recorded, also=_arm_argv(["axial", "cayley"])[::2]) == ["resolution", "--coord-modes",
                                                                                  "grid"]
    assert _drop_replaced(recorded, also=_arm_argv(["liere/grid"])[::2]) == ["resolution"]


@pytest.mark.slow
def test_verify_re_runs_a_coordinate_study(tmp_path, capsys, monkeypatch):
    """The default sample of a coordinate study (one encoding on both conventions, two seeds) re-runs and keeps
    its readings, the normalised − grid difference among them."""
    argv = ["experiment", "classify-coords", "--quick", "--seeds", "0,1", "--no-progress",
            "--out", str(tmp_path / "study")]
    monkeypatch.setattr("sys.argv", ["ropekit"] + argv)
    assert main(argv + ["--cache-dir", str(tmp_path / "cache")]) == 0
    report = tmp_path / "verify.md"
    assert main(["experiment", "verify", str(tmp_path / "study"), "--report", str(report)]) == 0
    text = report.read_text()
    assert "liere/normalized − liere/grid" in text and "**3 of 3 readings hold**" in text
    capsys.readouterr()


@pytest.mark.slow
def test_verify_re_runs_one_convention_of_a_resolution_study(tmp_path, capsys, monkeypatch):
    """A sample of one ``ENCODING/CONVENTION`` arm of a resolution study (``--sample 1x1`` of
    docs/results/resolution-comrope) re-runs one convention; its rows (both evaluation modes, ``pad`` among them)
    are named as the study named them, so each has its committed counterpart."""
    argv = ["experiment", "resolution-comrope", "--quick", "--seeds", "0,1", "--sizes", "16,28", "--no-progress",
            "--threads", "1", "--out", str(tmp_path / "study")]
    monkeypatch.setattr("sys.argv", ["ropekit"] + argv)
    assert main(argv + ["--cache-dir", str(tmp_path / "cache")]) == 0
    with open(tmp_path / "study" / "resolution-comrope.csv", newline="") as f:
        assert {r["pe"] for r in csv.DictReader(f)} == {"comrope-ld/normalized", "comrope-ld/normalized+jitter"}
    capsys.readouterr()
    report = tmp_path / "verify.md"
    assert main(["experiment", "verify", str(tmp_path / "study"), "--sample", "1x1", "--report", str(report),
                 "--threads", "1", "--out", str(tmp_path / "rerun")]) == 0
    text = report.read_text()
    assert "**4 of 4 readings hold**" in text  # one arm, two modes x two sizes, one seed: four levels, no pair
    assert "| comrope-ld/normalized | mode pad," in text and "| comrope-ld/normalized | mode resize," in text
    with open(tmp_path / "rerun" / "resolution-comrope.csv", newline="") as f:
        assert {r["pe"] for r in csv.DictReader(f)} == {"comrope-ld/normalized"}
