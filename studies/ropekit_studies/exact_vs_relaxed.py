"""Exact vs relaxed STRING on MNIST.

Two models that differ only in ``create_pe("relaxed", exact=...)``: the *exact* configuration (commuting 2x2
generators on the active planes, ``P_sp = I_active (+) Q_null``) and the *relaxed* one (dense, non-commuting
generators and a post-rotation free to mix active and null coordinates). The recipe makes every dimension
active in both (``active_planes = head_dim / 2``), so they rotate the same number of dimensions and differ only
in the commuting constraint and the free post-rotation. The option ``partial_planes`` (e.g. ``8`` of ``d / 2 =
16``) adds relaxed models with only that many active planes (the rest of the head dimension passes unrotated, as
STRING's relaxed variant allows), named ``relaxed-K``; the recipe trains none. Reported:

* the exactness diagnostics of the trained encodings -- commutator error (absolute and relative), mixing norm,
  relative-operator error (pairs ``r, s`` uniform over the patch grid of the training images) and invariant
  residual (``rho = 1`` patch, offsets ``~ N(0, I)`` patches);
* *logit sensitivity* ``mean_x ||logits(x, r) - logits(x, r + delta)||_2`` for coordinate shifts ``delta``
  (patches, both axes; pixels unchanged): what an offset of the coordinates alone does;
* *loss gap* under whole-patch translations of the content: every test image is placed on a background canvas
  ``canvas_pad`` patches wider on each side, and its content moved by ``k`` whole patches along both axes
  (``k`` in ``shifts``). The tokens are then exactly the unshifted tokens at grid positions ``+k`` (no
  resampling: the earlier bilinear sub-patch shifts measured interpolation, not the encoding), and the
  coordinates stay the canvas grid. Gap = ``loss(content moved by k) - loss(content at k = 0)`` on the same
  canvas, so the canvas size affects both terms alike. Offset semantics: a token's coordinate is its place on
  the canvas, so moving the content by ``k`` patches adds ``k`` to the coordinate of every content token. The
  exact model depends only on coordinate differences, so only the content's relation to the background tokens
  changes; the relaxed model also depends on the absolute coordinates ``r + k`` themselves.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from ropekit import diagnostics
from .common import StudyContext, StudyResult, headline
from .evaluation import accuracy, background_value, coord_scale, mean_loss, predict, token_grid
from .registry import register_study
from .report import aggregate, fmt_pm, markdown_table, setup_matplotlib
from .settings import ExperimentConfig

__all__ = ["run_exact_vs_relaxed", "DEFAULT_DELTAS", "DEFAULT_SHIFTS", "encoding_diagnostics", "canvas_shift"]

DEFAULT_DELTAS = (0.25, 0.5, 1.0, 2.0)
DEFAULT_SHIFTS = (0, 1, 2)


def canvas_shift(x: torch.Tensor, patch: int, pad: int, k: int, background: torch.Tensor) -> torch.Tensor:
    """Place images ``x`` ``(N, C, H, W)`` on a canvas ``pad`` patches wider on each side, filled with
    ``background`` ``(C,)`` (the value of an empty pixel after normalisation), with the content moved by ``k``
    whole patches down and right. Returns ``(N, C, H + 2 pad p, W + 2 pad p)``; integer moves are exact.

    Raises:
        ValueError: ``|k| > pad`` (the content would leave the canvas).
    """
    if abs(int(k)) > int(pad):
        raise ValueError(f"a shift of {k} patches leaves a canvas padded by {pad} patches")
    h, w = x.shape[-2:]
    o = (int(pad) + int(k)) * int(patch)  # top-left corner of the content, in pixels
    canvas = background.to(x.dtype).view(1, -1, 1, 1).expand(x.shape[0], x.shape[1], h + 2 * pad * patch,
                                                             w + 2 * pad * patch).clone()
    canvas[..., o:o + h, o:o + w] = x
    return canvas


VARIANTS = (("exact", True), ("relaxed", False))


def encoding_diagnostics(model, sample_shape, *, num_pairs: int = 256, seed: int = 0) -> Dict[str, float]:
    """Exactness diagnostics of a model's encoding(s): the worst over its distinct encoding modules."""
    grid = token_grid(model, sample_shape)
    scale = coord_scale(model, sample_shape).double()
    g = torch.Generator().manual_seed(seed)
    extent = torch.tensor([max(1, n - 1) for n in grid], dtype=torch.float64) * scale[:len(grid)]
    r = torch.rand(num_pairs, len(grid), generator=g, dtype=torch.float64) * extent
    s = torch.rand(num_pairs, len(grid), generator=g, dtype=torch.float64) * extent
    out = {"commutator_abs": 0.0, "commutator_rel": 0.0, "mixing_norm": 0.0, "relative_operator_error": 0.0,
           "invariant_residual": 0.0}
    for pe in model.encodings:
        comm = diagnostics.commutator_error(pe)
        out["commutator_abs"] = max(out["commutator_abs"], comm["abs"])
        out["commutator_rel"] = max(out["commutator_rel"], comm["rel"])
        out["mixing_norm"] = max(out["mixing_norm"], diagnostics.mixing_norm(pe))
        out["relative_operator_error"] = max(out["relative_operator_error"],
                                             diagnostics.relative_operator_error(pe, r, s))
        out["invariant_residual"] = max(out["invariant_residual"], diagnostics.invariant_residual(
            pe, rho=float(scale[0]), delta_std=float(scale[0]), generator=torch.Generator().manual_seed(seed)))
    return out


