"""SPEC §6.6 — exact vs relaxed STRING on MNIST.

Two models that differ only in ``create_pe("relaxed", exact=...)``: the *exact* configuration (commuting 2x2
generators on the active planes, ``P_sp = I_active (+) Q_null``) and the *relaxed* one (dense, non-commuting
generators and a post-rotation free to mix active and null coordinates). Reported:

* the SPEC §5 diagnostics of the trained encodings -- commutator error (absolute and relative), mixing norm,
  relative-operator error (pairs ``r, s`` uniform over the patch grid of the training images) and invariant
  residual (``rho = 1`` patch, offsets ``~ N(0, I)`` patches);
* a sweep of the global shift ``delta`` (patches, the same along both axes: a diagonal shift):
  *logit sensitivity* ``mean_x ||logits(x, r) - logits(x, r + delta)||_2`` (coordinates only, pixels unchanged)
  and *loss gap* ``loss(shifted x, r + delta) - loss(x, r)`` with the pixels shifted by ``delta * patch``
  (bilinear, zero fill) together with the coordinates.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import diagnostics
from .common import StudyContext, StudyResult, headline
from .evaluation import accuracy, coord_scale, mean_loss, predict, shift_images, token_grid
from .report import aggregate, fmt_pm, markdown_table, setup_matplotlib
from .settings import ExperimentConfig

__all__ = ["run_exact_vs_relaxed", "DEFAULT_DELTAS", "encoding_diagnostics"]

DEFAULT_DELTAS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
VARIANTS = (("exact", True), ("relaxed", False))


def encoding_diagnostics(model, sample_shape, *, num_pairs: int = 256, seed: int = 0) -> Dict[str, float]:
    """SPEC §5 diagnostics of a model's encoding(s): the worst over its distinct encoding modules."""
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


