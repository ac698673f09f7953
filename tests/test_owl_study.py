"""``ropekit experiment owl``: its plan, its readings, and the quick preset end to end (contrastive pretraining,
2-D and 3-D open-vocabulary detectors, the report)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pycocotools")

from ropekit_studies.owl import compare_owl, owl_recipe, planned, reading, run_owl, run_settings  # noqa: E402


def test_the_plan_pretrains_every_tower_once_per_seed():
    r = owl_recipe("default")
    plan = planned(r)
    pre = [p for p in plan if p[0] == "pretrain"]
    assert len(pre) == len(r["seeds"]) * (len(r["encodings"]) + 1)  # + the ViTD (Cayley RGB-D) towers
    assert ("pretrain", "cayley", "rgbd", 0) in pre and ("pretrain", "absolute", "rgb", 2) in pre
    assert sum(p[0] == "owl2d" for p in plan) == 7 * 3 and sum(p[0] == "owl3d" for p in plan) == 3 * 3
    for kind, enc, inp, seed in plan:  # every detector's towers are pretrained before it, in the same seed
        if kind != "pretrain":
            assert plan.index(("pretrain", enc, inp, seed)) < plan.index((kind, enc, inp, seed))
    with pytest.raises(ValueError, match="unknown preset"):
        owl_recipe("tpu")


def test_solid_3d_boxes_leave_the_contrastive_and_2d_runs_as_they_were():
    """Only the 3-D detectors' settings name the solid boxes: the contrastive and 2-D runs stay reusable."""
    for preset in ("default", "gpu", "quick"):
        r = owl_recipe(preset)
        assert r["three_d_solid"] is True
        for kind, enc, inp, seed in planned(r):
            s = run_settings(r, kind, enc, inp, seed)
            assert ("three_d_solid" in s) == (kind == "owl3d")
            assert "solid" not in s["data"]


def test_boxes_option_is_checked(tmp_path):
    with pytest.raises(ValueError, match="boxes must be 2d and/or 3d"):
        run_owl(owl_recipe("quick"), tmp_path, preset="quick", argv=[], boxes=("4d",))
    with pytest.raises(ValueError, match="boxes must be 2d and/or 3d"):
        run_owl(owl_recipe("quick"), tmp_path, preset="quick", argv=[], boxes=())


def test_readings():
    assert reading([0.05, 0.04, 0.06]) == "holds"
    assert reading([0.05, 0.04, 0.02]) == "trend"    # t = 4.16: inside t_{0.975,2} = 4.30, beyond t_{0.9,2} = 1.89
    assert reading([0.05, 0.04, -0.01]) == "null"    # t = 1.44
    assert reading([0.01, -0.02, 0.015]) == "null"
    assert reading([-0.05, -0.04, -0.06]) == "reversed"
    assert reading([0.05]) == "not assessable" and reading([]) == "-"
    assert reading([0.05, 0.04, 0.06], claimed=-1) == "reversed"


@pytest.mark.slow
def test_quick_study_end_to_end(tmp_path):
    pytest.importorskip("ropekit.multimodal.train")
    from ropekit_studies import run_experiment

    res = run_experiment("owl", quick=True, out=tmp_path / "owl")
    out = tmp_path / "owl"
    for name in ("owl.csv", "owl.json", "table.md", "owl.png", "config.json", "command.txt", "examples_2d.png",
                 "examples_3d.png"):
        assert (out / name).is_file(), name
    doc = json.loads((out / "owl.json").read_text())
    kinds = sorted((x["kind"], x["encoding"], x["input"]) for x in doc["rows"])
    assert kinds == [("owl2d", "absolute", "rgb"), ("owl2d", "cayley", "rgb"), ("owl3d", "cayley", "rgb"),
                     ("owl3d", "cayley", "rgbd")]
    for x in doc["rows"]:
        keys = ("AP_unseen",) if x["kind"] == "owl2d" else ("mean_iou", "iou25", "depth_err", "depth_err_rel")
        assert all(k in x for k in keys)
    table = res.table
    assert "AP_seen" in table and "ViTD (RGB-D)" in table and "ComRoPE, Table 2" in table
    assert compare_owl(json.loads((out / "config.json").read_text())) == []
    # resuming reads every finished run back instead of training it again
    before = {p: p.stat().st_mtime for p in (out / "runs").glob("*/metrics.json")}
    run_experiment("owl", quick=True, out=out)
    assert {p: p.stat().st_mtime for p in (out / "runs").glob("*/metrics.json")} == before
    doc = json.loads((out / "config.json").read_text())
    doc["recipe"]["owl"]["steps"] = 99
    assert any("recipe owl" in d for d in compare_owl(doc))
