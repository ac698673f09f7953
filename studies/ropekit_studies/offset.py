"""Global coordinate offset: add one random offset ``~ N(0, rho^2 I)`` per test image to every token
coordinate, and sweep ``rho`` (in patches).

A commuting encoding with mean pooling (or a CLS token placed at the centroid of the patch coordinates) makes
the logits a function of coordinate *differences* only, so they must not change: the study asserts that the
largest logit difference stays at round-off for every such model (raising :class:`InvarianceError` after the
files are written) and reports it. Beside them, the same encodings with an *unrotated* CLS token show the
effect of absolute coordinates leaking in, and LieRE (non-commuting) degrades with ``rho``. ``none`` and
``absolute`` take no coordinates at all: offsets cannot change them (listed as "no coordinate input").
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .common import StudyContext, StudyResult, headline
from .evaluation import accuracy, coord_scale, has_coordinate_path, is_offset_invariant, predict, random_offsets, \
    summarize_logit_change
from .registry import register_study
from .report import aggregate, fmt_pm, markdown_table, pe_label, setup_matplotlib
from .settings import DEFAULT_PES, QUICK_PES, ExperimentConfig

__all__ = ["run_offset", "InvarianceError", "OFFSET_RTOL", "DEFAULT_RHOS"]

DEFAULT_RHOS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)

#: Invariant models must keep ``max |logits(rho) - logits(0)| <= OFFSET_RTOL * max(1, max |logits(0)|)``
#: (float32 round-off of angles up to ~40 rad is ~1e-6 in the logits; violations are orders of magnitude larger).
OFFSET_RTOL = 1e-4


class InvarianceError(AssertionError):
    """A model that theory says is offset invariant changed its logits by more than round-off."""


def variant_name(pe: str, cls: str) -> str:
    return pe if cls == "none" else f"{pe}+cls-{cls}"


def variant_label(pe: str, cls: str) -> str:
    return pe_label(pe) + ("" if cls == "none" else f" + CLS ({cls})")


@register_study("offset", "accuracy and logits under random global coordinate offsets", options=("rhos", "cls_pe"),
                varies=("pe_sharing", "cls"))
def run_offset(cfg: ExperimentConfig, out: Any, rhos: Optional[Sequence[float]] = None,
               cls_pe: Optional[Sequence[str]] = None) -> StudyResult:
    pes = cfg.pe_list(QUICK_PES if cfg.quick else DEFAULT_PES)
    rhos = sorted({0.0, *(float(r) for r in (rhos or DEFAULT_RHOS))})
    cls_pes = list(cls_pe) if cls_pe is not None else ["mixed"]
    variants = [(pe, "none") for pe in pes] + [(pe, mode) for pe in cls_pes for mode in ("unrotated", "centroid")]
    ctx = StudyContext("offset", cfg, out, total=len(variants) * len(cfg.seeds))
    rows: List[Dict[str, Any]] = []
    checks: List[Dict[str, Any]] = []
    for pe, cls in variants:
        for seed in cfg.seeds:
            tcfg = cfg.train_config(pe, seed, cls=cls)
            rec = ctx.run(tcfg, f"{variant_label(pe, cls)} s{seed}")
            model = rec.model()
            x, y, _ = ctx.test_data(tcfg)
            scale = coord_scale(model, x.shape[1:])  # coordinate units per patch, (c,)
            ref = predict(model, x, batch_size=cfg.eval_batch_size)
            ref_acc = accuracy(ref, y)
            invariant = is_offset_invariant(model)
            coords = has_coordinate_path(model)
            worst = 0.0
            for i, rho in enumerate(rhos):
                if rho == 0.0:
                    logits, change = ref, {"max_abs": 0.0, "mean_l2": 0.0}
                else:
                    off = random_offsets(x.shape[0], model.coord_dim, rho, seed=1234 + i) * scale
                    logits = predict(model, x, offsets=off, batch_size=cfg.eval_batch_size)
                    change = summarize_logit_change(ref, logits)
                worst = max(worst, change["max_abs"])
                acc = accuracy(logits, y)
                rows.append({"variant": variant_name(pe, cls), "pe": pe, "cls": cls, "seed": seed, "rho": rho,
                             "test_acc": acc, "acc_change": acc - ref_acc, "max_logit_diff": change["max_abs"],
                             "mean_logit_l2": change["mean_l2"], "coordinate_input": coords,
                             "invariant_by_theory": invariant})
            tol = OFFSET_RTOL * max(1.0, float(ref.abs().max()))
            checks.append({"variant": variant_name(pe, cls), "seed": seed, "invariant_by_theory": invariant,
                           "coordinate_input": coords, "max_logit_diff": worst, "tolerance": tol,
                           "passed": (worst <= tol) if invariant else None})
            rec.release()
            ctx.advance(f"{variant_name(pe, cls)} s{seed}")

    names = [variant_name(pe, cls) for pe, cls in variants]
    labels = {variant_name(pe, cls): variant_label(pe, cls) for pe, cls in variants}
    acc = {(s["variant"], s["rho"]): s for s in aggregate(rows, ["variant", "rho"], "test_acc")}
    worst = {n: max(c["max_logit_diff"] for c in checks if c["variant"] == n) for n in names}
    kind = {}
    for n in names:
        c = next(c for c in checks if c["variant"] == n)
        kind[n] = "no coordinate input" if not c["coordinate_input"] else (
            "yes" if c["invariant_by_theory"] else "no")
    headers = ["model", "invariant by theory"] + [f"acc ρ={r:g}" for r in rhos] + ["largest logit change"]
    table_rows = [[labels[n], kind[n]] + [fmt_pm(acc[(n, r)], 3) for r in rhos] + [f"{worst[n]:.2e}"]
                  for n in names]
    failed = [c for c in checks if c["passed"] is False]
    inv_worst = max([c["max_logit_diff"] for c in checks if c["invariant_by_theory"]] or [0.0])
    verdict = ("All models that are invariant by theory kept their logits to round-off "
               f"(largest change {inv_worst:.2e}; tolerance {OFFSET_RTOL:g} × max(1, |logits|)).") if not failed else (
        "FAILED: " + "; ".join(f"{c['variant']} s{c['seed']} changed logits by {c['max_logit_diff']:.3g} "
                               f"> {c['tolerance']:.3g}" for c in failed))
    table = (f"**Global coordinate offset** — one offset ~ N(0, ρ² I) (ρ in patches) per test image added to "
             f"every token coordinate; test accuracy (mean ± std across seeds) and the largest absolute logit "
             f"change over all images, seeds and ρ. {headline(cfg)}.\n\n" + markdown_table(headers, table_rows)
             + "\n" + verdict + "\n")

    plt = setup_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = list(plt.rcParams["axes.prop_cycle"].by_key()["color"]) + ["black", "navy", "magenta", "lime"]
    for i, n in enumerate(names):
        ls = ":" if kind[n] == "no coordinate input" else ("-" if kind[n] == "yes" else "--")
        color = colors[i % len(colors)]
        st = [acc[(n, r)] for r in rhos]
        ax1.errorbar(rhos, [s["mean"] for s in st], yerr=[0 if s["n"] < 2 else s["std"] for s in st], marker="o",
                     ms=3, capsize=2, ls=ls, color=color, label=labels[n])
        if kind[n] != "no coordinate input":
            diffs = [max(r["max_logit_diff"] for r in rows if r["variant"] == n and r["rho"] == rho)
                     for rho in rhos[1:]]
            ax2.plot(rhos[1:], [max(d, 1e-9) for d in diffs], marker="o", ms=3, ls=ls, color=color, label=labels[n])
    ax1.set_xlabel("offset standard deviation ρ (patches)")
    ax1.set_ylabel("test accuracy")
    ax1.set_title("accuracy under a random global offset (mean ± std)")
    ax1.legend(fontsize=7, ncol=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("offset standard deviation ρ (patches)")
    ax2.set_ylabel("largest |logit change| (log scale)")
    ax2.set_title("logit change vs. no offset (solid: invariant by theory;\ndashed: not invariant)")
    tol_min = min(c["tolerance"] for c in checks)
    ax2.axhline(tol_min, color="grey", ls=":", lw=1)
    ax2.text(rhos[1], tol_min * 1.3, f"assertion tolerance ({tol_min:.0e} for the smallest logits)", fontsize=7,
             color="grey")
    ax2.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Global coordinate offset: {headline(cfg)}")
    fig.tight_layout()

    summary = {"accuracy": {f"{n}@{r:g}": acc[(n, r)] for n in names for r in rhos},
               "largest_logit_change": worst, "checks": checks, "all_invariant_models_passed": not failed}
    result = ctx.finish(rows=rows, summary=summary, table=table, figure=fig,
                        options={"pes": pes, "cls_pe": cls_pes, "rhos": rhos, "rtol": OFFSET_RTOL},
                        extra_csv={"invariance_checks.csv": checks})
    if failed:
        raise InvarianceError(verdict)
    return result
