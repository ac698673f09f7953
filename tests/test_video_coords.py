"""The ``video-coords`` study: the video study with grid and normalised (t, y, x) coordinates, paired by seed."""

import csv
import json

import pytest
import torch

from ropekit_studies import recipes as R
from ropekit_studies import run_experiment
from ropekit_studies.evaluation import coord_scale
from ropekit.nn import VisionTransformer, ViTConfig


def test_unknown_coordinate_convention_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="unknown coordinate convention.*known: grid, normalized"):
        run_experiment("video-coords", out=tmp_path / "out", quick=True,
                       overrides={"cache_dir": str(tmp_path / "cache"), "progress": False},
                       coord_modes=["grid", "normalized+jitter"])
    assert not (tmp_path / "cache").exists()


def test_video_coords_recipe_is_the_video_study_but_coordinates():
    for preset in ("default", "gpu", "quick"):
        r, base = R.recipe("video-coords", preset), R.recipe("video", preset)
        assert r["train"] == base["train"] and r["train"]["coords"] == "grid"
        assert r["study"]["options"]["coord_modes"] == ["grid", "normalized"]
        assert r["study"]["pe_overrides"] == base["study"]["pe_overrides"]
        assert set(r["study"]["seeds"]) <= set(base["study"]["seeds"])  # the grid arms pair with the video study
    assert {"liere", "comrope-ap"} <= set(R.recipe("video-coords")["study"]["pes"])


@pytest.mark.parametrize("mode", ["grid", "normalized"])
def test_video_coordinates_are_normalised_per_axis_and_the_offset_unit_follows(mode):
    """t, y and x are each divided by their own grid size (2 x 4 x 8 tubelets here, so a wrong axis shows), and
    the offset diagnostic's unit is one tubelet along each axis under either convention."""
    model = VisionTransformer(ViTConfig(pe="liere", modality="video", num_frames=4, tubelet_size=2, patch_size=4,
                                        embed_dim=16, depth=1, num_heads=2, num_classes=3, coords=mode))
    x = torch.zeros(1, 1, 4, 16, 32)  # (B, C, T, H, W) -> tubelet grid (2, 4, 8)
    _, coords, _ = model.embed(x)
    t, y, xx = torch.meshgrid(torch.arange(2.0), torch.arange(4.0), torch.arange(8.0), indexing="ij")
    ref = torch.stack([t.flatten(), y.flatten(), xx.flatten()], dim=-1)  # (64, 3) integer indices
    sizes = torch.tensor([2.0, 4.0, 8.0])
    if mode == "normalized":
        ref = (ref + 0.5) / sizes
    torch.testing.assert_close(coords, ref)
    unit = coord_scale(model, x.shape[1:])
    torch.testing.assert_close(unit, torch.ones(3) if mode == "grid" else 1.0 / sizes)


@pytest.mark.slow
def test_video_coords_pairs_each_convention_with_its_grid_run(tmp_path):
    out = tmp_path / "vc"
    run_experiment("video-coords", out=out, quick=True,
                   overrides={"cache_dir": str(tmp_path / "cache"), "progress": False})
    rows = list(csv.DictReader((out / "video-coords.csv").open()))
    assert [(r["pe"], r["encoding"], r["coords"]) for r in rows] == [("liere/grid", "liere", "grid"),
                                                                      ("liere/normalized", "liere", "normalized")]
    grid, norm = (float(r["test_acc"]) for r in rows)
    assert float(rows[1]["diff_vs_grid"]) == pytest.approx(norm - grid, abs=1e-9)
    assert float(rows[0]["diff_vs_grid"]) == 0.0
    assert all(r["token_grid"] == "4x4x4" for r in rows)
    doc = json.loads((out / "config.json").read_text())
    a, b = (run["train_config"] for run in doc["runs"])
    assert {k for k in a if a[k] != b[k]} == {"coords"} and (a["coords"], b["coords"]) == ("grid", "normalized")
    assert doc["options"] == {"pes": ["liere"], "coord_modes": ["grid", "normalized"]}
    summary = json.loads((out / "video-coords.json").read_text())["summary"]
    assert list(summary["paired_diff_vs_grid"]) == ["liere/normalized"]
    vs = summary["paired_diff_vs_grid"]["liere/normalized"]
    assert vs["per_seed"] == [pytest.approx(norm - grid)] and vs["reading"] == "not assessable"  # one seed
    table = (out / "table.md").read_text()
    assert "LieRE (normalized)" in table and "accuracy − grid coordinates (paired)" in table
    assert R.compare_with_committed(out) == []
