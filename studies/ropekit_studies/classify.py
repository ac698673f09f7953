"""Classification accuracy of every encoding (same backbone, data, schedule and seeds)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ropekit.nn.coords import COORD_MODES
from .common import StudyContext, StudyResult, coord_arms, headline
from .registry import register_study
from .report import (add_paired_difference, add_paired_vs_grid, aggregate, arm_label, fmt_pm, markdown_table, mean_std,
                     setup_matplotlib, where_trained)
from .settings import DEFAULT_PES, QUICK_PES, ExperimentConfig

__all__ = ["run_classify", "run_mqa", "run_classify_coords"]


@register_study("classify", "accuracy of every encoding, paired by seed", varies=("pe_sharing",))
def run_classify(cfg: ExperimentConfig, out: Any) -> StudyResult:
    """Train every encoding of ``cfg`` over ``cfg.seeds``; report final test accuracy and loss."""
    return _classify("classify", cfg, out)


@register_study("mqa", "multi-query attention: a per-head basis the shared key cannot absorb (Cayley vs RoPE-Mixed)",
                varies=("pe_sharing",))
def run_mqa(cfg: ExperimentConfig, out: Any) -> StudyResult:
    """The classification with one key/value head shared by every query head (the recipe's ``num_kv_heads=1``),
    each encoding with parameters per head; differences paired by seed against the first encoding (RoPE-Mixed).

    With multi-head attention a learnt orthogonal basis ``P_h`` is absorbed by the free q/k projections, so
    Cayley-STRING has RoPE's function class; with one shared key projection ``P_h W_k`` differs per query head and
    is not absorbed (``ropekit.nn.attention``). This study measures whether that shows in accuracy."""
    return _classify("mqa", cfg, out)


@register_study("classify-coords", "the classification with grid and normalised token coordinates, paired by seed",
                options=("coord_modes",), varies=("pe_sharing", "coords"))
def run_classify_coords(cfg: ExperimentConfig, out: Any, coord_modes: Optional[Sequence[str]] = None) -> StudyResult:
    """The classification of ``cfg``'s encodings with each coordinate convention of ``coord_modes`` (default
    grid and normalized, :data:`ropekit.nn.coords.COORD_MODES`: integer patch indices or patch centres in
    ``[0, 1]``): arms ``<pe>/<convention>``; besides the table's difference to the first arm, each
    non-grid arm's difference to its encoding's grid arm, paired by seed (``summary["paired_diff_vs_grid"]``)."""
    return _classify("classify-coords", cfg, out, list(coord_modes or COORD_MODES))


def _classify(name: str, cfg: ExperimentConfig, out: Any, coord_modes: Optional[List[str]] = None) -> StudyResult:
    encodings = cfg.pe_list(QUICK_PES if cfg.quick else DEFAULT_PES)
    variants = coord_arms(encodings, coord_modes)
    pes = [v[0] for v in variants]
    ctx = StudyContext(name, cfg, out, total=len(variants) * len(cfg.seeds))
    rows: List[Dict[str, Any]] = []
    curves: List[Dict[str, Any]] = []
    for pe, enc, cm in variants:
        for seed in cfg.seeds:
            rec = ctx.run(cfg.train_config(enc, seed) if cm is None else cfg.train_config(enc, seed, coords=cm))
            f = rec.final
            extra = {} if cm is None else {"encoding": enc, "coords": cm}
            rows.append({"pe": pe, **extra, "seed": seed, "test_acc": f.get("test_acc"),
                         "test_loss": f.get("test_loss"), "train_acc": f.get("train_acc"),
                         "train_loss": f.get("train_loss"),
                         "num_params": rec.summary.get("num_params"), "wall_time": rec.summary.get("wall_time"),
                         "device": rec.summary.get("device"),
                         "run": rec.run_dir.name})
            for h in rec.history:
                curves.append({"pe": pe, "seed": seed, "epoch": int(h["epoch"]), "test_acc": h["test_acc"],
                               "train_loss": h["train_loss"], "test_loss": h["test_loss"]})
            ctx.advance(f"{pe} s{seed}")

    ref = "absolute" if "absolute" in pes else pes[0]
    add_paired_difference(rows, ref)
    stats = {k: {r["pe"]: r for r in aggregate(rows, ["pe"], k)} for k in
             ("test_acc", "test_loss", "train_acc", "num_params", "wall_time", f"diff_vs_{ref}")}
    vs_grid: Dict[str, Dict[str, Any]] = {}
    if coord_modes and "grid" in coord_modes:  # each convention against its encoding's grid arm, seed by seed
        vs_grid = add_paired_vs_grid(rows)
    table_rows = []
    for pe in pes:
        diff = "(reference)" if pe == ref else fmt_pm(stats[f"diff_vs_{ref}"][pe], 4)
        table_rows.append([arm_label(pe), fmt_pm(stats["test_acc"][pe], 4), diff, fmt_pm(stats["test_loss"][pe], 3),
                           fmt_pm(stats["train_acc"][pe], 4), f"{int(stats['num_params'][pe]['mean']):,}",
                           f"{stats['wall_time'][pe]['mean']:.0f}"])
    table = (f"**Classification** — {headline(cfg)}. Test accuracy and loss after the last epoch, "
             f"mean ± std across seeds; the difference to {arm_label(ref)} is paired by seed (same data order).\n\n"
             + markdown_table(["encoding", "test accuracy", f"− {arm_label(ref)} (paired)", "test loss",
                               "train accuracy", "parameters", f"train time / run (s, {where_trained(rows)})"],
                              table_rows))
    if vs_grid:
        table = table.rstrip("\n") + "\n\n" + markdown_table(
            ["encoding and coordinates", "test accuracy − grid coordinates (paired)", "seeds"],
            [[arm_label(pe), fmt_pm(vs_grid[pe], 4), str(vs_grid[pe]["n"])] for pe in vs_grid])

    plt = setup_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(pes) + 2.2),
                                   gridspec_kw={"width_ratios": [1.1, 1]})
    ys = list(range(len(pes)))[::-1]
    means = [stats["test_acc"][pe]["mean"] for pe in pes]
    errs = [0 if stats["test_acc"][pe]["n"] < 2 else stats["test_acc"][pe]["std"] for pe in pes]
    ax1.barh(ys, means, xerr=errs, color="tab:blue", alpha=0.6, capsize=3, label="mean ± std")
    for y, pe in zip(ys, pes):
        vals = [r["test_acc"] for r in rows if r["pe"] == pe]
        ax1.plot(vals, [y] * len(vals), "k.", ms=4, label="one seed" if y == ys[0] else None)
    ax1.set_yticks(ys, [arm_label(pe) for pe in pes])
    lo = min(min(r["test_acc"] for r in rows) - 0.05, max(0.0, min(means) - 0.1))
    ax1.set_xlim(max(0.0, lo), min(1.0, max(r["test_acc"] for r in rows) + 0.03))
    ax1.set_xlabel("test accuracy (last epoch)")
    ax1.set_title("final test accuracy")
    ax1.legend(loc="lower right", fontsize=8)
    for pe in pes:
        epochs = sorted({c["epoch"] for c in curves if c["pe"] == pe})
        st = [mean_std(c["test_acc"] for c in curves if c["pe"] == pe and c["epoch"] == e) for e in epochs]
        ax2.errorbar(epochs, [s["mean"] for s in st], yerr=[0 if s["n"] < 2 else s["std"] for s in st],
                     marker="o", ms=3, capsize=2, label=arm_label(pe))
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("test accuracy")
    ax2.set_title("learning curves (mean ± std)")
    ax2.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Classification: {headline(cfg)}")
    fig.tight_layout()

    summary = {"test_acc": stats["test_acc"], "test_loss": stats["test_loss"], "train_acc": stats["train_acc"],
               f"paired_diff_vs_{ref}": stats[f"diff_vs_{ref}"]}
    if vs_grid:
        summary["paired_diff_vs_grid"] = vs_grid
    options: Dict[str, Any] = {"pes": pes} if coord_modes is None else {"pes": encodings, "coord_modes": coord_modes}
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig, options=options,
                      extra_csv={"curves.csv": curves})
