"""The detect3d study's tables: per-arm summaries over seeds, paired differences and the markdown grids of its
report (``ropekit_studies.detection`` trains and evaluates the runs)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ropekit.detection.model import depth_input_of, is_rotary

__all__ = ["INPUT_LABELS", "METRICS", "ERRORS", "DEPTH_AS", "depth_label", "summarise", "paired_differences",
           "grid_table", "markdown_table"]

#: Column titles: the paper's ViT and ViTD, and the two ablations of ViTD.
INPUT_LABELS = {"rgb": "ViT (RGB)", "rgbd": "ViTD (depth as input + coordinate)", "rgbd-channel": "depth as input only",
                "rgbd-coord": "depth as coordinate only"}
METRICS = ("mean_iou", "mAP@0.25", "mAP@0.5")
ERRORS = ("lateral_err", "depth_err", "size_err", "rot_err_deg", "class_acc")


#: How depth reaches the backbone, by its ``depth_input`` (``None``: an RGB model).
DEPTH_AS = {None: "-", "both": "input + coordinate", "channel": "input", "coord": "coordinate"}


def depth_label(enc: str, inp: str) -> str:
    """How depth reaches the model: ``-`` (RGB), ``input + coordinate``, ``input`` or ``coordinate``."""
    return DEPTH_AS[depth_input_of(enc, inp)]


def summarise(runs: Sequence[Dict[str, Any]], encodings: Sequence[str], inputs: Sequence[str]) -> List[Dict[str, Any]]:
    """Per encoding × input: ``<metric>_mean``, ``<metric>_std`` (sample std over seeds, 0 for one seed),
    ``<metric>_best``, ``<metric>_min``, the means of the error breakdown and of the learning-curve summary
    (:func:`curve_summary`), the best seed by mean IoU and the number of seeds."""
    out = []
    for enc in encodings:
        for inp in inputs:
            rs = [r for r in runs if r["encoding"] == enc and r["input"] == inp]
            if not rs:
                continue
            s: Dict[str, Any] = {"encoding": enc, "input": inp, "depth_as": rs[0]["depth_as"], "seeds": len(rs)}
            for m in METRICS:
                v = np.array([r[m] for r in rs], float)
                s[f"{m}_mean"] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
                s[f"{m}_std"] = float(np.nanstd(v, ddof=1)) if np.isfinite(v).sum() > 1 else 0.0
                s[f"{m}_best"] = float(np.nanmax(v)) if np.isfinite(v).any() else float("nan")
                s[f"{m}_min"] = float(np.nanmin(v)) if np.isfinite(v).any() else float("nan")
            for m in ERRORS + ("depth_err_const", "val_iou_final", "val_iou_last_quarter"):
                v = np.array([r.get(m, np.nan) for r in rs], float)
                s[f"{m}_mean"] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
            s["best_seed"] = int(max(rs, key=lambda r: r["mean_iou"])["seed"])
            out.append(s)
    return out


def paired_differences(runs: Sequence[Dict[str, Any]], encodings: Sequence[str],
                       pairs: Sequence[Tuple[str, str]]) -> List[Dict[str, Any]]:
    """Mean IoU differences paired by seed: for each encoding and each ``(a, b)`` input pair with runs of both at
    some seed, ``diff_mean`` / ``diff_std`` (sample std, 0 for one seed) of ``IoU(a) − IoU(b)`` and ``seeds``."""
    out = []
    for enc in encodings:
        for a, b in pairs:
            va = {r["seed"]: r["mean_iou"] for r in runs if r["encoding"] == enc and r["input"] == a}
            vb = {r["seed"]: r["mean_iou"] for r in runs if r["encoding"] == enc and r["input"] == b}
            d = np.array([va[k] - vb[k] for k in sorted(set(va) & set(vb))], float)
            if len(d):
                out.append({"encoding": enc, "a": a, "b": b, "seeds": len(d), "diff_mean": float(d.mean()),
                            "diff_std": float(d.std(ddof=1)) if len(d) > 1 else 0.0})
    return out


def metric_summary_cell(s: Dict[str, Any], m: str) -> str:
    spread = f" ± {s[f'{m}_std']:.3f}" if s["seeds"] > 1 else ""
    return f"{s[f'{m}_mean']:.3f}{spread} ({s[f'{m}_best']:.3f})"


def grid_table(encodings: Sequence[str], inputs: Sequence[str], find: Any, cell: Any) -> List[str]:
    """A markdown table, one row per encoding and one column per input, of ``cell(enc, inp, summary or None)``,
    then an empty line."""
    lines = ["| encoding | " + " | ".join(INPUT_LABELS.get(i, i) for i in inputs) + " |",
             "|---|" + "---|" * len(inputs)]
    lines += [f"| {enc} | " + " | ".join(cell(enc, inp, find(enc, inp)) for inp in inputs) + " |" for enc in encodings]
    return lines + [""]


def markdown_table(summary: Sequence[Dict[str, Any]], encodings: Sequence[str], inputs: Sequence[str],
                   differences: Sequence[Dict[str, Any]] = ()) -> str:
    """Tables of mean 3-D IoU and mAP@0.25 / 0.5 (``mean ± std (best)`` per encoding and input), the paired
    differences, the error breakdown and the learning-curve check."""
    def find(enc: str, inp: str) -> Optional[Dict[str, Any]]:
        return next((r for r in summary if r["encoding"] == enc and r["input"] == inp), None)

    lines = []
    for m, title in (("mean_iou", "Mean 3-D IoU (Hungarian-matched, every test object)"),
                     ("mAP@0.25", "mAP at 3-D IoU 0.25"), ("mAP@0.5", "mAP at 3-D IoU 0.5")):
        def metric_cell(enc: str, inp: str, s: Optional[Dict[str, Any]]) -> str:
            if s is not None:
                return metric_summary_cell(s, m) + (" †" if inp == "rgbd" and not is_rotary(enc) else "")
            if inp == "rgbd-channel" and not is_rotary(enc) and find(enc, "rgbd") is not None:
                return "= ViTD †"
            return "–"

        lines += [f"**{title}** — mean ± std over seeds (best seed)", ""]
        lines += grid_table(encodings, inputs, find, metric_cell)
    if any(not is_rotary(e) for e in encodings) and any(i != "rgb" for i in inputs):
        lines += ["† no coordinate path (NoPE, APE): depth enters as a fourth input channel only, so the ViTD and "
                  "the depth-as-input model are one model.", ""]
    if differences:
        lines += ["**Paired differences of mean IoU** (same seed) — mean ± std over seeds", ""]
        lines.append("| encoding | comparison | difference | seeds |")
        lines.append("|---|---|---:|---:|")
        for d in differences:
            a, b = INPUT_LABELS.get(d["a"], d["a"]), INPUT_LABELS.get(d["b"], d["b"])
            lines.append(f"| {d['encoding']} | {a} − {b} | {d['diff_mean']:+.3f} ± {d['diff_std']:.3f} "
                         f"| {d['seeds']} |")
        lines.append("")
    if any(np.isfinite(s.get(f"{ERRORS[0]}_mean", np.nan)) for s in summary):
        lines += ["**Where the boxes go wrong** — Hungarian-matched pairs, mean over seeds: centre error across "
                  "(lateral) and along (depth) the optical axis and size error in cm, rotation error in degrees, "
                  "matched class accuracy", ""]
        lines.append("| encoding | input | depth as | lateral cm | depth cm | size cm | rotation ° | class acc |")
        lines.append("|---|---|---|---:|---:|---:|---:|---:|")
        for enc in encodings:
            for inp in inputs:
                s = find(enc, inp)
                if s is None:
                    continue
                lines.append(f"| {enc} | {INPUT_LABELS.get(inp, inp)} | {s['depth_as']} | "
                             f"{100 * s['lateral_err_mean']:.1f} | {100 * s['depth_err_mean']:.1f} | "
                             f"{100 * s['size_err_mean']:.1f} | {s['rot_err_deg_mean']:.0f} | "
                             f"{s['class_acc_mean']:.2f} |")
        const = np.nanmean([s.get("depth_err_const_mean", np.nan) for s in summary])
        lines += ["", f"For scale: always answering the median object depth of the test scenes gives a depth error "
                      f"of {100 * const:.1f} cm.", ""]
    if any(np.isfinite(s.get("val_iou_final_mean", np.nan)) for s in summary):
        lines += ["**Learning curve** — held-out mean IoU at the last step, and its change over the last quarter of "
                  "the steps (mean over seeds; `iou_curve.png`)", ""]
        lines += grid_table(encodings, inputs, find, lambda enc, inp, s: "–" if s is None else
                       f"{s['val_iou_final_mean']:.3f} ({s['val_iou_last_quarter_mean']:+.3f})")
    return "\n".join(lines)
