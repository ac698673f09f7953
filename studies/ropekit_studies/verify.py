"""Does a committed study still give the same reading at this version? Re-run a sample of it and compare.

The rule for the committed studies (``docs/results/REGENERATE.md``): the documented command, run at HEAD, must
give **the same reading** -- each mean inside its committed spread, each paired difference with the same
verdict -- not the same digits. A change of summation order (another CPU, a faster kernel) moves the last digits
of every run; a real change of behaviour moves a reading. :func:`verify_study` re-runs the command a committed
folder recorded (``config.json``'s ``command``) for a sample of its arms and seeds, in a fresh run cache (so
nothing trained before is read back), and compares:

* **level** -- for every condition of the study (a row of its CSV without the seed: encoding, and e.g. fraction,
  image size, arm) and every sampled arm: the re-run mean over the sampled seeds against the committed mean over
  the same seeds. Holds when they differ by at most the committed spread (one sample standard deviation over all
  committed seeds): the re-run moved less than a change of seed moves the result. (The mean of two seeds can lie
  outside the all-seed mean ± spread by itself, so it is compared with the same seeds' committed values.)
* **paired difference** -- for every condition and every pair of sampled arms (``second − first``, as ``--pe``
  orders them): the committed differences seed by seed, and the same list with the sampled seeds' differences
  replaced by the re-run's ("spliced": what the whole study would read had it been re-run at HEAD). Holds when
  the spliced verdict (:func:`readings`: the rule of :mod:`ropekit_studies.verdict`, the pairs read as one
  Holm family) and sign are the committed ones.

Command line::

    ropekit experiment verify docs/results/classify --sample 2x2        # the first two arms and seeds
    ropekit experiment verify docs/results/classify --pe mixed,cayley --seeds 0,1 --metric test_acc,test_loss \
        --report docs/results/classify/verify.md
"""

from __future__ import annotations

import csv
import json
import math
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ropekit._platform import numerics_fingerprint
from .verdict import RULE, judge, judge_one

__all__ = ["reading", "readings", "compare_readings", "verify_study", "render_verification", "parse_sample"]

#: Columns that describe a run's bookkeeping, not its condition: never part of a row's key.
BOOKKEEPING = ("seed", "run", "device", "wall_time", "num_params", "parameters", "train_seconds", "eval_seconds")


def reading(diffs: Sequence[float], claimed: int = 1) -> Tuple[str, int]:
    """The verdict of paired differences ``diffs`` (one per seed) and its sign, by the one rule of
    :mod:`ropekit_studies.verdict` for a family of one comparison (no multiple-comparison correction):
    ``"holds"`` / ``"reversed"`` when the 95 % t interval excludes 0 with the ``claimed`` / the other sign,
    ``"trend"`` when only the 80 % interval does, ``"null"`` otherwise, ``"not assessable"`` for one seed.
    Returns ``(verdict, sign)``, sign ``+1``, ``-1`` or ``0`` (the sign of the mean).

    >>> reading([0.03, 0.02, 0.04])
    ('holds', 1)
    >>> reading([0.01, -0.02, 0.0])
    ('null', -1)
    """
    if not diffs:
        raise ValueError("reading of no differences")
    v = judge_one(list(diffs), claimed)
    return v.word, v.sign


def readings(diffs: Dict[str, Sequence[float]]) -> Dict[str, Tuple[str, int]]:
    """:func:`reading` of several comparisons read together: their p-values Holm-corrected as one family,
    each claimed positive (``second − first``)."""
    out = judge({k: list(v) for k, v in diffs.items()}, {k: 1 for k in diffs})
    return {k: (v.word, v.sign) for k, v in out.items()}


def _num(x: Any) -> Optional[float]:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _condition_columns(rows: Sequence[Dict[str, str]], metric: str, arm: str) -> List[str]:
    """The columns that name a row's condition besides its arm and seed: those whose values are the same
    multiset for every seed (fraction, image size, ...); measurements differ from seed to seed. Yes/no
    outcomes (``True`` / ``False``, e.g. whether a target was reached) are measurements even when every seed
    agrees. A column that only describes the arm (one value per arm, not the same for all: the encoding and the
    coordinate convention of an ``ENCODING/CONVENTION`` arm) is not a condition, so that arms still pair."""
    seeds = sorted({r["seed"] for r in rows})
    cols = [c for c in rows[0] if c not in BOOKKEEPING and c not in (metric, arm) and not c.startswith("diff_vs_")
            and not {r[c] for r in rows} <= {"True", "False"}]
    keep = []
    for c in cols:
        per_seed = [sorted(r[c] for r in rows if r["seed"] == s) for s in seeds]
        per_arm = {}
        for r in rows:
            per_arm.setdefault(r[arm], set()).add(r[c])
        describes_arm = all(len(v) == 1 for v in per_arm.values()) and len(set.union(*per_arm.values())) > 1
        if all(v == per_seed[0] for v in per_seed) and not describes_arm:
            keep.append(c)
    return keep


