"""Paired differences of the LieRE arms of the efficiency studies against APE and against RoPE-Mixed.

Usage (from the repository root)::

    python tools/efficiency_paired.py > docs/results/data-efficiency-liere/paired.md

``docs/results/data-efficiency-liere`` trained APE, LieRE and LieRE-Commute (seeds 0-2) with the recipe of
``docs/results/data-efficiency``, whose APE / RoPE-Mixed / Cayley runs (seeds 0-4) it does not retrain; the same
recipe and seed give the same run (the APE rows of both folders agree to the last digit, which this script
checks), so the differences are paired seed by seed across the two folders. ``docs/results/compute-efficiency``
(separate runs of 2-10 epochs) is read the same way. A difference is ``mean ± std`` over the shared seeds, with
the number of seeds where it is positive in brackets.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path
from typing import Dict, List, Tuple

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
ARMS = ("liere", "liere-commute")
LABEL = {"liere": "LieRE", "liere-commute": "LieRE-Commute", "mixed": "RoPE-Mixed", "cayley": "Cayley",
         "absolute": "APE"}


def _read(path: Path, budget: str) -> Dict[Tuple[str, float, int], float]:
    """``{(pe, fraction, seed): test_acc}`` of one CSV (``{}`` if absent)."""
    if not path.is_file():
        return {}
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("budget", budget) == budget:
                key = (r["pe"], float(r.get("fraction", r.get("epochs"))), int(r["seed"]))
                out[key] = float(r["test_acc"])
    return out


def _stat(values: List[float]) -> str:
    n = len(values)
    if n == 0:
        return "–"
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
    return f"{m:+.3f} ± {sd:.3f} ({sum(v > 0 for v in values)}/{n})".replace("-", "−")


def _diff(acc: Dict, a: str, b: str, x: float) -> List[float]:
    return _seeded(acc, a, b, x)[1]


def _growth(acc: Dict, a: str, b: str, small: float, full: float) -> List[float]:
    """Seed by seed, ``(a - b)`` at ``small`` minus ``(a - b)`` at ``full``: positive when a's lead grows on less."""
    d_small = dict(zip(*_seeded(acc, a, b, small)))
    d_full = dict(zip(*_seeded(acc, a, b, full)))
    return [d_small[s] - d_full[s] for s in sorted(set(d_small) & set(d_full))]


def _seeded(acc: Dict, a: str, b: str, x: float) -> Tuple[List[int], List[float]]:
    seeds = sorted({s for (p, f, s) in acc if p == a and f == x} & {s for (p, f, s) in acc if p == b and f == x})
    return seeds, [acc[(a, x, s)] - acc[(b, x, s)] for s in seeds]


def main() -> int:
    lines: List[str] = ["# LieRE in the efficiency studies: paired differences", ""]
    for budget, name in (("epochs", "data-efficiency.csv"), ("steps", "equal-steps.csv")):
        new = _read(RESULTS / "data-efficiency-liere" / name, budget)
        if not new:
            continue
        old = _read(RESULTS / "data-efficiency" / name, budget)
        same = [k for k in new if k[0] == "absolute" and k in old]
        if any(abs(new[k] - old[k]) > 1e-9 for k in same):
            sys.exit(f"the re-trained APE runs ({budget}) differ from the committed ones: not the same recipe")
        acc = {**old, **new}
        fractions = sorted({f for (_, f, _) in new})
        lines += [f"## Equal {budget}: arm − reference, per fraction of the training set "
                  f"({len(same)} APE runs re-trained, identical to the committed ones)", "",
                  "| arm − reference | " + " | ".join(f"{f:g}" for f in fractions) + " | lead growth 100 % → "
                  f"{fractions[0]:g} |", "|:---|" + "---:|" * (len(fractions) + 1)]
        for arm in ARMS:
            for ref in ("absolute", "mixed"):
                lines.append(f"| {LABEL[arm]} − {LABEL[ref]} | "
                             + " | ".join(_stat(_diff(acc, arm, ref, f)) for f in fractions)
                             + f" | {_stat(_growth(acc, arm, ref, fractions[0], fractions[-1]))} |")
        lines.append("")
    ce = _read(RESULTS / "compute-efficiency" / "compute-efficiency.csv", "epochs")
    if ce:
        budgets = sorted({e for (_, e, _) in ce})
        pes = [p for p in ("liere", "liere-commute", "mixed", "cayley") if any(k[0] == p for k in ce)]
        lines += ["## Compute efficiency: arm − reference at each training length (separate runs)", "",
                  "| arm − reference | " + " | ".join(f"{e:g} epochs" for e in budgets) + " |",
                  "|:---|" + "---:|" * len(budgets)]
        for arm in pes:
            for ref in ("absolute", "mixed"):
                if arm != ref and any(k[0] == ref for k in ce):
                    lines.append(f"| {LABEL[arm]} − {LABEL[ref]} | "
                                 + " | ".join(_stat(_diff(ce, arm, ref, e)) for e in budgets) + " |")
        lines.append("")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
