"""``ropekit bench packing``: packed against padded batches of images at mixed resolutions, FlexAttention against
SDPA with a mask, and ``torch.compile`` across sequence-length buckets.

What is measured (one ViT, one set of images, one process):

* **packed vs padded** -- a training step (forward and backward) over the same images: *padded* gives each image a
  row of ``seq_len`` tokens (a fixed-length batch, as a NaFlex loader pads to its longest sequence), *packed* fills
  rows of ``seq_len`` tokens with as many images as fit (:func:`ropekit.nn.packing.pack`); both run ``rows`` rows per
  step, so each step has the same token budget. The images: token budgets uniform in ``[min_tokens, seq_len]``
  and aspect ratios log-uniform in ``[1/2, 2]`` (the native-resolution loader's training mix,
  :mod:`ropekit.data.native`). Images per second, and the padding each saves; rounds alternate the two.
* **FlexAttention vs SDPA** -- the attention of packed rows alone (``(rows, H, seq_len, d)``) under the document
  mask: SDPA with the boolean mask, FlexAttention eager (PyTorch's reference implementation off CUDA) and compiled
  (inductor), forward only (PyTorch has no FlexAttention backward on the CPU).
* **compile** -- the packed forward under ``torch.compile(dynamic=True)`` with a counting backend over five
  sequence-length buckets (rows and slots padded to fixed counts): graphs compiled, recompiles and graph breaks.

Records are dicts; :func:`format_packing_report` renders them as markdown.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["PackingBenchConfig", "run_packing_bench", "format_packing_report", "mixed_images"]


@dataclass
class PackingBenchConfig:
    """Options of ``ropekit bench packing``."""

    model: str = "tiny"
    pe: str = "cayley"
    patch_size: int = 16
    seq_len: int = 256
    min_tokens: int = 16
    rows: int = 8
    images: int = 64
    rounds: int = 3
    buckets: Tuple[int, ...] = (64, 128, 192, 256, 320)
    flex_compiled: bool = True
    seed: int = 0
    threads: Optional[int] = None


def mixed_images(n: int, cfg: PackingBenchConfig) -> List[Any]:
    """``n`` patched random images: token budget uniform in ``[min_tokens, seq_len]``, aspect log-uniform in
    ``[1/2, 2]``, resized to the largest grid within the budget (``ropekit.data.native.grid_for``)."""
    from ..data.native import grid_for
    from ..nn.packing import patchify

    g = torch.Generator().manual_seed(cfg.seed)
    out = []
    p = cfg.patch_size
    for _ in range(n):
        t = int(torch.randint(cfg.min_tokens, cfg.seq_len + 1, (1,), generator=g))
        aspect = math.exp((2 * float(torch.rand((), generator=g)) - 1) * math.log(2))
        gh, gw = grid_for(int(round(512 / math.sqrt(aspect))), int(round(512 * math.sqrt(aspect))), t, p)
        out.append(patchify(torch.randn(3, gh * p, gw * p, generator=g), p, label=int(torch.randint(10, (1,), generator=g))))
    return out


def _batches(images: List[Any], cfg: PackingBenchConfig, packed: bool) -> List[Any]:
    from ..nn.packing import pack

    if not packed:  # one image per row, every row seq_len long
        return [pack(images[i:i + cfg.rows], cfg.seq_len, max_images=1, num_rows=cfg.rows)
                for i in range(0, len(images), cfg.rows)]
    batches, rows, used = [], [[]], 0
    for i, im in enumerate(images):  # rows filled in order; a batch holds `rows` rows
        m = im.patches.shape[0]
        if used + m > cfg.seq_len:
            if len(rows) == cfg.rows:
                batches.append(rows)
                rows = []
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += m
    batches.append(rows)
    out = []
    for rws in batches:
        ids = [i for r in rws for i in r]
        local = {i: j for j, i in enumerate(ids)}
        out.append(pack([images[i] for i in ids], cfg.seq_len, rows=[[local[i] for i in r] for r in rws],
                        num_rows=cfg.rows))
    return out


def _train_time(model: torch.nn.Module, batches: List[Any]) -> float:
    import torch.nn.functional as F

    t0 = time.perf_counter()
    for b in batches:
        loss = F.cross_entropy(model(b), b.labels)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _packed_vs_padded(cfg: PackingBenchConfig, log: Callable[[str], None]) -> List[Dict[str, Any]]:
    from ..nn.vit import VisionTransformer, vit_config

    torch.manual_seed(cfg.seed)
    model = VisionTransformer(vit_config(cfg.model, num_classes=10, in_chans=3, patch_size=cfg.patch_size,
                                         pe=cfg.pe)).train()
    images = mixed_images(cfg.images, cfg)
    tokens = sum(im.patches.shape[0] for im in images)
    arms = {"padded": _batches(images, cfg, False), "packed": _batches(images, cfg, True)}
    _train_time(model, arms["packed"][:1])  # warm-up
    _train_time(model, arms["padded"][:1])
    times: Dict[str, List[float]] = {k: [] for k in arms}
    for r in range(cfg.rounds):
        for name in (("padded", "packed") if r % 2 == 0 else ("packed", "padded")):
            times[name].append(_train_time(model, arms[name]))
            log(f"packing bench: round {r + 1}/{cfg.rounds} {name} {times[name][-1]:.2f} s")
    rows = []
    for name, batches in arms.items():
        slots = sum(b.segment_ids.numel() for b in batches)
        t = statistics.median(times[name])
        rows.append({"table": "packed_vs_padded", "arm": name, "images": len(images), "steps": len(batches),
                     "token_slots": slots, "image_tokens": tokens, "padding": 1 - tokens / slots,
                     "seconds": t, "images_per_s": len(images) / t, "times": times[name]})
    padded, packed = rows
    packed["speedup"] = packed["images_per_s"] / padded["images_per_s"]
    packed["speedup_per_round"] = [a / b for a, b in zip(times["padded"], times["packed"])]
    return rows


def _time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds per call of ``fn``: ``torch.utils.benchmark.Timer.blocked_autorange`` at this process's thread
    count, given about ``repeats`` calls' time (one timed warm-up call sets the budget; the Timer warms up again
    and picks its block size)."""
    from torch.utils import benchmark

    t0 = time.perf_counter()
    fn()
    budget = max(repeats, 1) * (time.perf_counter() - t0)
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return float(timer.blocked_autorange(min_run_time=budget).median)


