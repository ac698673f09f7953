"""Markdown tables and the performance targets from ``ropekit bench`` records (see :mod:`ropekit.bench.core`)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

__all__ = ["format_report", "format_summary", "evaluate_targets"]


def _find(records: List[Dict[str, Any]], label: str, case: str) -> Optional[Dict[str, Any]]:
    for r in records:
        if r.get("label") == label and r.get("case") == case and "skipped" not in r:
            return r
    return None


def _f(v: Optional[float], fmt: str = "{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def _case_title(case: str, rec: Dict[str, Any]) -> str:
    what = ("a 14 x 14 grid shared by the batch" if case == "grid2d" else "per-example 3-D coordinates")
    if case == "grid2d" and rec.get("tokens") != 196:
        what = "a grid shared by the batch"
    dtype = rec.get("dtype", "fp32")
    dtype = dtype if dtype == "fp32" else f"{dtype} (autocast)"
    return (f"`{case}`: q, k of shape ({rec['batch']}, {rec['heads']}, {rec['tokens']}, {rec['head_dim']}), "
            f"{dtype}, {what}")


def _compile_mode_note(vit: List[Dict[str, Any]]) -> str:
    """`` in mode=...`` when the compiled rows used a torch.compile mode other than the default."""
    modes = {r.get("compile_mode") for r in vit if r.get("mode") == "compiled"} - {None, "default"}
    return f" in mode={', '.join(sorted(modes))}" if modes else ""


def _on_gpu(records: List[Dict[str, Any]]) -> bool:
    return any(str(r.get("device", "cpu")).startswith("cuda") for r in records)


def _vit_find(records: List[Dict[str, Any]], label: str, size: str, mode: str) -> Optional[Dict[str, Any]]:
    for r in records:
        if (r.get("kind") == "vit" and r.get("label") == label and r.get("size") == size
                and r.get("mode", "eager") == mode and "skipped" not in r):
            return r
    return None


def evaluate_targets(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The performance targets, each with the measured value, the bound and whether it is met (None: not measured).

    CPU runs: the targets of the CPU cost work; GPU runs: the encoding table against the floor ``q * c, k * c`` and
    the ViT-B/16 training step against the absolute-embedding ViT (eager and compiled) and against timm's.
    """
    out: List[Dict[str, Any]] = []

    def add(target: str, case: str, value: Optional[float], bound: float, unit: str, lower_is_better: bool = True,
            note: Optional[str] = None):
        met = None if value is None else (value <= bound if lower_is_better else value >= bound)
        out.append({"target": target, "case": case, "value": value, "bound": bound, "unit": unit, "met": met,
                    **({"note": note} if note else {})})

    def gpu_time(r: Optional[Dict[str, Any]]) -> Tuple[Optional[float], Optional[str]]:
        """``(ratio, note)``: the GPU-time ratio of a row, or None and why: a call that synchronises the host has
        no GPU time of its own (its events include the host's gaps)."""
        if r and r.get("gpu_synced"):
            return None, "not isolable: the op synchronises the host"
        return r and r.get("x_floor_gpu"), None

    if _on_gpu(records):
        for case in ("grid2d", "rgbd3d"):
            for label, bound in (("axial", 1.5), ("mixed", 1.5), ("cayley", 2.0), ("circulant", 2.0),
                                 ("comrope-ap (b=8)", 2.0), ("comrope-ld (b=8)", 2.0), ("liere-commute", 2.0),
                                 ("fused kernel (mixed freqs)", 1.5)):
                r = _find(records, label, case)
                add(f"{label} fwd+bwd <= {bound:g}x floor (q*c, k*c)", case, r and r["x_floor"], bound, "x floor")
                value, note = gpu_time(r)
                add(f"{label} fwd+bwd <= {bound:g}x floor (q*c, k*c), GPU time", case, value, bound, "x floor",
                    note=note)
            for label in ("cayley", "circulant", "comrope-ap (b=8)", "comrope-ld (b=8)"):
                r = _find(records, f"{label} in training (folded)", case)
                value, note = gpu_time(r)
                add(f"{label} in training (folded, per layer) fwd+bwd <= 2x floor (q*c, k*c), GPU time", case,
                    value, 2.0, "x floor", note=note)
        for mode in ("eager", "compiled"):
            for pe in ("axial", "mixed", "cayley", "circulant", "comrope-ld"):
                r = _vit_find(records, pe, "base", mode)
                add(f"ViT-B/16 step with {pe} <= 1.05x absolute embedding ({mode})", "vit-base",
                    r and r["x_absolute"], 1.05, "x absolute")
            timm = next((r for r in records if r.get("kind") == "vit" and str(r.get("label", "")).startswith("timm")
                         and r.get("mode") == mode and "skipped" not in r), None)
            # the timm row is timed against ropekit's absolute-embedding ViT: its inverse ratio is ropekit / timm
            add(f"ropekit absolute-embedding ViT-B step <= timm's ({mode})", "vit-base",
                timm and 1.0 / timm["x_absolute"], 1.0, "x timm")
        return out

    for case in ("grid2d", "rgbd3d"):
        for label in ("axial", "mixed"):
            r = _find(records, label, case)
            add(f"{label} fwd+bwd <= 2x elementwise floor", case, r and r["x_floor"], 2.0, "x floor")
        comrope = 0.10 if case == "grid2d" else 0.25
        bounds = {"cayley": 0.10, "circulant": 0.10, "comrope-ap (b=8)": comrope, "comrope-ld (b=8)": comrope}
        for label, bound in bounds.items():
            r = _find(records, f"{label} in training (folded)", case)
            add(f"{label} in training (folded, per layer) fwd+bwd <= {bound:.0%} of SDPA", case,
                r and r["frac_sdpa"], bound, "of SDPA")
            r = _find(records, label, case)
            add(f"{label} alone (every token, unfolded) fwd+bwd <= {bound:.0%} of SDPA", case,
                r and r["frac_sdpa"], bound, "of SDPA")
        for label in ("comrope-ap (b=8)", "comrope-ld (b=8)"):
            r = _find(records, label, case)
            dense = _find(records, f"dense d x d {label}", case)
            measured = r and dense and "peak_mb" in r and "peak_mb" in dense
            ratio = r["peak_mb"] / dense["peak_mb"] if measured else None
            add(f"{label} peak memory <= 1/5 of dense per-token d x d", case, ratio, 0.2, "of dense")
        for label in ("liere (b=8)", "liere (dense)"):
            naive = _find(records, f"naive {label}", case)
            add(f"{label} fwd+bwd >= 5x faster than one matrix_exp per token", case,
                naive and naive["speedup_fwdbwd"], 5.0, "x faster", lower_is_better=False)
            for kind in ("peak", "saved"):
                add(f"{label} {kind} memory <= 1/5 of one matrix_exp per token", case,
                    naive and naive.get(f"{kind}_ratio"), 0.2, f"of naive ({kind})")
        for label in ("cayley", "circulant"):
            r = _find(records, f"folded {label}", case)
            add(f"folded {label} inference (fwd) within 5% of axial RoPE", case, r and r["x_axial_fwd"], 1.05,
                "x axial")
    for pe in ("cayley", "circulant"):
        r = _find(records, pe, "vit-tiny")
        add(f"tiny-ViT training step with {pe} <= 1.15x absolute embedding", "vit-tiny", r and r["x_absolute"],
            1.15, "x absolute")
    return out


