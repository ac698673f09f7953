"""The compute-efficiency study: separate runs per training length, each with its own schedule, read against the
absolute-embedding model's accuracy at the recipe's length."""

import json
import math

import pytest

from ropekit_studies import run_experiment
from ropekit_studies.compute_efficiency import smallest_budget_reaching


def test_smallest_budget_reaching():
    means = {10: 0.86, 2: 0.5, 6: 0.85, 4: 0.7}
    assert smallest_budget_reaching(means, 0.85) == 6  # not the first key given, the smallest budget
    assert smallest_budget_reaching(means, 0.4) == 2
    assert smallest_budget_reaching(means, 0.9) is None
    assert smallest_budget_reaching({2: math.nan, 4: 0.9}, 0.5) == 4  # a budget with no finite mean never counts
    assert smallest_budget_reaching({}, 0.5) is None


@pytest.mark.slow
def test_each_budget_is_its_own_run_with_a_scaled_warmup(tmp_path):
    """Budget 2 at a 1-epoch recipe is a separate 2-epoch run (not the first epochs of a longer one) with twice the
    warm-up; the recipe's length is always trained, and the reference reaches its own mean there."""
    res = run_experiment("compute-efficiency", out=tmp_path, quick=True, epoch_budgets=[2],
                         overrides={"pes": ["absolute"], "cache_dir": str(tmp_path / "cache"), "progress": False,
                                    "eval_limit": 50})
    doc = json.loads((tmp_path / "config.json").read_text())
    runs = {r["train_config"]["epochs"]: r["train_config"] for r in doc["runs"]}
    assert sorted(runs) == [1, 2]
    assert runs[2]["warmup_epochs"] == pytest.approx(2 * runs[1]["warmup_epochs"])
    assert doc["options"]["epoch_budgets"] == [1, 2]
    target = res.summary["target"]
    assert target == pytest.approx(res.summary["accuracy"]["absolute@1"]["mean"])
    assert res.summary["epochs_to_target"]["absolute"] in (1, 2)
    assert (tmp_path / "table.md").read_text().count("| APE") == 1


def test_rejects_a_non_positive_budget(tmp_path):
    with pytest.raises(ValueError, match="positive"):
        run_experiment("compute-efficiency", out=tmp_path, quick=True, epoch_budgets=[0],
                       overrides={"pes": ["absolute"], "cache_dir": str(tmp_path / "cache"), "progress": False})
