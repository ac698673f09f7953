"""Data efficiency: test accuracy against the fraction of the training set, under two budgets:

* ``epochs`` -- the same number of epochs at every fraction (so fewer optimisation steps on less data);
* ``steps`` -- the same number of optimisation steps as the full set gets (more epochs on less data; the warm-up
  keeps its length in steps), so less data is not also less optimisation.

Beside it, the number of epochs each encoding needs (equal-epoch budget) to reach the absolute-embedding model's
final accuracy (the mean over seeds of ``absolute`` at the same fraction; ``absolute`` is added if missing).

Fractions are relative to the training set the experiment uses (``train_fraction`` of the settings); subsets are
stratified (the first examples of each class), so every smaller set is contained in the larger ones.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from .common import StudyContext, StudyResult, headline
from .registry import register_study
from .report import aggregate, fmt_pm, markdown_table, mean_std, pe_label, setup_matplotlib
from .runs import memo_data
from .settings import DEFAULT_PES, QUICK_PES, ExperimentConfig

__all__ = ["run_data_efficiency", "DEFAULT_FRACTIONS", "epochs_to_reach"]

DEFAULT_FRACTIONS = (0.1, 0.25, 0.5, 1.0)
BUDGETS = ("epochs", "steps")
REFERENCE = "absolute"


def equal_step_schedule(epochs: int, warmup_epochs: float, batch_size: int, n_full: int,
                        n_subset: int) -> Dict[str, Any]:
    """``{"epochs", "warmup_epochs", "steps"}`` giving a subset of ``n_subset`` examples (about) the optimisation
    steps and warm-up steps that ``epochs`` epochs of ``n_full`` examples take at ``batch_size``."""
    full = math.ceil(n_full / batch_size)
    per = math.ceil(n_subset / batch_size)
    e = max(1, round(epochs * full / per))
    return {"epochs": int(e), "warmup_epochs": float(warmup_epochs) * full / per, "steps": int(e * per)}


def epochs_to_reach(history: Sequence[Dict[str, float]], target: float) -> Optional[int]:
    """The first epoch whose test accuracy is at least ``target`` (``None`` if never)."""
    for h in history:
        if h["test_acc"] >= target - 1e-12:
            return int(h["epoch"])
    return None


@register_study("data-efficiency", "accuracy vs training fraction at equal epochs and at equal steps",
                options=("fractions", "budgets"), varies=("pe_sharing", "train_fraction", "epochs", "warmup_epochs"))
def run_data_efficiency(cfg: ExperimentConfig, out: Any, fractions: Optional[Sequence[float]] = None,
                        budgets: Optional[Sequence[str]] = None) -> StudyResult:
    """Train every encoding at every fraction under each of ``budgets`` (``epochs``, ``steps``)."""
    pes = cfg.pe_list(QUICK_PES if cfg.quick else DEFAULT_PES)
    budgets = list(dict.fromkeys(budgets or ("epochs",)))
    bad = sorted(set(budgets) - set(BUDGETS))
    if bad or "epochs" not in budgets:
        raise ValueError(f"budgets must include epochs (the reference), optionally steps; got {', '.join(budgets)}")
    budgets = ["epochs"] + [b for b in budgets if b != "epochs"]
    if REFERENCE not in pes:
        pes = [REFERENCE] + pes
    fractions = sorted(float(f) for f in (fractions or ((0.5, 1.0) if cfg.quick else DEFAULT_FRACTIONS)))
    if any(not 0 < f <= 1 for f in fractions):
        raise ValueError(f"fractions must be in (0, 1], got {fractions}")
    ctx = StudyContext("data-efficiency", cfg, out, total=len(pes) * len(cfg.seeds) * len(fractions) * len(budgets))
    n_full = len(memo_data(cfg.train_config(pes[0], cfg.seeds[0]))[0])
    rows: List[Dict[str, Any]] = []
    step_rows: List[Dict[str, Any]] = []
    histories: Dict[tuple, List[Dict[str, float]]] = {}
    for budget in budgets:
        for frac in fractions:  # reference first within each fraction, so targets are known
            for pe in pes:
                for seed in cfg.seeds:
                    tcfg = cfg.train_config(pe, seed, train_fraction=cfg.train_fraction * frac)
                    n_train = len(memo_data(tcfg)[0])
                    if budget == "steps":
                        sched = equal_step_schedule(cfg.epochs, cfg.warmup_epochs, cfg.batch_size, n_full, n_train)
                        tcfg = tcfg.replace(epochs=sched["epochs"], warmup_epochs=sched["warmup_epochs"])
                    rec = ctx.run(tcfg, f"{pe_label(pe)} {frac:g} {budget} s{seed}")
                    steps = tcfg.optim.epochs * math.ceil(n_train / tcfg.optim.batch_size)
                    row = {"budget": budget, "pe": pe, "seed": seed, "fraction": frac,
                           "train_fraction": tcfg.data.train_fraction, "train_examples": n_train,
                           "epochs": tcfg.optim.epochs,
                           "steps": steps, "test_acc": rec.final.get("test_acc"),
                           "train_acc": rec.final.get("train_acc"), "test_loss": rec.final.get("test_loss")}
                    if budget == "epochs":
                        histories[(pe, seed, frac)] = rec.history
                        rows.append(row)
                    else:
                        step_rows.append(row)
                    ctx.advance(f"{pe} {frac:g} {budget} s{seed}")

    targets = {f: mean_std(r["test_acc"] for r in rows if r["pe"] == REFERENCE and r["fraction"] == f)["mean"]
               for f in fractions}
    for r in rows:
        e = epochs_to_reach(histories[(r["pe"], r["seed"], r["fraction"])], targets[r["fraction"]])
        r["target_acc"] = targets[r["fraction"]]
        r["epochs_to_target"] = e
        r["reached_target"] = e is not None

    acc = {(s["pe"], s["fraction"]): s for s in aggregate(rows, ["pe", "fraction"], "test_acc")}
    ep = {(s["pe"], s["fraction"]): s for s in aggregate(rows, ["pe", "fraction"], "epochs_to_target")}
    n_seeds = len(cfg.seeds)
    reached = {(pe, f): sum(1 for r in rows if r["pe"] == pe and r["fraction"] == f and r["reached_target"])
               for pe in pes for f in fractions}
    n_ex = {f: next(r["train_examples"] for r in rows if r["fraction"] == f) for f in fractions}
    full = fractions[-1]

    def ep_text(pe: str, f: float) -> str:
        k = reached[(pe, f)]
        if k == 0:
            return f"not reached (0/{n_seeds})"
        return f"{fmt_pm(ep[(pe, f)], 1)} ({k}/{n_seeds})"

    acc_table = markdown_table(["encoding"] + [f"{f:g} ({n_ex[f]} images)" for f in fractions],
                               [[pe_label(pe)] + [fmt_pm(acc[(pe, f)], 3) for f in fractions] for pe in pes])
    ep_table = markdown_table(["encoding"] + [f"{f:g} (target {targets[f]:.3f})" for f in fractions],
                              [[pe_label(pe)] + [ep_text(pe, f) for f in fractions] for pe in pes])
    table = (f"**Data efficiency** — {headline(cfg)} at every fraction (fewer examples, same epochs).\n\n"
             f"Test accuracy against the fraction of the training set (mean ± std across seeds):\n\n{acc_table}\n"
             f"Epochs to reach the absolute-embedding model's final accuracy at the same fraction (mean ± std over "
             f"the seeds that reached it; reached/seeds in brackets; max {cfg.epochs}):\n\n{ep_table}")
    sacc = {(s["pe"], s["fraction"]): s for s in aggregate(step_rows, ["pe", "fraction"], "test_acc")}
    if step_rows:
        sched = {r["fraction"]: (r["epochs"], r["steps"]) for r in step_rows}
        step_table = markdown_table(
            ["encoding"] + [f"{f:g} ({sched[f][0]} epochs, {sched[f][1]} steps)" for f in fractions],
            [[pe_label(pe)] + [fmt_pm(sacc[(pe, f)], 3) for f in fractions] for pe in pes])
        table += (f"\nEqual optimisation budget: every fraction trained for (about) the steps the full set gets in "
                  f"{cfg.epochs} epochs, warm-up equally long in steps (mean ± std across seeds):\n\n{step_table}")

    plt = setup_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for pe in pes:
        st = [acc[(pe, f)] for f in fractions]
        ax1.errorbar([n_ex[f] for f in fractions], [s["mean"] for s in st],
                     yerr=[0 if s["n"] < 2 else s["std"] for s in st], marker="o", ms=3, capsize=2,
                     label=pe_label(pe), ls="--" if pe in ("none", "absolute") else "-")
    for i, pe in enumerate(pes if step_rows else []):
        st = [sacc[(pe, f)] for f in fractions]
        ax1.plot([n_ex[f] for f in fractions], [s["mean"] for s in st], marker="x", ms=4, ls=":", lw=1,
                 color=f"C{i % 10}", label="equal steps" if i == 0 else None)
    ax1.set_xscale("log")
    ax1.set_xticks([n_ex[f] for f in fractions], [f"{n_ex[f]}\n({f:g})" for f in fractions])
    ax1.minorticks_off()
    ax1.set_xlabel("training images (fraction of the training set)")
    ax1.set_ylabel("test accuracy after the last epoch")
    ax1.set_title("accuracy vs. training data (mean ± std; dotted ×: equal steps)")
    ax1.legend(fontsize=7, ncol=2)
    xs = list(range(len(pes)))
    means, errs, colors = [], [], []
    for pe in pes:
        k = reached[(pe, full)]
        s = ep[(pe, full)]
        means.append(s["mean"] if k else cfg.epochs + 1)
        errs.append(0 if k < 2 or s["std"] != s["std"] else s["std"])
        colors.append("tab:green" if k == n_seeds else ("tab:olive" if k else "lightgrey"))
    ax2.bar(xs, means, yerr=errs, capsize=3, color=colors)
    for i, pe in enumerate(pes):
        k = reached[(pe, full)]
        ax2.text(i, means[i] + 0.1, f"{k}/{n_seeds}", ha="center", va="bottom", fontsize=7)
    ax2.axhline(cfg.epochs, color="grey", ls=":", lw=1)
    ax2.set_xticks(xs, [pe_label(pe) for pe in pes], rotation=30, ha="right")
    ax2.set_ylabel("epochs to reach the target (grey bar: never)")
    ax2.set_title(f"epochs to reach APE's final accuracy {targets[full]:.3f} (fraction {full:g});\n"
                  f"label: seeds that reached it", fontsize=9)
    fig.suptitle(f"Data efficiency: {headline(cfg)}")
    fig.tight_layout()
    summary = {"accuracy": {f"{pe}@{f:g}": acc[(pe, f)] for pe in pes for f in fractions},
               "epochs_to_target": {f"{pe}@{f:g}": {**ep[(pe, f)], "reached": reached[(pe, f)]}
                                    for pe in pes for f in fractions},
               "targets": {f"{f:g}": targets[f] for f in fractions},
               "accuracy_equal_steps": {f"{pe}@{f:g}": sacc[(pe, f)] for pe in pes for f in fractions
                                        if (pe, f) in sacc}}
    curves = [{"pe": pe, "seed": s, "fraction": f, **h} for (pe, s, f), hist in histories.items() for h in hist]
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig,
                      options={"pes": pes, "fractions": fractions, "reference": REFERENCE, "budgets": budgets},
                      extra_csv={"curves.csv": curves, **({"equal-steps.csv": step_rows} if step_rows else {})})
