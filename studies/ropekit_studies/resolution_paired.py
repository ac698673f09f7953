"""The paired table of a resolution study's README, generated: per declared comparison and evaluation size, the
paired difference of test accuracy (first − second arm, by seed), its verdict by the one rule
(:mod:`ropekit_studies.verdict`, every cell of the table one Holm family, each claimed positive) and, beside a
null, the smallest difference the seeds detect (MDE).

The README keeps the table between two marker lines, ``<!-- paired:begin -->`` and ``<!-- paired:end -->``;
``tests/test_generated_verdicts.py`` fails when they differ from what the CSV gives. Regenerate with::

    python -m ropekit_studies.resolution_paired docs/results/resolution-comrope

The comparisons of a folder are declared in :data:`PAIRED_TABLES` (its study name picks them).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .report import markdown_table, pe_label, replace_marked_lines
from .verdict import judge

__all__ = ["PAIRED_TABLES", "BEGIN", "END", "paired_size_table", "render_folder", "main"]

BEGIN, END = "<!-- paired:begin -->", "<!-- paired:end -->"

_SIZES = (16, 24, 28, 36, 44, 56)
_LD_AP = ("ComRoPE-LD − ComRoPE-AP, σ = 0", "comrope-ld/normalized", "comrope-ap/normalized")
_AP_CIRCULANT = ("ComRoPE-AP − Circulant, σ = 0", "comrope-ap/normalized", "circulant/normalized")


def _sigma(*encodings: str) -> Tuple[Tuple[str, str, str], ...]:
    """The jitter comparisons, σ = 1 − σ = 0, of ``encodings`` (labels from :func:`~ropekit_studies.report.
    pe_label`)."""
    return tuple((f"σ = 1 − σ = 0, {pe_label(pe).replace('-STRING', '')}", f"{pe}/normalized+jitter",
                  f"{pe}/normalized") for pe in encodings)


#: study -> (evaluation mode, evaluation sizes, [(label, first arm, second arm)]): the comparisons its README
#: reads, declared before the runs; arms as the study's CSV names them (``ENCODING/CONVENTION``).
PAIRED_TABLES: Dict[str, Tuple[str, Tuple[int, ...], Tuple[Tuple[str, str, str], ...]]] = {
    "resolution-comrope": ("resize", _SIZES,
                           (_LD_AP,) + _sigma("comrope-ap", "comrope-ld", "circulant") + (_AP_CIRCULANT,)),
    # ComRoPE with its authors' random start, and LieRE and APE: ComRoPE Table 1's order (LD > AP > LieRE > APE)
    # and the comparisons resolution-comrope made, declared before its runs were read
    "resolution-comrope-paper": ("resize", _SIZES, (
        _LD_AP, ("ComRoPE-LD − LieRE, σ = 0", "comrope-ld/normalized", "liere/normalized"),
        ("LieRE − APE, σ = 0", "liere/normalized", "absolute")) + _sigma("comrope-ap", "comrope-ld")
        + (_AP_CIRCULANT,)),
}


def _signed(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def paired_size_table(rows: Sequence[Dict[str, str]], mode: str, sizes: Sequence[int],
                      pairs: Sequence[Tuple[str, str, str]], train_size: Optional[int] = None) -> List[str]:
    """The markdown lines of the table: one row per pair, one column per size of ``sizes``; each cell
    ``"mean ± sd word"`` (``"trend (−)"``: a trend against the claimed sign; a null with its MDE). ``rows``: a
    resolution study's CSV rows (``mode``, ``pe``, ``image_size``, ``seed``, ``test_acc``, ``train_size``;
    strings as a CSV gives them). Raises ``ValueError`` when an arm or size of a pair is missing."""
    acc = {(r["mode"], r["pe"], int(r["image_size"]), int(r["seed"])): float(r["test_acc"]) for r in rows}
    train_size = train_size if train_size is not None else int(rows[0]["train_size"])
    diffs: Dict[str, List[float]] = {}
    for label, a, b in pairs:
        for size in sizes:
            seeds = sorted(s for (m, p, z, s) in acc if (m, p, z) == (mode, a, size) and (mode, b, size, s) in acc)
            if not seeds:
                raise ValueError(f"no paired runs of {a} and {b} at {size} px ({mode})")
            diffs[f"{label} @ {size}"] = [acc[(mode, a, size, s)] - acc[(mode, b, size, s)] for s in seeds]
    verdicts = judge(diffs, {k: 1 for k in diffs})

    def cell(key: str) -> str:
        v = verdicts[key]
        if v.n < 2:
            return f"{_signed(v.mean)} {v.word}"
        word = {"trend": "trend" if v.sign == v.claimed else "trend (−)"}.get(v.word, v.word)
        return (f"{_signed(v.mean)} ± {v.sd:.3f} {word}"
                + (f" (MDE {v.mde:.3f})" if v.word == "null" else ""))

    head = ["difference"] + [f"{s}{' (train)' if s == train_size else ''}" for s in sizes]
    head[1], head[-1] = head[1] + " px", head[-1] + " px"
    body = [[label] + [cell(f"{label} @ {s}") for s in sizes] for label, _, _ in pairs]
    return markdown_table(head, body).rstrip("\n").split("\n")


def render_folder(folder: Path) -> str:
    """The README of ``folder`` with its paired table regenerated from the folder's CSV (the study named by
    ``config.json``; its comparisons from :data:`PAIRED_TABLES`)."""
    folder = Path(folder)
    study = json.loads((folder / "config.json").read_text())["study"]
    if study not in PAIRED_TABLES:
        raise ValueError(f"{folder}: no paired table is declared for study {study!r}")
    mode, sizes, pairs = PAIRED_TABLES[study]
    with open(folder / f"{study}.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    lines = paired_size_table(rows, mode, sizes, pairs)
    return replace_marked_lines((folder / "README.md").read_text(), BEGIN, END, [""] + lines + [""])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m ropekit_studies.resolution_paired STUDY_FOLDER", file=sys.stderr)
        return 2
    folder = Path(args[0])
    text = render_folder(folder)
    (folder / "README.md").write_text(text)
    print(f"wrote {folder / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
