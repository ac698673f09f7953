"""Study outputs: every number as CSV and JSON, a markdown table of mean ± spread, one PNG, and the config.

A study folder holds::

    <study>.csv     one row per (model, seed, measurement): every number the study computed
    <study>.json    the same rows, the aggregated summary (mean, std, min, max, n per group) and the config
    table.md        the markdown table(s): mean ± standard deviation across seeds (n seeds)
    <study>.png     one figure, readable on its own (title, axis labels, legend, error bars = ±1 std)
    config.json     the experiment settings, the command line, and every run's configuration and hash

Spread is the sample standard deviation across seeds (``ddof=1``); with one seed it is reported as ``–``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from ropekit.encodings.registry import RegistryView

__all__ = ["mean_std", "fmt_pm", "where_trained", "add_paired_difference", "add_paired_vs_grid", "arm_label",
           "aggregate", "markdown_table",
           "replace_marked_lines", "StudyWriter", "setup_matplotlib", "PE_LABELS", "pe_label"]

#: Display names of the encodings in tables and plots: each registered encoding's ``label``.
PE_LABELS: Mapping[str, str] = RegistryView("label")
#: Display names of the absolute embeddings, which are no registered encoding.
_ABSOLUTE_LABELS = {"absolute": "APE (learned)", "sincos": "APE (sincos)"}


def pe_label(pe: str) -> str:
    """The display name of the encoding (or absolute embedding) ``pe``; ``pe`` itself when it has none."""
    return PE_LABELS[pe] if pe in PE_LABELS else _ABSOLUTE_LABELS.get(pe, pe)


def mean_std(values: Iterable[float]) -> Dict[str, float]:
    """``{"mean", "std", "min", "max", "n"}`` of the finite values (``std`` is NaN for fewer than 2)."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    n = len(v)
    if n == 0:
        return {"mean": float("nan"), "std": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    m = sum(v) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1)) if n > 1 else float("nan")
    return {"mean": m, "std": sd, "min": min(v), "max": max(v), "n": n}


def _fmt_num(x: float, digits: int, sci: bool) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if sci or (x != 0 and (abs(x) < 10 ** (-digits) or abs(x) >= 1e5)):
        return f"{x:.{max(1, digits - 2)}e}"
    return f"{x:.{digits}f}"


def where_trained(rows: Sequence[Dict[str, Any]]) -> str:
    """Where a study's runs trained, for its time column: the devices the rows carry (``device`` from each run's
    summary). Runs from before summaries recorded it were all trained on this repository's shared 2-core CPU."""
    devices = sorted({r["device"] for r in rows if r.get("device")})
    return ", ".join(devices) if devices else "shared 2-core CPU"


def add_paired_difference(rows: Sequence[Dict[str, Any]], ref: str, value: str = "test_acc",
                          within: Sequence[str] = ()) -> str:
    """Set ``row["diff_vs_<ref>"]`` on every row: its ``value`` minus that of the ``ref`` encoding's row with the
    same seed (and the same ``within`` fields). Every encoding of a seed sees the same initialisation seed and data
    order, so the per-seed difference removes the variation they share. Returns the new column's name.

    Raises:
        KeyError: a seed (or ``within`` group) has no row of ``ref``.
    """
    column = f"diff_vs_{ref}"
    keys = ("seed", *within)
    base = {tuple(r[k] for k in keys): r[value] for r in rows if r["pe"] == ref}
    for r in rows:
        r[column] = r[value] - base[tuple(r[k] for k in keys)]
    return column


def add_paired_vs_grid(rows: Sequence[Dict[str, Any]], value: str = "test_acc") -> Dict[str, Dict[str, Any]]:
    """Set ``row["diff_vs_grid"]`` on every row of a study with coordinate arms (rows with ``encoding`` and
    ``coords``): its ``value`` minus that of the same encoding's ``coords == "grid"`` row of the same seed (0 on
    the grid rows). Returns the difference's summary per non-grid arm (``aggregate``, keyed by the row's ``pe``).

    Raises:
        KeyError: an encoding and seed without a grid row.
    """
    grid = {(r["encoding"], r["seed"]): r[value] for r in rows if r["coords"] == "grid"}
    for r in rows:
        r["diff_vs_grid"] = r[value] - grid[(r["encoding"], r["seed"])]
    return {s["pe"]: s for s in aggregate([r for r in rows if r["coords"] != "grid"], ["pe"], "diff_vs_grid")}


def arm_label(arm: str) -> str:
    """Display name of a study arm ``<pe>`` or ``<pe>/<coordinate convention>``: ``"LieRE (normalized)"``."""
    pe, _, cm = arm.partition("/")
    return pe_label(pe) + (f" ({cm})" if cm else "")


