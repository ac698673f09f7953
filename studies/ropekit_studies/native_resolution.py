"""Native resolution: fixed-size against native-resolution training, evaluated from half to four times the training
size and at other aspect ratios, with and without each resolution-scaling method.

Arms (``trainings``):

* ``fixed`` -- the ordinary recipe: every training image at the data set's size (MNIST: 28 px, a 7x7 grid of
  4-pixel patches);
* ``native`` -- ``ropekit train --native-resolution`` on the same images: each image gets a token budget drawn from
  ``[min_tokens, max_tokens]`` and an aspect-ratio stretch (``aspect``: the height-to-width ratio times a
  log-uniform factor in ``[1/aspect, aspect]``), is resized to that grid and packed with others into rows of
  ``seq_len`` tokens (NaViT's patch n' pack). The learned absolute embedding cannot be packed (its table is
  resized per grid), so APE has a fixed-size arm only.

Evaluation: the first ``eval_limit`` test digits resized (bilinear, antialiased when shrinking) to square grids of
``grids`` patches per side (training grid 7: 4..28 is 0.5x..4x) and to the non-square grids ``aspect_grids``
(``"HxW"``); each model is evaluated as trained (``none``) and with each method of ``scalings`` applied to its
encoding's RoPE form (:mod:`ropekit.encodings.scaling`: position interpolation, NTK-aware, YaRN with its attention
factor, low-frequency cap), with the per-axis scale ``s_k = max(1, g_k / L)``: ``L`` the training grid side
(fixed) or the side of a square image at ``max_tokens`` (native). At or below the training extent every method is
the identity. APE has no RoPE form; its rows have ``none`` only.

Claims (declared before running; one Holm family, :mod:`ropekit_studies.verdict`), each a paired difference of
test accuracy over seeds:

* NaViT (Dehghani et al. 2023, Fig. 1 / Sec. 3.2): native-resolution training helps away from the training
  resolution -- per rotary encoding, ``native - fixed`` of the mean accuracy over the evaluation shapes other than
  the training grid, claimed > 0;
* rope-vit (Heo et al. 2024, Table: ViT-B 224 -> 384, APE 83.4 -> 82.8, axial 83.6 -> 83.9, RoPE-Mixed
  83.8 -> 84.4): at the grid closest to 384/224 = 1.71x (12 for a 7-grid), fixed-size ``axial - absolute`` and
  ``mixed - absolute`` > 0, and the change from the training grid, ``(mixed@12 - mixed@7) - (absolute@12 -
  absolute@7)`` > 0 (the paper: +0.6 against -0.6);
* ComRoPE Table 1 (accuracy across resolutions; at 224 px LD 65.49, APE 58.76): fixed-size ``comrope-ld -
  absolute``, mean over the evaluation shapes other than the training grid, > 0.

A second family reads the scaling methods (no paper number for vision; YaRN and NTK are language-model methods):
per arm and method, ``method - none`` of the mean accuracy over the rotary encodings and the grids larger than the
training extent, claimed > 0.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ropekit.encodings.scaling import SCALING_METHODS, ResolutionScaling, apply_resolution_scaling, \
    remove_resolution_scaling
from ropekit.classification.trainer import training_extent
from .common import StudyContext, StudyResult, headline
from .evaluation import accuracy, predict
from .registry import register_study
from .report import aggregate, fmt_pm, markdown_table, pe_label, setup_matplotlib
from .settings import ExperimentConfig
from .verdict import RULE, judge

__all__ = ["run_native_resolution", "NATIVE_PES", "TRAININGS", "PAPER_CLAIMS", "parse_grid", "native_verdicts"]

#: The encodings the study compares (APE: fixed-size arm only).
NATIVE_PES = ("absolute", "axial", "mixed", "cayley", "circulant", "comrope-ld")
TRAININGS = ("fixed", "native")
_NO_ROPE_FORM = ("none", "absolute", "sincos")

#: The papers' claims: (key, sign, the paper's words and numbers).
PAPER_CLAIMS: Tuple[Tuple[str, int, str], ...] = (
    ("native - fixed: {pe}, off-training shapes", 1,
     "NaViT: native-resolution training helps at other resolutions (NaViT Fig. 1, Sec. 3.2)"),
    ("axial - absolute at 1.71x (fixed)", 1, "rope-vit ViT-B 224->384: axial 83.9, APE 82.8"),
    ("mixed - absolute at 1.71x (fixed)", 1, "rope-vit ViT-B 224->384: RoPE-Mixed 84.4, APE 82.8"),
    ("mixed - absolute, change 1x->1.71x (fixed)", 1,
     "rope-vit ViT-B 224->384: RoPE-Mixed +0.6 (83.8->84.4), APE -0.6 (83.4->82.8)"),
    ("comrope-ld - absolute, off-training shapes (fixed)", 1,
     "ComRoPE Table 1 (accuracy across resolutions): at 224 px LD 65.49, APE 58.76"),
)


def parse_grid(text: Any) -> Tuple[int, int]:
    """``"5x10"`` -> ``(5, 10)``; an int ``g`` -> ``(g, g)``; ``ValueError`` otherwise."""
    if isinstance(text, (list, tuple)) and len(text) == 2:
        gh, gw = int(text[0]), int(text[1])
    elif isinstance(text, int) and not isinstance(text, bool):
        gh = gw = int(text)
    else:
        parts = str(text).lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"a grid is HxW in patches (e.g. 5x10), got {text!r}")
        gh, gw = int(parts[0]), int(parts[1])
    if gh < 1 or gw < 1:
        raise ValueError(f"a grid needs at least one patch per side, got {text!r}")
    return gh, gw


def _resize(x: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    if tuple(x.shape[-2:]) == size:
        return x
    shrink = size[0] < x.shape[-2] or size[1] < x.shape[-1]
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=shrink)


@register_study("native-resolution", "fixed-size vs native-resolution (packed, mixed aspect ratios) training, "
                "evaluated at 0.5-4x and other aspect ratios, with and without resolution scaling (PI, NTK, YaRN, "
                "cap)", options=("grids", "aspect_grids", "scalings", "trainings", "native_options"),
                varies=("native_resolution", "native_options"))
def run_native_resolution(cfg: ExperimentConfig, out: Any, grids: Optional[Sequence[int]] = None,
                          aspect_grids: Optional[Sequence[str]] = None, scalings: Optional[Sequence[str]] = None,
                          trainings: Optional[Sequence[str]] = None,
                          native_options: Optional[Dict[str, Any]] = None) -> StudyResult:
    """Train every encoding of ``cfg`` with each of ``trainings`` and evaluate each model at the square ``grids``
    (patches per side) and ``aspect_grids`` (``"HxW"``) with each of ``scalings`` (module docstring).
    ``native_options``: the native arm's :class:`~ropekit.data.native.NativeOptions` fields."""
    pes = cfg.pe_list(NATIVE_PES)
    trainings = list(trainings or TRAININGS)
    scalings = list(scalings or SCALING_METHODS)
    native_options = dict(native_options or {})
    for what, got, known in (("training", trainings, TRAININGS), ("scaling method", scalings, SCALING_METHODS)):
        bad = sorted(set(got) - set(known))
        if bad:
            raise ValueError(f"unknown {what}(s) {', '.join(bad)}; known: {', '.join(known)}")
    if "none" not in scalings:
        scalings = ["none"] + scalings
    arms = [(t, pe) for t in trainings for pe in pes if not (t == "native" and pe in _NO_ROPE_FORM)]
    ctx = StudyContext("native-resolution", cfg, out, total=len(arms) * len(cfg.seeds))
    probe = cfg.train_config(pes[0], cfg.seeds[0])
    x0, y0, info = ctx.test_data(probe)
    patch = int(probe.model.patch_size or 4)
    train_grid = (int(info.image_size[0]) // patch, int(info.image_size[1]) // patch)
    grids = [int(g) for g in (grids or [4, 7, 10, 12, 14, 21, 28])]
    aspect_grids = [str(g) for g in (aspect_grids or [])]
    shapes = [parse_grid(g) for g in grids] + [parse_grid(g) for g in aspect_grids]
    shapes = list(dict.fromkeys(shapes))
    rows: List[Dict[str, Any]] = []
    for training, pe in arms:
        for seed in cfg.seeds:
            if training == "native":
                tcfg = cfg.train_config(pe, seed, native_resolution=True, native_options=native_options)
            else:
                tcfg = cfg.train_config(pe, seed)
            rec = ctx.run(tcfg, f"{pe_label(pe)} ({training}) s{seed}")
            model = rec.model()
            # the side of the training grid, or of a square at the native run's largest token budget
            extent = float(max(training_extent(model.cfg, tcfg))) if training == "native" else float(max(train_grid))
            for shape in shapes:
                x = _resize(x0, (shape[0] * patch, shape[1] * patch))
                scale = [max(1.0, g / extent) for g in shape]
                for method in scalings if pe not in _NO_ROPE_FORM else ["none"]:
                    if method != "none":
                        apply_resolution_scaling(model, ResolutionScaling(method, scale=scale, train_extent=extent))
                    logits = predict(model, x, batch_size=cfg.eval_batch_size)
                    remove_resolution_scaling(model)
                    rows.append({"training": training, "pe": pe, "seed": seed, "scaling": method,
                                 "grid": f"{shape[0]}x{shape[1]}", "grid_h": shape[0], "grid_w": shape[1],
                                 "num_tokens": shape[0] * shape[1], "train_grid": f"{train_grid[0]}x{train_grid[1]}",
                                 "train_extent": extent, "scale": max(scale), "test_acc": accuracy(logits, y0)})
            rec.release()
            ctx.advance(f"{pe} {training} s{seed}")
    options = {"pes": list(pes), "trainings": trainings, "scalings": scalings, "grids": grids,
               "aspect_grids": aspect_grids, "native_options": native_options}
    return _report(ctx, cfg, rows, pes, trainings, scalings, shapes, train_grid, patch, options)


def _acc(rows: Sequence[Dict[str, Any]], training: str, pe: str, seed: int, method: str = "none",
         keep: Any = None) -> float:
    vals = [r["test_acc"] for r in rows if r["training"] == training and r["pe"] == pe and r["seed"] == seed
            and r["scaling"] == method and (keep is None or keep(r))]
    return float(np.mean(vals)) if vals else math.nan


def claim_diffs(rows: Sequence[Dict[str, Any]], pes: Sequence[str], seeds: Sequence[int],
                train_grid: Tuple[int, int]) -> Tuple[Dict[str, List[float]], Dict[str, int], Dict[str, str]]:
    """The papers' claims as per-seed differences ``(diffs, signs, paper)``; a claim whose arms did not run is left
    out."""
    tg = f"{train_grid[0]}x{train_grid[1]}"
    off = lambda r: r["grid"] != tg  # noqa: E731
    grids = sorted({(r["grid_h"], r["grid_w"]) for r in rows if r["grid_h"] == r["grid_w"]})
    target = 384 / 224 * train_grid[0]
    near = min(grids, key=lambda g: abs(g[0] - target))[0] if grids else None
    at = lambda g: (lambda r: r["grid"] == f"{g}x{g}")  # noqa: E731
    have = {(r["training"], r["pe"]) for r in rows}
    diffs: Dict[str, List[float]] = {}
    signs: Dict[str, int] = {}
    paper: Dict[str, str] = {}

    def add(key: str, sign: int, text: str, values: List[float]) -> None:
        if values and all(math.isfinite(v) for v in values):
            diffs[key], signs[key], paper[key] = values, sign, text

    navit, ax, mx, change, comrope = PAPER_CLAIMS
    for pe in pes:
        if ("native", pe) in have and ("fixed", pe) in have:
            add(navit[0].format(pe=pe), navit[1], navit[2],
                [_acc(rows, "native", pe, s, keep=off) - _acc(rows, "fixed", pe, s, keep=off) for s in seeds])
    if ("fixed", "absolute") in have and near is not None and near != train_grid[0]:
        for pe, claim in (("axial", ax), ("mixed", mx)):
            if ("fixed", pe) in have:
                add(claim[0], claim[1], claim[2], [_acc(rows, "fixed", pe, s, keep=at(near))
                                                   - _acc(rows, "fixed", "absolute", s, keep=at(near)) for s in seeds])
        if ("fixed", "mixed") in have:
            def delta(pe: str, s: int) -> float:
                return _acc(rows, "fixed", pe, s, keep=at(near)) - _acc(rows, "fixed", pe, s, keep=at(train_grid[0]))
            add(change[0], change[1], change[2], [delta("mixed", s) - delta("absolute", s) for s in seeds])
    if ("fixed", "absolute") in have and ("fixed", "comrope-ld") in have:
        add(comrope[0], comrope[1], comrope[2], [_acc(rows, "fixed", "comrope-ld", s, keep=off)
                                                 - _acc(rows, "fixed", "absolute", s, keep=off) for s in seeds])
    return diffs, signs, paper


def scaling_diffs(rows: Sequence[Dict[str, Any]], seeds: Sequence[int], trainings: Sequence[str],
                  scalings: Sequence[str]) -> Dict[str, List[float]]:
    """Per arm and method: ``method - none`` of the mean accuracy over the rotary encodings and the shapes beyond
    the training extent (``scale > 1``), per seed."""
    out: Dict[str, List[float]] = {}
    for training in trainings:
        pes = sorted({r["pe"] for r in rows if r["training"] == training and r["pe"] not in _NO_ROPE_FORM})
        big = lambda r: r["scale"] > 1.0  # noqa: E731
        for method in scalings:
            if method == "none" or not pes:
                continue
            vals = [float(np.mean([_acc(rows, training, pe, s, method, big) - _acc(rows, training, pe, s, "none", big)
                                   for pe in pes])) for s in seeds]
            if all(math.isfinite(v) for v in vals):
                out[f"{method} - none ({training}), beyond the training extent"] = vals
    return out


def native_verdicts(rows: Sequence[Dict[str, Any]], pes: Sequence[str], seeds: Sequence[int],
                    train_grid: Tuple[int, int], trainings: Sequence[str],
                    scalings: Sequence[str]) -> Tuple[Dict[str, Any], Dict[str, str], Dict[str, Any]]:
    """The study's two Holm families read by the one rule: ``(claims, paper, scaling)``, the papers' claims
    (:func:`claim_diffs`) and each scaling method against none (:func:`scaling_diffs`, claimed positive), as
    ``{claim: Verdict}``, and the paper's words per claim."""
    diffs, signs, paper = claim_diffs(rows, pes, seeds, train_grid)
    sdiffs = scaling_diffs(rows, seeds, trainings, scalings)
    return (judge(diffs, signs) if diffs else {}), paper, (judge(sdiffs, {k: 1 for k in sdiffs}) if sdiffs else {})


def _verdict_rows(verdicts: Dict[str, Any], paper: Dict[str, str]) -> List[List[str]]:
    return [[key, paper.get(key, "-"), str(v.n), f"{v.mean:+.3f}", v.word] for key, v in verdicts.items()]


def _report(ctx: StudyContext, cfg: ExperimentConfig, rows: List[Dict[str, Any]], pes: Sequence[str],
            trainings: Sequence[str], scalings: Sequence[str], shapes: Sequence[Tuple[int, int]],
            train_grid: Tuple[int, int], patch: int, options: Dict[str, Any]) -> StudyResult:
    stats = {(s["training"], s["pe"], s["scaling"], s["grid"]): s
             for s in aggregate(rows, ["training", "pe", "scaling", "grid"], "test_acc")}
    names = [f"{h}x{w}" for h, w in shapes]
    tg = f"{train_grid[0]}x{train_grid[1]}"
    headers = ["training", "encoding", "scaling"] + [f"{g}{' (train)' if g == tg else ''}" for g in names]
    table_rows = []
    for training in trainings:
        for pe in pes:
            for method in scalings:
                if (training, pe, method, names[0]) in stats:
                    table_rows.append([training, pe_label(pe), method]
                                      + [fmt_pm(stats[(training, pe, method, g)], 3) for g in names])
    verdicts, paper, sverdicts = native_verdicts(rows, pes, cfg.seeds, train_grid, trainings, scalings)
    claims_table = markdown_table(["claim (first − second)", "paper", "n", "mean", "verdict"],
                                  _verdict_rows(verdicts, paper))
    scaling_table = markdown_table(["method − none", "paper", "n", "mean", "verdict"],
                                   _verdict_rows(sverdicts, {}))
    native_text = ", ".join(f"{k}={v}" for k, v in sorted(options["native_options"].items())) or "defaults"
    table = "\n".join([
        f"**Native resolution** — test accuracy at each evaluation grid (patches of {patch} px; training grid {tg}), "
        f"mean ± std across seeds. {headline(cfg)}. fixed: every training image at {tg}; native: packed, each image "
        f"at a sampled token budget and aspect ratio ({native_text}). Scaling: none, pi (position interpolation), "
        f"ntk, yarn (with its attention factor), cap (low-frequency cap), at s = max(1, grid side / training "
        f"extent) per axis.\n",
        markdown_table(headers, table_rows), "",
        "**The papers' claims** (one Holm family). " + RULE + "\n", claims_table, "",
        "**Scaling methods** (a second family: each method against none, mean over the rotary encodings at the "
        "grids beyond the training extent).\n", scaling_table])

    plt = setup_matplotlib()
    squares = [g for g in names if g.split("x")[0] == g.split("x")[1]]
    fig, axes = plt.subplots(1, len(trainings), figsize=(6.5 * len(trainings), 4.6), sharey=True, squeeze=False)
    for ax, training in zip(axes[0], trainings):
        for pe in pes:
            if (training, pe, "none", squares[0]) not in stats:
                continue
            ax.errorbar([int(g.split("x")[0]) for g in squares],
                        [stats[(training, pe, "none", g)]["mean"] for g in squares], marker="o", ms=3,
                        label=pe_label(pe))
        ax.axvline(train_grid[0], color="grey", ls=":", lw=1)
        ax.set_xlabel("evaluation grid side (patches); dotted: training grid")
        ax.set_title(f"{training} training, no scaling")
    axes[0][0].set_ylabel("test accuracy")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Native resolution: {headline(cfg)}")
    fig.tight_layout()
    summary = {"claims": {k: {**v.as_dict(), "paper": paper[k]} for k, v in verdicts.items()},
               "scaling": {k: v.as_dict() for k, v in sverdicts.items()},
               "accuracy": {"/".join(k): v for k, v in stats.items()}}
    claim_rows = [{"family": "papers", "claim": k, "paper": paper[k], **v.as_dict()} for k, v in verdicts.items()] + \
                 [{"family": "scaling", "claim": k, "paper": "", **v.as_dict()} for k, v in sverdicts.items()]
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig,
                      options={**options, "train_grid": tg},
                      extra_csv={"claims.csv": claim_rows} if claim_rows else None)
