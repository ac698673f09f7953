"""The ``scale`` study's width axis: heads scale with the width so the head dimension stays the recipe's."""

from __future__ import annotations

import csv
import json

import pytest

from ropekit_studies import run_experiment
from ropekit_studies.scale import heads_for_width


def test_heads_keep_the_head_dimension():
    assert [heads_for_width(w, 64, 2) for w in (32, 64, 128)] == [1, 2, 4]
    assert heads_for_width(96, 96, 3) == 3
    for bad in (48, 0, -32, 16):
        with pytest.raises(ValueError, match="multiple of the head dimension 32"):
            heads_for_width(bad, 64, 2)


def test_bad_or_repeated_width_fails_before_training(tmp_path):
    for widths, msg in (([24], "multiple of the head dimension 16"), ([32, 32], "repeated width")):
        with pytest.raises(ValueError, match=msg):
            run_experiment("scale", out=tmp_path / "out", quick=True, arms=["1x1"], widths=widths,
                           overrides={"cache_dir": str(tmp_path / "cache"), "progress": False})
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.slow
def test_widths_cross_the_arms_and_change_only_width_and_heads(tmp_path):
    """The ``scale-width`` recipe (quick: widths 16 and 32, head dimension 16) through ``run_experiment``; its
    outputs match the recipe, and LieRE is paired with RoPE-Mixed as well as with APE."""
    from ropekit_studies.recipes import compare_with_committed

    out = tmp_path / "out"
    run_experiment("scale-width", out=out, quick=True, overrides={"cache_dir": str(tmp_path / "cache"),
                                                                  "progress": False})
    assert compare_with_committed(out) == []
    config = json.loads((out / "config.json").read_text())
    assert config["options"] == {"arms": [[1, 1]], "widths": [16, 32]}
    runs = {(r["train_config"]["pe"], r["train_config"]["model_options"]["embed_dim"]): r["train_config"]
            for r in config["runs"]}
    assert sorted(runs) == [(pe, w) for pe in ("absolute", "liere", "mixed") for w in (16, 32)]
    a, b = runs[("mixed", 16)], runs[("mixed", 32)]
    assert {k for k in a if a[k] != b[k]} == {"model_options"}
    assert {k for k in a["model_options"] if a["model_options"][k] != b["model_options"][k]} == {"embed_dim",
                                                                                                  "num_heads"}
    # the quick recipe is width 32 with 2 heads: head dimension 16 at both widths
    assert (a["model_options"]["num_heads"], b["model_options"]["num_heads"]) == (1, 2)
    with open(out / "scale-width.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["arm"] for r in rows} == {"width 16, depth 1, 1 epoch", "width 32, depth 1, 1 epoch"}
    acc = {(r["arm"], r["pe"], r["seed"]): float(r["test_acc"]) for r in rows}
    for r in rows:
        for ref in ("absolute", "mixed"):
            assert float(r[f"diff_vs_{ref}"]) == pytest.approx(acc[(r["arm"], r["pe"], r["seed"])]
                                                               - acc[(r["arm"], ref, r["seed"])])
    table = (out / "table.md").read_text()
    assert "width 16, depth 1, 1 epoch" in table and "− RoPE-Mixed (paired)" in table