def format_report(records: List[Dict[str, Any]], command: str = "") -> str:
    """A markdown report: one table per case, the naive baselines, folded inference, the ViT steps, the targets."""
    lines: List[str] = []
    meta = next((r for r in records), {})
    if command:
        lines += [f"Command: `{command}`", ""]
    if meta:
        load = ""
        if meta.get("load_avg_start"):
            load = (f"; load average (1, 5, 15 min) {meta['load_avg_start']} at the start, "
                    f"{meta.get('load_avg_end')} at the end")
        clock = {"cpu": "process CPU time", "cuda events": "CUDA-event time of each call after a synchronisation"}.get(
            meta.get("clock"), "wall-clock time")
        gpu = ""
        if meta.get("gpu"):
            gpu = (f"GPU {meta['gpu']} (compute capability {meta.get('capability')}, CUDA {meta.get('cuda')}, Triton "
                   f"{meta.get('triton', '–')}, TF32 matmul {'on' if meta.get('tf32_matmul') else 'off'}); host ")
        lines += [f"Machine: {gpu}{meta.get('cpu')}, {meta.get('cpus')} cores visible, {meta.get('threads')} torch "
                  f"threads, torch {meta.get('torch')}{load}; times are {clock}"
                  + (f"; CPU allocator: {meta['allocator']}" if meta.get("allocator") else "")
                  + (" (quick run)" if meta.get("quick") else ""), ""]
    if records:
        lines += [format_summary(records)]
    for case in ("grid2d", "rgbd3d"):
        rows = [r for r in records if r.get("case") == case and r.get("kind") in ("pe", "kernel")]
        if not rows:
            continue
        ok = [r for r in rows if "skipped" not in r]
        if not ok:  # nothing measured: say why, row by row
            lines += [f"### Encoding alone, `{case}`: no row measured", ""]
            lines += [f"*{r['label']}* not run: {r['skipped']}" for r in rows] + [""]
            continue
        floor = sorted(r["floor_fwdbwd_ms"] for r in ok)[len(ok) // 2]
        sdpa = sorted(r["sdpa_fwdbwd_ms"] for r in ok)[len(ok) // 2]
        floor_name = "q*c, k*c" if _on_gpu(records) else "q*k"
        lines += [f"### Encoding alone, {_case_title(case, ok[0])}", "",
                  f"References (medians over the rows' rounds): elementwise floor {floor_name} fwd+bwd {floor:.2f} ms, "
                  f"SDPA fwd+bwd {sdpa:.2f} ms. Every ratio below uses the references timed in the same rounds "
                  f"as its row: medians, and (min) the ratio of the fastest rounds, less sensitive to other jobs on "
                  f"a shared machine. *Spread*: the interquartile range of the per-round ratio fwd+bwd / floor, "
                  f"relative to its median; a row whose spread passes the limit is refused.", ""]
        if any("fwdbwd_gpu_ms" in r for r in ok):
            lines += ["GPU time alone (host overhead hidden behind a queued GPU sleep; medians):", "",
                      "| encoding | fwd GPU ms | fwd+bwd GPU ms | x floor (GPU) | % of SDPA (GPU) | floor GPU ms |",
                      "|---|---:|---:|---:|---:|---:|"]
            for r in ok:
                if "fwdbwd_gpu_ms" in r:
                    sync = " (synchronises the host: host gaps included)" if r.get("gpu_synced") else ""
                    lines.append(f"| {r['label']}{sync} | {r['fwd_gpu_ms']:.3f} | {r['fwdbwd_gpu_ms']:.3f} | "
                                 f"{r['x_floor_gpu']:.2f} | {100 * r['frac_sdpa_gpu']:.1f}% | "
                                 f"{r['floor_fwdbwd_gpu_ms']:.3f} |")
            lines += ["", "Latency (each call after a synchronisation, host overhead included):", ""]
        lines += ["| encoding | fwd ms | fwd+bwd ms | x none | x floor | spread | % of SDPA | x floor (min) "
                  "| % of SDPA (min) | peak MB | saved MB |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if "skipped" in r:
                lines.append(f"| {r['label']} | – | – | – | – | – | – | – | – | – | – |")
                continue
            x_min = r["fwdbwd_ms_min"] / r["floor_fwdbwd_ms_min"]
            s_min = r["fwdbwd_ms_min"] / r["sdpa_fwdbwd_ms_min"]
            lines.append(f"| {r['label']} | {r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | {r['x_none']:.2f} | "
                         f"{r['x_floor']:.2f} | {_pct(r.get('x_floor_spread'))} | {100 * r['frac_sdpa']:.1f}% | "
                         f"{x_min:.2f} | {100 * s_min:.1f}% | "
                         f"{_f(r.get('peak_mb'), '{:.1f}')} | {_f(r.get('saved_mb'), '{:.1f}')} |")
        skipped = [r for r in rows if "skipped" in r]
        for r in skipped:
            lines.append(f"\n*{r['label']}* not run: {r['skipped']}")
        lines.append("")

    naive = [r for r in records if r.get("kind") == "naive"]
    if naive:
        lines += ["### Naive reference forms (timed in the same rounds as the fast row)", "",
                  "| case | reference form | its fwd+bwd ms | fast row | fast fwd+bwd ms | speed-up | peak MB "
                  "(reference / fast) | max rel. error (outputs, grads) |",
                  "|---|---|---:|---|---:|---:|---:|---:|"]
        for r in naive:
            if "skipped" in r:
                lines.append(f"| {r['case']} | {r['label']} | – | {r['base']} | – | – | – "
                             f"| not run: {r['skipped']} |")
                continue
            fast = _find(records, r["base"], r["case"])
            fast_peak = r.get("fast_peak_mb", fast and fast.get("peak_mb"))  # measured in the naive row's run first
            mem = f"{r['peak_mb']:.0f} / {fast_peak:.0f}" if "peak_mb" in r and fast_peak is not None else "–"
            if "fast_saved_mb" in r:
                mem += f" (saved {r['saved_mb']:.0f} / {r['fast_saved_mb']:.0f})"
            lines.append(f"| {r['case']} | {r['label']} | {r['fwdbwd_ms']:.1f} | {r['base']} | "
                         f"{r['fast_fwdbwd_ms']:.1f} | {r['speedup_fwdbwd']:.1f}x | {mem} | "
                         f"{_f(r.get('check_max_rel_err'), '{:.1e}')} |")
        lines.append("")

    train = [r for r in records if r.get("kind") == "train"]
    if train:
        lines += ["### In training: what each encoding adds to one attention layer's step", "",
                  "`ropekit.nn.Attention` (fold=True, the default) merges a commuting encoding's basis into the q/k "
                  "projection once per step and rotates each token by its frequencies. *Its work* is that: the "
                  "encoding's RoPE form, the merge into a (3D, D) weight and bias, and the rotation of q and k, "
                  "forward + backward (the projection's product with the tokens is the same with or without an "
                  "encoding). *Alone* is the encoding applied to every token (`pe(q, k, coords)`, the table above): "
                  "what a user's own attention pays.", "",
                  "| case | encoding | its work fwd ms | its work fwd+bwd ms | x floor | % of SDPA | alone fwd+bwd ms "
                  "| x alone |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in train:
            if "skipped" in r:
                lines.append(f"| {r['case']} | {r['base']} | – | – | – | – | – | not run: {r['skipped']} |")
                continue
            alone = _find(records, r["base"], r["case"])
            lines.append(f"| {r['case']} | {r['base']} | {r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | "
                         f"{r['x_floor']:.2f} | {100 * r['frac_sdpa']:.1f}% | {_f(alone and alone['fwdbwd_ms'])} | "
                         f"{_f(alone and r['fwdbwd_ms'] / alone['fwdbwd_ms'])} |")
        lines.append("")

    folded = [r for r in records if r.get("kind") == "folded" and "skipped" not in r]
    if folded:
        lines += ["### Folded inference (`ropekit.fold`: the basis merged into the q/k projections)", "",
                  "| case | encoding | folded fwd ms | axial RoPE fwd ms | x axial | unfolded fwd ms |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in folded:
            lines.append(f"| {r['case']} | {r['base']} | {r['fwd_ms']:.2f} | {r['axial_fwd_ms']:.2f} | "
                         f"{r['x_axial_fwd']:.2f} | {r['unfolded_fwd_ms']:.2f} |")
        lines.append("")

    vit = [r for r in records if r.get("kind") == "vit"]
    if vit:
        order = ["tiny", "small", "base"]
        cols = sorted({(r["size"], r.get("mode", "eager")) for r in vit},
                      key=lambda sm: (order.index(sm[0]), sm[1] != "eager"))

        def name(sm):
            return sm[0] if sm[1] == "eager" else f"{sm[0]} {sm[1]}"

        head = " | ".join(f"{name(c)} step ms | {name(c)} x absolute" for c in cols)
        desc = "; ".join(f"{s}: batch {r['batch']}, {r['image_size']}x{r['image_size']} images, {r['tokens']} tokens"
                         for s in dict.fromkeys(c[0] for c in cols) for r in [next(v for v in vit if v["size"] == s)])
        dtype = meta.get("dtype", "fp32")
        extra = (f", {dtype} autocast" if dtype != "fp32" else "") + (", fused AdamW" if _on_gpu(records) else "")
        lines += ["### Training step of the ViT (forward, loss, backward, AdamW) against the absolute-embedding ViT",
                  "", f"{desc}{extra}. The absolute-embedding step is timed in alternation with each row's (for "
                  f"`compiled`, both models under torch.compile{_compile_mode_note(vit)}); a timm row is timm's "
                  "model of the same shape "
                  "against ropekit's absolute-embedding ViT. [n%]: the spread of the per-round ratio (interquartile "
                  "range relative to the median).", "",
                  f"| encoding | {head} |", "|---|" + "---:|---:|" * len(cols)]
        for pe in dict.fromkeys(r["pe"] for r in vit):
            cells = []
            for s, mode in cols:
                r = next((v for v in vit if v["pe"] == pe and v["size"] == s and v.get("mode", "eager") == mode), None)
                if r is None or "skipped" in r:
                    cells += ["–", "–"]
                else:
                    spread = f" [{_pct(r['x_absolute_spread'])}]" if "x_absolute_spread" in r else ""
                    cells += [f"{r['step_ms']:.1f}", f"{r['x_absolute']:.2f}{spread}"]
            lines.append(f"| {pe} | " + " | ".join(cells) + " |")
        ref = [r for r in vit if "absolute_step_ms" in r]
        for s, mode in cols:
            v = sorted(r["absolute_step_ms"] for r in ref if r["size"] == s and r.get("mode", "eager") == mode)
            if v:
                lines.append(f"\nAbsolute-embedding ViT ({name((s, mode))}): median {v[len(v) // 2]:.1f} ms per step.")
        for r in vit:
            if "skipped" in r:
                lines.append(f"\n*{r['label']}* ({r['size']} {r.get('mode', 'eager')}) not run: {r['skipped']}")
        lines.append("")

    lines += _targets_section(records)
    return "\n".join(lines)


def _pct(v: Optional[float]) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def _targets_section(records: List[Dict[str, Any]]) -> List[str]:
    """The targets this run measured (or ran and found not measurable, with the reason), as a table, and one line
    counting the others: those whose rows were not run or were refused (no table row for them)."""
    targets = evaluate_targets(records)
    if not targets:
        return []
    shown = [t for t in targets if t["value"] is not None or t.get("note")]
    lines = ["### Targets", ""]
    if shown:
        lines += ["| target | case | measured | bound | met |", "|---|---|---:|---:|---|"]
    for t in shown:
        percent = t["unit"].startswith(("of SDPA", "of dense", "of naive"))
        bound = f"{100 * t['bound']:.0f}%" if percent else f"{t['bound']:g}"
        if t["value"] is None:
            lines.append(f"| {t['target']} | {t['case']} | – | {bound} | {t['note']} |")
            continue
        val = f"{100 * t['value']:.1f}%" if percent else f"{t['value']:.2f}"
        lines.append(f"| {t['target']} | {t['case']} | {val} {t['unit']} | {bound} | "
                     f"{'yes' if t['met'] else '**no**'} |")
    missing = len(targets) - len(shown)
    if missing:
        lines += ["", f"{missing} of {len(targets)} targets not measured in this run (their rows were not run or "
                      "were refused as too noisy); the JSON records hold every row."]
    return lines + [""]


def format_summary(records: List[Dict[str, Any]]) -> str:
    """A few lines to read first: per table, how many rows were measured and refused and the range of the headline
    ratio (with the largest spread); then how many measured targets were met, naming those that were not."""
    lines: List[str] = []
    for case in dict.fromkeys(r.get("case") for r in records if r.get("kind") in ("pe", "kernel")):
        rows = [r for r in records if r.get("case") == case and r.get("kind") in ("pe", "kernel")]
        ok = [r for r in rows if "skipped" not in r]
        refused = [r for r in rows if str(r.get("skipped", "")).startswith("refused")]
        line = f"- {case}, encoding alone: {len(ok)} of {len(rows)} rows measured"
        if refused:
            line += f", {len(refused)} refused as too noisy ({', '.join(r['label'] for r in refused)})"
        if ok:
            lo, hi = min(ok, key=lambda r: r["x_floor"]), max(ok, key=lambda r: r["x_floor"])
            worst = max(r.get("x_floor_spread", 0.0) for r in ok)
            line += (f"; fwd+bwd {lo['x_floor']:.2f}x floor ({lo['label']}) to {hi['x_floor']:.2f}x ({hi['label']}), "
                     f"largest spread {100 * worst:.0f}%")
        lines.append(line)
    vit = [r for r in records if r.get("kind") == "vit"]
    for size, mode in dict.fromkeys((r["size"], r.get("mode", "eager")) for r in vit):
        rows = [r for r in vit if r["size"] == size and r.get("mode", "eager") == mode]
        ok = [r for r in rows if "skipped" not in r]
        line = f"- vit-{size} {mode} training step: {len(ok)} of {len(rows)} rows measured"
        if ok:
            lo, hi = min(ok, key=lambda r: r["x_absolute"]), max(ok, key=lambda r: r["x_absolute"])
            line += (f"; {lo['x_absolute']:.2f}x absolute embedding ({lo['label']}) to {hi['x_absolute']:.2f}x "
                     f"({hi['label']})")
        lines.append(line)
    targets = evaluate_targets(records)
    measured = [t for t in targets if t["value"] is not None]
    failed = [t for t in measured if not t["met"]]
    if targets:
        line = f"- targets: {len(measured) - len(failed)} of {len(measured)} measured met"
        if failed:
            line += "; not met: " + "; ".join(f"{t['target']} ({t['case']})" for t in failed[:3])
            line += f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        line += f"; {len(targets) - len(measured)} not measured in this run"
        lines.append(line)
    return "\n".join(["### Summary", ""] + lines + [""])
