"""Compare the runs two study folders share: the same configuration (run id), trained twice, perhaps on two machines.

Usage (from the repository root)::

    python tools/compare_runs.py docs/results/scale docs/results/classify docs/results/classify-depth6
    python tools/compare_runs.py NEW OLD [OLD ...] --metric train_acc --json out.json

Every study CSV (``<folder>/<study>.csv``, a ``run`` column naming the run by its configuration hash) of the first
folder is matched, row by row, with the rows of the other folders that name the same run. A run trained from the
same configuration on the same kind of machine gives the same numbers to the last digit; on a CPU with another
vector instruction set the sums round in another order and training ends elsewhere. The report says how far: the
matched runs one by one, how many are identical, the mean and largest absolute difference, and -- to judge the
size -- the spread over seeds of the same encoding and arm in the first folder.

Runs are matched by their configuration hash, which includes the library version, so both folders must come from
the same version. To check whether a committed study's readings hold at this version (the rule for the committed
results), use ``ropekit experiment verify docs/results/STUDY`` instead: it re-runs a sample and compares readings.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List


def study_rows(folder: Path) -> List[Dict[str, str]]:
    """The rows of ``folder``'s study CSV (the one named after the folder's study in ``config.json``)."""
    study = json.loads((folder / "config.json").read_text())["study"]
    with open(folder / f"{study}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and "run" not in rows[0]:
        raise ValueError(f"{folder / f'{study}.csv'} names no run (it evaluates another study's runs)")
    return rows


def compare(new: Path, olds: List[Path], metric: str = "test_acc") -> Dict[str, Any]:
    """Matched runs of ``new`` against ``olds`` and a summary; raises ``ValueError`` when none match."""
    old = {}
    for folder in olds:
        for r in study_rows(folder):
            if metric not in r:
                raise ValueError(f"{folder}'s study CSV has no column {metric!r}")
            old.setdefault(r["run"], (folder.name, float(r[metric])))
    rows = study_rows(new)
    if rows and metric not in rows[0]:
        raise ValueError(f"{new}'s study CSV has no column {metric!r}")
    matched = [{"run": r["run"], "group": r.get("arm") or r.get("pe"), "pe": r.get("pe"), "seed": int(r["seed"]),
                "new": float(r[metric]), "old": old[r["run"]][1], "old_folder": old[r["run"]][0]}
               for r in rows if r["run"] in old]
    if not matched:
        raise ValueError(f"no run of {new} is in {', '.join(map(str, olds))}")
    for m in matched:
        m["diff"] = m["new"] - m["old"]
    spreads = {}
    for r in rows:
        spreads.setdefault((r.get("arm"), r.get("pe")), []).append(float(r[metric]))
    seed_std = [statistics.stdev(v) for v in spreads.values() if len(v) > 1]
    absd = [abs(m["diff"]) for m in matched]
    return {"metric": metric, "new": str(new), "old": [str(o) for o in olds], "runs": matched,
            "matched": len(matched), "identical": sum(d == 0 for d in absd), "mean_abs_diff": statistics.mean(absd),
            "max_abs_diff": max(absd), "median_seed_std": statistics.median(seed_std) if seed_std else None}


def render(doc: Dict[str, Any]) -> str:
    lines = [f"{doc['matched']} runs of {doc['new']} also in {', '.join(doc['old'])} ({doc['metric']}):", "",
             "| run | group | seed | new | old | difference |", "|---|---|---:|---:|---:|---:|"]
    for m in doc["runs"]:
        lines.append(f"| {m['run']} | {m['group']} | {m['seed']} | {m['new']:.4f} | {m['old']:.4f} "
                     f"({m['old_folder']}) | {m['diff']:+.4f} |")
    spread = doc["median_seed_std"]
    lines += ["", f"identical: {doc['identical']} of {doc['matched']}; |difference| mean {doc['mean_abs_diff']:.4f}, "
                  f"largest {doc['max_abs_diff']:.4f}; median seed spread in {doc['new']}: "
                  + (f"{spread:.4f}" if spread is not None else "n/a")]
    return "\n".join(lines)


def plot(doc: Dict[str, Any], path: Path) -> None:
    """Each matched run as a point (earlier value across, new value up) per group, the diagonal, and a band of
    one median seed spread around it."""
    from ropekit_studies.report import setup_matplotlib

    plt = setup_matplotlib()
    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    values = [m[k] for m in doc["runs"] for k in ("new", "old")]
    lo, hi = min(values), max(values)
    pad = 0.05 * (hi - lo or 1.0)
    lo, hi = lo - pad, hi + pad
    ax.plot([lo, hi], [lo, hi], color="0.3", lw=1, label="same value")
    if doc["median_seed_std"]:
        s = doc["median_seed_std"]
        ax.fill_between([lo, hi], [lo - s, hi - s], [lo + s, hi + s], color="0.85", label="± median seed spread")
    for group in dict.fromkeys(m["group"] for m in doc["runs"]):
        pts = [(m["old"], m["new"]) for m in doc["runs"] if m["group"] == group]
        ax.scatter(*zip(*pts), s=22, label=group)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel(f"{doc['metric']}, committed run")
    ax.set_ylabel(f"{doc['metric']}, retrained")
    ax.set_title(f"{doc['identical']} of {doc['matched']} identical; largest |difference| {doc['max_abs_diff']:.3f}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("new", type=Path, help="study folder whose runs are compared")
    p.add_argument("old", type=Path, nargs="+", help="study folders with the same runs trained before")
    p.add_argument("--metric", default="test_acc", help="CSV column compared (default test_acc)")
    p.add_argument("--json", type=Path, help="also write the comparison as JSON")
    p.add_argument("--plot", type=Path, help="also draw each run's retrained against its committed value (PNG)")
    args = p.parse_args(argv)
    try:
        doc = compare(args.new, args.old, args.metric)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(doc))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