def _flex_vs_sdpa(cfg: PackingBenchConfig, log: Callable[[str], None]) -> List[Dict[str, Any]]:
    import torch.nn.functional as F

    from ..nn.masks import flex_segment_mask, masked_attention, segment_mask
    from ..nn.vit import VIT_SIZES

    size = VIT_SIZES[cfg.model]
    h, d = size["num_heads"], size["embed_dim"] // size["num_heads"]
    batch = _batches(mixed_images(cfg.images, cfg), cfg, True)[0]
    seg = batch.segment_ids
    g = torch.Generator().manual_seed(cfg.seed)
    q, k, v = (torch.randn(cfg.rows, h, cfg.seq_len, d, generator=g) for _ in range(3))
    mask = segment_mask(seg)
    t_mask = _time(lambda: segment_mask(seg), 10)
    t_block = _time(lambda: flex_segment_mask(seg), 3)
    block = flex_segment_mask(seg)
    rows = []
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        arms: List[Tuple[str, Callable[[], Any], float]] = [
            ("sdpa + boolean mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), t_mask),
            ("flex, eager", lambda: masked_attention(q, k, v, block), t_block)]
        if cfg.flex_compiled:
            from torch.nn.attention.flex_attention import flex_attention

            compiled = torch.compile(flex_attention, dynamic=False)
            t0 = time.perf_counter()
            try:
                compiled(q, k, v, block_mask=block)
                arms.append(("flex, compiled (inductor)", lambda: compiled(q, k, v, block_mask=block), t_block))
                log(f"packing bench: flex compiled in {time.perf_counter() - t0:.1f} s")
            except Exception as exc:  # a backend that cannot compile it here: reported, not fatal
                rows.append({"table": "flex_vs_sdpa", "arm": "flex, compiled (inductor)",
                             "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
        for name, fn, t_build in arms:
            err = float((fn() - ref).abs().max())
            t = _time(fn, max(3, cfg.rounds))
            rows.append({"table": "flex_vs_sdpa", "arm": name, "seconds": t, "mask_build_s": t_build,
                                    "max_abs_diff": err, "shape": [cfg.rows, h, cfg.seq_len, d]})
            log(f"packing bench: {name} {t * 1e3:.1f} ms")
    return rows


def _compile_buckets(cfg: PackingBenchConfig, log: Callable[[str], None]) -> List[Dict[str, Any]]:
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from ..nn.packing import pack
    from ..nn.vit import VisionTransformer, vit_config

    torch.manual_seed(cfg.seed)
    model = VisionTransformer(vit_config(cfg.model, num_classes=10, in_chans=3, patch_size=cfg.patch_size,
                                         pe=cfg.pe)).eval()
    graphs: List[Any] = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    dynamo.reset()
    counters.clear()
    fn = torch.compile(model, backend=counting, dynamic=True)
    images = mixed_images(4 * cfg.images, cfg)
    per_row, rows_, out = 4, 3, []
    for n in cfg.buckets:
        fit = [im for im in images if im.patches.shape[0] <= n // per_row][:per_row * rows_ - 1]  # (always fit)
        batch = pack(fit, n, max_images=per_row, num_rows=rows_, pad_to=n)
        t0 = time.perf_counter()
        with torch.no_grad():
            fn(batch)
        out.append({"table": "compile_buckets", "seq_len": n, "rows": rows_, "images": len(fit),
                    "graphs_so_far": len(graphs), "seconds": time.perf_counter() - t0})
        log(f"packing bench: compile bucket {n}: {len(graphs)} graph(s)")
    breaks = sum(counters["graph_break"].values())
    out.append({"table": "compile_summary", "buckets": list(cfg.buckets), "graphs": len(graphs),
                "recompiles": max(0, len(graphs) - 1), "graph_breaks": breaks, "dynamic": True})
    dynamo.reset()
    return out


def run_packing_bench(cfg: PackingBenchConfig, log: Callable[[str], None] = lambda s: None) -> List[Dict[str, Any]]:
    """Run the three tables; returns their records (the first one describes the machine and the options)."""
    previous = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        head = {"table": "machine", "torch": torch.__version__, "python": platform.python_version(),
                "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(), "config": asdict(cfg)}
        return [head] + _packed_vs_padded(cfg, log) + _flex_vs_sdpa(cfg, log) + _compile_buckets(cfg, log)
    finally:
        torch.set_num_threads(previous)


def format_packing_report(records: List[Dict[str, Any]], command: str = "") -> str:
    """The markdown report of :func:`run_packing_bench`'s records."""
    head = records[0]
    c = head["config"]
    lines = ["# Packed sequences: speed", "",
             f"`{command}` -- torch {head['torch']}, Python {head['python']}, {head['processor']}, "
             f"{head['threads']} threads; ViT-{c['model']}, pe={c['pe']}, patch {c['patch_size']}, rows of "
             f"{c['seq_len']} tokens, {c['rows']} rows per step.", "",
             "## Packed vs padded (training step, equal token budget per step)", "",
             f"{c['images']} images, token budgets uniform in [{c['min_tokens']}, {c['seq_len']}], aspect ratios "
             f"log-uniform in [1/2, 2]; median of {c['rounds']} rounds (the arms alternate).", "",
             "| batches | steps | token slots | padding | seconds | images/s | speed-up |", "|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("table") == "packed_vs_padded":
            sp = f"{r['speedup']:.2f}x (per round {', '.join(f'{v:.2f}' for v in r['speedup_per_round'])})" \
                if "speedup" in r else "1"
            lines.append(f"| {r['arm']} | {r['steps']} | {r['token_slots']} | {r['padding']:.1%} | {r['seconds']:.2f} | "
                         f"{r['images_per_s']:.1f} | {sp} |")
    lines += ["", "## FlexAttention vs SDPA with a mask (attention of packed rows, forward)", "",
              "| path | ms | mask build ms | max abs diff vs SDPA |", "|---|---|---|---|"]
    for r in records:
        if r.get("table") == "flex_vs_sdpa":
            if "error" in r:
                lines.append(f"| {r['arm']} | not run: {r['error']} | | |")
            else:
                lines.append(f"| {r['arm']} | {r['seconds'] * 1e3:.2f} | {r['mask_build_s'] * 1e3:.2f} | "
                             f"{r['max_abs_diff']:.1e} |")
    lines += ["", "## torch.compile across sequence-length buckets (dynamic=True, rows and slots padded)", "",
              "| seq_len | images | graphs so far | seconds |", "|---|---|---|---|"]
    for r in records:
        if r.get("table") == "compile_buckets":
            lines.append(f"| {r['seq_len']} | {r['images']} | {r['graphs_so_far']} | {r['seconds']:.1f} |")
    for r in records:
        if r.get("table") == "compile_summary":
            lines += ["", f"{len(r['buckets'])} buckets: {r['graphs']} graph(s) compiled, {r['recompiles']} "
                          f"recompile(s), {r['graph_breaks']} graph break(s)."]
    return "\n".join(lines) + "\n"
