"""Scale: does depth or training length turn the ranking of rotary encodings against a learned absolute one?

The classification study's small CPU model (2 blocks, 10 epochs) has every rotary encoding level with or below
the learned absolute embedding (APE); its GPU preset (6 blocks of width 192, 40 epochs) has every one above it.
This study changes one factor of the CPU recipe at a time, then both, for APE and a few rotary encodings, so
the two candidates are measured apart (width, MLP ratio, drop-path, learning rate and batch, which the GPU
preset also changes, are not varied here):

* ``arms`` -- ``[depth, epochs]`` pairs; the first is the reference (the recipe's own depth and epochs, whose
  runs are the classification study's and come from the cache). The warm-up stays as long in epochs as the
  recipe's; the learning rate, batch and everything else are as the recipe states.
* ``widths`` -- optional embedding widths, crossed with every arm. The number of heads scales with the width so
  the head dimension stays the recipe's (width 64 with 2 heads: head dimension 32, so widths 32, 64, 128 get 1, 2,
  4 heads); a width must be a multiple of that head dimension. Unset: the recipe's width only, and arms are
  labelled by depth and epochs alone.

Per arm: test and train accuracy of every encoding and each rotary encoding's difference to APE paired by seed;
where RoPE-Mixed and another rotary encoding are trained, also that encoding's difference to RoPE-Mixed.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .common import StudyContext, StudyResult, headline
from .registry import register_study
from .report import (add_paired_difference, aggregate, fmt_pm, markdown_table, pe_label, setup_matplotlib,
                     where_trained)
from .settings import SCALE_PES, ExperimentConfig

__all__ = ["run_scale", "run_scale_width", "parse_arm", "heads_for_width", "REFERENCE"]

REFERENCE = "absolute"
#: A second reference, paired against when it and another rotary encoding are trained (LieRE's own comparison).
ROTARY_REFERENCE = "mixed"


def parse_arm(arm: Any) -> Tuple[int, int]:
    """``(depth, epochs)`` from ``[6, 10]`` or ``"6x10"``; one-line ``ValueError`` otherwise."""
    try:
        depth, epochs = (str(arm).split("x") if isinstance(arm, str) else arm)
        depth, epochs = int(depth), int(epochs)
    except (TypeError, ValueError):
        raise ValueError(f"an arm is DEPTHxEPOCHS (e.g. 6x10) or [depth, epochs]; got {arm!r}") from None
    if depth < 1 or epochs < 1:
        raise ValueError(f"an arm's depth and epochs must be at least 1; got {depth}x{epochs}")
    return depth, epochs


def heads_for_width(width: int, embed_dim: int, num_heads: int) -> int:
    """Heads that keep the head dimension ``embed_dim // num_heads`` at ``width``; one-line ``ValueError`` when
    ``width`` is not a positive multiple of it."""
    head_dim = int(embed_dim) // int(num_heads)
    if int(width) < 1 or int(width) % head_dim:
        raise ValueError(f"a width must be a positive multiple of the head dimension {head_dim}; got {width!r}")
    return int(width) // head_dim


def _label(depth: int, epochs: int, width: Optional[int] = None) -> str:
    w = "" if width is None else f"width {width}, "
    return f"{w}depth {depth}, {epochs} epoch{'s' if epochs != 1 else ''}"


@register_study("scale", "depth and training length one at a time: which turns rotary vs APE",
                options=("arms", "widths"), varies=("pe_sharing", "model_options", "epochs"))
def run_scale(cfg: ExperimentConfig, out: Any, arms: Optional[Sequence[Any]] = None,
              widths: Optional[Sequence[int]] = None) -> StudyResult:
    """Train every encoding of ``cfg`` (APE added first when missing) at every arm over ``cfg.seeds``.

    Args:
        arms: ``[depth, epochs]`` pairs (or ``"DxE"`` strings); default the recipe's own depth and epochs, then
            three times the depth, four times the epochs, and both.
        widths: embedding widths crossed with every arm, heads scaled to keep the recipe's head dimension;
            default the recipe's width alone (then not named in the arm labels).

    Raises:
        ValueError: a malformed or repeated arm or width, or a width that is not a multiple of the head dimension.
    """
    return _scale("scale", cfg, out, arms, widths)


@register_study("scale-width", "model width with the head dimension fixed: does LieRE's lead hold as it grows",
                options=("arms", "widths"), varies=("pe_sharing", "model_options", "epochs"))
def run_scale_width(cfg: ExperimentConfig, out: Any, arms: Optional[Sequence[Any]] = None,
                    widths: Optional[Sequence[int]] = None) -> StudyResult:
    """The scale study with a width axis as its recipe: APE, RoPE-Mixed and LieRE at widths 32, 64 and 128 (1, 2
    and 4 heads of dimension 32) with the classification's depth and epochs; arguments as :func:`run_scale`."""
    return _scale("scale-width", cfg, out, arms, widths)


