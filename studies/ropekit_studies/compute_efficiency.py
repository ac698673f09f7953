"""Compute efficiency: test accuracy against the training length, each length a separate run with its own schedule.

Every encoding is trained on the full training set for each of ``epoch_budgets`` epochs, every run with its own
complete warm-up + cosine schedule (the warm-up the same fraction of the run as in the recipe), so a short run is
a finished training run, not the early part of a long one. The target is the absolute-embedding model's mean
accuracy over seeds at the recipe's epochs; each encoding's *epochs to target* is the smallest budget whose mean
accuracy over seeds reaches it, and the paired differences (seed by seed) against ``absolute`` at each budget say
how sure that is.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .common import StudyContext, StudyResult, headline
from .registry import register_study
from .report import aggregate, fmt_pm, markdown_table, mean_std, pe_label, setup_matplotlib
from .settings import ExperimentConfig

__all__ = ["run_compute_efficiency", "DEFAULT_EPOCH_BUDGETS", "smallest_budget_reaching"]

DEFAULT_EPOCH_BUDGETS = (2, 4, 6, 10)
REFERENCE = "absolute"


def smallest_budget_reaching(means: Dict[int, float], target: float) -> Optional[int]:
    """The smallest budget (key of ``means``) whose mean accuracy is at least ``target`` (``None`` if none)."""
    for e in sorted(means):
        if means[e] == means[e] and means[e] >= target - 1e-12:
            return int(e)
    return None


@register_study("compute-efficiency", "accuracy vs training epochs, each a separate run with its own schedule",
                options=("epoch_budgets",), varies=("epochs", "warmup_epochs"))
def run_compute_efficiency(cfg: ExperimentConfig, out: Any,
                           epoch_budgets: Optional[Sequence[int]] = None) -> StudyResult:
    """Train every encoding for each of ``epoch_budgets`` epochs (the recipe's epochs always included)."""
    budgets = sorted({int(e) for e in (epoch_budgets or DEFAULT_EPOCH_BUDGETS)} | {int(cfg.epochs)})
    if budgets[0] < 1:
        raise ValueError(f"epoch budgets must be positive integers, got {budgets}")
    pes = list(cfg.pes)
    if REFERENCE not in pes:
        pes = [REFERENCE] + pes
    ctx = StudyContext("compute-efficiency", cfg, out, total=len(pes) * len(cfg.seeds) * len(budgets))
    rows: List[Dict[str, Any]] = []
    for pe in pes:
        for e in budgets:
            for seed in cfg.seeds:
                tcfg = cfg.train_config(pe, seed)
                tcfg = tcfg.replace(epochs=e, warmup_epochs=cfg.warmup_epochs * e / cfg.epochs)
                rec = ctx.run(tcfg, f"{pe_label(pe)} {e} epochs s{seed}")
                rows.append({"pe": pe, "seed": seed, "epochs": e, "warmup_epochs": tcfg.optim.warmup_epochs,
                             "test_acc": rec.final.get("test_acc"), "train_acc": rec.final.get("train_acc"),
                             "test_loss": rec.final.get("test_loss")})
                ctx.advance(f"{pe} {e} s{seed}")

    acc = {(s["pe"], s["epochs"]): s for s in aggregate(rows, ["pe", "epochs"], "test_acc")}
    by = {(r["pe"], r["epochs"], r["seed"]): r["test_acc"] for r in rows}
    target = acc[(REFERENCE, cfg.epochs)]["mean"]
    paired = {(pe, e): mean_std(by[(pe, e, s)] - by[(REFERENCE, e, s)] for s in cfg.seeds)
              for pe in pes for e in budgets}
    reach = {pe: smallest_budget_reaching({e: acc[(pe, e)]["mean"] for e in budgets}, target) for pe in pes}
    n_seeds = len(cfg.seeds)

    def reach_text(pe: str) -> str:
        e = reach[pe]
        return "not reached" if e is None else f"{e} ({cfg.epochs / e:.2g}x fewer)" if e < cfg.epochs else f"{e}"

    def diff_text(pe: str, e: int) -> str:
        above = sum(by[(pe, e, s)] > by[(REFERENCE, e, s)] for s in cfg.seeds)
        return f"{'+' if paired[(pe, e)]['mean'] > 0 else ''}{fmt_pm(paired[(pe, e)], 3)} ({above}/{n_seeds})"

    acc_table = markdown_table(
        ["encoding"] + [f"{e} epochs" for e in budgets] + [f"epochs to reach {target:.3f}"],
        [[pe_label(pe)] + [fmt_pm(acc[(pe, e)], 3) for e in budgets] + [reach_text(pe)] for pe in pes])
    diff_table = markdown_table(
        ["encoding"] + [f"{e} epochs" for e in budgets],
        [[pe_label(pe)] + [diff_text(pe, e) for e in budgets] for pe in pes if pe != REFERENCE])
    table = (f"**Compute efficiency** — {headline(cfg)}; every budget a separate run on the full training set with "
             f"its own warm-up ({cfg.warmup_epochs / cfg.epochs:.0%} of the run) and cosine schedule.\n\n"
             f"Test accuracy after the last epoch (mean ± std across seeds); the last column is the smallest budget "
             f"whose mean reaches APE's mean at {cfg.epochs} epochs:\n\n{acc_table}\n"
             f"Paired difference from APE at the same budget (mean ± std over seeds; seeds above APE in brackets):"
             f"\n\n{diff_table}")

    plt = setup_matplotlib()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for pe in pes:
        st = [acc[(pe, e)] for e in budgets]
        ax.errorbar(budgets, [s["mean"] for s in st], yerr=[0 if s["n"] < 2 else s["std"] for s in st], marker="o",
                    ms=3, capsize=2, label=pe_label(pe), ls="--" if pe == REFERENCE else "-")
    ax.axhline(target, color="grey", ls=":", lw=1, label=f"APE at {cfg.epochs} epochs")
    ax.set_xticks(budgets)
    ax.set_xlabel("training epochs (each a separate run with its own schedule)")
    ax.set_ylabel("test accuracy after the last epoch")
    ax.set_title(f"Compute efficiency: {headline(cfg)}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    summary = {"accuracy": {f"{pe}@{e}": acc[(pe, e)] for pe in pes for e in budgets},
               "paired_vs_absolute": {f"{pe}@{e}": paired[(pe, e)] for pe in pes for e in budgets
                                      if pe != REFERENCE},
               "target": target, "epochs_to_target": reach}
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig,
                      options={"pes": pes, "epoch_budgets": budgets, "reference": REFERENCE})