def _stats(values: Sequence[float]) -> Tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def compare_readings(committed: Sequence[Dict[str, str]], rerun: Sequence[Dict[str, str]], arms: Sequence[str],
                     metric: str = "test_acc", arm_column: str = "pe") -> Dict[str, Any]:
    """The level and paired-difference readings of ``committed`` (a study CSV's rows, as strings) and whether the
    re-run ``rerun`` (rows of the same study for a sample of arms and seeds) keeps each one (module docstring).

    Returns ``{"levels": [...], "pairs": [...], "holds": n, "total": n}``; raises ``ValueError`` when the CSVs
    lack ``metric`` or ``arm_column``, or a re-run row has no committed counterpart.
    """
    for name, rows in (("committed", committed), ("re-run", rerun)):
        if not rows:
            raise ValueError(f"the {name} study has no rows")
        for col in (metric, arm_column, "seed"):
            if col not in rows[0]:
                raise ValueError(f"the {name} study CSV has no column {col!r}")
    conds = _condition_columns(committed, metric, arm_column)

    def index(rows):
        out: Dict[Tuple, Dict[int, float]] = {}
        for r in rows:
            v = _num(r[metric])
            if v is None:
                continue
            key = (r[arm_column],) + tuple(r.get(c, "") for c in conds)
            out.setdefault(key, {})[int(r["seed"])] = v
        return out

    old, new = index(committed), index(rerun)
    missing = sorted(k for k in new if k not in old)
    if missing:
        raise ValueError(f"re-run rows with no committed counterpart: {missing[:3]} (condition columns {conds})")
    seeds = sorted({s for v in new.values() for s in v})
    levels, pairs = [], []
    for key in sorted(new, key=lambda k: (list(arms).index(k[0]) if k[0] in arms else len(arms), k[1:])):
        o, n = old[key], new[key]
        om, os_ = _stats(list(o.values()))
        nm = statistics.fmean(n.values())
        missing_seeds = sorted(set(n) - set(o))
        if missing_seeds:
            raise ValueError(f"the committed study has no seed {missing_seeds} of {key}")
        same = statistics.fmean(o[s] for s in n)
        levels.append({"arm": key[0], "condition": dict(zip(conds, key[1:])), "committed_mean": om,
                       "committed_std": os_, "committed_n": len(o), "seeds": sorted(n), "committed_same_seeds": same,
                       "rerun_mean": nm, "delta": nm - same, "holds": abs(nm - same) <= os_ + 1e-12})
    raw = []
    for i, a in enumerate(arms):
        for b in arms[i + 1:]:
            for key in sorted({k[1:] for k in new if k[0] == a} & {k[1:] for k in new if k[0] == b}):
                oa, ob, na, nb = old[(a,) + key], old[(b,) + key], new[(a,) + key], new[(b,) + key]
                common = sorted(set(oa) & set(ob))
                cdiff = {s: ob[s] - oa[s] for s in common}
                rdiff = {s: nb[s] - na[s] for s in sorted(set(na) & set(nb))}
                raw.append((a, b, key, cdiff, rdiff, {**cdiff, **rdiff}))
    # the pairs a verification reads are one family, committed and spliced alike
    cread = readings({str(j): list(r[3].values()) for j, r in enumerate(raw) if r[3]})
    sread = readings({str(j): list(r[5].values()) for j, r in enumerate(raw) if r[5]})
    for j, (a, b, key, cdiff, rdiff, spliced) in enumerate(raw):
        cv, spv = cread.get(str(j), ("not assessable", 0)), sread.get(str(j), ("not assessable", 0))
        cm, cs = _stats(list(cdiff.values())) if cdiff else (float("nan"), float("nan"))
        sm, ss = _stats(list(spliced.values()))
        pairs.append({"first": a, "second": b, "condition": dict(zip(conds, key)), "seeds": sorted(rdiff),
                      "committed_mean": cm, "committed_std": cs, "committed_n": len(cdiff),
                      "committed_reading": list(cv),
                      "committed_same_seeds": statistics.fmean(cdiff[s] for s in rdiff if s in cdiff)
                      if set(rdiff) & set(cdiff) else None,
                      "rerun_mean": statistics.fmean(rdiff.values()), "spliced_mean": sm, "spliced_std": ss,
                      "spliced_reading": list(spv), "holds": cv == spv})
    checks = levels + pairs
    runs = [abs(new[k][sd] - old[k][sd]) for k in new for sd in new[k] if sd in old[k]]
    return {"metric": metric, "arm_column": arm_column, "arms": list(arms), "seeds": seeds, "conditions": conds,
            "levels": levels, "pairs": pairs, "holds": sum(c["holds"] for c in checks), "total": len(checks),
            "runs_compared": len(runs), "runs_identical": sum(d == 0 for d in runs),
            "largest_run_difference": max(runs) if runs else None}


