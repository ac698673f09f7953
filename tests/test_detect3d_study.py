"""The detect3d study: ViT (RGB) vs the STRING paper's ViTD (depth as input, and as coordinate for rotary
encodings) with the depth-as-input-only ablation; its pinned recipes (every field stated, checked complete,
compared with a committed folder); the learning curve; two processes sharing one output folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ropekit_studies import detection as ex
from ropekit_studies.recipes import detect3d as DR
from ropekit.detection.model import is_rotary
from ropekit.detection.scenes import SceneConfig
from ropekit.detection.train import DetTrainConfig
from ropekit_studies.recipes import PRESETS, compare_with_committed
from ropekit.nn import vit as vit_module
from ropekit.nn.embed import LearnedPosEmbed
from ropekit.nn.vit import ViTConfig

from test_detection_model import _one_thread  # noqa: F401  (one torch thread for this module too)
from test_studies_recipes import SENTINEL, _has_sentinel, _patch_defaults


def _quick_argv(tmp_path, *extra):
    return ["experiment", "detect3d", "--quick", "--out", str(tmp_path / "d3"), "--cache-dir",
            str(tmp_path / "cache"), "--no-progress", *extra]


# ------------------------------------------------------------------------------------------------ recipes


@pytest.mark.parametrize("preset", PRESETS)
def test_recipe_is_complete_and_builds_every_run(preset):
    r = DR.recipe(preset)
    assert set(r["encodings"]) >= ({"none", "cayley"} if preset == "quick" else
                                   {"absolute", "none", "axial", "mixed", "cayley", "circulant"})
    assert r["inputs"] == ["rgb", "rgbd", "rgbd-channel"] and (preset == "quick" or len(r["seeds"]) >= 3)
    cfg = ex.preset_config(preset)
    assert cfg.recipe() == json.loads(json.dumps(r))  # the config runs exactly the recipe
    for enc, inp in ex.planned_runs(cfg):
        model = ex.build_detector(cfg, enc, inp)
        assert model.backbone.cfg.embed_dim == r["backbone"]["embed_dim"]
        assert model.backbone.cfg.depth == r["backbone"]["depth"]


def test_recipe_check_catches_missing_and_unknown_fields():
    for section, name in ((None, "n_train"), ("backbone", "qkv_bias"), ("train", "grad_clip"),
                          ("train", "precision"), ("scenes", "fov")):
        r = DR.recipe("default")
        del (r[section] if section else r)[name]
        with pytest.raises(ValueError, match=f"misses {name}"):
            DR.check_recipe(r)
    r = DR.recipe("default")
    r["backbone"]["embed_dims"] = 64
    with pytest.raises(ValueError, match="embed_dims"):
        DR.check_recipe(r)
    r = DR.recipe("default")
    r["train"]["seed"] = 3  # per run, never in a recipe
    with pytest.raises(ValueError, match="seed"):
        DR.check_recipe(r)
    r = DR.recipe("default")
    r["pe_overrides"]["mixed"]["share"] = "head"
    with pytest.raises(ValueError, match="share"):
        DR.check_recipe(r)
    with pytest.raises(ValueError, match="unknown preset"):
        DR.recipe("tpu")


@pytest.mark.parametrize("preset", PRESETS)
def test_every_field_comes_from_the_recipe(monkeypatch, preset):
    """With every library default a detect3d run could fall back on replaced by a sentinel (ViTConfig, the named
    model sizes, DetTrainConfig, SceneConfig), the study still builds the same models, schedule and scenes."""
    def resolve():
        cfg = ex.preset_config(preset)
        models = {f"{e}/{i}": ex.build_detector(cfg, e, i).cfg.to_dict() for e, i in ex.planned_runs(cfg)}
        return models, cfg.train.to_dict(), vars(cfg.scene_config())

    expected = resolve()
    _patch_defaults(monkeypatch, ViTConfig, {f.name for f in vit_module.dataclasses.fields(ViTConfig)})
    monkeypatch.setattr(vit_module, "VIT_SIZES", {k: {f: SENTINEL for f in v} for k, v in vit_module.VIT_SIZES.items()})
    _patch_defaults(monkeypatch, DetTrainConfig, (DR.train_fields() - {"precision"}) | {"seed"})
    _patch_defaults(monkeypatch, SceneConfig, DR.scene_fields())
    got = resolve()
    assert not _has_sentinel(got), f"detect3d/{preset}: a field fell back on a library default"
    assert got == expected


def test_gpu_preset_is_larger():
    cpu, gpu = DR.recipe("default"), DR.recipe("gpu")
    for key in ("embed_dim", "depth"):
        assert gpu["backbone"][key] > cpu["backbone"][key]
    assert gpu["image_size"] > cpu["image_size"] and gpu["n_train"] > cpu["n_train"]
    assert gpu["train"]["steps"] * gpu["train"]["batch_size"] > cpu["train"]["steps"] * cpu["train"]["batch_size"]
    assert gpu["train"]["precision"] in ("fp32", "bf16") and gpu["seeds"] == cpu["seeds"]


# ------------------------------------------------------------------------------------------------ the models


def test_vitd_is_the_papers_and_the_ablation_is_depth_as_input_only():
    """ViTD of a rotary encoding: 4 input channels (RGB + depth) and 3-D coordinates (y, x, z); of APE / NoPE:
    the depth channel only; the ablation: the channel with a 2-D encoding; ViT: RGB and 2-D."""
    cfg = ex.preset_config("default")
    runs = ex.planned_runs(cfg)
    # the depth-as-input-only model of APE / NoPE would be their ViTD itself: trained once
    assert ("none", "rgbd-channel") not in runs and ("absolute", "rgbd-channel") not in runs
    assert len(runs) == 6 + 6 + 4
    for enc, inp in runs:
        bb = ex.build_detector(cfg, enc, inp).backbone
        channels, coord_dim = bb.patch_embed.proj.in_channels, bb.coord_dim
        if inp == "rgb":
            assert (channels, coord_dim) == (3, 2), enc
        elif inp == "rgbd" and is_rotary(enc):
            assert (channels, coord_dim, bb.cfg.depth_input) == (4, 3, "both"), enc
            assert bb.depth_lift is not None
        else:  # APE / NoPE ViTD, and the ablation
            assert (channels, coord_dim, bb.cfg.depth_input) == (4, 2, "channel"), (enc, inp)
            assert bb.depth_lift is None
        assert isinstance(bb.ape, LearnedPosEmbed) == (enc == "absolute")
        assert (bb.cfg.rotary is None) == (enc in ("none", "absolute"))
    mixed = ex.build_detector(cfg, "mixed", "rgbd").backbone.cfg
    assert mixed.per_head and mixed.pe_sharing == "head"  # RoPE-Mixed per layer and head, as its paper


def test_coordinate_only_variant_is_an_option():
    cfg = ex.preset_config("quick")
    cfg = ex.config_from_recipe({**cfg.recipe(), "inputs": ["rgbd-coord"]}, preset="custom")
    assert ex.planned_runs(cfg) == [("cayley", "rgbd-coord")]
    bb = ex.build_detector(cfg, "cayley", "rgbd-coord").backbone
    assert (bb.patch_embed.proj.in_channels, bb.coord_dim) == (3, 3)


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.sim
def test_quick_study_end_to_end(tmp_path, monkeypatch, capsys):
    pytest.importorskip("pybullet")
    from ropekit.cli import main as cli_main

    out = tmp_path / "d3"
    assert cli_main(_quick_argv(tmp_path)) == 0
    wrote = capsys.readouterr().err.rsplit("files to", 1)[-1]
    assert "table.md" in wrote and ".lock" not in wrote  # the outputs, not the (git-ignored) lock files
    for name in ("detect3d.csv", "detect3d.json", "summary.csv", "table.md", "detect3d.png", "config.json",
                 "training.png", "iou_curve.png", "examples.png", "command.txt"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    doc = json.loads((out / "detect3d.json").read_text())
    rows = {(r["encoding"], r["input"]): r for r in doc["rows"]}
    assert set(rows) == {("none", "rgb"), ("none", "rgbd"), ("cayley", "rgb"), ("cayley", "rgbd"),
                         ("cayley", "rgbd-channel")}
    assert rows[("cayley", "rgbd")]["depth_as"] == "input + coordinate"
    assert rows[("cayley", "rgbd-channel")]["depth_as"] == rows[("none", "rgbd")]["depth_as"] == "input"
    for (enc, inp), r in rows.items():
        assert 0.0 <= r["mean_iou"] <= 1.0
        run_dir = out / "runs" / f"{enc}-{inp}-s0"
        curve = (run_dir / "curve.csv").read_text().splitlines()
        assert "val_mean_iou" in curve[0] and len(curve) == 1 + 3  # a held-out IoU at each of the 3 log rows
        assert 0.0 <= r["val_iou_final"] <= 1.0
    table = (out / "table.md").read_text()
    for label in ("ViT (RGB)", "ViTD (depth as input + coordinate)", "depth as input only", "= ViTD †",
                  "Paired differences", "Learning curve"):
        assert label in table, label
    assert (out / "command.txt").read_text().split() == ["ropekit", "experiment", "detect3d", "--preset", "quick",
                                                         "--out", str(out)]
    # the committed config is the recipe; a changed recipe (as a changed default would be) is reported
    config = json.loads((out / "config.json").read_text())
    assert config["study"] == "detect3d" and config["preset"] == "quick" and len(config["runs"]) == 5
    assert config["recipe"] == json.loads(json.dumps(DR.recipe("quick")))
    assert compare_with_committed(out) == []
    monkeypatch.setitem(DR.RECIPES["quick"]["train"], "lr", 0.5)
    diffs = compare_with_committed(out)
    assert any("recipe train" in d for d in diffs) and sum("run " in d and "train" in d for d in diffs) == 5
    monkeypatch.setitem(DR.RECIPES["quick"]["train"], "lr", 1e-3)
    assert compare_with_committed(out) == []
    monkeypatch.setitem(DR.RECIPES["quick"], "seeds", [0, 1])  # a seed more in the recipe: its runs are missing
    assert sum("is missing" in d for d in compare_with_committed(out)) == 5
    monkeypatch.setitem(DR.RECIPES["quick"], "seeds", [0])
    # a second call finds every run done and only rewrites the report
    mtime = (out / "runs" / "none-rgb-s0" / "metrics.json").stat().st_mtime
    capsys.readouterr()
    assert cli_main(_quick_argv(tmp_path)) == 2  # the report is there: never overwritten unless told
    assert "already holds results" in capsys.readouterr().err
    assert cli_main(_quick_argv(tmp_path, "--overwrite")) == 0
    assert (out / "runs" / "none-rgb-s0" / "metrics.json").stat().st_mtime == mtime
    # a fresh clone has the run files but no checkpoints (git-ignored): the report is rewritten, the examples kept
    for ckpt in out.glob("runs/*/model.pt"):
        ckpt.unlink()
    examples = (out / "examples.png").read_bytes()
    (out / "table.md").unlink()
    capsys.readouterr()
    assert cli_main(_quick_argv(tmp_path, "--overwrite")) == 0
    assert "examples.png not redrawn" in capsys.readouterr().out
    assert (out / "table.md").is_file() and (out / "examples.png").read_bytes() == examples
    assert (out / "runs" / "none-rgb-s0" / "metrics.json").stat().st_mtime == mtime


def test_cli_maps_subsets_onto_the_recipe(tmp_path, monkeypatch, capsys):
    """``--pe``, ``--seeds``, ``--inputs`` and ``--preset`` reach the study; the command records them."""
    from ropekit.cli import main as cli_main

    seen = {}

    def fake_run(cfg, argv=None, progress=True):
        seen["cfg"], seen["argv"] = cfg, argv
        (tmp_path / "table.md").write_text("| table |")
        return {"summary": [], "runs": []}

    monkeypatch.setattr(ex, "run_detect3d", fake_run)
    assert cli_main(["experiment", "detect3d", "--pe", "none,mixed", "--seeds", "3,4", "--inputs", "rgb,rgbd",
                     "--threads", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    cfg = seen["cfg"]
    assert cfg.encodings == ("none", "mixed") and cfg.seeds == (3, 4) and cfg.inputs == ("rgb", "rgbd")
    assert cfg.threads == 1 and cfg.preset == "default" and cfg.out == str(tmp_path)
    assert cfg.train.steps == DR.recipe("default")["train"]["steps"]
    assert seen["argv"] == ["ropekit", "experiment", "detect3d", "--pe", "none,mixed", "--seeds", "3,4", "--inputs",
                            "rgb,rgbd", "--out", str(tmp_path)]
    assert cli_main(["experiment", "detect3d", "--out", str(tmp_path), "--no-progress", "--overwrite"]) == 0
    assert seen["cfg"].recipe() == json.loads(json.dumps(DR.recipe("default")))
    assert seen["argv"] == ["ropekit", "experiment", "detect3d", "--out", str(tmp_path)]
    assert cli_main(["experiment", "detect3d", "--preset", "gpu", "--out", str(tmp_path), "--no-progress",
                     "--overwrite"]) == 0
    assert seen["cfg"].recipe() == json.loads(json.dumps(DR.recipe("gpu"))) and seen["cfg"].preset == "gpu"
    assert seen["argv"][3:5] == ["--preset", "gpu"]
    assert cli_main(["experiment", "detect3d", "--inputs", "depth", "--out", str(tmp_path), "--no-progress",
                     "--overwrite"]) != 0
    assert "unknown input 'depth'" in capsys.readouterr().err


@pytest.mark.sim
def test_a_run_locked_by_another_process_is_waited_for(tmp_path, monkeypatch, capsys):
    """Two processes on one output folder: a run whose folder another process holds is passed over, and taken up
    once that process has ended."""
    pytest.importorskip("pybullet")
    from ropekit.cli import main as cli_main

    run_dir = tmp_path / "d3" / "runs" / "none-rgb-s0"
    run_dir.mkdir(parents=True)
    release = tmp_path / "release"
    # the other process holds the first run until this one has done every other run, then half a second more
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True)\n"
         "while not os.path.exists(sys.argv[2]): time.sleep(0.05)\ntime.sleep(0.5)",
         str(run_dir / ".lock"), str(release)], stdout=subprocess.PIPE, text=True)
    train_one = ex.train_one

    def train_and_release(cfg, enc, inp, seed, *args):
        row = train_one(cfg, enc, inp, seed, *args)
        if (enc, inp) == ("cayley", "rgbd-channel"):
            release.touch()
        return row

    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(ex, "POLL_SECONDS", 0.1)
        monkeypatch.setattr(ex, "train_one", train_and_release)
        assert cli_main(_quick_argv(tmp_path)) == 0
    finally:
        holder.kill()
        holder.wait()
    log = capsys.readouterr().out
    assert "waiting for 1 run(s) another process is training: none-rgb-s0" in log
    assert log.index("cayley-rgbd-channel-s0:") < log.rindex("none-rgb-s0:")  # taken up at the end
    assert (run_dir / "metrics.json").is_file()


def test_module_cli_changes_recipe_fields_and_says_so():
    """``python -m ropekit_studies.detection --set ...``: any recipe field, recorded as a changed preset."""
    import argparse

    p = argparse.ArgumentParser()
    ex.add_arguments(p)
    cfg = ex.config_from_args(p.parse_args(["--set", "train.steps=5", "--set", "backbone.depth=2", "--set",
                                            "n_train=100", "--inputs", "rgb,rgbd-coord", "--encodings", "cayley"]))
    assert (cfg.train.steps, cfg.backbone["depth"], cfg.n_train) == (5, 2, 100)
    assert cfg.inputs == ("rgb", "rgbd-coord") and cfg.preset == "default+changes"
    assert ex.config_from_args(p.parse_args([])).recipe() == json.loads(json.dumps(DR.recipe("default")))
    with pytest.raises(ValueError, match="not a recipe field"):
        ex.config_from_args(p.parse_args(["--set", "train.stepz=5"]))
