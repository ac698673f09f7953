"""The claims index, generated: for every committed classification folder, each claim the study declares
(:data:`ropekit_studies.recipes.STUDY_CLAIMS`) with the paper's numbers, our paired mean, its 95 % interval
and the verdict of the one rule (:mod:`ropekit_studies.verdict`), the claims of a folder read as one Holm
family; for every retrieval folder (:data:`RETRIEVAL_FOLDERS`) the study's recall claims
(:func:`ropekit_studies.retrieval.comparisons`), the power of its STRING-against-RoPE pair and the depth
hard negatives per arm against chance (:func:`ropekit_studies.retrieval.hard_negatives`); for the native-resolution
folder (:data:`NATIVE_FOLDERS`) the papers' claims and the scaling methods, and for the resolution-finetune folder
(:data:`FINETUNE_FOLDERS`) the fine-tuning claims, recomputed from their CSVs.

Command line (from the repository root; ``--check`` exits 1 when the committed page differs)::

    python -m ropekit_studies.claims docs/results            # writes docs/results/claims.md
    python -m ropekit_studies.claims docs/results --check
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .recipes import STUDY_CLAIMS
from .report import pe_label
from .verdict import RULE, judge

__all__ = ["CLASSIFY_FOLDERS", "RETRIEVAL_FOLDERS", "NATIVE_FOLDERS", "FINETUNE_FOLDERS", "read_runs",
           "read_retrieval_rows", "classify_claims", "render_claims", "main"]

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


def _verdict_cells(v: Any) -> str:
    """``n | mean ± sd | 95 % interval | Holm p | verdict`` of a :class:`~ropekit_studies.verdict.Verdict`."""
    word = f"**{v.label}**" + (f" (MDE {v.mde:.4f})" if v.word == "null" else "")
    sd = "–" if v.n < 2 else f"{v.sd:.4f}"
    iv = "–" if v.n < 2 else f"[{_pm(v.low95)}, {_pm(v.high95)}]"
    ph = "–" if v.n < 2 else f"{v.p_holm:.3f}"
    return f"{v.n} | {_pm(v.mean)} ± {sd} | {iv} | {ph} | {word}"


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
        lines.append(f"| {pe_label(r['first'])} − {pe_label(r['second'])} | {r['paper']} | "
                     f"{_verdict_cells(r['verdict'])} |")
    return lines + [""]


#: The native-resolution study's folders, relative to docs/results, and what each is.
NATIVE_FOLDERS: Tuple[Tuple[str, str], ...] = (
    ("native-resolution", "MNIST, 2 blocks, CPU recipe: fixed-size (7x7 patches) against native-resolution "
                          "training (packed, token budgets 16..100, aspect ratios stretched up to 2x), evaluated "
                          "at 4x4..28x28 and four other aspect ratios"),
)


def _native_section(root: Path, folder: str, what: str) -> List[str]:
    """The native-resolution claims of a folder, recomputed from its CSV with the study's own reading
    (:func:`ropekit_studies.native_resolution.native_verdicts`): the papers' claims and the scaling methods, two
    Holm families."""
    from .native_resolution import native_verdicts

    path = root / folder / "native-resolution.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as fh:
        rows = [{**r, "seed": int(r["seed"]), "grid_h": int(r["grid_h"]), "grid_w": int(r["grid_w"]),
                 "scale": float(r["scale"]), "test_acc": float(r["test_acc"])} for r in csv.DictReader(fh)]
    if not rows:
        return []
    seeds = sorted({r["seed"] for r in rows})
    pes = list(dict.fromkeys(r["pe"] for r in rows))
    trainings = list(dict.fromkeys(r["training"] for r in rows))
    scalings = list(dict.fromkeys(r["scaling"] for r in rows))
    th, tw = (int(v) for v in next(r["train_grid"] for r in rows if r["training"] == "fixed").split("x"))
    verdicts, paper, sverdicts = native_verdicts(rows, pes, seeds, (th, tw), trainings, scalings)
    lines = [f"## {folder}", "", f"{what}; test accuracy, paired by seed; seeds {_seed_ranges(seeds)}. The papers' "
             f"claims ({len(verdicts)}, one Holm family), then each scaling method against none beyond the training "
             f"extent, mean over the rotary encodings ({len(sverdicts)}, a second family).", "",
             "| claim (first − second) | paper | n | mean ± sd | 95 % interval | Holm p | verdict |",
             "|---|---|---:|---:|---:|---:|---|"]
    for family, vs in ((paper, verdicts), ({}, sverdicts)):
        for key, v in vs.items():
            lines.append(f"| {key} | {family.get(key, '–')} | {_verdict_cells(v)} |")
    return lines + [""]


#: The resolution-finetune study's folders, relative to docs/results, and what each is.
FINETUNE_FOLDERS: Tuple[Tuple[str, str], ...] = (
    ("resolution-finetune", "MNIST, 2 blocks, CPU recipe: the classification's runs (7x7 patches) fine-tuned for "
                            "one epoch at 56 px (14x14) with no scaling, position interpolation or YaRN in place"),
    ("resolution-finetune-4x", "the same runs of four encodings (axial, RoPE-Mixed, Cayley, Circulant) fine-tuned "
                               "for one epoch at four times the size, 112 px (28x28), `--factor 4`"),
)


def _finetune_section(root: Path, folder: str, what: str) -> List[str]:
    """The resolution-finetune claims of a folder, recomputed from its CSV with the study's own reading
    (:func:`ropekit_studies.resolution_finetune.finetune_verdicts`), one Holm family."""
    from .resolution_finetune import finetune_verdicts

    path = root / folder / "resolution-finetune.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as fh:
        rows = [{**r, "seed": int(r["seed"]), "test_acc": float(r["test_acc"])} for r in csv.DictReader(fh)]
    if not rows:
        return []
    seeds = sorted({r["seed"] for r in rows})
    verdicts, paper = finetune_verdicts(rows, list(dict.fromkeys(r["pe"] for r in rows)), seeds)
    size = rows[0].get("image_size") or "the fine-tuning size"
    lines = [f"## {folder}", "", f"{what}; test accuracy at {size} px after fine-tuning, paired by seed; seeds "
             f"{_seed_ranges(seeds)}; {len(verdicts)} claims, one Holm family.", "",
             "| claim (first − second) | paper | n | mean ± sd | 95 % interval | Holm p | verdict |",
             "|---|---|---:|---:|---:|---:|---|"]
    for key, v in verdicts.items():
        lines.append(f"| {key} | {paper[key]} | {_verdict_cells(v)} |")
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


#: The retrieval studies' folders, relative to docs/results, and what each is; a folder not there is left out (the
#: index reports a folder the moment its runs are dropped in, with no code change).
RETRIEVAL_FOLDERS: Tuple[Tuple[str, str], ...] = (
    ("retrieval", "natural captioned scenes (apparent size, image height and occlusion go with depth), "
                  "default preset"),
    ("retrieval-depth", "depth-only captioned scenes (apparent size, image height and occlusion say nothing of "
                        "depth order; only the depth map tells a depth relation), default preset"),
    ("retrieval-depth-quick", "depth-only captioned scenes, quick preset: a smoke run of the pipeline (16 test "
                              "captions per seed), which decides nothing"),
)


def read_retrieval_rows(folder: Path) -> Tuple[str, List[Dict[str, str]]]:
    """``(study, rows)`` of a retrieval study folder: the study named by its ``config.json`` (else the folder's
    name) and the rows of ``<study>.csv``; no rows when the folder or the CSV is missing."""
    folder = Path(folder)
    study = folder.name
    if (folder / "config.json").is_file():
        study = json.loads((folder / "config.json").read_text()).get("study", study)
    path = folder / f"{study}.csv"
    if not path.is_file():
        return study, []
    with open(path, newline="") as fh:
        return study, list(csv.DictReader(fh))


def _retrieval_section(root: Path, folder: str, what: str) -> List[str]:
    from .retrieval import ARMS, PAPER_TABLE2, comparisons, decision_power, hard_negatives, power_sentence

    study, rows = read_retrieval_rows(root / folder)
    if not rows:
        return []
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    comps = comparisons(rows, arms)
    seeds = sorted({int(r["seed"]) for r in rows})
    paper = ", ".join(f"{name} {v:.2f}" for name, v in PAPER_TABLE2.values())
    lines = [f"## {folder}", "", f"Image–text retrieval (`ropekit experiment {study}`) on {what}; seeds "
             f"{_seed_ranges(seeds)}. Mean recall in points, paired by seed; STRING Table 2 (WebLI-3D mean "
             f"recall): {paper}; {len(comps)} claims, one Holm family.", "",
             "| claim | n | mean ± sd | 95 % interval | Holm p | verdict |", "|---|---:|---:|---:|---:|---|"]
    for c in comps:
        word = f"**{c['label']}**" + (f" (MDE {100 * c['mde']:.1f})" if c["reading"] == "null" else "")
        iv = "–" if c["n"] < 2 else f"[{100 * c['low95']:+.1f}, {100 * c['high95']:+.1f}]"
        ph = "–" if c["n"] < 2 else f"{c['p_holm']:.3f}"
        sd = "–" if c["n"] < 2 else f"{100 * c['std']:.2f}"
        lines.append(f"| {c['what']} | {c['n']} | {100 * c['mean']:+.2f} ± {sd} | {iv} | {ph} | {word} |")
    power = decision_power(comps)
    if power is not None:
        lines += ["", power_sentence(power)]
    lines += [""] + _hard_negative_lines(hard_negatives(rows, arms))
    return lines + [""]


def _hard_negative_lines(hn: Sequence[Dict[str, Any]]) -> List[str]:
    """The depth hard negatives of a retrieval folder (:func:`ropekit_studies.retrieval.hard_negatives`): per arm
    the accuracy against chance with its bootstrap interval and, for a declared claim, the verdict and the word
    the claim expects."""
    from .retrieval import ARMS, HARD_NEGATIVE_CLAIMS, MIN_HARD_NEGATIVE_PAIRS

    if not hn:
        return ["Depth hard negatives: not measured (these runs predate the measure)."]
    claimed = [h for h in hn if h["claim"] is not None]
    lines = [f"Depth hard negatives (each test caption with a depth relation against the same caption with the "
             f"relation flipped; accuracy in percent, chance 50): accuracy − 50 per arm, the 95 % interval a "
             f"bootstrap over seeds and then captions; {len(claimed)} declared claims "
             f"(`ropekit_studies.retrieval.HARD_NEGATIVE_CLAIMS`), one Holm family; the RGB-only towers are the "
             f"control that must read null (at chance); fewer than {MIN_HARD_NEGATIVE_PAIRS} pairs in all, or one "
             f"seed: not assessable.", "",
             "| vision tower | claim | n | pairs | accuracy (%) | 95 % interval | Holm p | verdict | as expected |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for h in hn:
        if h["claim"] is None:
            word, ph, ok, claim = "–", "–", "–", "not a claim"
        else:
            word = f"**{h['label']}**" + (f" (MDE {100 * h['mde']:.1f})" if h["reading"] == "null" else "")
            ph = "–" if h["p_holm"] != h["p_holm"] else f"{h['p_holm']:.3f}"
            ok = (f"– (expected {h['expected']})" if h["reading"] == "not assessable" else
                  ("yes" if h["as_expected"] else "**no**") + f" (expected {h['expected']})")
            claim = HARD_NEGATIVE_CLAIMS[h["arm"]][0]
        acc = f"{100 * h['mean']:.1f}" + (f" ± {100 * h['std']:.1f}" if h["n"] > 1 else "")
        lines.append(f"| {ARMS[h['arm']][0]} | {claim} | {h['n']} | {sum(h['pairs'])} | {acc} | "
                     f"[{100 * h['low95']:.1f}, {100 * h['high95']:.1f}] | {ph} | {word} | {ok} |")
    return lines


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
    for folder, what in RETRIEVAL_FOLDERS:
        lines += _retrieval_section(root, folder, what)
    for folder, what in NATIVE_FOLDERS:
        lines += _native_section(root, folder, what)
    for folder, what in FINETUNE_FOLDERS:
        lines += _finetune_section(root, folder, what)
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
