"""``ropekit experiment native-resolution``: the recipe's arms, the aspect-ratio stretch of the native loader, the
claims read through the verdict rule against hand-made rows, and the quick preset end to end on tiny sizes."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

from ropekit.data.native import NativeBatches, NativeOptions, plan_epoch
from ropekit_studies import run_experiment, study_config
from ropekit.train.upgrade import flatten
from ropekit_studies.native_resolution import PAPER_CLAIMS, claim_diffs, parse_grid, scaling_diffs
from ropekit_studies.recipes import compare_with_committed, recipe
from ropekit_studies.verdict import judge


def test_recipe_trains_fixed_and_native_arms_with_the_encodings_asked_for():
    r = recipe("native-resolution", "default")
    assert r["study"]["pes"] == ["absolute", "axial", "mixed", "cayley", "circulant", "comrope-ld"]
    o = r["study"]["options"]
    assert o["trainings"] == ["fixed", "native"] and o["scalings"] == ["none", "pi", "ntk", "yarn", "cap"]
    assert min(o["grids"]) <= 4 and max(o["grids"]) >= 4 * 7  # about 0.5x (4 of 7) .. 4x the 7x7 training grid
    cfg = study_config("native-resolution")
    fixed = cfg.train_config("mixed", 0)
    native = cfg.train_config("mixed", 0, native_resolution=True, native_options=o["native_options"])
    assert not fixed.data.native_resolution and native.data.native_resolution
    assert native.data.native_options["hflip"] == 0.0 and native.data.native_options["aspect"] > 1
    f, n = flatten(fixed.to_nested()), flatten(native.to_nested())
    assert {k for k, v in f.items() if n[k] != v} == {"native_resolution", "native_options"}


@pytest.mark.parametrize("text,want", [("5x10", (5, 10)), (7, (7, 7)), ("12X4", (12, 4)), ([3, 2], (3, 2))])
def test_parse_grid(text, want):
    assert parse_grid(text) == want


@pytest.mark.parametrize("bad", ["5", "0x3", "ax3", True, "-1x2"])
def test_parse_grid_refuses(bad):
    with pytest.raises(ValueError, match="grid"):
        parse_grid(bad)


def test_aspect_stretch_mixes_aspect_ratios_of_square_images_and_only_in_training():
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.zeros(1, 28, 28), i % 3

    opts = NativeOptions(patch_size=4, seq_len=64, rows=4, min_tokens=49, max_tokens=49, hflip=0.0, aspect=3.0)
    plan = plan_epoch(64, opts, seed=0, epoch=0)
    batches = NativeBatches(Squares(), opts, plan, seed=0, epoch=0)
    grids = {tuple(batches._image(i, 49).grid) for i in range(64)}
    ratios = [g[0] / g[1] for g in grids]
    assert len(grids) >= 3 and min(ratios) < 0.75 and max(ratios) > 1.33
    # the stretch is bounded by [1/3, 3] (a grid rounds each side down: at most one patch off)
    assert all(1 / 3 * (5 / 7) <= r <= 3 * (7 / 5) for r in ratios)
    again = NativeBatches(Squares(), opts, plan, seed=0, epoch=0)
    assert [tuple(again._image(i, 49).grid) for i in range(8)] == [tuple(batches._image(i, 49).grid) for i in range(8)]
    evaluation = NativeBatches(Squares(), opts, plan, seed=0, epoch=0, train=False)
    assert {tuple(evaluation._image(i, 49).grid) for i in range(64)} == {(7, 7)}
    with pytest.raises(ValueError, match="aspect"):
        NativeOptions(patch_size=4, aspect=0.5)


def _rows(acc):
    """Rows of the study's CSV from ``acc[(training, pe, seed, scaling, grid)]``."""
    out = []
    for (training, pe, seed, scaling, grid), a in acc.items():
        h, w = parse_grid(grid)
        out.append({"training": training, "pe": pe, "seed": seed, "scaling": scaling, "grid": grid, "grid_h": h,
                    "grid_w": w, "scale": max(1.0, max(h, w) / 7), "test_acc": a})
    return out