def fmt_pm(stats: Dict[str, float], digits: int = 3, scale: float = 1.0, sci: bool = False) -> str:
    """``"0.912 ± 0.004"`` (``"0.912"`` for a single seed, ``"–"`` when empty)."""
    if not stats or stats.get("n", 0) == 0:
        return "–"
    m = stats["mean"] * scale
    sd = stats["std"] * scale if not math.isnan(stats["std"]) else float("nan")
    if math.isnan(sd):
        return _fmt_num(m, digits, sci)
    return f"{_fmt_num(m, digits, sci)} ± {_fmt_num(sd, digits, sci)}"


def aggregate(rows: Sequence[Dict[str, Any]], by: Sequence[str], value: str = "value") -> List[Dict[str, Any]]:
    """Group ``rows`` by the columns ``by`` (first-seen order) and summarise ``value`` per group."""
    groups: "OrderedDict[tuple, List[float]]" = OrderedDict()
    for r in rows:
        key = tuple(r.get(k) for k in by)
        groups.setdefault(key, []).append(r.get(value))
    out = []
    for key, vals in groups.items():
        out.append({**dict(zip(by, key)), **mean_std(vals)})
    return out


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: Optional[str] = None) -> str:
    """A GitHub markdown table; ``align`` one char per column (``l``/``r``/``c``), default: first left, rest right."""
    align = align or ("l" + "r" * (len(headers) - 1))
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join(marks[a] for a in align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def replace_marked_lines(text: str, begin: str, end: str, lines: Sequence[str]) -> str:
    """``text`` with the lines strictly between its ``begin`` and ``end`` marker lines replaced by ``lines``.

    A marker line is a line whose stripped text equals the marker (so a marker may be indented, e.g. inside a
    markdown list item); the marker lines themselves are kept. This is how a generated table is kept inside a
    hand-written document (a README's results block).

    Raises:
        ValueError: ``text`` does not have exactly one ``begin`` line and, below it, exactly one ``end`` line.
    """
    rows = text.split("\n")
    at = {m: [i for i, row in enumerate(rows) if row.strip() == m] for m in (begin, end)}
    if len(at[begin]) != 1 or len(at[end]) != 1 or at[begin][0] > at[end][0]:
        raise ValueError(f"needs one line {begin!r} and, below it, one line {end!r}")
    return "\n".join(rows[:at[begin][0] + 1] + list(lines) + rows[at[end][0]:])


def setup_matplotlib():
    """``matplotlib.pyplot`` with the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 110, "axes.grid": True, "grid.alpha": 0.3,
                         "font.size": 9})
    return plt


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class StudyWriter:
    """Writes the files of one study into ``out_dir`` (see the module docstring)."""

    def __init__(self, out_dir: Any, study: str) -> None:
        self.dir = Path(out_dir)
        self.study = study
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files: List[Path] = []

    def _path(self, name: str) -> Path:
        p = self.dir / name
        if p not in self.files:
            self.files.append(p)
        return p

    def csv(self, rows: Sequence[Dict[str, Any]], name: Optional[str] = None) -> Path:
        """All rows, with the union of their keys as columns (first-seen order)."""
        cols: List[str] = []
        for r in rows:
            cols.extend(k for k in r if k not in cols)
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.8g}" if isinstance(v, float) else ("" if v is None else v)) for k, v in r.items()})
        path = self._path(name or f"{self.study}.csv")
        _atomic_write(path, buf.getvalue())
        return path

    def json(self, doc: Dict[str, Any], name: Optional[str] = None) -> Path:
        path = self._path(name or f"{self.study}.json")
        _atomic_write(path, json.dumps(_jsonable(doc), indent=2) + "\n")
        return path

    def table(self, markdown: str, name: str = "table.md") -> Path:
        path = self._path(name)
        _atomic_write(path, markdown if markdown.endswith("\n") else markdown + "\n")
        return path

    def figure(self, fig: Any, name: Optional[str] = None) -> Path:
        plt = setup_matplotlib()
        path = self._path(name or f"{self.study}.png")
        tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
        fig.savefig(tmp, bbox_inches="tight")
        plt.close(fig)
        os.replace(tmp, path)
        return path

    def config(self, doc: Dict[str, Any]) -> Path:
        doc = dict(doc)
        doc.setdefault("command", " ".join(["ropekit"] + sys.argv[1:]) if sys.argv and "ropekit" in sys.argv[0]
                       else None)
        return self.json(doc, "config.json")