def _scale(name: str, cfg: ExperimentConfig, out: Any, arms: Optional[Sequence[Any]],
           widths: Optional[Sequence[int]]) -> StudyResult:
    base = (int(cfg.model_options["depth"]), int(cfg.epochs))
    arm_list = [parse_arm(a) for a in (arms or [base, (3 * base[0], base[1]), (base[0], 4 * base[1]),
                                                 (3 * base[0], 4 * base[1])])]
    if len(set(arm_list)) != len(arm_list):
        raise ValueError(f"repeated arm in {['%dx%d' % a for a in arm_list]}")
    embed_dim, num_heads = int(cfg.model_options["embed_dim"]), int(cfg.model_options["num_heads"])
    width_list: List[Optional[int]] = [None] if not widths else [int(w) for w in widths]
    if len(set(width_list)) != len(width_list):
        raise ValueError(f"repeated width in {width_list}")
    heads = {w: num_heads if w is None else heads_for_width(w, embed_dim, num_heads) for w in width_list}
    grid = [(w, d, e) for w in width_list for d, e in arm_list]
    pes = cfg.pe_list(SCALE_PES)
    if REFERENCE not in pes:
        pes = [REFERENCE] + pes
    ctx = StudyContext(name, cfg, out, total=len(grid) * len(pes) * len(cfg.seeds))
    rows: List[Dict[str, Any]] = []
    for width, depth, epochs in grid:
        arm = _label(depth, epochs, width)
        wtag = "" if width is None else f"w{width} "
        size = {} if width is None else {"embed_dim": width, "num_heads": heads[width]}
        for pe in pes:
            for seed in cfg.seeds:
                tcfg = cfg.train_config(pe, seed)
                tcfg = tcfg.replace(model_options={**tcfg.model.extra(), **size, "depth": depth}, epochs=epochs)
                rec = ctx.run(tcfg, f"{pe_label(pe)} {wtag}{depth}x{epochs} s{seed}")
                f = rec.final
                rows.append({"arm": arm, "width": width or embed_dim, "depth": depth, "epochs": epochs, "pe": pe,
                             "seed": seed,
                             "test_acc": f.get("test_acc"), "train_acc": f.get("train_acc"),
                             "num_params": rec.summary.get("num_params"), "wall_time": rec.summary.get("wall_time"),
                             "device": rec.summary.get("device"), "run": rec.run_dir.name})
                ctx.advance(f"{pe} {wtag}{depth}x{epochs} s{seed}")

    add_paired_difference(rows, REFERENCE, within=("arm",))
    stats = {k: {(s["arm"], s["pe"]): s for s in aggregate(rows, ["arm", "pe"], k)}
             for k in ("test_acc", "train_acc", f"diff_vs_{REFERENCE}", "wall_time")}
    arms_l = [_label(d, e, w) for w, d, e in grid]
    trs = []
    for arm in arms_l:
        for pe in pes:
            k = (arm, pe)
            diff = "(reference)" if pe == REFERENCE else fmt_pm(stats[f"diff_vs_{REFERENCE}"][k], 4)
            signs = "" if pe == REFERENCE else "/".join(
                f"{r[f'diff_vs_{REFERENCE}']:+.3f}" for r in rows if r["arm"] == arm and r["pe"] == pe)
            trs.append([arm, pe_label(pe), fmt_pm(stats["test_acc"][k], 4), fmt_pm(stats["train_acc"][k], 4), diff,
                        signs, f"{stats['wall_time'][k]['mean']:.0f}"])
    changes = ("the width, with as many heads as keep the head dimension" if widths else
               "the depth or the number of epochs alone, or both")
    table = (f"**Scale** — {headline(cfg)} as the reference arm; each other arm changes {changes}. Test accuracy after the last epoch, mean ± std across seeds; the difference "
             f"to {pe_label(REFERENCE)} is paired by seed (same data order), and listed seed by seed.\n\n"
             + markdown_table(["arm", "encoding", "test accuracy", "train accuracy", f"− {pe_label(REFERENCE)} "
                               "(paired)", "per seed", f"train time / run (s, {where_trained(rows)})"], trs, "llrrrlr"))
    others = [pe for pe in pes if pe not in (REFERENCE, ROTARY_REFERENCE)]
    if ROTARY_REFERENCE in pes and others:
        col = add_paired_difference(rows, ROTARY_REFERENCE, within=("arm",))
        dst = {(s["arm"], s["pe"]): s for s in aggregate(rows, ["arm", "pe"], col)}
        table += (f"\n\nThe same runs against {pe_label(ROTARY_REFERENCE)}, paired by seed:\n\n"
                  + markdown_table(["arm", "encoding", f"− {pe_label(ROTARY_REFERENCE)} (paired)", "per seed"],
                                   [[a, pe_label(pe), fmt_pm(dst[(a, pe)], 4),
                                     "/".join(f"{r[col]:+.3f}" for r in rows if r["arm"] == a and r["pe"] == pe)]
                                    for a in arms_l for pe in others], "llrl"))

    plt = setup_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    xs = list(range(len(arms_l)))
    width = 0.8 / len(pes)
    for j, pe in enumerate(pes):
        off = (j - (len(pes) - 1) / 2) * width
        st = [stats["test_acc"][(a, pe)] for a in arms_l]
        ax1.bar([x + off for x in xs], [s["mean"] for s in st], width,
                yerr=[0 if s["n"] < 2 else s["std"] for s in st], capsize=3, label=pe_label(pe))
        if pe == REFERENCE:
            continue
        d = [stats[f"diff_vs_{REFERENCE}"][(a, pe)] for a in arms_l]
        ax2.errorbar([x + off for x in xs], [s["mean"] for s in d], yerr=[0 if s["n"] < 2 else s["std"] for s in d],
                     marker="o", ms=5, capsize=3, ls="none", color=f"C{j}", label=pe_label(pe))
        for x, a in zip(xs, arms_l):
            vals = [r[f"diff_vs_{REFERENCE}"] for r in rows if r["arm"] == a and r["pe"] == pe]
            ax2.plot([x + off] * len(vals), vals, ".", color="k", ms=3)
    lo = min(r["test_acc"] for r in rows)
    ax1.set_ylim(max(0.0, lo - 0.05), min(1.0, max(r["test_acc"] for r in rows) + 0.03))
    for ax in (ax1, ax2):
        ax.set_xticks(xs, [a.replace(", ", "\n") for a in arms_l])
    ax1.set_ylabel("test accuracy (last epoch)")
    ax1.set_title("test accuracy (mean ± std)")
    ax1.legend(fontsize=8)
    ax2.axhline(0.0, color="k", lw=0.8)
    ax2.set_ylabel(f"test accuracy − {pe_label(REFERENCE)} (paired by seed)")
    ax2.set_title("rotary − APE: mean ± std, dots: seeds")
    ax2.legend(fontsize=8)
    what = "width (head dimension fixed)" if widths else "depth and training length"
    fig.suptitle(f"Scale: {what}; reference arm: {headline(cfg)}")
    fig.tight_layout()
    summary = {f"{a}/{pe}": {"test_acc": stats["test_acc"][(a, pe)],
                             f"diff_vs_{REFERENCE}": stats[f"diff_vs_{REFERENCE}"][(a, pe)]}
               for a in arms_l for pe in pes}
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig,
                      options={"arms": [list(a) for a in arm_list],
                               **({"widths": [int(w) for w in widths]} if widths else {})})
