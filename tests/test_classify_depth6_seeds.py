"""docs/results/classify-depth6-seeds: the power table its README reads at 13 seeds is what the committed CSVs
give (seeds 0-4 of classify-depth6, 5-12 of runs.csv), and the loop's arms are what the README says."""

from __future__ import annotations

import csv
import re
import statistics
from pathlib import Path

from ropekit_studies.verdict import judge, judge_one, seeds_needed

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
FOLDER = RESULTS / "classify-depth6-seeds"
LABELS = {"mixed": "RoPE-Mixed", "axial": "axial", "cayley": "Cayley", "circulant": "Circulant"}


def _accuracy() -> dict:
    acc = {}
    for path in (RESULTS / "classify-depth6" / "classify.csv", FOLDER / "runs.csv"):
        with open(path, newline="") as fh:
            for r in csv.DictReader(fh):
                acc[(r["pe"], int(r["seed"]))] = float(r["test_acc"])
    return acc


def _signed(x: float) -> str:
    return f"{x:+.4f}".replace("-", "−")


def test_the_power_table_at_13_seeds_is_what_the_csvs_give():
    acc = _accuracy()
    page = (FOLDER / "README.md").read_text()
    table = page.split("**Power, again at 13 seeds (0–12).**")[1].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| pair")]
    assert len(rows) == 5
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        first, second = cells[0].split(" − ")
        a, b = ({v: k for k, v in LABELS.items()}[x] for x in (first, second))
        diffs = [acc[(a, s)] - acc[(b, s)] for s in range(13)]
        sd = statistics.stdev(diffs)
        want = [_signed(statistics.mean(diffs)), f"{sd:.4f}", f"{judge_one(diffs).mde:.4f}",
                str(seeds_needed(sd, 0.01)), str(seeds_needed(sd, 0.005))]
        assert cells[1:] == want, (line, want)


def test_ape_is_left_out_only_after_every_rotary_claim_held():
    """From seed 13 on runs.csv has no APE row, and the four rotary - APE differences at seeds 0-12 each exclude
    zero after a Holm correction over the four (the claims page corrects over its whole family and says "holds"
    for them too)."""
    acc = _accuracy()
    with open(FOLDER / "runs.csv", newline="") as fh:
        ape_seeds = {int(r["seed"]) for r in csv.DictReader(fh) if r["pe"] == "absolute"}
    assert ape_seeds and max(ape_seeds) == 12
    rotary = ("mixed", "axial", "cayley", "circulant")
    verdicts = judge({pe: [acc[(pe, s)] - acc[("absolute", s)] for s in range(13)] for pe in rotary},
                     {pe: 1 for pe in rotary})
    assert {pe: v.word for pe, v in verdicts.items()} == {pe: "holds" for pe in rotary}
    assert re.search(r'ARMS="mixed cayley circulant axial"', (FOLDER / "run.sh").read_text())
