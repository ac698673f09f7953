"""The ``classify-coords`` study: the classification with grid and normalised token coordinates, paired by seed."""

import csv
import json

import pytest

from ropekit_studies import run_experiment
from ropekit_studies import recipes as R


def test_unknown_coordinate_convention_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="unknown coordinate convention.*known: grid, normalized"):
        run_experiment("classify-coords", out=tmp_path / "out", quick=True,
                       overrides={"cache_dir": str(tmp_path / "cache"), "progress": False},
                       coord_modes=["grid", "normalized+scale"])
    assert not (tmp_path / "cache").exists()


def test_classify_coords_recipe_is_the_classification_but_coordinates():
    for preset in ("default", "gpu", "quick"):
        r, base = R.recipe("classify-coords", preset), R.recipe("classify", preset)
        assert r["train"] == base["train"] and r["train"]["coords"] == "grid"
        assert r["study"]["options"]["coord_modes"] == ["grid", "normalized"]
        assert set(r["study"]["pes"]) <= set(base["study"]["pes"])
        assert set(r["study"]["seeds"]) <= set(base["study"]["seeds"])  # the grid arms pair with the classification


@pytest.mark.slow
def test_classify_coords_pairs_each_convention_with_its_grid_run(tmp_path):
    out = tmp_path / "cc"
    run_experiment("classify-coords", out=out, quick=True,
                   overrides={"cache_dir": str(tmp_path / "cache"), "progress": False})
    rows = list(csv.DictReader((out / "classify-coords.csv").open()))
    assert [(r["pe"], r["coords"]) for r in rows] == [("liere/grid", "grid"), ("liere/normalized", "normalized")]
    grid, norm = (float(r["test_acc"]) for r in rows)
    assert float(rows[1]["diff_vs_grid"]) == pytest.approx(norm - grid, abs=1e-9)
    assert float(rows[0]["diff_vs_grid"]) == 0.0
    doc = json.loads((out / "config.json").read_text())
    a, b = (run["train_config"] for run in doc["runs"])
    assert {k for k in a if a[k] != b[k]} == {"coords"} and (a["coords"], b["coords"]) == ("grid", "normalized")
    summary = json.loads((out / "classify-coords.json").read_text())["summary"]
    assert list(summary["paired_diff_vs_grid"]) == ["liere/normalized"]
    assert "LieRE (normalized)" in (out / "table.md").read_text()
    assert R.compare_with_committed(out) == []