def _cond(c: Dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items()) or "—"


def _verdict(r: Sequence[Any]) -> str:
    v, sign = r
    return f"{v} ({'+' if sign > 0 else '−' if sign < 0 else '0'})"


def render_verification(doc: Dict[str, Any]) -> str:
    """The markdown report of :func:`verify_study` (one section per metric), or of one :func:`compare_readings`."""
    lines = []
    if "study_dir" in doc:
        lines += [f"# Verification of `{doc['study_dir']}`", "",
                  f"Committed command: `{doc['command']}`", "",
                  f"Re-run: `{doc['rerun_command']}` ("
                  + (f"{doc['minutes']:.1f} min of wall time" if doc.get("minutes") is not None else "trained")
                  + " on "
                  + f"{doc.get('machine', '?')})", "",
                  f"**{doc['holds']} of {doc['total']} readings hold** (arms {', '.join(doc['arms'])}; seeds "
                  f"{', '.join(map(str, doc['seeds']))}).", ""]
    for part in doc.get("by_metric", [doc]):
        lines += _render_metric(part)
    return "\n".join(lines) + "\n"


def _render_metric(doc: Dict[str, Any]) -> List[str]:
    lines = [f"## {doc['metric']}: {doc['holds']} of {doc['total']} readings hold", ""]
    if doc.get("runs_compared"):
        lines += [f"Run by run (the same seed and condition, as the CSVs round them): {doc['runs_identical']} of "
                  f"{doc['runs_compared']} identical, largest |re-run − committed| "
                  f"{doc['largest_run_difference']:.6g}.", ""]
    lines += ["Levels: the re-run's mean over the sampled seeds against the committed mean of the same seeds (holds "
              "when they differ by at most the committed spread, one standard deviation over all committed seeds).",
              "", "| arm | condition | committed (all seeds) | committed, sampled seeds | re-run | re-run − committed "
              "(same seeds) | holds |", "|---|---|---:|---:|---:|---:|---|"]
    for r in doc["levels"]:
        same = f"{r['committed_same_seeds']:.4f}"
        lines.append(f"| {r['arm']} | {_cond(r['condition'])} | {r['committed_mean']:.4f} ± {r['committed_std']:.4f} "
                     f"(n={r['committed_n']}) | {same} | {r['rerun_mean']:.4f} | {r['delta']:+.4f} | "
                     f"{'yes' if r['holds'] else '**no**'} |")
    if doc["pairs"]:
        lines += ["", "Paired differences (second − first, seed by seed): the committed verdict against the verdict "
                      "with the sampled seeds' differences replaced by the re-run's (holds when the verdict and sign "
                      "are unchanged). Verdicts, the pairs of this table Holm-corrected together, each claimed "
                      f"positive: {RULE}.", "",
                  "| difference | condition | committed | verdict | committed, sampled seeds | re-run, sampled seeds "
                  "| spliced | verdict | holds |", "|---|---|---:|---|---:|---:|---:|---|---|"]
        for p in doc["pairs"]:
            same = "—" if p["committed_same_seeds"] is None else f"{p['committed_same_seeds']:+.4f}"
            lines.append(f"| {p['second']} − {p['first']} | {_cond(p['condition'])} | {p['committed_mean']:+.4f} ± "
                         f"{p['committed_std']:.4f} | {_verdict(p['committed_reading'])} | {same} | "
                         f"{p['rerun_mean']:+.4f} | {p['spliced_mean']:+.4f} ± {p['spliced_std']:.4f} | "
                         f"{_verdict(p['spliced_reading'])} | {'yes' if p['holds'] else '**no**'} |")
    return lines + [""]


