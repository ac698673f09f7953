"""The committed study results are what their documented commands train at this version.

Each folder under ``docs/results/`` written by ``ropekit experiment NAME --out docs/results/NAME`` records its
preset, its complete recipe and every run's configuration. A changed default, recipe or study option makes the
folder differ from what the command would train now, and this test fails until the study is regenerated
(``docs/results/REGENERATE.md``). The README's results table must be the committed classification table.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

from ropekit.experiments.recipes import compare_with_committed

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
COMMITTED = ["classify", "shuffle", "offset", "resolution", "data-efficiency", "exact-vs-relaxed", "video",
             "ablations", "detect3d", "robot"]


@pytest.mark.parametrize("study", COMMITTED)
def test_committed_study_matches_its_recipe(study):
    assert (RESULTS / study / "config.json").is_file(), f"docs/results/{study} has no config.json"
    assert compare_with_committed(RESULTS / study) == []


def test_readme_results_table_is_the_committed_one():
    spec = importlib.util.spec_from_file_location("gen_readme_results", ROOT / "tools" / "gen_readme_results.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_readme_results"] = mod
    spec.loader.exec_module(mod)
    readme = (ROOT / "README.md").read_text()
    table = (RESULTS / "classify" / "table.md").read_text()
    assert mod.render(readme, table) == readme, "run python tools/gen_readme_results.py"
    assert table.strip() in readme
