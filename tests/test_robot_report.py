"""The robot study's paired comparison lines, against differences and a z worked out by hand."""

from __future__ import annotations

import math

from ropekit_studies.robot import _paired_lines


def _cell(rates, episodes_per_seed=100):
    successes = sum(round(r * episodes_per_seed) for r in rates)
    n = episodes_per_seed * len(rates)
    return {"seeds": [0, 1, 2], "seed_rates": rates, "successes": successes, "episodes": n,
            "success_rate": successes / n}


def test_paired_differences_and_pooled_z():
    table = {("3d_scratch", "ood"): _cell([0.13, 0.39, 0.33]), ("2d", "ood"): _cell([0.17, 0.28, 0.17])}
    lines = _paired_lines(table, ["2d", "3d_scratch"], ["ood"])
    rows = [line for line in lines if line.startswith("| 3-D")]
    assert len(rows) == 1  # only the pair whose two policies ran
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[2] == "-4, +11, +16"
    diffs = [-4, 11, 16]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert cells[3] == f"{mean:+.1f} ± {sd:.1f}" == "+7.7 ± 10.4"
    p = (85 + 62) / 600
    z = (85 / 300 - 62 / 300) / math.sqrt(p * (1 - p) * (2 / 300))
    assert cells[4] == f"{z:+.2f}" and abs(z - 2.18) < 0.005
