"""Patch shuffling: the relative accuracy drop ``(before - after) / before`` when every test image's
patches (with their pixels; tubelets for video, so frames move too) are randomly permuted while the coordinate
grid stays. How much a model relies on position: ``none`` with mean pooling is permutation invariant (drop 0).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from .common import StudyContext, StudyResult, headline
from .evaluation import accuracy, predict, shuffle_patches
from .registry import register_study
from .report import aggregate, fmt_pm, markdown_table, pe_label, setup_matplotlib
from .settings import DEFAULT_PES, QUICK_PES, ExperimentConfig

__all__ = ["run_shuffle", "shuffle_drop"]


def shuffle_drop(model, x, y, *, seed: int = 0, batch_size: int = 250) -> Dict[str, float]:
    """Accuracy before and after shuffling the patches of ``x`` and the relative drop."""
    before = accuracy(predict(model, x, batch_size=batch_size), y)
    g = torch.Generator().manual_seed(int(seed))
    xs = shuffle_patches(x, model.cfg.patch_size, tubelet_size=model.cfg.tubelet_size if x.dim() == 5 else None,
                         generator=g)
    after = accuracy(predict(model, xs, batch_size=batch_size), y)
    return {"test_acc": before, "shuffled_acc": after, "relative_drop": (before - after) / before if before else 0.0}


@register_study("shuffle", "relative accuracy drop when the patches are permuted", varies=("pe_sharing",))
def run_shuffle(cfg: ExperimentConfig, out: Any) -> StudyResult:
    pes = cfg.pe_list(QUICK_PES if cfg.quick else DEFAULT_PES)
    ctx = StudyContext("shuffle", cfg, out, total=len(pes) * len(cfg.seeds))
    rows: List[Dict[str, Any]] = []
    for pe in pes:
        for seed in cfg.seeds:
            tcfg = cfg.train_config(pe, seed)
            rec = ctx.run(tcfg)
            x, y, _ = ctx.test_data(tcfg)
            res = shuffle_drop(rec.model(), x, y, seed=777, batch_size=cfg.eval_batch_size)
            rows.append({"pe": pe, "seed": seed, **res})
            rec.release()
            ctx.advance(f"{pe} s{seed}")

    st = {k: {s["pe"]: s for s in aggregate(rows, ["pe"], k)} for k in ("test_acc", "shuffled_acc", "relative_drop")}
    table_rows = [[pe_label(pe), fmt_pm(st["test_acc"][pe], 3), fmt_pm(st["shuffled_acc"][pe], 3),
                   fmt_pm(st["relative_drop"][pe], 3)] for pe in pes]
    table = (f"**Patch shuffling** — accuracy before and after permuting the patches of each test image (pixels "
             f"move, the coordinate grid stays); relative drop = (before − after) / before, mean ± std across "
             f"seeds. {headline(cfg)}.\n\n"
             + markdown_table(["encoding", "accuracy", "shuffled accuracy", "relative drop"], table_rows))

    plt = setup_matplotlib()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = range(len(pes))
    m = [st["relative_drop"][pe]["mean"] for pe in pes]
    e = [0 if st["relative_drop"][pe]["n"] < 2 else st["relative_drop"][pe]["std"] for pe in pes]
    ax.bar(xs, m, yerr=e, capsize=3, color="tab:orange", alpha=0.75, label="mean ± std")
    for i, pe in enumerate(pes):
        vals = [r["relative_drop"] for r in rows if r["pe"] == pe]
        ax.plot([i] * len(vals), vals, "k.", ms=4, label="one seed" if i == 0 else None)
    ax.set_xticks(list(xs), [pe_label(pe) for pe in pes], rotation=30, ha="right")
    ax.set_ylabel("relative accuracy drop (before − after) / before")
    ax.set_title(f"Patch shuffling: how much each model relies on position\n{headline(cfg)}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return ctx.finish(rows=rows, summary={k: v for k, v in st.items()}, table=table, figure=fig,
                      options={"pes": pes, "permutation_seed": 777})
