"""``ropekit experiment``: every study end to end in quick mode, plus the helpers they rely on.

The studies share one run cache (module fixture), so runs needed by several studies are trained once, as in
real use. The whole file takes well under three minutes on two CPU cores.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from ropekit_studies import STUDIES, run_experiment, study_config
from ropekit_studies.ablations import block_sizes
from ropekit_studies.data_efficiency import epochs_to_reach
from ropekit_studies.evaluation import is_offset_invariant, shift_images, shuffle_patches
from ropekit_studies.offset import OFFSET_RTOL
from ropekit_studies.recipes import recipe
from ropekit_studies.report import fmt_pm, mean_std, replace_marked_lines
from ropekit_studies.runs import RunCache, canonical_pe_options, run_key
from ropekit_studies.scale import parse_arm

#: The studies of this file (classification and its controlled variants); detect3d and robot have their own tests.
NAMES = ["classify", "resolution", "offset", "shuffle", "data-efficiency", "exact-vs-relaxed", "video", "ablations",
         "scale", "compute-efficiency"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, cache) -> dict:
    """Run every study once in quick mode; map name -> (StudyResult, out dir)."""
    root = tmp_path_factory.mktemp("results")
    done = {}
    for name in NAMES:
        out = root / name
        result = run_experiment(name, out=out, quick=True,
                                overrides={"cache_dir": str(cache), "progress": False})
        done[name] = (result, out)
    return done


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_quick_outputs_match_their_recipe(outputs, name, tmp_path):
    """Every study records its preset, recipe and options so that ``compare_with_committed`` can check it; a
    study option changed after the run (as a changed recipe would) is reported."""
    from ropekit_studies.recipes import compare_with_committed

    _, out = outputs[name]
    assert compare_with_committed(out) == []
    doc = json.loads((out / "config.json").read_text())
    stated = sorted(recipe(name, "quick")["study"]["options"])
    if stated:
        doc["options"][stated[0]] = "something else"
        (tmp_path / "config.json").write_text(json.dumps(doc))
        assert [d for d in compare_with_committed(tmp_path) if f"option {stated[0]}:" in d]


@pytest.mark.slow
def test_command_options_narrow_the_recipe(outputs, tmp_path):
    """A list-valued study option on the recorded command (``--groups``, ``--sharing-pe``, ...) is part of what the
    command trains: the committed options must equal it, and it must be a subset of the recipe's list."""
    from ropekit_studies.recipes import compare_with_committed

    _, out = outputs["ablations"]
    doc = json.loads((out / "config.json").read_text())
    groups = doc["options"]["groups"]
    assert groups == recipe("ablations", "quick")["study"]["options"]["groups"] and len(groups) > 1

    def diffs(command):
        (tmp_path / "config.json").write_text(json.dumps(dict(doc, command=command)))
        return compare_with_committed(tmp_path)

    assert diffs(f"ropekit experiment ablations --quick --groups {','.join(groups)}") == []
    # a command naming one group did not train what these (all-group) outputs hold
    assert [d for d in diffs(f"ropekit experiment ablations --quick --groups {groups[0]}") if "option groups:" in d]
    # an option outside the recipe's list, or one the recipe states no list for, is reported
    assert [d for d in diffs("ropekit experiment ablations --quick --groups sharing,nonsense")
            if "--groups ['nonsense'] are not in the recipe's" in d]
    assert [d for d in diffs("ropekit experiment ablations --quick --block-sizes 2,4")
            if "--block-sizes is not a list the recipe states" in d]


def test_registry_lists_the_studies():
    assert set(NAMES) <= set(STUDIES)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_study_writes_its_files(outputs, name):
    result, out = outputs[name]
    for fname in (f"{name}.csv", f"{name}.json", "table.md", f"{name}.png", "config.json"):
        path = out / fname
        assert path.is_file() and path.stat().st_size > 0, f"{name}: {fname} missing"
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / f"{name}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, f"{name}: empty CSV"
    doc = json.loads((out / f"{name}.json").read_text())
    assert doc["study"] == name and len(doc["rows"]) == len(rows)
    config = json.loads((out / "config.json").read_text())
    assert config["experiment"]["quick"] is True
    assert config["runs"] and all(len(r["key"]) == 16 for r in config["runs"])
    table = (out / "table.md").read_text()
    assert table.count("|") > 8 and result.table == table


