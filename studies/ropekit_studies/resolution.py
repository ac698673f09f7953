"""Resolution extrapolation: train at one image size, evaluate at smaller and larger ones.

The patch size stays the same, so the token grid shrinks or grows (absolute embeddings are resized
bilinearly by the model). Two ways to change the size, both reported:

* ``resize`` (the protocol) -- the test images are resized (bilinear, antialiased when shrinking), so the
  digit scales with the image: more tokens *and* a larger object;
* ``pad`` -- the test images keep their pixel scale and are centred on a larger zero canvas (or cropped
  centrally), offsets rounded to whole patches: more tokens, the same object on the same patch boundaries.
  This separates token-count extrapolation from scale change.

Each encoding is trained with up to four coordinate conventions (``coord_modes``): ``grid`` (integer patch
indices, so a larger image has larger coordinates), ``normalized`` (patch centres in ``[0, 1]``, so a larger image
has a finer grid over the same range) and ``normalized+scale`` (normalised coordinates *and* scale augmentation:
every training step resizes its batch to one of ``scale_sizes``, so the model has seen several grids -- this
study's own protocol, not ComRoPE's: ComRoPE's Table 1 trains at one size with normalised coordinates perturbed
by noise of scale sigma and evaluates from half to twice the training size, which the ablation study's jitter
arms come closer to). Encodings without coordinates (``none``, ``absolute``) are trained without and, when
``normalized+scale`` is asked for, with scale augmentation (a learned table is resized to each grid). The fourth,
``normalized+jitter``, is normalised coordinates perturbed in training by Gaussian noise of ``jitter_sigma``
patches (``ViTConfig.jitter``).

``resolution-comrope`` is ComRoPE's protocol as arms of this study (its own recipe): one training size,
normalised coordinates with perturbation sigma 0 and 1 (``normalized`` and ``normalized+jitter``), ComRoPE-AP,
ComRoPE-LD (per layer and head, as ComRoPE's Table 7 counts them) and Circulant-STRING, evaluated from about half
to twice the training size (``docs/results/resolution-comrope/``). Its ComRoPE arms start as axial RoPE
(``init="rope"``, the encoding's default); ``resolution-comrope-paper`` is the same protocol with ComRoPE's own
start for normalised coordinates (random bases, ``init="normal"``, ``init_std=1``) and APE and LieRE rows.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ropekit.classification.config import auto_patch_size
from .common import StudyContext, StudyResult, headline
from .evaluation import accuracy, background_value, mean_loss, pad_or_crop, predict, token_grid
from .registry import register_study
from .report import aggregate, fmt_pm, markdown_table, pe_label, setup_matplotlib
from .settings import DEFAULT_PES, QUICK_PES, ExperimentConfig

__all__ = ["run_resolution", "run_resolution_comrope", "default_sizes", "MODES", "COORD_MODES"]

MODES = ("resize", "pad")
COORD_MODES = ("grid", "normalized", "normalized+scale", "normalized+jitter")
_NO_COORDS = ("none", "absolute", "sincos")


def default_sizes(train_size: int, patch: int, quick: bool = False) -> List[int]:
    """Training size -2..+3 patches (quick: -1..+1), sizes of at least 2 patches."""
    ks = (-1, 0, 1) if quick else (-2, -1, 0, 1, 2, 3)
    return [train_size + k * patch for k in ks if train_size + k * patch >= 2 * patch]


@register_study("resolution", "train at one size, evaluate at other sizes, grid and normalised coordinates, "
                "scale augmentation", options=("sizes", "coord_modes", "scale_sizes", "jitter_sigma"),
                varies=("pe_sharing", "coords", "augment_sizes", "jitter"))
def run_resolution(cfg: ExperimentConfig, out: Any, sizes: Optional[Sequence[int]] = None,
                   coord_modes: Optional[Sequence[str]] = None, scale_sizes: Optional[Sequence[int]] = None,
                   jitter_sigma: float = 1.0) -> StudyResult:
    """Train every encoding of ``cfg`` with each of ``coord_modes`` and evaluate it at ``sizes`` (default
    the training size -2..+3 patches), resizing and padding. ``scale_sizes``: the training image sizes of the
    ``normalized+scale`` convention (default: the training size -1..+1 patches); ``jitter_sigma``: the
    perturbation (patches) of ``normalized+jitter``."""
    return _resolution("resolution", cfg, out, sizes, coord_modes, scale_sizes, jitter_sigma)


@register_study("resolution-comrope", "ComRoPE's resolution protocol: one training size, normalised coordinates "
                "perturbed by sigma 0 or 1, evaluation at 0.5-2x", options=("sizes", "coord_modes", "scale_sizes",
                                                                            "jitter_sigma"),
                varies=("pe_sharing", "coords", "augment_sizes", "jitter"))
def run_resolution_comrope(cfg: ExperimentConfig, out: Any, sizes: Optional[Sequence[int]] = None,
                           coord_modes: Optional[Sequence[str]] = None, scale_sizes: Optional[Sequence[int]] = None,
                           jitter_sigma: float = 1.0) -> StudyResult:
    """The resolution study with ComRoPE's protocol as its recipe (module docstring)."""
    return _resolution("resolution-comrope", cfg, out, sizes, coord_modes, scale_sizes, jitter_sigma)


