"""Fine-tuning at a larger resolution, with and without a resolution scaling of the encodings' frequencies.

Each encoding is trained by the classification's recipe (MNIST: a 7x7 grid of 4-pixel patches; these are the
classification's runs of the same seeds), then fine-tuned at ``factor`` times the image size (2: 56 px, a 14x14
grid) for ``finetune_epochs`` at learning rate ``finetune_lr`` -- what ``ropekit train --init-from RUN --image-size
56 [--scaling METHOD]`` runs -- once per method of ``scalings``: ``none`` (the frequencies as trained: the new
positions extrapolate), ``pi`` (position interpolation) and ``yarn`` (YaRN's per-frequency ramp with its attention
factor), each measured from the 7x7 extent to the 14x14 one and kept during fine-tuning
(:mod:`ropekit.encodings.scaling`). Learned spectra (RoPE-Mixed, Cayley, Circulant, ComRoPE-LD) are scaled on their
RoPE form as axial RoPE is. The fine-tuned models are evaluated on the first ``eval_limit`` test digits at the
fine-tuning size; the base models at that size, with each method and no fine-tuning, are reported beside them.

Claims (declared before running; one Holm family, :mod:`ropekit_studies.verdict`), paired over seeds, on the test
accuracy after fine-tuning at the larger size:

* Position Interpolation (Chen et al. 2023, abstract and Sec. 3: RoPE models extended to 32768 tokens within 1000
  fine-tuning steps, where fine-tuning on extrapolated positions adapts slowly): per encoding ``pi - none`` > 0;
* YaRN (Peng et al. 2023, abstract: 10x fewer tokens and 2.5x fewer steps than previous methods): per encoding
  ``yarn - none`` > 0 and ``yarn - pi`` > 0.

Both papers are language-model results (context length, perplexity, passkey retrieval); here the longer context is a
larger image, and the spectra may be learned.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ropekit.classification.trainer import eval_scaling
from ropekit.encodings.scaling import SCALING_METHODS, apply_resolution_scaling, remove_resolution_scaling
from .common import StudyContext, StudyResult, headline
from .evaluation import accuracy, predict
from .registry import register_study
from .report import aggregate, fmt_pm, markdown_table, pe_label, setup_matplotlib
from .settings import ExperimentConfig
from .verdict import RULE, judge

__all__ = ["run_resolution_finetune", "FINETUNE_PES", "finetune_verdicts"]

#: The encodings the study fine-tunes (every one has a RoPE form; APE's table has no frequencies to scale).
FINETUNE_PES = ("axial", "mixed", "cayley", "circulant", "comrope-ld")

#: The papers' claims: (first method, second method, the paper's words and numbers), each claimed positive.
PAPER_CLAIMS: Tuple[Tuple[str, str, str], ...] = (
    ("pi", "none", "Position Interpolation (Chen et al. 2023): LLaMA extended to 32768 tokens within 1000 "
                   "fine-tuning steps; fine-tuning on extrapolated positions adapts slowly"),
    ("yarn", "none", "YaRN (Peng et al. 2023): context extension with 10x fewer tokens, 2.5x fewer steps than "
                     "previous methods"),
    ("yarn", "pi", "YaRN (Peng et al. 2023): above Position Interpolation at equal fine-tuning"),
)


@register_study("resolution-finetune", "fine-tuning at twice (--factor) the training size with no scaling, "
                "position interpolation or YaRN kept in place, for axial RoPE and the learned spectra",
                options=("scalings", "factor", "finetune_epochs", "finetune_lr"),
                varies=("image_size", "init_from", "epochs", "lr", "warmup_epochs", "model_options"))
def run_resolution_finetune(cfg: ExperimentConfig, out: Any, scalings: Optional[Sequence[str]] = None,
                            factor: int = 2, finetune_epochs: int = 1,
                            finetune_lr: float = 5e-4) -> StudyResult:
    """Train every encoding of ``cfg`` at its size, then fine-tune it at ``factor`` times that size with each
    method of ``scalings`` (module docstring)."""
    pes = cfg.pe_list(FINETUNE_PES)
    methods = list(scalings or ("none", "pi", "yarn"))
    bad = sorted(set(methods) - set(SCALING_METHODS))  # (none: the frequencies as trained)
    if bad:
        raise ValueError(f"unknown scaling method(s) {', '.join(bad)}; known: {', '.join(SCALING_METHODS)}")
    if "none" not in methods:
        methods = ["none"] + methods
    if int(factor) < 2:
        raise ValueError(f"factor must be an integer >= 2 (the fine-tuning size over the training size), got {factor}")
    ctx = StudyContext("resolution-finetune", cfg, out, total=len(pes) * len(cfg.seeds) * (1 + len(methods)))
    probe = cfg.train_config(pes[0], cfg.seeds[0])
    _, _, info = ctx.test_data(probe)
    size = int(info.image_size[0])
    big = size * int(factor)
    patch = int(probe.model.patch_size or 4)
    x_big, y_big, _ = ctx.test_data(probe, image_size=big)
    rows: List[Dict[str, Any]] = []
    for pe in pes:
        for seed in cfg.seeds:
            base_cfg = cfg.train_config(pe, seed)
            base = ctx.run(base_cfg, f"{pe_label(pe)} s{seed}")
            model = base.model()
            for method in methods:  # the base model at the larger size, not fine-tuned
                if method != "none":
                    apply_resolution_scaling(model, eval_scaling(method, model.cfg, base_cfg, big))
                rows.append({"stage": "zero-shot", "pe": pe, "seed": seed, "scaling": method, "image_size": big,
                             "test_acc": accuracy(predict(model, x_big, batch_size=cfg.eval_batch_size), y_big)})
                remove_resolution_scaling(model)
            base.release()
            ctx.advance(f"{pe} s{seed}")
            for method in methods:
                options = dict(cfg.model_options)
                if method != "none":
                    options["resolution_scaling"] = {"method": method}
                ft_cfg = cfg.train_config(pe, seed, image_size=big, init_from=str(base.run_dir),
                                          epochs=int(finetune_epochs), lr=float(finetune_lr), warmup_epochs=0.0,
                                          model_options=options)
                rec = ctx.run(ft_cfg, f"{pe_label(pe)} s{seed} fine-tuned at {big} px, {method}")
                rows.append({"stage": "fine-tuned", "pe": pe, "seed": seed, "scaling": method, "image_size": big,
                             "test_acc": accuracy(predict(rec.model(), x_big, batch_size=cfg.eval_batch_size),
                                                  y_big)})
                rec.release()
                ctx.advance(f"{pe} s{seed} {method}")
    options = {"pes": list(pes), "scalings": methods, "factor": int(factor), "finetune_epochs": int(finetune_epochs),
               "finetune_lr": float(finetune_lr)}
    return _report(ctx, cfg, rows, pes, methods, size, big, patch, options)


def _acc(rows: Sequence[Dict[str, Any]], stage: str, pe: str, seed: int, method: str) -> float:
    vals = [r["test_acc"] for r in rows if r["stage"] == stage and r["pe"] == pe and r["seed"] == seed
            and r["scaling"] == method]
    return float(np.mean(vals)) if vals else math.nan


def finetune_verdicts(rows: Sequence[Dict[str, Any]], pes: Sequence[str], seeds: Sequence[int]
                      ) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """The papers' claims per encoding read by the one rule (one Holm family): ``({claim: Verdict}, {claim: the
    paper's words})``; a claim whose methods did not run is left out."""
    ran = {r["scaling"] for r in rows if r["stage"] == "fine-tuned"}
    diffs: Dict[str, List[float]] = {}
    paper: Dict[str, str] = {}
    for first, second, words in PAPER_CLAIMS:
        if first not in ran or second not in ran:
            continue
        for pe in pes:
            values = [_acc(rows, "fine-tuned", pe, s, first) - _acc(rows, "fine-tuned", pe, s, second) for s in seeds]
            if all(math.isfinite(v) for v in values):
                key = f"{first} - {second}: {pe}, fine-tuned"
                diffs[key], paper[key] = values, words
    return (judge(diffs, {k: 1 for k in diffs}) if diffs else {}), paper