@pytest.mark.slow
def test_offset_invariance_holds(outputs):
    _, out = outputs["offset"]
    doc = json.loads((out / "offset.json").read_text())
    checks = doc["summary"]["checks"]
    assert doc["summary"]["all_invariant_models_passed"] is True
    by_variant = {}
    for c in checks:
        by_variant.setdefault(c["variant"], []).append(c)
    # commuting encoding + mean pooling, and + centroid CLS: logits equal to round-off
    for v in ("mixed", "mixed+cls-centroid"):
        for c in by_variant[v]:
            assert c["invariant_by_theory"] and c["passed"]
            assert c["max_logit_diff"] <= OFFSET_RTOL * 10  # round-off, far below any real change
    # the unrotated CLS token sees absolute coordinates: not invariant
    for c in by_variant["mixed+cls-unrotated"]:
        assert not c["invariant_by_theory"]
        assert c["max_logit_diff"] > c["tolerance"]
    # LieRE does not commute
    assert all(not c["invariant_by_theory"] for c in by_variant["liere"])
    # APE takes no coordinates: an offset cannot change it
    assert all(c["max_logit_diff"] == 0.0 and not c["coordinate_input"] for c in by_variant["absolute"])


@pytest.mark.slow
def test_exact_relaxed_diagnostics(outputs):
    _, out = outputs["exact-vs-relaxed"]
    with open(out / "diagnostics.csv", newline="") as f:
        diag = {r["variant"]: r for r in csv.DictReader(f)}
    exact, relaxed = diag["exact"], diag["relaxed"]
    # the recipe makes every dimension active in both, so they rotate the same dimensions (and no null space is
    # left to mix with: the mixing norm is zero by construction)
    assert exact["active_dims"] == relaxed["active_dims"] == exact["head_dim"]
    for key in ("commutator_abs", "relative_operator_error", "invariant_residual"):
        assert float(exact[key]) < 1e-6, key
        assert float(relaxed[key]) > 1e-3, key
    with open(out / "sensitivity.csv", newline="") as f:
        sens = list(csv.DictReader(f))
    assert sorted({float(r["delta"]) for r in sens}) == pytest.approx([0.25, 0.5, 1.0, 2.0])
    exact_sens = [float(r["logit_sensitivity"]) for r in sens if r["variant"] == "exact"]
    relaxed_sens = [float(r["logit_sensitivity"]) for r in sens if r["variant"] == "relaxed"]
    assert max(exact_sens) < 1e-4 and min(relaxed_sens) > max(exact_sens)
    with open(out / "exact-vs-relaxed.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted({int(r["shift"]) for r in rows}) == [0, 1, 2]
    assert all(float(r["loss_gap"]) == 0.0 for r in rows if r["shift"] == "0")


@pytest.mark.slow
def test_cached_runs_are_reused(outputs, cache):
    # shuffle needs exactly the classify models, resolution those (grid coordinates) and the rotary encodings
    # with normalised coordinates: nothing was trained twice
    classify = {r["key"] for r in json.loads((outputs["classify"][1] / "config.json").read_text())["runs"]}
    runs = json.loads((outputs["shuffle"][1] / "config.json").read_text())["runs"]
    assert {r["key"] for r in runs} == classify and all(r["cached"] for r in runs)
    runs = json.loads((outputs["resolution"][1] / "config.json").read_text())["runs"]
    grid = {r["key"] for r in runs if r["train_config"]["coords"] == "grid" and not r["train_config"]["augment_sizes"]}
    assert grid == classify and all(r["cached"] for r in runs if r["key"] in grid)
    normalized = [r for r in runs if r["train_config"]["coords"] == "normalized"]
    assert {r["train_config"]["pe"] for r in normalized if not r["train_config"]["augment_sizes"]} == {"mixed", "liere"}
    # scale augmentation: every encoding, APE included (its table is resized to each grid)
    scaled = {r["train_config"]["pe"] for r in runs if r["train_config"]["augment_sizes"]}
    assert "absolute" in scaled and {"mixed", "liere"} <= scaled
    cfg = study_config("classify", quick=True, overrides={"cache_dir": str(cache), "progress": False})
    rec = RunCache(cache).get(cfg.train_config("mixed", 0))
    assert rec.cached and rec.history


def test_cli_runs_a_study(tmp_path, cache, capsys):
    from ropekit.cli import main

    out = tmp_path / "shuffle"
    code = main(["experiment", "shuffle", "--quick", "--pe", "none,mixed", "--out", str(out), "--cache-dir", str(cache),
                 "--no-progress"])
    assert code == 0
    assert (out / "shuffle.png").is_file()
    printed = capsys.readouterr().out
    assert "relative drop" in printed
    with open(out / "shuffle.csv", newline="") as f:
        rows = {r["pe"]: r for r in csv.DictReader(f)}
    # no position information + mean pooling: shuffling the patches changes nothing
    assert float(rows["none"]["relative_drop"]) == 0.0


def test_cli_rejects_bad_input(tmp_path, capsys):
    from ropekit.cli import main

    assert main(["experiment", "classify", "--quick", "--pe", "bogus", "--out", str(tmp_path / "x"),
                 "--cache-dir", str(tmp_path / "c"), "--no-progress"]) == 2
    assert "unknown position encoding" in capsys.readouterr().err
    assert main(["experiment", "offset", "--quick", "--fractions", "0.5", "--out", str(tmp_path / "y")]) == 2
    assert "takes no option --fractions" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's usage error, one line naming the list it could not read
        main(["experiment", "classify", "--quick", "--seeds", "0,a"])
    err = capsys.readouterr().err
    assert "--seeds: expected comma-separated integers, got '0,a'" in err and "_ints" not in err
    with pytest.raises(SystemExit):
        main(["experiment", "offset", "--quick", "--rhos", "0.5,x"])
    assert "--rhos: expected comma-separated numbers, got '0.5,x'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------


def test_shift_images_integer_and_fractional():
    x = torch.arange(2 * 1 * 5 * 6, dtype=torch.float32).reshape(2, 1, 5, 6)
    y = shift_images(x, 1, 2)
    assert torch.equal(y[..., 1:, 2:], x[..., :-1, :-2])
    assert torch.all(y[..., 0, :] == 0) and torch.all(y[..., :, :2] == 0)
    half = shift_images(x, 0, 0.5)
    assert torch.allclose(half[..., 1:], 0.5 * (x[..., 1:] + x[..., :-1]))
    assert torch.allclose(half[..., 0], 0.5 * x[..., 0])  # zero fill from the border
    clip = torch.rand(1, 1, 3, 4, 4)
    assert torch.equal(shift_images(clip, 1, 0)[:, :, :, 1:], clip[:, :, :, :-1])


def test_shuffle_patches_permutes_whole_patches():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 2, 8, 12)
    s = shuffle_patches(x, 4, generator=g)

    def patches(t):
        return t.reshape(3, 2, 2, 4, 3, 4).permute(0, 2, 4, 1, 3, 5).reshape(3, 6, -1)

    for b in range(3):
        a = {tuple(p.tolist()) for p in patches(x)[b]}
        assert a == {tuple(p.tolist()) for p in patches(s)[b]}
    v = torch.rand(2, 1, 4, 4, 4)
    sv = shuffle_patches(v, 2, tubelet_size=2, generator=g)
    assert torch.equal(sv.reshape(2, -1).sort(1).values, v.reshape(2, -1).sort(1).values)