@register_study("exact-vs-relaxed", "relaxed STRING exact=True vs exact=False, whole-patch shifts on a "
                "padded canvas", options=("shifts", "canvas_pad", "deltas", "partial_planes"), varies=("pe_options",))
def run_exact_vs_relaxed(cfg: ExperimentConfig, out: Any, deltas: Optional[Sequence[float]] = None,
                         shifts: Optional[Sequence[int]] = None, canvas_pad: int = 2,
                         partial_planes: Optional[Sequence[int]] = None) -> StudyResult:
    """Train relaxed STRING exact and relaxed over ``cfg.seeds`` (and relaxed with each of ``partial_planes``
    active planes); diagnostics, logit sensitivity to coordinate shifts ``deltas`` and the loss gap under
    whole-patch content shifts ``shifts`` on a canvas padded by ``canvas_pad`` patches (see the module
    docstring)."""
    if cfg.pes and set(cfg.pes) != {"relaxed"}:
        raise ValueError("exact-vs-relaxed compares relaxed STRING with itself (exact=True vs exact=False); "
                         "--pe does not apply")
    deltas = sorted({float(d) for d in (deltas or DEFAULT_DELTAS) if float(d) != 0.0})
    shifts = sorted({0, *(int(k) for k in (shifts or DEFAULT_SHIFTS))})
    pad = int(canvas_pad)
    if pad < max(abs(k) for k in shifts):
        raise ValueError(f"canvas_pad={pad} patches is smaller than the largest shift {max(shifts)}")
    base_opts = dict(cfg.train_options.get("pe_options", {}))
    full = base_opts.get("active_planes")
    bad = [k for k in (partial_planes or []) if int(k) < 1 or (full is not None and int(k) >= int(full))]
    if bad:
        raise ValueError(f"partial_planes {bad}: each must be at least 1 and below the recipe's {full} active planes")
    variants = [(n, {"exact": e}) for n, e in VARIANTS] + [
        (f"relaxed-{int(k)}", {"exact": False, "active_planes": int(k)}) for k in (partial_planes or [])]
    ctx = StudyContext("exact-vs-relaxed", cfg, out, total=len(variants) * len(cfg.seeds))
    diag_rows: List[Dict[str, Any]] = []
    rows: List[Dict[str, Any]] = []
    sens_rows: List[Dict[str, Any]] = []
    for name, opts in variants:
        for seed in cfg.seeds:
            tcfg = cfg.train_config("relaxed", seed, pe_options={**base_opts, **opts})
            rec = ctx.run(tcfg, f"relaxed STRING ({name}) s{seed}")
            model = rec.model()
            x, y, info = ctx.test_data(tcfg)
            p = model.cfg.patch_size
            scale = coord_scale(model, x.shape[1:])
            ref = predict(model, x, batch_size=cfg.eval_batch_size)
            d = encoding_diagnostics(model, x.shape[1:], seed=seed)
            diag_rows.append({"variant": name, "seed": seed, "test_acc": accuracy(ref, y),
                              "active_dims": int(model.encodings[0].active_dim), "head_dim": model.cfg.head_dim, **d})
            for delta in deltas:
                off = torch.full((model.coord_dim,), float(delta)) * scale  # the same shift for every image
                sens = torch.linalg.vector_norm(predict(model, x, offsets=off, batch_size=cfg.eval_batch_size) - ref,
                                                dim=-1)  # (N,)
                sens_rows.append({"variant": name, "seed": seed, "delta": delta,
                                  "logit_sensitivity": float(sens.mean()), "logit_sensitivity_max": float(sens.max())})
            bg = background_value(info, x.shape[1])
            base = predict(model, canvas_shift(x, p, pad, 0, bg), batch_size=cfg.eval_batch_size)
            loss0 = mean_loss(base, y)
            for k in shifts:
                moved = base if k == 0 else predict(model, canvas_shift(x, p, pad, k, bg),
                                                    batch_size=cfg.eval_batch_size)
                change = torch.linalg.vector_norm(moved - base, dim=-1)
                rows.append({"variant": name, "seed": seed, "shift": k, "canvas_pad": pad,
                             "loss": mean_loss(moved, y), "loss_gap": mean_loss(moved, y) - loss0,
                             "canvas_acc": accuracy(moved, y), "logit_change": float(change.mean())})
            rec.release()
            ctx.advance(f"{name} s{seed}")

    names = [n for n, _ in variants]
    metrics = [("test_acc", "test accuracy", 4, False),
               ("commutator_abs", "commutator error ‖[L_a, L_b]‖_F", 2, True),
               ("commutator_rel", "relative commutator error", 2, True), ("mixing_norm", "mixing norm", 2, True),
               ("relative_operator_error", "relative-operator error", 2, True),
               ("invariant_residual", "invariant residual (ρ = 1 patch)", 2, True)]
    dstats = {m: {s["variant"]: s for s in aggregate(diag_rows, ["variant"], m)} for m, *_ in metrics}
    diag_table = markdown_table(["quantity"] + [f"{n} STRING" for n in names],
                                [[label] + [fmt_pm(dstats[m][n], dig, sci=sci) for n in names]
                                 for m, label, dig, sci in metrics])
    sens = {(s["variant"], s["delta"]): s for s in aggregate(sens_rows, ["variant", "delta"], "logit_sensitivity")}
    gap = {(s["variant"], s["shift"]): s for s in aggregate(rows, ["variant", "shift"], "loss_gap")}
    cacc = {(s["variant"], s["shift"]): s for s in aggregate(rows, ["variant", "shift"], "canvas_acc")}
    # paired by seed: relaxed minus exact at each shift
    paired = [{"shift": k, "seed": sd, "diff": next(r["loss_gap"] for r in rows if r["variant"] == "relaxed"
                                                     and r["shift"] == k and r["seed"] == sd)
               - next(r["loss_gap"] for r in rows if r["variant"] == "exact" and r["shift"] == k and r["seed"] == sd)}
              for k in shifts for sd in cfg.seeds]
    pdiff = {s["shift"]: s for s in aggregate(paired, ["shift"], "diff")}
    sens_table = markdown_table(["δ (patches)"] + [f"logit sensitivity, {n}" for n in names],
                                [[f"{dl:g}"] + [fmt_pm(sens[(n, dl)], 4, sci=True) for n in names] for dl in deltas])
    gap_table = markdown_table(
        ["shift k (patches)"] + [f"loss gap, {n}" for n in names] + ["relaxed − exact (paired)"]
        + [f"accuracy, {n}" for n in names],
        [[f"{k:d}"] + [fmt_pm(gap[(n, k)], 4) for n in names] + [fmt_pm(pdiff[k], 4)]
         + [fmt_pm(cacc[(n, k)], 3) for n in names] for k in shifts])
    partial = "".join(f"; relaxed-{k}: relaxed with {2 * int(k)} of {diag_rows[0]['head_dim']} dimensions active"
                      for k in (partial_planes or []))
    table = (f"**Exact vs relaxed STRING** — {headline(cfg)}; relaxed STRING with exact=True / exact=False, both "
             f"with all {diag_rows[0]['active_dims']} of {diag_rows[0]['head_dim']} dimensions active{partial}; "
             f"mean ± std across seeds.\n\nDiagnostics of the trained encodings:\n\n{diag_table}\n"
             f"Logit sensitivity to a coordinate shift δ along both axes (pixels unchanged):\n\n{sens_table}\n"
             f"Loss gap under whole-patch content shifts: images on a background canvas padded by {pad} patches per "
             f"side, content moved by k patches along both axes (exact, no resampling); coordinates are canvas "
             f"positions, so every content token's coordinate grows by k. Gap = loss(k) − loss(0) on the same "
             f"canvas:\n\n{gap_table}")

    plt = setup_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.3))
    styles = {"exact": dict(color="tab:blue", marker="o"), "relaxed": dict(color="tab:red", marker="s"),
              **{n: dict(marker="^") for n in names[2:]}}
    pos = [dl for dl in deltas if dl > 0]
    for n in names:
        st = [sens[(n, dl)] for dl in pos]
        lo = [max(s["mean"], 1e-12) for s in st]
        err = [0 if s["n"] < 2 else min(s["std"], 0.9 * s["mean"]) for s in st]  # keep the bars on a log axis
        ax1.errorbar(pos, lo, yerr=err, capsize=2, ms=4, label=f"{n} STRING", **styles[n])
        st = [gap[(n, k)] for k in shifts]
        ax2.errorbar(shifts, [s["mean"] for s in st], yerr=[0 if s["n"] < 2 else s["std"] for s in st], capsize=2,
                     ms=4, label=f"{n} STRING", **styles[n])
    ax1.set_yscale("log")
    ax1.axhspan(ax1.get_ylim()[0], 1e-4, color="green", alpha=0.07)
    ax1.text(pos[0], 2e-5, "float32 round-off", fontsize=8, color="green")
    ax1.set_xlim(0, max(deltas) * 1.05)
    ax1.set_xlabel("coordinate shift δ (patches, both axes)")
    ax1.set_ylabel("mean ‖Δ logits‖₂ (log scale)")
    ax1.set_title("logit sensitivity (coordinates shifted, pixels fixed)")
    ax1.legend()
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set_xticks(shifts)
    ax2.set_xlabel(f"content shift k (whole patches, both axes; canvas padded by {pad})")
    ax2.set_ylabel("loss(k) − loss(0)")
    ax2.set_title("loss gap (content moved on the canvas, exact)")
    ax2.legend()
    fig.suptitle(f"Exact vs relaxed STRING: {headline(cfg)}")
    fig.tight_layout()
    summary = {"diagnostics": {m: dstats[m] for m, *_ in metrics},
               "logit_sensitivity": {f"{n}@{dl:g}": sens[(n, dl)] for n in names for dl in deltas},
               "loss_gap": {f"{n}@{k:d}": gap[(n, k)] for n in names for k in shifts},
               "loss_gap_relaxed_minus_exact": {f"{k:d}": pdiff[k] for k in shifts}}
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig,
                      options={"deltas": deltas, "shifts": shifts, "canvas_pad": pad,
                               "variants": {n: {"pe": "relaxed", **o} for n, o in variants}},
                      extra_csv={"diagnostics.csv": diag_rows, "sensitivity.csv": sens_rows})

