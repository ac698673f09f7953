"""Video: classification of moving-digit clips with 3-D token coordinates ``(t, y, x)``.

Each tubelet (``tubelet_size`` frames x ``patch`` x ``patch`` pixels) gets the coordinate of its place in the
``(gt, gh, gw)`` grid, and every encoding is built for ``c = 3``. The label is the dataset's (``labels`` option
of ``moving-digits``); the recipes use the *direction of motion*, which no single frame shows: a model must
relate tokens across time, and in the right order (the same frames played backwards move the other way).

Besides accuracy the study reports accuracy with

* the frames of every clip shuffled (one random permutation of the frame order per clip; pixels within a frame
  untouched), which removes the motion;
* the frames played backwards, which reverses it (a model that reads direction falls below chance);
* the tubelets shuffled in space and time;

and the largest logit change under a random global 3-D offset (``rho = 1`` patch), round-off for the commuting
encodings.

``video-coords`` trains the same recipe with each coordinate convention (``grid``: integer tubelet indices;
``normalized``: tubelet centres ``(i + 0.5) / g`` in ``[0, 1]`` along t, y and x each) and pairs each convention
with its encoding's grid run by seed. The offset is drawn in patches and scaled to the convention's units, so
``rho = 1`` is one tubelet under either.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from ropekit.nn.coords import COORD_MODES
from .common import StudyContext, StudyResult, coord_arms, headline
from .evaluation import accuracy, coord_scale, has_coordinate_path, is_offset_invariant, predict, random_offsets, \
    summarize_logit_change, token_grid
from .registry import register_study
from .report import add_paired_vs_grid, aggregate, arm_label, fmt_pm, markdown_table, setup_matplotlib
from .settings import DEFAULT_PES, QUICK_PES, ExperimentConfig
from .shuffle import shuffle_drop
from .verify import readings

__all__ = ["run_video", "run_video_coords", "shuffle_frames", "reverse_frames"]


def shuffle_frames(x: Tensor, generator: torch.Generator) -> Tensor:
    """Clips ``(B, C, T, H, W)`` with the frame order of each clip randomly permuted (one permutation per clip)."""
    b, t = x.shape[0], x.shape[2]
    perm = torch.argsort(torch.rand(b, t, generator=generator), dim=1)  # (B, T)
    return x[torch.arange(b)[:, None], :, perm].permute(0, 2, 1, 3, 4)


def reverse_frames(x: Tensor) -> Tensor:
    """Clips ``(B, C, T, H, W)`` played backwards."""
    return x.flip(2)


@register_study("video", "moving-digit clips labelled by direction of motion, (t, y, x) coordinates, frame "
                "shuffling", varies=("pe_sharing",))
def run_video(cfg: ExperimentConfig, out: Any) -> StudyResult:
    return _video("video", cfg, out)


@register_study("video-coords", "the video study with grid and normalised (t, y, x) coordinates, paired by seed",
                options=("coord_modes",), varies=("pe_sharing", "coords"))
def run_video_coords(cfg: ExperimentConfig, out: Any, coord_modes: Optional[Sequence[str]] = None) -> StudyResult:
    """The video study of ``cfg``'s encodings with each coordinate convention of ``coord_modes`` (default grid and
    normalized, :data:`ropekit.nn.coords.COORD_MODES`): arms ``<pe>/<convention>``; each non-grid arm's accuracy
    difference to its encoding's grid arm, paired by seed, with its reading (:func:`ropekit_studies.verify.
    readings`: normalised − grid claimed positive, the arms one Holm family) in ``summary["paired_diff_vs_grid"]``
    and a second table."""
    return _video("video-coords", cfg, out, list(coord_modes or COORD_MODES))


def _video(name: str, cfg: ExperimentConfig, out: Any, coord_modes: Optional[List[str]] = None) -> StudyResult:
    encodings = cfg.pe_list(QUICK_PES if cfg.quick else DEFAULT_PES)
    variants = coord_arms(encodings, coord_modes)
    pes = [v[0] for v in variants]
    ctx = StudyContext(name, cfg, out, total=len(variants) * len(cfg.seeds))
    rows: List[Dict[str, Any]] = []
    for pe, enc, cm in variants:
        for seed in cfg.seeds:
            tcfg = cfg.train_config(enc, seed) if cm is None else cfg.train_config(enc, seed, coords=cm)
            rec = ctx.run(tcfg)
            model = rec.model()
            if model.cfg.modality != "video":
                raise ValueError(f"the video study needs a video dataset (e.g. moving-digits), got {cfg.data!r}")
            x, y, _ = ctx.test_data(tcfg)
            res = shuffle_drop(model, x, y, seed=777, batch_size=cfg.eval_batch_size)
            bs = cfg.eval_batch_size
            res["frames_shuffled_acc"] = accuracy(predict(model, shuffle_frames(x, torch.Generator().manual_seed(778)),
                                                          batch_size=bs), y)
            res["reversed_acc"] = accuracy(predict(model, reverse_frames(x), batch_size=bs), y)
            change = {"max_abs": 0.0}
            if has_coordinate_path(model):
                ref = predict(model, x, batch_size=cfg.eval_batch_size)
                off = random_offsets(x.shape[0], model.coord_dim, 1.0, seed=1234) * coord_scale(model, x.shape[1:])
                change = summarize_logit_change(ref, predict(model, x, offsets=off, batch_size=cfg.eval_batch_size))
            extra = {} if cm is None else {"encoding": enc, "coords": cm}
            rows.append({"pe": pe, **extra, "seed": seed, **res, "offset_max_logit_diff": change["max_abs"],
                         "invariant_by_theory": is_offset_invariant(model),
                         "coordinate_input": has_coordinate_path(model),
                         "token_grid": "x".join(str(v) for v in token_grid(model, x.shape[1:])),
                         "num_params": rec.summary.get("num_params")})
            rec.release()
            ctx.advance(f"{pe} s{seed}")

    st = {k: {s["pe"]: s for s in aggregate(rows, ["pe"], k)}
          for k in ("test_acc", "frames_shuffled_acc", "reversed_acc", "shuffled_acc", "relative_drop")}
    worst = {pe: max(r["offset_max_logit_diff"] for r in rows if r["pe"] == pe) for pe in pes}
    coord = {pe: next(r["coordinate_input"] for r in rows if r["pe"] == pe) for pe in pes}
    grid = rows[0]["token_grid"]
    table_rows = [[arm_label(pe), fmt_pm(st["test_acc"][pe], 3), fmt_pm(st["frames_shuffled_acc"][pe], 3),
                   fmt_pm(st["reversed_acc"][pe], 3), fmt_pm(st["shuffled_acc"][pe], 3),
                   fmt_pm(st["relative_drop"][pe], 3), f"{worst[pe]:.1e}" if coord[pe] else "no coordinate input"]
                  for pe in pes]
    vs_grid: Dict[str, Dict[str, Any]] = {}
    if coord_modes and "grid" in coord_modes:  # each convention against its encoding's grid arm, seed by seed
        vs_grid = add_paired_vs_grid(rows)
        for arm, s in vs_grid.items():
            s["per_seed"] = [r["diff_vs_grid"] for r in rows if r["pe"] == arm]
        # normalised − grid, claimed positive (the papers feed normalised coordinates), one Holm family
        words = readings({arm: s["per_seed"] for arm, s in vs_grid.items()})
        for arm, s in vs_grid.items():
            s["reading"], s["sign"] = words[arm]
    labels = cfg.data_options.get("labels", "digit-direction")
    conventions = f" ({' or '.join(coord_modes)} per arm)" if coord_modes else ""
    table = (f"**Video** — {headline(cfg, cfg.data)}; label: {labels}; token grid (t, y, x) = {grid}, 3-D "
             f"coordinates{conventions}. Test accuracy; with the frame order of each clip shuffled; played backwards; "
             f"with the tubelets shuffled in space and time (and the relative drop); the largest logit change under a "
             f"random global (t, y, x) offset ~ N(0, I) patches; mean ± std across seeds.\n\n"
             + markdown_table(["encoding", "accuracy", "frames shuffled", "backwards", "tubelets shuffled",
                               "relative drop (tubelets)", "largest logit change, offset ρ=1"], table_rows))
    if vs_grid:
        table = table.rstrip("\n") + "\n\n" + markdown_table(
            ["encoding and coordinates", "accuracy − grid coordinates (paired)", "per seed", "reading"],
            [[arm_label(pe), ("+" if s["mean"] > 0 else "") + fmt_pm(s, 3),
              ", ".join(f"{d:+.3f}" for d in s["per_seed"]),
              s["reading"] + (" (worse)" if s["sign"] < 0 and s["reading"] == "trend" else "")]
             for pe, s in vs_grid.items()], align="lrrl")

    plt = setup_matplotlib()
    fig, ax = plt.subplots(figsize=(9, 4.6))
    xs = list(range(len(pes)))
    w = 0.2
    for off, key, color, label in ((-1.5 * w, "test_acc", "tab:blue", "clips as recorded"),
                                   (-0.5 * w, "frames_shuffled_acc", "tab:green", "frame order shuffled"),
                                   (0.5 * w, "reversed_acc", "tab:red", "played backwards"),
                                   (1.5 * w, "shuffled_acc", "tab:orange", "tubelets shuffled (space and time)")):
        m = [st[key][pe]["mean"] for pe in pes]
        e = [0 if st[key][pe]["n"] < 2 else st[key][pe]["std"] for pe in pes]
        ax.bar([x + off for x in xs], m, w, yerr=e, capsize=3, color=color, alpha=0.8, label=label)
    ax.set_xticks(xs, [arm_label(pe) for pe in pes], rotation=30, ha="right")
    ax.set_ylabel(f"test accuracy ({labels} labels)")
    ax.set_title(f"Video classification with (t, y, x) coordinates, mean ± std\n{headline(cfg, cfg.data)}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    summary = {**{k: v for k, v in st.items()}, "offset_largest_logit_change": worst}
    if vs_grid:
        summary["paired_diff_vs_grid"] = vs_grid
    options: Dict[str, Any] = {"pes": pes} if coord_modes is None else {"pes": encodings, "coord_modes": coord_modes}
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig, options=options)