def parse_sample(text: str) -> Tuple[int, int]:
    """``"AxS"`` -> ``(A, S)``: A arms, S seeds (each ≥ 1)."""
    try:
        a, s = (int(t) for t in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--sample {text!r}: expected ARMSxSEEDS, e.g. 2x2") from None
    if a < 1 or s < 1:
        raise ValueError(f"--sample {text!r}: arms and seeds must be at least 1")
    return a, s


def _study_rows(folder: Path, study: str) -> List[Dict[str, str]]:
    path = folder / f"{study}.csv"
    if not path.is_file():
        raise ValueError(f"{folder} has no {study}.csv")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def verify_study(study_dir: Any, *, arms: Optional[Sequence[str]] = None, seeds: Optional[Sequence[int]] = None,
                 sample: str = "2x2", metrics: Sequence[str] = ("test_acc",), out: Any = None, cache_dir: Any = None,
                 threads: Optional[int] = None, rerun: Any = None) -> Dict[str, Any]:
    """Re-run the command ``study_dir/config.json`` recorded for ``arms`` × ``seeds`` (default: the first arms and
    seeds of the committed study, as many as ``sample`` says) and compare readings (:func:`compare_readings`, once
    per column of ``metrics``).

    The re-run writes its study folder into ``out`` (default a temporary folder) and trains in ``cache_dir``
    (default a fresh temporary folder: no run trained before is read back). ``rerun``: a study folder re-run
    before (e.g. a kept ``out``, or one trained on another machine) to compare instead of training; its arms and
    seeds are the sample. Studies whose arms ``--pe`` selects (classify, shuffle, offset, resolution, data
    efficiency, video, ablations, scale, mqa, and the coordinate studies, whose arms are ``ENCODING/CONVENTION``)
    are supported.

    Raises:
        ValueError: no recorded ``ropekit experiment`` command, an arm or seed the committed study lacks, or a
            study whose CSV has no ``pe`` column.
    """
    import argparse

    from .arguments import OPTION_FIELDS, add_arguments, overrides
    from .runner import run_experiment

    study_dir = Path(study_dir)
    doc = json.loads((study_dir / "config.json").read_text())
    words = shlex.split(doc.get("command") or "")
    if words[:2] != ["ropekit", "experiment"] or len(words) < 3:
        raise ValueError(f"{study_dir}/config.json records no `ropekit experiment` command")
    committed = _study_rows(study_dir, doc["study"])
    if "pe" not in committed[0]:
        raise ValueError(f"{study_dir}: its CSV has no pe column; verify compares studies whose arms --pe selects")
    have_arms = list(dict.fromkeys(r["pe"] for r in committed))
    have_seeds = sorted({int(r["seed"]) for r in committed})
    if rerun is not None:
        return _compare_folder(study_dir, doc, committed, Path(rerun), metrics)
    n_arms, n_seeds = parse_sample(sample)
    arms = list(arms) if arms else have_arms[:n_arms]
    seeds = list(seeds) if seeds is not None else have_seeds[:n_seeds]
    bad = [a for a in arms if a not in have_arms] + [s for s in seeds if s not in have_seeds]
    if bad:
        raise ValueError(f"{study_dir} has no {bad} (arms {have_arms}, seeds {have_seeds})")
    tmp = tempfile.TemporaryDirectory(prefix="ropekit-verify-") if out is None or cache_dir is None else None
    out = Path(out) if out is not None else Path(tmp.name) / "study"
    fresh = cache_dir is None
    cache_dir = Path(cache_dir) if cache_dir is not None else Path(tmp.name) / "cache"
    arm_argv = _arm_argv(arms)
    recorded = _drop_replaced(words[2:], also=arm_argv[::2])  # the flags of the arm options
    sample_argv = arm_argv + ["--seeds", ",".join(map(str, seeds)), "--no-progress"]
    if threads is not None:
        sample_argv += ["--threads", str(threads)]
    argv = recorded + sample_argv + ["--out", str(out), "--cache-dir", str(cache_dir)]
    parser = argparse.ArgumentParser(prog="ropekit experiment")
    add_arguments(parser)
    args = parser.parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k in OPTION_FIELDS}
    shown = recorded + sample_argv + ([] if tmp is not None and out.is_relative_to(tmp.name)
                                                             else ["--out", str(out)])
    command = "ropekit experiment " + " ".join(shlex.quote(w) for w in shown)
    t0 = time.monotonic()
    try:
        run_experiment(args.name, out=out, quick=args.quick, preset=args.preset, overrides=overrides(args), **options)
        minutes = (time.monotonic() - t0) / 60
        rerun_rows = _study_rows(out, doc["study"])
        redoc = json.loads((out / "config.json").read_text())  # what was re-run, for a later --rerun
        redoc.update(command=command, verify_minutes=minutes)
        (out / "config.json").write_text(json.dumps(redoc, indent=1) + "\n")
    finally:
        if tmp is not None:
            tmp.cleanup()
    parts = [compare_readings(committed, rerun_rows, arms, m) for m in metrics]
    fp = numerics_fingerprint()
    return {"arms": list(arms), "seeds": parts[0]["seeds"], "by_metric": parts,
            "holds": sum(p["holds"] for p in parts), "total": sum(p["total"] for p in parts),
            "study_dir": str(study_dir), "command": doc["command"], "minutes": minutes,
            "rerun_command": command + (" (in a fresh run cache)" if fresh else f" --cache-dir {cache_dir}"),
            "machine": f"{fp['cpu']} ({fp['cpu_capability']}), torch {fp['torch']}, {fp['threads']} thread(s)"}


