"""The claims index, generated: for every committed classification folder, each claim the study declares
(:data:`ropekit_studies.recipes.STUDY_CLAIMS`) with the paper's numbers, our paired mean, its 95 % interval
and the verdict of the one rule (:mod:`ropekit_studies.verdict`), the claims of a folder read as one Holm
family; the retrieval study's claims come from its own table (:func:`ropekit_studies.retrieval.comparisons`).

Command line (from the repository root; ``--check`` exits 1 when the committed page differs)::

    python -m ropekit_studies.claims docs/results            # writes docs/results/claims.md
    python -m ropekit_studies.claims docs/results --check
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .recipes import STUDY_CLAIMS
from .report import pe_label
from .verdict import RULE, judge

__all__ = ["CLASSIFY_FOLDERS", "read_runs", "classify_claims", "render_claims", "main"]

#: (heading, CSV files whose rows are pooled by seed, what the folder is), relative to docs/results.
CLASSIFY_FOLDERS: Tuple[Tuple[str, Tuple[str, ...], str], ...] = (
    ("classify", ("classify/classify.csv",), "MNIST, 2 blocks, CPU recipe"),
    ("classify-depth6", ("classify-depth6/classify.csv",), "MNIST, 6 blocks, CPU recipe, the committed seeds"),
    ("classify-depth6 + classify-depth6-seeds", ("classify-depth6/classify.csv", "classify-depth6-seeds/runs.csv"),
     "MNIST, 6 blocks, CPU recipe, with the added seeds of the five arms the STRING-vs-RoPE and rotary-vs-APE "
     "decisions rest on (seeds 5 onward trained at a later code version than seeds 0–4, each seed's arms at one version)"),
    ("gpu/classify", ("gpu/classify/classify.csv",), "MNIST, GPU preset (width 192, 6 blocks, 40 epochs)"),
)


def read_runs(paths: Sequence[Path], metric: str = "test_acc") -> Dict[str, Dict[int, float]]:
    """``{pe: {seed: metric}}`` from study CSVs (columns ``pe``, ``seed``, ``metric``); a later file's row for the
    same encoding and seed is an error (the files must hold disjoint runs)."""
    out: Dict[str, Dict[int, float]] = {}
    for p in paths:
        if not Path(p).is_file():
            continue
        with open(p, newline="") as fh:
            for r in csv.DictReader(fh):
                seed = int(r["seed"])
                if seed in out.setdefault(r["pe"], {}):
                    raise ValueError(f"{p}: a second row for {r['pe']} seed {seed}")
                out[r["pe"]][seed] = float(r[metric])
    return out


def classify_claims(runs: Dict[str, Dict[int, float]], study: str = "classify") -> List[Dict[str, Any]]:
    """Every declared claim of ``study`` whose two arms were run, with its per-seed differences (the seeds both
    arms have) and its :class:`~ropekit_studies.verdict.Verdict`; the claims are one Holm family."""
    rows = []
    for a, b, sign, paper in STUDY_CLAIMS[study]:
        if a in runs and b in runs:
            seeds = sorted(set(runs[a]) & set(runs[b]))
            if seeds:
                rows.append({"first": a, "second": b, "sign": sign, "paper": paper, "seeds": seeds,
                             "diffs": [runs[a][s] - runs[b][s] for s in seeds]})
    names = [f"{r['first']} - {r['second']}" for r in rows]
    verdicts = judge({n: r["diffs"] for n, r in zip(names, rows)}, {n: r["sign"] for n, r in zip(names, rows)})
    for n, r in zip(names, rows):
        r["verdict"] = verdicts[n]
    return rows


def _pm(x: float) -> str:
    return f"{x:+.4f}"


def _classify_section(heading: str, files: Sequence[str], what: str, root: Path) -> List[str]:
    runs = read_runs([root / f for f in files])
    if not runs:
        return []
    rows = classify_claims(runs)
    seeds = sorted({s for r in rows for s in r["seeds"]})
    lines = [f"## {heading}", "", f"{what}; test accuracy, first − second paired by seed; seeds "
             f"{_seed_ranges(seeds)}; {len(rows)} claims, one Holm family.", "",
             "| claim (first − second) | paper | n | mean ± sd | 95 % interval | Holm p | verdict |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        v = r["verdict"]
        word = f"**{v.label}**" + (f" (MDE {v.mde:.4f})" if v.word == "null" else "")
        sd = "–" if v.n < 2 else f"{v.sd:.4f}"
        iv = "–" if v.n < 2 else f"[{_pm(v.low95)}, {_pm(v.high95)}]"
        ph = "–" if v.n < 2 else f"{v.p_holm:.3f}"
        lines.append(f"| {pe_label(r['first'])} − {pe_label(r['second'])} | {r['paper']} | {v.n} | "
                     f"{_pm(v.mean)} ± {sd} | {iv} | {ph} | {word} |")
    return lines + [""]


def _seed_ranges(seeds: Sequence[int]) -> str:
    if not seeds:
        return "none"
    parts, start, prev = [], seeds[0], seeds[0]
    for s in list(seeds[1:]) + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        parts.append(f"{start}–{prev}" if prev != start else f"{start}")
        if s is not None:
            start = prev = s
    return ", ".join(parts)


def _retrieval_section(root: Path) -> List[str]:
    from .retrieval import ARMS, PAPER_TABLE2, comparisons

    path = root / "retrieval" / "retrieval.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    comps = comparisons(rows, arms)
    paper = ", ".join(f"{name} {v:.2f}" for name, v in PAPER_TABLE2.values())
    lines = ["## retrieval", "", f"Image–text retrieval on generated captioned RGB-D scenes (`ropekit experiment "
             f"retrieval`), mean recall in points, paired by seed; STRING Table 2 (WebLI-3D mean recall): {paper}; "
             f"{len(comps)} claims, one Holm family.", "",
             "| claim | n | mean ± sd | 95 % interval | Holm p | verdict |", "|---|---:|---:|---:|---:|---|"]
    for c in comps:
        word = f"**{c['label']}**" + (f" (MDE {100 * c['mde']:.1f})" if c["reading"] == "null" else "")
        iv = "–" if c["n"] < 2 else f"[{100 * c['low95']:+.1f}, {100 * c['high95']:+.1f}]"
        ph = "–" if c["n"] < 2 else f"{c['p_holm']:.3f}"
        lines.append(f"| {c['what']} | {c['n']} | {100 * c['mean']:+.2f} ± {100 * c['std']:.2f} | {iv} | {ph} | "
                     f"{word} |")
    return lines + [""]


def render_claims(root: Path) -> str:
    """The markdown of ``docs/results/claims.md`` from the CSVs under ``root`` (docs/results)."""
    root = Path(root)
    lines = ["# Claims, read from the committed runs", "",
             "Generated by `python -m ropekit_studies.claims docs/results` from the study CSVs; do not edit "
             "by hand (`tests/test_generated_verdicts.py` fails when this page and the files disagree). Each "
             "study declares the comparisons its papers make before it runs, with the claimed sign; the paired "
             "mean over seeds is read with its 95 % t interval. Verdicts: " + RULE + ". A null here means "
             "*not measurable at this number of seeds*, as much as *no effect*: read it beside its MDE. The "
             "papers' numbers come from their own data sets and model sizes (ImageNet, WebLI-3D): they give the "
             "direction and size of the published effect, not a level these runs should reach.", ""]
    for heading, files, what in CLASSIFY_FOLDERS:
        lines += _classify_section(heading, files, what, root)
    lines += _retrieval_section(root)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    args = [a for a in args if a != "--check"]
    if len(args) != 1:
        print("usage: python -m ropekit_studies.claims RESULTS_DIR [--check]", file=sys.stderr)
        return 2
    root = Path(args[0])
    if not root.is_dir():
        print(f"error: {root} is not a folder", file=sys.stderr)
        return 2
    text = render_claims(root)
    target = root / "claims.md"
    if check:
        same = target.is_file() and target.read_text() == text
        print(f"{target}: {'up to date' if same else 'differs from the CSVs; regenerate it'}")
        return 0 if same else 1
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