def run_exact_vs_relaxed(cfg: ExperimentConfig, out: Any, deltas: Optional[Sequence[float]] = None) -> StudyResult:
    if cfg.pes and set(cfg.pes) != {"relaxed"}:
        raise ValueError("exact-vs-relaxed compares relaxed STRING with itself (exact=True vs exact=False); "
                         "--pe does not apply")
    deltas = sorted({0.0, *(float(d) for d in (deltas or DEFAULT_DELTAS))})
    ctx = StudyContext("exact-vs-relaxed", cfg, out, total=len(VARIANTS) * len(cfg.seeds))
    diag_rows: List[Dict[str, Any]] = []
    rows: List[Dict[str, Any]] = []
    for name, exact in VARIANTS:
        for seed in cfg.seeds:
            tcfg = cfg.train_config("relaxed", seed, pe_options={"exact": exact})
            rec = ctx.run(tcfg, f"relaxed STRING ({name}) s{seed}")
            model = rec.model()
            x, y, _ = ctx.test_data(tcfg)
            p = model.cfg.patch_size
            scale = coord_scale(model, x.shape[1:])
            ref = predict(model, x, batch_size=cfg.eval_batch_size)
            loss0 = mean_loss(ref, y)
            d = encoding_diagnostics(model, x.shape[1:], seed=seed)
            diag_rows.append({"variant": name, "seed": seed, "test_acc": accuracy(ref, y), **d})
            for delta in deltas:
                if delta == 0.0:
                    moved = both = ref
                else:
                    off = torch.full((model.coord_dim,), float(delta)) * scale  # the same shift for every image
                    moved = predict(model, x, offsets=off, batch_size=cfg.eval_batch_size)
                    xs = shift_images(x, delta * p, delta * p)
                    both = predict(model, xs, offsets=off, batch_size=cfg.eval_batch_size)
                sens = torch.linalg.vector_norm(moved - ref, dim=-1)  # (N,)
                rows.append({"variant": name, "seed": seed, "delta": delta,
                             "logit_sensitivity": float(sens.mean()), "logit_sensitivity_max": float(sens.max()),
                             "loss": mean_loss(both, y), "loss_gap": mean_loss(both, y) - loss0,
                             "shifted_acc": accuracy(both, y)})
            rec.release()
            ctx.advance(f"{name} s{seed}")

    names = [n for n, _ in VARIANTS]
    metrics = [("test_acc", "test accuracy", 4, False), ("commutator_abs", "commutator error ‖[L_a, L_b]‖_F", 2, True),
               ("commutator_rel", "relative commutator error", 2, True), ("mixing_norm", "mixing norm", 2, True),
               ("relative_operator_error", "relative-operator error", 2, True),
               ("invariant_residual", "invariant residual (ρ = 1 patch)", 2, True)]
    dstats = {m: {s["variant"]: s for s in aggregate(diag_rows, ["variant"], m)} for m, *_ in metrics}
    diag_table = markdown_table(["quantity"] + [f"{n} STRING" for n in names],
                                [[label] + [fmt_pm(dstats[m][n], dig, sci=sci) for n in names]
                                 for m, label, dig, sci in metrics])
    sens = {(s["variant"], s["delta"]): s for s in aggregate(rows, ["variant", "delta"], "logit_sensitivity")}
    gap = {(s["variant"], s["delta"]): s for s in aggregate(rows, ["variant", "delta"], "loss_gap")}
    sweep_table = markdown_table(
        ["δ (patches)"] + [f"logit sensitivity, {n}" for n in names] + [f"loss gap, {n}" for n in names],
        [[f"{dl:g}"] + [fmt_pm(sens[(n, dl)], 4, sci=True) for n in names]
         + [fmt_pm(gap[(n, dl)], 4) for n in names] for dl in deltas])
    table = (f"**Exact vs relaxed STRING** — {headline(cfg)}; relaxed STRING with exact=True / exact=False, "
             f"mean ± std across seeds.\n\nDiagnostics of the trained encodings (SPEC §5):\n\n{diag_table}\n"
             f"Global shift sweep (diagonal shift δ along both axes; logit sensitivity: coordinates only; loss gap: "
             f"pixels shifted by δ × {p} px with bilinear resampling and zero fill, together with the coordinates):"
             f"\n\n{sweep_table}")

    plt = setup_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.3))
    styles = {"exact": dict(color="tab:blue", marker="o"), "relaxed": dict(color="tab:red", marker="s")}
    pos = [dl for dl in deltas if dl > 0]
    for n in names:
        st = [sens[(n, dl)] for dl in pos]
        lo = [max(s["mean"], 1e-12) for s in st]
        err = [0 if s["n"] < 2 else min(s["std"], 0.9 * s["mean"]) for s in st]  # keep the bars on a log axis
        ax1.errorbar(pos, lo, yerr=err, capsize=2, ms=4, label=f"{n} STRING", **styles[n])
        st = [gap[(n, dl)] for dl in deltas]
        ax2.errorbar(deltas, [s["mean"] for s in st], yerr=[0 if s["n"] < 2 else s["std"] for s in st], capsize=2,
                     ms=4, label=f"{n} STRING", **styles[n])
    ax1.set_yscale("log")
    ax1.axhspan(ax1.get_ylim()[0], 1e-4, color="green", alpha=0.07)
    ax1.text(pos[0], 2e-5, "float32 round-off", fontsize=8, color="green")
    ax1.set_xlim(0, max(deltas) * 1.05)
    ax1.set_xlabel("global coordinate shift δ (patches, both axes)")
    ax1.set_ylabel("mean ‖Δ logits‖₂ (log scale; 0 at δ = 0)")
    ax1.set_title("logit sensitivity (coordinates shifted, pixels fixed)")
    ax1.legend()
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set_xlabel("global shift δ (patches, both axes)")
    ax2.set_ylabel("loss(shifted) − loss(unshifted)")
    ax2.set_title("loss gap (pixels and coordinates shifted together)")
    ax2.legend()
    fig.suptitle(f"Exact vs relaxed STRING: {headline(cfg)}")
    fig.tight_layout()
    summary = {"diagnostics": {m: dstats[m] for m, *_ in metrics},
               "logit_sensitivity": {f"{n}@{dl:g}": sens[(n, dl)] for n in names for dl in deltas},
               "loss_gap": {f"{n}@{dl:g}": gap[(n, dl)] for n in names for dl in deltas}}
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig,
                      options={"deltas": deltas, "variants": {n: {"pe": "relaxed", "exact": e} for n, e in VARIANTS}},
                      extra_csv={"diagnostics.csv": diag_rows})
