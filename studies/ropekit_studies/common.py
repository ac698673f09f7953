"""What every study shares: a context (settings, run cache, bars, writer) and the result it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ropekit.nn.coords import COORD_MODES
from ropekit.classification import TrainConfig
from .report import StudyWriter, pe_label
from .runs import Progress, RunCache, RunRecord, memo_data
from .settings import ExperimentConfig

__all__ = ["StudyContext", "StudyResult", "run_label", "coord_arms"]


@dataclass
class StudyResult:
    """What a study returns: its name, output folder, the files written, the markdown table and the summary;
    ``cache_dir`` is the run cache its runs were trained in or read back from (``None`` for a study that trains
    into its own output folder, or that had no run)."""

    name: str
    out_dir: Path
    files: List[Path]
    table: str
    summary: Dict[str, Any] = field(default_factory=dict)
    cache_dir: Optional[Path] = None


def run_label(tcfg: TrainConfig, extra: str = "") -> str:
    name = pe_label(tcfg.model.vit().pe)
    return f"{name}{' ' + extra if extra else ''} s{tcfg.run.seed}"


def coord_arms(encodings: Sequence[str], coord_modes: Optional[Sequence[str]]
               ) -> List[Tuple[str, str, Optional[str]]]:
    """The arms of a study: ``(name in the outputs, encoding, coordinate convention)``. Without ``coord_modes``
    one arm per encoding with the recipe's convention (``None``); with them ``<pe>/<convention>`` for each
    encoding and each convention of :data:`ropekit.nn.coords.COORD_MODES` listed.

    Raises:
        ValueError: an unknown convention (before anything trains).
    """
    if not coord_modes:
        return [(pe, pe, None) for pe in encodings]
    bad = sorted(set(coord_modes) - set(COORD_MODES))
    if bad:
        raise ValueError(f"unknown coordinate convention(s) {', '.join(bad)}; known: {', '.join(COORD_MODES)}")
    return [(f"{pe}/{cm}", pe, cm) for pe in encodings for cm in coord_modes]


class StudyContext:
    """Settings, run cache, progress bars and output writer of one study run."""

    def __init__(self, name: str, cfg: ExperimentConfig, out: Any, total: int) -> None:
        self.name = name
        self.cfg = cfg
        self.out = Path(out)
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        self.progress = Progress(total, f"experiment {name}", enabled=cfg.progress)
        self.cache = RunCache(cfg.cache_dir, threads=cfg.threads, progress=self.progress)
        self.writer = StudyWriter(self.out, name)
        self.runs: List[RunRecord] = []

    # ------------------------------------------------------------------ runs and data
    def run(self, tcfg: TrainConfig, label: Optional[str] = None) -> RunRecord:
        """Train (or load from the cache) one run, and remember it for ``config.json``."""
        rec = self.cache.get(tcfg, label or run_label(tcfg))
        if all(r.key != rec.key for r in self.runs):
            self.runs.append(rec)
        return rec

    def test_data(self, tcfg: TrainConfig, image_size: Any = None) -> Tuple[Tensor, Tensor, Any]:
        """``(images, labels, info)`` of the run's test set (at ``image_size``), the first ``eval_limit`` examples."""
        _, test_ds, info = memo_data(tcfg.replace(train_fraction=1.0), image_size)
        n = len(test_ds) if self.cfg.eval_limit is None else min(len(test_ds), int(self.cfg.eval_limit))
        return test_ds.images[:n], test_ds.labels[:n], info

    def advance(self, note: Optional[str] = None) -> None:
        self.progress.advance(1, note)

    # ------------------------------------------------------------------ outputs
    def finish(self, *, rows: List[Dict[str, Any]], summary: Dict[str, Any], table: str, figure: Any,
               options: Dict[str, Any], extra_csv: Optional[Dict[str, List[Dict[str, Any]]]] = None) -> StudyResult:
        """Write the CSV, JSON, table, figure and config; close the bars."""
        w = self.writer
        w.csv(rows)
        for name, extra in (extra_csv or {}).items():
            w.csv(extra, name)
        config = {"study": self.name, "preset": self.cfg.preset, "recipe": recipe_of(self.cfg),
                  "experiment": self.cfg.to_dict(), "options": options, "runs": [r.describe() for r in self.runs]}
        w.json({"study": self.name, "rows": rows, "summary": summary, "options": options,
                "experiment": self.cfg.to_dict(), **({"extra": extra_csv} if extra_csv else {})})
        w.table(table)
        w.figure(figure)
        w.config(config)
        self.progress.close()
        return StudyResult(self.name, self.out, list(w.files), table, summary,
                           cache_dir=self.cache.root.resolve() if self.runs else None)

    def close(self) -> None:
        self.progress.close()


def recipe_of(cfg: ExperimentConfig) -> Dict[str, Any]:
    """The recipe a study ran with (the pinned recipe plus any override), in the recipes' layout:
    ``{"train": every TrainConfig recipe field, "study": pes, seeds, eval_limit, pe_overrides}``."""
    from .recipes import SLOTS

    train = {k: getattr(cfg, k) for k in SLOTS}
    train.update(cfg.train_options)
    return {"train": train, "study": {"pes": cfg.pes, "seeds": cfg.seeds, "eval_limit": cfg.eval_limit,
                                      "pe_overrides": cfg.pe_overrides}}


def headline(cfg: ExperimentConfig, data_label: Optional[str] = None) -> str:
    """One line naming the backbone and schedule, for figure titles and tables."""
    mo = cfg.model_options
    width = mo.get("embed_dim", "?")
    depth = mo.get("depth", "?")
    heads = mo.get("num_heads", "?")
    if mo.get("num_kv_heads") is not None:  # grouped-query / multi-query attention
        kv = mo["num_kv_heads"]
        heads = f"{heads} query heads sharing {kv} key/value head{'s' if kv != 1 else ''}"
    else:
        heads = f"{heads} heads"
    n = len(cfg.seeds)
    data = data_label or cfg.data
    frac = f", {cfg.train_fraction:g} of train" if cfg.train_fraction < 1 else ""
    return (f"{data}{frac}; ViT width {width}, depth {depth}, {heads}, patch {cfg.patch_size}; "
            f"{cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''}; {n} seed{'s' if n != 1 else ''}")
