"""SPEC §6.2 — resolution extrapolation: train at one image size, evaluate at smaller and larger ones.

The patch size stays the same, so the token grid shrinks or grows (absolute embeddings are resized
bilinearly by the model). The test digits are resized to each size (bilinear, antialiased when shrinking),
so the content scales with the image.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .common import StudyContext, StudyResult, headline
from .evaluation import accuracy, mean_loss, predict, token_grid
from .report import aggregate, fmt_pm, markdown_table, pe_label, setup_matplotlib
from .settings import DEFAULT_PES, QUICK_PES, ExperimentConfig

__all__ = ["run_resolution", "default_sizes"]


def default_sizes(train_size: int, patch: int, quick: bool = False) -> List[int]:
    """Training size -2..+3 patches (quick: -1..+1), sizes of at least 2 patches."""
    ks = (-1, 0, 1) if quick else (-2, -1, 0, 1, 2, 3)
    return [train_size + k * patch for k in ks if train_size + k * patch >= 2 * patch]


def run_resolution(cfg: ExperimentConfig, out: Any, sizes: Optional[Sequence[int]] = None) -> StudyResult:
    pes = cfg.pe_list(QUICK_PES if cfg.quick else DEFAULT_PES)
    ctx = StudyContext("resolution", cfg, out, total=len(pes) * len(cfg.seeds))
    probe = cfg.train_config(pes[0], cfg.seeds[0])
    _, _, info = ctx.test_data(probe)
    train_size = int(info.image_size[0])
    rows: List[Dict[str, Any]] = []
    patch = None
    for pe in pes:
        for seed in cfg.seeds:
            tcfg = cfg.train_config(pe, seed)
            rec = ctx.run(tcfg)
            model = rec.model()
            patch = model.cfg.patch_size
            eval_sizes = list(sizes) if sizes else default_sizes(train_size, patch, cfg.quick)
            for size in eval_sizes:
                x, y, _ = ctx.test_data(tcfg, image_size=None if size == train_size else size)
                logits = predict(model, x, batch_size=cfg.eval_batch_size)
                grid = token_grid(model, x.shape[1:])
                rows.append({"pe": pe, "seed": seed, "image_size": size, "grid": "x".join(map(str, grid)),
                             "num_tokens": int(_prod(grid)), "train_size": train_size,
                             "test_acc": accuracy(logits, y), "test_loss": mean_loss(logits, y)})
            rec.release()
            ctx.advance(f"{pe} s{seed}")

    eval_sizes = sorted({r["image_size"] for r in rows})
    stats = {(s["pe"], s["image_size"]): s for s in aggregate(rows, ["pe", "image_size"], "test_acc")}
    grids = {r["image_size"]: r["grid"] for r in rows}
    headers = ["encoding"] + [f"{s} px ({grids[s]}){' train' if s == train_size else ''}" for s in eval_sizes]
    table_rows = [[pe_label(pe)] + [fmt_pm(stats[(pe, s)], 3) for s in eval_sizes] for pe in pes]
    table = (f"**Resolution extrapolation** — trained at {train_size} px; test accuracy at each evaluation size "
             f"(patch {patch}, token grid in brackets), mean ± std across seeds. {headline(cfg)}.\n\n"
             + markdown_table(headers, table_rows))

    plt = setup_matplotlib()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, pe in enumerate(pes):
        st = [stats[(pe, s)] for s in eval_sizes]
        ax.errorbar([s + (i - len(pes) / 2) * 0.12 for s in eval_sizes], [v["mean"] for v in st],
                    yerr=[0 if v["n"] < 2 else v["std"] for v in st], marker="o", ms=3, capsize=2,
                    label=pe_label(pe), ls="--" if pe in ("none", "absolute") else "-")
    ax.axvline(train_size, color="grey", ls=":", lw=1)
    ax.annotate("training size", (train_size, ax.get_ylim()[0]), xytext=(3, 5), textcoords="offset points",
                fontsize=8, color="grey")
    ax.set_xticks(eval_sizes, [f"{s}\n({grids[s]})" for s in eval_sizes])
    ax.set_xlabel("evaluation image size in pixels (token grid)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"Resolution extrapolation (mean ± std)\n{headline(cfg)}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    summary = {f"{pe}@{s}": stats[(pe, s)] for pe in pes for s in eval_sizes}
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig,
                      options={"pes": pes, "sizes": eval_sizes, "train_size": train_size})


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for v in xs:
        out *= int(v)
    return out
