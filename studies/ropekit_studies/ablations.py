"""Ablations: parameter sharing, block size, position jitter.

* ``sharing`` -- one encoding for the whole model, one per layer, or one per layer with parameters per head
  (``pe_sharing = model / layer / head``);
* ``block`` -- block size of LieRE and ComRoPE-AP/LD (2, 4, 8; LieRE also dense, ``d``) and of Circulant-STRING
  (4 ... 64 and ``d``, where the head dimension allows: the block must divide it, and ComRoPE-AP needs a whole
  number of blocks per axis);
* ``jitter`` -- position jitter ``sigma`` in {0, 1} patches during training; besides the accuracy at the
  training size, the accuracy two patches larger (resolution extrapolation, where jitter is meant to help).

Every variant changes one option of the experiment's backbone; the default variants (model sharing, the
encoding's default block, no jitter) are the same runs as the other studies' and come from the cache.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ropekit.classification import build_vit_config
from .common import StudyContext, StudyResult, headline
from .evaluation import accuracy, predict
from .registry import register_study
from .report import aggregate, fmt_pm, markdown_table, pe_label, setup_matplotlib
from .runs import memo_data
from .settings import ExperimentConfig

__all__ = ["run_ablations", "GROUPS", "block_sizes"]

GROUPS = ("sharing", "block", "jitter")
SHARING_PES = ("cayley", "liere")
JITTER_PES = ("mixed", "cayley")
BLOCK_CANDIDATES: Dict[str, Tuple[Optional[int], ...]] = {
    "liere": (2, 4, 8, None), "comrope-ap": (2, 4, 8), "comrope-ld": (2, 4, 8),
    "circulant": (4, 8, 16, 32, 64, None),
}
QUICK = {"sharing": ("mixed",), "jitter": ("mixed",), "block": {"liere": (2, None), "circulant": (4, None)}}
SHARING_MODES = ("model", "layer", "head")
JITTERS = (0.0, 1.0)


def block_sizes(pe: str, head_dim: int, coord_dim: int, candidates: Sequence[Optional[int]]) -> List[Optional[int]]:
    """The candidate block sizes that fit ``head_dim`` (``None``: one full block of ``head_dim``)."""
    out: List[Optional[int]] = []
    for b in candidates:
        if b is None:
            out.append(None)
            continue
        if b >= head_dim or head_dim % b or b % 2:
            continue  # b == head_dim is the full block, listed as None
        if pe == "comrope-ap" and (head_dim // b) % coord_dim:
            continue
        if pe == "circulant" and b < 4:
            continue  # a 2x2 circulant block has only DC and Nyquist modes: it never rotates
        out.append(b)
    return out


@register_study("ablations", "sharing for every learnable encoding, block sizes, position jitter",
                options=("groups", "sharing_pe", "block_pe", "jitter_pe", "block_sizes_"),
                varies=("pe_sharing", "per_head", "pe_options", "jitter"), varies_overrides=True)
def run_ablations(cfg: ExperimentConfig, out: Any, groups: Optional[Sequence[str]] = None,
                  sharing_pe: Optional[Sequence[str]] = None, block_pe: Optional[Sequence[str]] = None,
                  jitter_pe: Optional[Sequence[str]] = None,
                  block_sizes_: Optional[Sequence[int]] = None) -> StudyResult:
    """Args: groups (default all); sharing_pe / block_pe / jitter_pe: encodings of each group (default
    SHARING_PES, the keys of BLOCK_CANDIDATES, JITTER_PES); block_sizes_: block sizes to try (default each
    encoding's candidates; the full block ``d`` is always included for LieRE and Circulant). ``cfg.pes``, when
    given, filters every group."""
    groups = list(groups or GROUPS)
    bad = sorted(set(groups) - set(GROUPS))
    if bad:
        raise ValueError(f"unknown ablation group(s) {', '.join(bad)}; known: {', '.join(GROUPS)}")
    chosen = set(cfg.pes) if cfg.pes else None
    probe = cfg.train_config("mixed", cfg.seeds[0])
    train_ds, test_ds, info = memo_data(probe)
    vit = build_vit_config(probe, info)
    head_dim, coord_dim = vit.head_dim, vit.coord_dim
    patch = vit.patch_size

    def pick(given: Optional[Sequence[str]], default: Sequence[str], quick: Sequence[str]) -> List[str]:
        base = list(given) if given is not None else list(quick if cfg.quick else default)
        return [p for p in base if not chosen or p in chosen]

    variants: List[Dict[str, Any]] = []  # group, pe, setting label, numeric value, TrainConfig changes
    if "sharing" in groups:
        for pe in pick(sharing_pe, SHARING_PES, QUICK["sharing"]):
            if pe in ("none", "absolute", "axial"):
                continue  # nothing learnable to share
            for mode in SHARING_MODES:
                variants.append({"group": "sharing", "pe": pe, "setting": mode, "value": SHARING_MODES.index(mode),
                                 "changes": {"pe_sharing": mode}})
    if "block" in groups:
        table = dict(QUICK["block"] if cfg.quick and block_pe is None else BLOCK_CANDIDATES)
        if block_pe is not None:
            unknown = sorted(set(block_pe) - set(BLOCK_CANDIDATES))
            if unknown:
                raise ValueError(f"no block size to ablate for {', '.join(unknown)}; "
                                 f"block encodings: {', '.join(BLOCK_CANDIDATES)}")
            table = {pe: table[pe] for pe in block_pe}
        for pe, cands in table.items():
            if chosen and pe not in chosen:
                continue
            if block_sizes_:
                cands = tuple(int(b) for b in block_sizes_) + ((None,) if None in cands else ())
            for b in block_sizes(pe, head_dim, coord_dim, cands):
                opts = {} if b is None else {"block_size": b}
                variants.append({"group": "block", "pe": pe, "setting": f"b={b if b else head_dim}" +
                                 (" (d)" if b is None else ""), "value": b or head_dim,
                                 "changes": {"pe_options": opts}})
    if "jitter" in groups:
        for pe in pick(jitter_pe, JITTER_PES, QUICK["jitter"]):
            if pe in ("none", "absolute"):
                continue  # no coordinates to jitter
            for sigma in JITTERS:
                variants.append({"group": "jitter", "pe": pe, "setting": f"σ={sigma:g}", "value": sigma,
                                 "changes": {"jitter": sigma}})
    if not variants:
        raise ValueError("no ablation variant matches the chosen --pe / --groups")

    train_size = int(info.image_size[0])
    big = train_size + 2 * patch
    ctx = StudyContext("ablations", cfg, out, total=len(variants) * len(cfg.seeds))
    rows: List[Dict[str, Any]] = []
    for v in variants:
        for seed in cfg.seeds:
            tcfg = cfg.train_config(v["pe"], seed, **v["changes"])
            rec = ctx.run(tcfg, f"{pe_label(v['pe'])} {v['setting']} s{seed}")
            row = {"group": v["group"], "pe": v["pe"], "setting": v["setting"], "value": v["value"], "seed": seed,
                   "test_acc": rec.final.get("test_acc"), "num_params": rec.summary.get("num_params")}
            if v["group"] == "jitter" and vit.modality == "image":
                x, y, _ = ctx.test_data(tcfg, image_size=big)
                row[f"acc_at_{big}px"] = accuracy(predict(rec.model(), x, batch_size=cfg.eval_batch_size), y)
                rec.release()
            rows.append(row)
            ctx.advance(f"{v['group']} {v['pe']} {v['setting']} s{seed}")

    acc = {(s["group"], s["pe"], s["setting"]): s for s in aggregate(rows, ["group", "pe", "setting"], "test_acc")}
    res_key = f"acc_at_{big}px"
    res = {(s["group"], s["pe"], s["setting"]): s
           for s in aggregate([r for r in rows if res_key in r], ["group", "pe", "setting"], res_key)}
    params = {(r["group"], r["pe"], r["setting"]): r["num_params"] for r in rows}
    parts = [f"**Ablations** — {headline(cfg)}; test accuracy, mean ± std across seeds "
             f"(head dimension {head_dim}).\n"]
    titles = {"sharing": "Parameter sharing of the encoding (model: one for all layers; layer: one per layer; "
                         "head: one per layer, parameters per head)",
              "block": "Block size (b = d: one dense block)",
              "jitter": f"Position jitter σ (patches) during training; accuracy at the training size and at {big} px"}
    for group in groups:
        vs = [v for v in variants if v["group"] == group]
        if not vs:
            continue
        headers = ["encoding", "setting", "test accuracy", "parameters"] + (
            [f"accuracy at {big} px"] if group == "jitter" and res else [])
        trs = []
        for v in vs:
            k = (group, v["pe"], v["setting"])
            trs.append([pe_label(v["pe"]), v["setting"], fmt_pm(acc[k], 4), f"{params[k]:,}"]
                       + ([fmt_pm(res[k], 4)] if group == "jitter" and res else []))
        parts.append(f"{titles[group]}:\n\n" + markdown_table(headers, trs, "llrr" + "r" * (len(headers) - 4)))
    table = "\n".join(parts)

    plt = setup_matplotlib()
    present = [g for g in groups if any(v["group"] == g for v in variants)]
    fig, axes = plt.subplots(1, len(present), figsize=(5.2 * len(present), 4.4), squeeze=False)
    for ax, group in zip(axes[0], present):
        vs = [v for v in variants if v["group"] == group]
        pes = list(dict.fromkeys(v["pe"] for v in vs))
        if group == "block":
            for pe in pes:
                pts = [v for v in vs if v["pe"] == pe]
                st = [acc[(group, pe, v["setting"])] for v in pts]
                ax.errorbar([v["value"] for v in pts], [s["mean"] for s in st],
                            yerr=[0 if s["n"] < 2 else s["std"] for s in st], marker="o", ms=4, capsize=2,
                            label=pe_label(pe))
            ax.set_xscale("log", base=2)
            ticks = sorted({v["value"] for v in vs})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel(f"block size b (head dimension d = {head_dim})")
            ax.legend(fontsize=7)
        else:
            settings = list(dict.fromkeys(v["setting"] for v in vs))
            w = 0.8 / len(settings)
            for j, s in enumerate(settings):
                xs = [i + (j - (len(settings) - 1) / 2) * w for i, pe in enumerate(pes) if (group, pe, s) in acc]
                st = [acc[(group, pe, s)] for pe in pes if (group, pe, s) in acc]
                ax.bar(xs, [t["mean"] for t in st], w, yerr=[0 if t["n"] < 2 else t["std"] for t in st], capsize=3,
                       label=s if group == "sharing" else f"{s}, at {train_size} px")
                if group == "jitter" and res:
                    rs = [res[(group, pe, s)] for pe in pes if (group, pe, s) in res]
                    ax.errorbar(xs, [t["mean"] for t in rs], yerr=[0 if t["n"] < 2 else t["std"] for t in rs],
                                fmt="^", mfc=f"C{j}", mec="k", ecolor="k", ms=6, capsize=2,
                                label=f"{s}, at {big} px")  # black bars: they lie on the bar of their colour
            slant = len(pes) > 3  # seven names do not fit level
            ax.set_xticks(range(len(pes)), [pe_label(pe) for pe in pes], rotation=25 if slant else 0,
                          ha="right" if slant else "center")
            ax.set_xlabel("encoding")
            lo = min(min(r["test_acc"], r.get(res_key, 1.0)) for r in rows if r["group"] == group)
            ax.set_ylim(max(0.0, lo - 0.15), 1.08)  # the legend goes in one row above the bars, which fill the bottom
            ax.legend(fontsize=7, loc="upper center", ncol=len(ax.get_legend_handles_labels()[1]), columnspacing=0.8)
        ax.set_ylabel("test accuracy")
        ax.set_title({"sharing": "parameter sharing", "block": "block size", "jitter": "position jitter σ"}[group])
    fig.suptitle(f"Ablations (mean ± std): {headline(cfg)}")
    fig.tight_layout()
    summary = {f"{g}/{pe}/{s}": st for (g, pe, s), st in acc.items()}
    return ctx.finish(rows=rows, summary=summary, table=table, figure=fig,
                      options={"groups": groups, "sharing_pe": _listed(sharing_pe), "block_pe": _listed(block_pe),
                               "jitter_pe": _listed(jitter_pe), "block_sizes_": _listed(block_sizes_),
                               "variants": [{k: v[k] for k in ("group", "pe", "setting", "changes")}
                                                              for v in variants], "head_dim": head_dim})


def _listed(names: Optional[Sequence[Any]]) -> Optional[List[Any]]:
    """An option as the run recorded it (``None``: the study's default)."""
    return None if names is None else list(names)
