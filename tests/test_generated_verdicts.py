"""Every verdict word of the generated pages is what the committed CSVs give under the one rule: the claims index
(docs/results/claims.md), the retrieval study's comparisons and the owl study's tables. Regenerate a page that
fails with the command its docstring names."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest

from ropekit_studies.claims import render_claims
from ropekit_studies.verdict import WORDS

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def _words(text: str):
    return re.findall(r"\*\*(" + "|".join(WORDS + ("trend against the claim",)) + r")\*\*", text)


def test_claims_page_matches_the_csvs():
    committed = (RESULTS / "claims.md").read_text()
    fresh = render_claims(RESULTS)
    assert _words(committed) == _words(fresh), "regenerate: python -m ropekit_studies.claims docs/results"
    assert committed == fresh, "regenerate: python -m ropekit_studies.claims docs/results"
    assert len(_words(fresh)) >= 4 * 17  # four classification folders of 17 claims each, and retrieval's


def test_retrieval_table_matches_its_csv():
    from ropekit_studies.retrieval import ARMS, comparison_table, comparisons

    with open(RESULTS / "retrieval" / "retrieval.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    text = (RESULTS / "retrieval" / "table.md").read_text()
    fresh = comparison_table(comparisons(rows, arms))
    assert fresh in text
    assert _words(text) == _words(fresh) and len(_words(fresh)) == 12


def test_owl_table_matches_its_csv(tmp_path):
    from ropekit_studies.owl import write_report

    src = RESULTS / "owl"
    doc = json.loads((src / "config.json").read_text())

    def conv(v: str):
        try:
            return int(v) if v.isdigit() else float(v)
        except ValueError:
            return v

    with open(src / "owl.csv", newline="") as fh:
        rows = [{k: conv(v) for k, v in r.items() if v != ""} for r in csv.DictReader(fh)]
    if (src / "runs").is_dir():
        shutil.copytree(src / "runs", tmp_path / "runs")
    write_report(doc["recipe"], rows, tmp_path, preset=doc["preset"], argv=["owl"])
    committed, fresh = (src / "table.md").read_text(), (tmp_path / "table.md").read_text()
    words = re.compile(r"\| (holds|reversed|trend|null|not assessable|-) ")
    assert words.findall(committed) == words.findall(fresh)
    assert committed == fresh


@pytest.mark.sim
@pytest.mark.parametrize("folder", ["robot", "robot-ood"])
def test_robot_tables_match_their_csv(folder):
    pytest.importorskip("pybullet")
    from ropekit_studies.robot import _paired_lines, paired_verdicts

    src = RESULTS / folder
    doc = json.loads((src / "robot.json").read_text())
    agg = doc["summary"]["aggregate"]
    policies = list(dict.fromkeys(a["policy"] for a in agg))
    conditions = list(dict.fromkeys(a["condition"] for a in agg))
    with open(src / "robot.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    fresh = "\n".join(_paired_lines({(a["policy"], a["condition"]): a for a in agg}, policies, conditions,
                                    paired_verdicts(rows, policies, conditions)))
    text = (src / "table.md").read_text()
    assert fresh in text, f"regenerate the paired section of docs/results/{folder}/table.md"