def test_claims_are_the_papers_comparisons_computed_by_hand():
    rng = np.random.default_rng(0)
    acc = {}
    for seed in range(3):
        for pe in ("absolute", "axial", "mixed", "comrope-ld"):
            for training in ("fixed", "native"):
                if training == "native" and pe == "absolute":
                    continue
                for grid in ("4x4", "7x7", "12x12", "5x10"):
                    for scaling in ("none", "pi"):
                        if pe == "absolute" and scaling != "none":
                            continue
                        acc[(training, pe, seed, scaling, grid)] = float(rng.uniform(0.5, 1.0))
    rows = _rows(acc)
    diffs, signs, paper = claim_diffs(rows, ["absolute", "axial", "mixed", "comrope-ld"], [0, 1, 2], (7, 7))
    off = ("4x4", "12x12", "5x10")
    for s in range(3):
        want = np.mean([acc[("native", "mixed", s, "none", g)] for g in off]) - \
            np.mean([acc[("fixed", "mixed", s, "none", g)] for g in off])
        assert math.isclose(diffs["native - fixed: mixed, off-training shapes"][s], want, rel_tol=0, abs_tol=1e-12)
        want = acc[("fixed", "axial", s, "none", "12x12")] - acc[("fixed", "absolute", s, "none", "12x12")]
        assert math.isclose(diffs[PAPER_CLAIMS[1][0]][s], want, abs_tol=1e-12)
        d = lambda pe: acc[("fixed", pe, s, "none", "12x12")] - acc[("fixed", pe, s, "none", "7x7")]  # noqa: E731
        assert math.isclose(diffs[PAPER_CLAIMS[3][0]][s], d("mixed") - d("absolute"), abs_tol=1e-12)
    assert "native - fixed: absolute, off-training shapes" not in diffs  # APE has no native arm
    assert set(signs.values()) == {1} and "83.9" in paper[PAPER_CLAIMS[1][0]]
    sd = scaling_diffs(rows, [0, 1, 2], ["fixed"], ["none", "pi"])
    (key, vals), = sd.items()
    for s in range(3):
        big = ("12x12", "5x10")  # a side beyond the extent 7
        want = np.mean([np.mean([acc[("fixed", pe, s, "pi", g)] for g in big])
                        - np.mean([acc[("fixed", pe, s, "none", g)] for g in big])
                        for pe in ("axial", "comrope-ld", "mixed")])
        assert math.isclose(vals[s], want, abs_tol=1e-12)
    assert judge(diffs, signs).keys() == diffs.keys()


@pytest.mark.slow
def test_quick_preset_end_to_end_on_tiny_sizes(tmp_path):
    out = tmp_path / "native-resolution"
    res = run_experiment("native-resolution", quick=True, out=out,
                         overrides={"train_fraction": 0.01, "eval_limit": 24, "seeds": [0, 1],
                                    "pes": ["absolute", "mixed"], "cache_dir": str(tmp_path / "cache"),
                                    "progress": False, "threads": 1},
                         grids=[4, 7, 12], aspect_grids=["3x6"], scalings=["pi", "yarn"])
    rows = list(csv.DictReader(open(out / "native-resolution.csv")))
    # fixed APE (none only), fixed and native RoPE-Mixed (none, pi, yarn), 4 shapes, 2 seeds
    assert len(rows) == (1 + 3 + 3) * 4 * 2
    assert {r["training"] for r in rows if r["pe"] == "absolute"} == {"fixed"}
    for r in rows:
        assert 0.0 <= float(r["test_acc"]) <= 1.0
        if r["scaling"] != "none" and float(r["scale"]) == 1.0:  # the identity at or below the training extent
            twin = [q for q in rows if q["scaling"] == "none" and all(q[k] == r[k] for k in
                                                                      ("training", "pe", "seed", "grid"))]
            assert twin and twin[0]["test_acc"] == r["test_acc"]
    claims = list(csv.DictReader(open(out / "claims.csv")))
    assert {c["word"] for c in claims} <= {"holds", "reversed", "trend", "null", "not assessable"}
    assert any("NaViT" in c["paper"] for c in claims) and any("rope-vit" in c["paper"] for c in claims)
    assert "native - fixed: mixed" in res.table and "rope-vit" in res.table
    config = json.loads((out / "config.json").read_text())
    assert config["study"] == "native-resolution" and len(config["runs"]) == 3 * 2
    assert sum(run["train_config"]["native_resolution"] for run in config["runs"]) == 2
