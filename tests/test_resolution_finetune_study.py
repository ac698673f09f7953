"""``ropekit experiment resolution-finetune``: the recipe's fine-tuning runs, the claims read through the verdict
rule against hand-made rows, and the quick preset end to end on tiny sizes (the fine-tuning runs start from the
base runs, carry the method resolved against them, and record no absolute path)."""

from __future__ import annotations

import csv
import json

import pytest

from ropekit_studies import run_experiment, study_config
from ropekit.train.upgrade import flatten
from ropekit_studies.recipes import recipe
from ropekit_studies.resolution_finetune import finetune_verdicts
from ropekit_studies.runs import run_key


def test_recipe_fine_tunes_each_encoding_at_twice_the_size_with_three_methods():
    r = recipe("resolution-finetune", "default")
    assert r["study"]["pes"] == ["axial", "mixed", "cayley", "circulant", "comrope-ld"]
    assert r["study"]["options"] == {"scalings": ["none", "pi", "yarn"], "factor": 2, "finetune_epochs": 1,
                                     "finetune_lr": 5e-4}
    # the base runs are the classification's: the same recipe for the training fields
    assert r["train"] == recipe("classify", "default")["train"]


def test_run_key_names_the_base_run_by_its_folder_and_tells_methods_apart(tmp_path):
    cfg = study_config("resolution-finetune", quick=True)
    opts = dict(cfg.model_options)

    def ft(base, method):
        mo = dict(opts, resolution_scaling={"method": method}) if method != "none" else opts
        return cfg.train_config("mixed", 0, image_size=56, init_from=str(base), epochs=1, model_options=mo)

    here, there = tmp_path / "a" / "mnist-mixed-s0-0123", tmp_path / "b" / "mnist-mixed-s0-0123"
    key, doc = run_key(ft(here, "yarn"))  # (yarn needs train_extent: the model is built without the scaling)
    assert run_key(ft(there, "yarn"))[0] == key and doc["train"]["init_from"] == "mnist-mixed-s0-0123"
    assert len({run_key(ft(here, m))[0] for m in ("none", "pi", "yarn")}) == 3


def _rows(diff_by_seed):
    rows = []
    for seed, (none, pi, yarn) in enumerate(diff_by_seed):
        for m, acc in (("none", none), ("pi", pi), ("yarn", yarn)):
            rows.append({"stage": "fine-tuned", "pe": "cayley", "seed": seed, "scaling": m, "test_acc": acc})
            rows.append({"stage": "zero-shot", "pe": "cayley", "seed": seed, "scaling": m, "test_acc": 0.1})
    return rows


def test_verdicts_read_paired_differences_by_the_one_rule():
    rows = _rows([(0.60, 0.85, 0.86), (0.62, 0.88, 0.87), (0.58, 0.84, 0.86), (0.61, 0.86, 0.85)])
    verdicts, paper = finetune_verdicts(rows, ["cayley"], [0, 1, 2, 3])
    assert set(verdicts) == {"pi - none: cayley, fine-tuned", "yarn - none: cayley, fine-tuned",
                             "yarn - pi: cayley, fine-tuned"}
    pi = verdicts["pi - none: cayley, fine-tuned"]
    assert pi.word == "holds" and pi.mean == pytest.approx((0.25 + 0.26 + 0.26 + 0.25) / 4)
    assert verdicts["yarn - pi: cayley, fine-tuned"].word in ("null", "trend")  # +0.0025 on +-0.015 noise
    assert "Position Interpolation" in paper["pi - none: cayley, fine-tuned"]
    # a method that did not run leaves its claims out
    only = [r for r in rows if r["scaling"] != "yarn"]
    assert set(finetune_verdicts(only, ["cayley"], [0, 1, 2, 3])[0]) == {"pi - none: cayley, fine-tuned"}


@pytest.mark.slow
def test_quick_preset_end_to_end_on_tiny_sizes(tmp_path):
    out = tmp_path / "resolution-finetune"
    res = run_experiment("resolution-finetune", quick=True, out=out,
                         overrides={"train_fraction": 0.01, "eval_limit": 16, "seeds": [0, 1], "pes": ["cayley"],
                                    "cache_dir": str(tmp_path / "cache"), "progress": False, "threads": 1},
                         scalings=["pi"])
    rows = list(csv.DictReader(open(out / "resolution-finetune.csv")))
    assert len(rows) == 2 * 2 * 2  # (zero-shot, fine-tuned) x (none, pi) x 2 seeds
    assert {r["image_size"] for r in rows} == {"56"} and all(0.0 <= float(r["test_acc"]) <= 1.0 for r in rows)
    assert "pi - none: cayley, fine-tuned" in res.table and "Position Interpolation" in res.table
    config = json.loads((out / "config.json").read_text())
    runs = config["runs"]
    assert config["study"] == "resolution-finetune" and len(runs) == 2 * 3  # a base and two fine-tunings per seed
    assert str(tmp_path) not in json.dumps(runs)  # no absolute path: the base by its folder name
    bases = {run["run"] for run in runs if run["train_config"].get("init_from") is None}
    tuned = [run for run in runs if run["train_config"].get("init_from")]
    assert {run["train_config"]["init_from"] for run in tuned} == bases
    # the pi run recorded its scaling resolved against the base (7x7 -> 14x14: s = 2) in its own folder
    pi = [run for run in tuned if run["train_config"]["model_options"].get("resolution_scaling")]
    assert len(pi) == 2
    recorded = json.loads((tmp_path / "cache" / pi[0]["run"] / "config.json").read_text())
    assert recorded["model"]["resolution_scaling"]["scale"] == [2.0, 2.0]
    assert flatten(recorded["train"])["image_size"] == 56


def test_a_factor_given_on_the_recorded_command_is_the_variant_the_folder_is_compared_with(tmp_path):
    """A single-valued study option on the recorded command (``--factor 4``) replaces the recipe's value when a
    committed folder is compared with what its command trains now: the folder must have run with it."""
    from pathlib import Path

    from ropekit_studies.arguments import OPTION_FIELDS
    from ropekit_studies.recipes import compare_with_committed

    assert "factor" in OPTION_FIELDS
    doc = json.loads((Path(__file__).parents[1] / "docs/results/resolution-finetune/config.json").read_text())
    folder = tmp_path / "rf"
    folder.mkdir()

    def compare(command_tail, factor):
        d = dict(doc, command=doc["command"] + command_tail, options=dict(doc["options"], factor=factor))
        (folder / "config.json").write_text(json.dumps(d))
        return compare_with_committed(folder)

    assert compare("", 2) == []
    assert compare(" --factor 4", 4) == []
    assert compare(" --factor 4", 2) == ["resolution-finetune: option factor: committed 2, recipe 4"]
    assert compare("", 4) == ["resolution-finetune: option factor: committed 4, recipe 2"]