@pytest.mark.slow
def test_scale_changes_one_factor_per_arm_and_pairs_by_seed(outputs):
    _, out = outputs["scale"]
    config = json.loads((out / "config.json").read_text())
    runs = {(r["train_config"]["pe"], r["train_config"]["model_options"]["depth"], r["train_config"]["epochs"]): r
            for r in config["runs"]}
    assert sorted(runs) == [("absolute", 1, 1), ("absolute", 2, 1), ("mixed", 1, 1), ("mixed", 2, 1)]
    # the reference arm is the classification study's own runs, read from the cache
    classify = {r["key"] for r in json.loads((outputs["classify"][1] / "config.json").read_text())["runs"]}
    assert {runs[("absolute", 1, 1)]["key"], runs[("mixed", 1, 1)]["key"]} <= classify
    assert runs[("mixed", 1, 1)]["cached"] and not runs[("mixed", 2, 1)]["cached"]
    # the other arm differs from it in the depth alone
    a, b = runs[("mixed", 1, 1)]["train_config"], runs[("mixed", 2, 1)]["train_config"]
    assert {k for k in a if a[k] != b[k]} == {"model_options"}
    assert {k for k in a["model_options"] if a["model_options"][k] != b["model_options"][k]} == {"depth"}
    with open(out / "scale.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    acc = {(r["arm"], r["pe"], r["seed"]): float(r["test_acc"]) for r in rows}
    for r in rows:
        assert float(r["diff_vs_absolute"]) == pytest.approx(acc[(r["arm"], r["pe"], r["seed"])]
                                                             - acc[(r["arm"], "absolute", r["seed"])])
    assert parse_arm("6x10") == (6, 10) and parse_arm([2, 40]) == (2, 40)
    for bad in ("6", "x10", "0x10", [2], "6x10x2"):
        with pytest.raises(ValueError, match="arm"):
            parse_arm(bad)
    with pytest.raises(ValueError, match="repeated arm"):
        run_experiment("scale", out=out / "again", quick=True, arms=["1x1", "1x1"],
                       overrides={"cache_dir": str(out / "unused"), "progress": False})


def test_small_helpers():
    assert canonical_pe_options("comrope-ld", {"block_size": 8}) == {}
    assert canonical_pe_options("comrope-ld", {"block_size": 4}) == {"block_size": 4}
    assert block_sizes("comrope-ap", 24, 3, (2, 4, 8)) == [2, 4, 8]  # 12, 6 and 3 blocks: whole per axis
    assert block_sizes("comrope-ap", 32, 3, (2, 4, 8)) == []  # 16, 8, 4 blocks cannot split over 3 axes
    assert block_sizes("circulant", 32, 2, (2, 4, 8, 16, 32, 64, None)) == [4, 8, 16, None]
    hist = [{"epoch": 1, "test_acc": 0.5}, {"epoch": 2, "test_acc": 0.8}]
    assert epochs_to_reach(hist, 0.7) == 2 and epochs_to_reach(hist, 0.9) is None
    st = mean_std([0.9, 0.92])
    assert st["n"] == 2 and fmt_pm(st, 2) == "0.91 ± 0.01"
    assert fmt_pm(mean_std([0.5]), 3) == "0.500"


def test_run_key_ignores_runtime_fields_and_default_options():
    cfg = study_config("classify", quick=True).train_config("comrope-ld", 0)
    k1, _ = run_key(cfg)
    assert run_key(cfg.replace(out="/elsewhere", threads=2, progress=False))[0] == k1
    assert run_key(cfg.replace(pe_options={"block_size": 8}))[0] == k1
    assert run_key(cfg.replace(pe_options={"block_size": 4}))[0] != k1
    assert run_key(cfg.replace(seed=1))[0] != k1


def test_invariance_flags():
    from ropekit.nn import VisionTransformer, vit_config

    def model(**kw):
        return VisionTransformer(vit_config("tiny", embed_dim=32, num_heads=2, depth=1, patch_size=7, **kw))

    assert is_offset_invariant(model(pe="cayley"))
    assert is_offset_invariant(model(pe="mixed", cls="centroid"))
    assert not is_offset_invariant(model(pe="mixed", cls="unrotated"))
    assert not is_offset_invariant(model(pe="liere"))
    assert not is_offset_invariant(model(pe="absolute"))


def test_replace_marked_lines_keeps_markers_and_everything_outside():
    text = "intro\n  <!-- b -->\n  old 1\n  old 2\n  <!-- e -->\noutro"
    assert replace_marked_lines(text, "<!-- b -->", "<!-- e -->", ["new"]) == \
        "intro\n  <!-- b -->\nnew\n  <!-- e -->\noutro"
    assert replace_marked_lines(text, "<!-- b -->", "<!-- e -->", []) == "intro\n  <!-- b -->\n  <!-- e -->\noutro"


@pytest.mark.parametrize("text", ["no markers", "<!-- e -->\n<!-- b -->", "<!-- b -->\n<!-- b -->\n<!-- e -->",
                                  "x <!-- b --> y\n<!-- e -->"])
def test_replace_marked_lines_rejects_missing_repeated_or_misordered_markers(text):
    with pytest.raises(ValueError, match="needs one line"):
        replace_marked_lines(text, "<!-- b -->", "<!-- e -->", ["new"])
