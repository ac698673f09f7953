"""SPEC §6.7 — video: classification of moving-digit clips with 3-D token coordinates ``(t, y, x)``.

Each tubelet (``tubelet_size`` frames x ``patch`` x ``patch`` pixels) gets the coordinate of its place in the
``(gt, gh, gw)`` grid, and every encoding is built for ``c = 3``. The label is the dataset's (``labels``
option of ``moving-digits``; the preset uses the digit, see ``VIDEO_DEFAULTS``). Besides accuracy the study
reports the relative drop when the tubelets are shuffled (space and time) and the largest logit change under a
random global 3-D offset (``rho = 1`` patch), which is round-off for the commuting encodings.
"""

from __future__ import annotations

from typing import Any, Dict, List

from .common import StudyContext, StudyResult, headline
from .evaluation import coord_scale, has_coordinate_path, is_offset_invariant, predict, random_offsets, \
    summarize_logit_change, token_grid
from .report import aggregate, fmt_pm, markdown_table, pe_label, setup_matplotlib
from .settings import DEFAULT_PES, QUICK_PES, ExperimentConfig
from .shuffle import shuffle_drop

__all__ = ["run_video", "VIDEO_DEFAULTS", "VIDEO_QUICK"]

#: The video preset: 4 frames of 32x32 pixels, tubelets 2x8x8 -> a 2x4x4 token grid; label = the digit (10
#: classes; the 40-class digit x direction task stays near chance at this training budget, see
#: docs/results/README.md); head dimension 24 (a multiple of 6, and 3 ComRoPE-AP blocks of 8), so every
#: encoding splits evenly over the three axes.
VIDEO_DEFAULTS: Dict[str, Any] = dict(data="moving-digits", patch_size=8, tubelet_size=2,
                                      data_options=dict(num_frames=4, labels="digit"),
                                      model_options=dict(embed_dim=48, num_heads=2, depth=2))
VIDEO_QUICK: Dict[str, Any] = dict(data="moving-digits", image_size=16, patch_size=4, tubelet_size=2,
                                   train_fraction=1.0, data_options=dict(num_train=300, num_test=100),
                                   model_options=dict(embed_dim=48, num_heads=2, depth=1))


def run_video(cfg: ExperimentConfig, out: Any) -> StudyResult:
    pes = cfg.pe_list(QUICK_PES if cfg.quick else DEFAULT_PES)
    ctx = StudyContext("video", cfg, out, total=len(pes) * len(cfg.seeds))
    rows: List[Dict[str, Any]] = []
    for pe in pes:
        for seed in cfg.seeds:
            tcfg = cfg.train_config(pe, seed)
            rec = ctx.run(tcfg)
            model = rec.model()
            if model.cfg.modality != "video":
                raise ValueError(f"the video study needs a video dataset (e.g. moving-digits), got {cfg.data!r}")
            x, y, _ = ctx.test_data(tcfg)
            res = shuffle_drop(model, x, y, seed=777, batch_size=cfg.eval_batch_size)
            change = {"max_abs": 0.0}
            if has_coordinate_path(model):
                ref = predict(model, x, batch_size=cfg.eval_batch_size)
                off = random_offsets(x.shape[0], model.coord_dim, 1.0, seed=1234) * coord_scale(model, x.shape[1:])
                change = summarize_logit_change(ref, predict(model, x, offsets=off, batch_size=cfg.eval_batch_size))
            rows.append({"pe": pe, "seed": seed, **res, "offset_max_logit_diff": change["max_abs"],
                         "invariant_by_theory": is_offset_invariant(model),
                         "coordinate_input": has_coordinate_path(model),
                         "token_grid": "x".join(str(v) for v in token_grid(model, x.shape[1:])),
                         "num_params": rec.summary.get("num_params")})
            rec.release()
            ctx.advance(f"{pe} s{seed}")

    st = {k: {s["pe"]: s for s in aggregate(rows, ["pe"], k)} for k in ("test_acc", "shuffled_acc", "relative_drop")}
    worst = {pe: max(r["offset_max_logit_diff"] for r in rows if r["pe"] == pe) for pe in pes}
    coord = {pe: next(r["coordinate_input"] for r in rows if r["pe"] == pe) for pe in pes}
    grid = rows[0]["token_grid"]
    table_rows = [[pe_label(pe), fmt_pm(st["test_acc"][pe], 3), fmt_pm(st["shuffled_acc"][pe], 3),
                   fmt_pm(st["relative_drop"][pe], 3), f"{worst[pe]:.1e}" if coord[pe] else "no coordinate input"]
                  for pe in pes]
    table = (f"**Video** — {headline(cfg, cfg.data)}; token grid (t, y, x) = {grid}, 3-D coordinates. Test accuracy, "
             f"accuracy with the tubelets shuffled in space and time, relative drop, and the largest logit change "
             f"under a random global (t, y, x) offset ~ N(0, I) patches; mean ± std across seeds.\n\n"
             + markdown_table(["encoding", "accuracy", "shuffled accuracy", "relative drop",
                               "largest logit change, offset ρ=1"], table_rows))

    plt = setup_matplotlib()
    fig, ax = plt.subplots(figsize=(9, 4.6))
    xs = list(range(len(pes)))
    w = 0.38
    for off, key, color, label in ((-w / 2, "test_acc", "tab:blue", "clips as recorded"),
                                   (w / 2, "shuffled_acc", "tab:orange", "tubelets shuffled (space and time)")):
        m = [st[key][pe]["mean"] for pe in pes]
        e = [0 if st[key][pe]["n"] < 2 else st[key][pe]["std"] for pe in pes]
        ax.bar([x + off for x in xs], m, w, yerr=e, capsize=3, color=color, alpha=0.8, label=label)
    ax.set_xticks(xs, [pe_label(pe) for pe in pes], rotation=30, ha="right")
    ax.set_ylabel(f"test accuracy ({cfg.data_options.get('labels', 'digit-direction')} labels)")
    ax.set_title(f"Video classification with (t, y, x) coordinates, mean ± std\n{headline(cfg, cfg.data)}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    summary = {**{k: v for k, v in st.items()}, "offset_largest_logit_change": worst}
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig, options={"pes": pes})