@register_study("resolution-comrope-paper", "ComRoPE's resolution protocol with ComRoPE's own random start (not axial "
                "RoPE's), and APE and LieRE rows", options=("sizes", "coord_modes", "scale_sizes", "jitter_sigma"),
                varies=("pe_sharing", "pe_options", "coords", "augment_sizes", "jitter"))
def run_resolution_comrope_paper(cfg: ExperimentConfig, out: Any, sizes: Optional[Sequence[int]] = None,
                                 coord_modes: Optional[Sequence[str]] = None,
                                 scale_sizes: Optional[Sequence[int]] = None,
                                 jitter_sigma: float = 1.0) -> StudyResult:
    """``resolution-comrope`` with ComRoPE started from random bases (``init="normal"``, ``init_std=1``, the
    authors' start for normalised coordinates) instead of axial RoPE, plus APE and LieRE (module docstring)."""
    return _resolution("resolution-comrope-paper", cfg, out, sizes, coord_modes, scale_sizes, jitter_sigma)


def _resolution(name: str, cfg: ExperimentConfig, out: Any, sizes: Optional[Sequence[int]],
                coord_modes: Optional[Sequence[str]], scale_sizes: Optional[Sequence[int]],
                jitter_sigma: float) -> StudyResult:
    base_pes = cfg.pe_list(QUICK_PES if cfg.quick else DEFAULT_PES)
    # An arm is named ENCODING/CONVENTION whenever conventions are chosen (by the recipe or --coord-modes), however
    # many: a re-run of one convention (``ropekit experiment verify``) must name its rows as the study did.
    named = bool(coord_modes)
    coord_modes = list(coord_modes or ("grid",))
    bad = sorted(set(coord_modes) - set(COORD_MODES))
    if bad:
        raise ValueError(f"unknown coordinate convention(s) {', '.join(bad)}; known: {', '.join(COORD_MODES)}")
    # (name in the outputs, encoding, coordinate convention)
    def no_coord_modes() -> List[str]:  # without coordinates only the augmentation can differ
        first = "grid" if coord_modes[0] == "normalized+jitter" else coord_modes[0]
        return [first] + (["normalized+scale"] if "normalized+scale" in coord_modes[1:] else [])

    variants = [(pe if not named or (pe in _NO_COORDS and cm != "normalized+scale") else f"{pe}/{cm}", pe, cm)
                for pe in base_pes for cm in (no_coord_modes() if pe in _NO_COORDS else coord_modes)]
    pes = [v[0] for v in variants]
    ctx = StudyContext(name, cfg, out, total=len(variants) * len(cfg.seeds))
    probe = cfg.train_config(base_pes[0], cfg.seeds[0])
    _, _, info = ctx.test_data(probe)
    train_size = int(info.image_size[0])
    rows: List[Dict[str, Any]] = []
    train_patch = probe.model.patch_size or auto_patch_size(info.image_size)  # as the trainer resolves it
    aug = [int(v) for v in scale_sizes] if scale_sizes else [train_size + k * train_patch for k in (-1, 0, 1)]
    patch = None
    for pe, enc, cm in variants:
        for seed in cfg.seeds:
            if cm == "normalized+scale":
                tcfg = cfg.train_config(enc, seed, coords="grid" if enc in _NO_COORDS else "normalized",
                                        augment_sizes=aug)
            elif cm == "normalized+jitter":
                tcfg = cfg.train_config(enc, seed, coords="normalized", jitter=float(jitter_sigma))
            else:
                tcfg = cfg.train_config(enc, seed, coords=cm)
            rec = ctx.run(tcfg, f"{pe_label(enc)} ({cm}) s{seed}")
            model = rec.model()
            patch = model.cfg.patch_size
            eval_sizes = list(sizes) if sizes else default_sizes(train_size, patch, cfg.quick)
            x0, y0, info0 = ctx.test_data(tcfg)
            bg = background_value(info0, x0.shape[1]).view(1, -1, 1, 1)
            for mode in MODES:
                for size in eval_sizes:
                    if mode == "resize":
                        x, y, _ = ctx.test_data(tcfg, image_size=None if size == train_size else size)
                    else:
                        x, y = pad_or_crop(x0 - bg, (size, size), align=patch) + bg, y0  # black border
                    logits = predict(model, x, batch_size=cfg.eval_batch_size)
                    grid = token_grid(model, x.shape[1:])
                    rows.append({"mode": mode, "pe": pe, "encoding": enc, "coords": cm, "seed": seed,
                                 "train_sizes": " ".join(map(str, tcfg.data.augment_sizes)) or str(train_size),
                                 "image_size": size,
                                 "grid": "x".join(map(str, grid)), "num_tokens": int(_prod(grid)),
                                 "train_size": train_size, "test_acc": accuracy(logits, y),
                                 "test_loss": mean_loss(logits, y)})
            rec.release()
            ctx.advance(f"{pe} s{seed}")

    eval_sizes = sorted({r["image_size"] for r in rows})
    keys = ["mode", "pe", "image_size"]
    stats = {(s["mode"], s["pe"], s["image_size"]): s for s in aggregate(rows, keys, "test_acc")}
    grids = {r["image_size"]: r["grid"] for r in rows}
    headers = ["encoding"] + [f"{s} px ({grids[s]}){' train' if s == train_size else ''}" for s in eval_sizes]
    what = {"resize": "test images resized to each size (the digit scales with the image)",
            "pad": "test images at their own scale, centred on a zero canvas of each size (cropped when smaller)"}
    parts = [f"**Resolution extrapolation** — trained at {train_size} px; test accuracy at each evaluation size "
             f"(patch {patch}, token grid in brackets), mean ± std across seeds. {headline(cfg)}. Coordinates: "
             f"grid = integer patch indices, normalized = patch centres in [0, 1], normalized+scale = normalised "
             f"coordinates trained with scale augmentation (each step at one of "
             f"{_scale_sizes_text(rows)} px)"
             + (f", normalized+jitter = normalised coordinates perturbed in training by N(0, {jitter_sigma:g}²) "
                f"patches" if "normalized+jitter" in coord_modes else "") + ".\n"]
    for mode in MODES:
        table_rows = [[_label(pe)] + [fmt_pm(stats[(mode, pe, s)], 3) for s in eval_sizes] for pe in pes]
        parts.append(f"*{mode}*: {what[mode]}.\n\n" + markdown_table(headers, table_rows))
    table = "\n".join(parts)

    plt = setup_matplotlib()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.9), sharey=True)
    for ax, mode in zip(axes, MODES):
        for i, pe in enumerate(pes):
            st = [stats[(mode, pe, s)] for s in eval_sizes]
            ax.errorbar([s + (i - len(pes) / 2) * 0.12 for s in eval_sizes], [v["mean"] for v in st],
                        yerr=[0 if v["n"] < 2 else v["std"] for v in st], marker="o", ms=3, capsize=2,
                        label=_label(pe), ls="--" if pe in _NO_COORDS else (
                            ":" if pe.endswith("/normalized") else "-." if pe.endswith(("+scale", "+jitter"))
                            else "-"))
        ax.axvline(train_size, color="grey", ls=":", lw=1)
        ax.set_xticks(eval_sizes, [f"{s}\n({grids[s]})" for s in eval_sizes])
        ax.set_xlabel("evaluation image size in pixels (token grid); dotted: training size")
        ax.set_title({"resize": "digits resized with the image (scale changes)",
                      "pad": "digits at training scale on a padded / cropped canvas"}[mode])
    axes[0].set_ylabel("test accuracy")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Resolution extrapolation (mean ± std): {headline(cfg)}")
    fig.tight_layout()
    summary = {f"{mode}/{pe}@{s}": stats[(mode, pe, s)] for mode in MODES for pe in pes for s in eval_sizes}
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig,
                      options={"pes": pes, "sizes": eval_sizes, "train_size": train_size, "modes": list(MODES),
                               "coord_modes": coord_modes, "scale_sizes": scale_sizes,
                               **({"jitter_sigma": jitter_sigma} if "normalized+jitter" in coord_modes else {})})


def _scale_sizes_text(rows: Sequence[Dict[str, Any]]) -> str:
    sizes = sorted({r["train_sizes"] for r in rows if r["coords"] == "normalized+scale"})
    return ", ".join(sizes).replace(" ", "/") if sizes else "(none trained)"


def _label(name: str) -> str:
    """``"mixed/normalized"`` -> ``"RoPE-Mixed (normalized)"``."""
    pe, _, cm = name.partition("/")
    return pe_label(pe) + (f" ({cm})" if cm else "")


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for v in xs:
        out *= int(v)
    return out