def _report(ctx: StudyContext, cfg: ExperimentConfig, rows: List[Dict[str, Any]], pes: Sequence[str],
            methods: Sequence[str], size: int, big: int, patch: int, options: Dict[str, Any]) -> StudyResult:
    stats = {(s["stage"], s["pe"], s["scaling"]): s for s in aggregate(rows, ["stage", "pe", "scaling"], "test_acc")}
    headers = ["encoding"] + [f"{m}, not fine-tuned" for m in methods] + [f"{m}, fine-tuned" for m in methods]
    table_rows = [[pe_label(pe)] + [fmt_pm(stats[("zero-shot", pe, m)], 3) for m in methods]
                  + [fmt_pm(stats[("fine-tuned", pe, m)], 3) for m in methods] for pe in pes]
    verdicts, paper = finetune_verdicts(rows, pes, cfg.seeds)
    claims_table = markdown_table(["claim (first − second)", "paper", "n", "mean", "verdict"],
                                  [[k, paper[k], str(v.n), f"{v.mean:+.3f}", v.word] for k, v in verdicts.items()])
    grid, big_grid = size // patch, big // patch
    table = "\n".join([
        f"**Fine-tuning at {big} px** — test accuracy at {big} px ({big_grid}x{big_grid} patches of {patch} px; "
        f"trained at {size} px, {grid}x{grid}), mean ± std across seeds. {headline(cfg)}. Fine-tuned for "
        f"{options['finetune_epochs']} epoch(s) at lr {options['finetune_lr']:g} from the trained model, the method "
        f"in place (s = {big_grid / grid:g} from the {grid}x{grid} extent); not fine-tuned: the trained model at "
        f"{big} px with the method.\n",
        markdown_table(headers, table_rows), "",
        "**The papers' claims** (one Holm family). " + RULE + "\n", claims_table])

    plt = setup_matplotlib()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        means = [stats[("fine-tuned", pe, m)]["mean"] for pe in pes]
        errs = [stats[("fine-tuned", pe, m)].get("std", 0.0) for pe in pes]
        ax.bar(np.arange(len(pes)) + (i - (len(methods) - 1) / 2) * width, means, width, yerr=errs, capsize=2,
               label=f"fine-tuned, {m}")
    for i, m in enumerate(methods):
        ax.scatter(np.arange(len(pes)) + (i - (len(methods) - 1) / 2) * width,
                   [stats[("zero-shot", pe, m)]["mean"] for pe in pes], marker="_", color="black", s=120,
                   label="not fine-tuned" if i == 0 else None, zorder=3)
    ax.set_xticks(np.arange(len(pes)))
    ax.set_xticklabels([pe_label(pe) for pe in pes], fontsize=8)
    ax.set_ylabel(f"test accuracy at {big} px")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"Fine-tuning at {big} px (trained at {size} px): {headline(cfg)}", fontsize=8)
    fig.tight_layout()
    summary = {"claims": {k: {**v.as_dict(), "paper": paper[k]} for k, v in verdicts.items()},
               "accuracy": {"/".join(k): v for k, v in stats.items()}}
    claim_rows = [{"family": "papers", "claim": k, "paper": paper[k], **v.as_dict()} for k, v in verdicts.items()]
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig, options=options,
                      extra_csv={"claims.csv": claim_rows} if claim_rows else None)