def _compare_folder(study_dir: Path, doc: Dict[str, Any], committed: List[Dict[str, str]], rerun: Path,
                    metrics: Sequence[str]) -> Dict[str, Any]:
    """:func:`verify_study` of a study folder re-run before (``rerun``), without training."""
    redoc = json.loads((rerun / "config.json").read_text())
    if redoc.get("study") != doc["study"]:
        raise ValueError(f"{rerun} is a {redoc.get('study')!r} study, {study_dir} a {doc['study']!r} one")
    rows = _study_rows(rerun, doc["study"])
    arms = list(dict.fromkeys(r["pe"] for r in rows))
    parts = [compare_readings(committed, rows, arms, m) for m in metrics]
    machine = (redoc.get("runs") or [{}])[0].get("machine") or {}
    return {"arms": arms, "seeds": parts[0]["seeds"], "by_metric": parts,
            "holds": sum(p["holds"] for p in parts), "total": sum(p["total"] for p in parts),
            "study_dir": str(study_dir), "command": doc["command"], "minutes": redoc.get("verify_minutes"),
            "rerun_command": f"{redoc.get('command')} (the folder {rerun}, compared without training)",
            "machine": ", ".join(f"{k} {v}" for k, v in machine.items()) or "?"}


def _arm_argv(arms: Sequence[str]) -> List[str]:
    """The options that select ``arms``: ``--pe A,B``; arms of the coordinate studies (``classify-coords``,
    ``video-coords``), named ``ENCODING/CONVENTION``, as ``--pe`` and ``--coord-modes`` (which train every pairing
    of the two lists, a superset of ``arms`` when they mix encodings and conventions)."""
    split = [a.split("/", 1) for a in arms]
    if all(len(p) == 1 for p in split):
        return ["--pe", ",".join(arms)]
    if not all(len(p) == 2 for p in split):
        raise ValueError(f"arms {list(arms)} mix plain encodings with ENCODING/CONVENTION arms")
    return ["--pe", ",".join(dict.fromkeys(p[0] for p in split)),
            "--coord-modes", ",".join(dict.fromkeys(p[1] for p in split))]


#: Options of the recorded command that every re-run of a sample replaces: with a value, and without.
_REPLACED = ("--out", "--cache-dir", "--pe", "--seeds", "--threads")
_REPLACED_SWITCHES = ("--no-progress",)


def _drop_replaced(argv: List[str], also: Sequence[str] = ()) -> List[str]:
    """``argv`` without the options the re-run of a sample sets itself (:data:`_REPLACED`, and ``also``: those the
    sample's arms select, e.g. ``--coord-modes`` for ``ENCODING/CONVENTION`` arms; otherwise a recorded
    ``--coord-modes`` stays part of the study)."""
    replaced = _REPLACED + tuple(also)
    out, skip = [], False
    for w in argv:
        if skip:
            skip = False
        elif w in replaced:
            skip = True
        elif w in _REPLACED_SWITCHES or any(w.startswith(f + "=") for f in replaced):
            continue
        else:
            out.append(w)
    return out
