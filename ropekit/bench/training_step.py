"""The training-step tables of ``ropekit bench``: one optimisation step (forward, cross entropy, backward, AdamW)
of a ViT, timed in alternation with a reference step.

* :func:`bench_vit` -- ``ropekit.nn.VisionTransformer`` with each encoding against the same model with a learned
  absolute embedding (and, for ``small`` / ``base``, timm's ViT of the same shape against it);
* :func:`run_timm_bench` (``ropekit bench timm``) -- ropekit's step against timm's at the same encoding (absolute
  embedding, axial RoPE, RoPE-Mixed: timm's ports of rope-vit) and the folded encodings (Cayley, Circulant)
  against ropekit's axial step, all in the same rounds of one process.

Shape legend: ``B`` batch, ``C`` channels, ``H = W`` image side. A ``cfg: Any`` argument is a
:class:`ropekit.bench.core.BenchConfig` (typed ``Any``: ``core`` imports this module, not the other way round).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..encodings.registry import PE_REGISTRY
from . import measure

__all__ = ["VIT_SETTINGS", "TIMM_MODELS", "optimiser_step", "random_batch", "train_step", "vit_step", "timm_step",
           "bench_vit", "TIMM_PAIRS", "TimmBenchConfig", "run_timm_bench", "format_timm_report"]

VIT_SETTINGS = {
    # size: (image size, patch size, channels, batch on the CPU) -- tiny: the MNIST default; base: ViT-B/16 at 224
    "tiny": (28, 4, 1, 32),
    "small": (224, 16, 3, 8),
    "base": (224, 16, 3, 8),
}

#: timm's model of the same shape as ropekit's named size (the external reference of the training-step table).
TIMM_MODELS = {"base": "vit_base_patch16_224", "small": "vit_small_patch16_224"}


def vit_batch(size: str, cfg: Any) -> int:
    if cfg.vit_batch is not None:
        return cfg.vit_batch
    return 128 if (cfg.on_gpu and size == "base") else VIT_SETTINGS[size][3]


def optimiser_step(model: nn.Module, x: Tensor, y: Tensor, fused: bool = False,
                   autocast_dtype: torch.dtype = torch.float32, compiled: bool = False,
                   compile_mode: str = "default") -> Callable[[], None]:
    """One optimisation step of ``model`` on the fixed batch ``x`` (images ``(B, C, H, W)``) and ``y`` (labels
    ``(B,)``, int64): forward (under autocast for a dtype other than fp32), cross entropy, backward, AdamW (fused
    when ``fused``); ``compiled`` wraps the model's forward in ``torch.compile`` (``compile_mode``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {}))
    fwd = torch.compile(model, mode=None if compile_mode == "default" else compile_mode) if compiled else model
    dev = x.device

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with (torch.autocast(dev.type, dtype=autocast_dtype) if autocast_dtype != torch.float32
              else contextlib.nullcontext()):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()

    return step


def random_batch(batch: int, chans: int, image: int, seed: int, device: Any = "cpu") -> Tuple[Tensor, Tensor]:
    """Fixed random images ``(batch, chans, image, image)`` float32 and labels ``(batch,)`` in ``[0, 10)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, chans, image, image, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return x.to(device), y.to(device)


def train_step(model: nn.Module, size: str, cfg: Any, compiled: bool, fused_adamw: Optional[bool] = None,
               image_size: Optional[int] = None) -> Callable[[], None]:
    """One optimisation step (forward, cross entropy, backward, AdamW) of ``model`` on fixed random data (fused
    AdamW on a GPU, or where ``fused_adamw`` asks for it; images of ``image_size``, default the size's)."""
    image, _, chans, _ = VIT_SETTINGS[size]
    dev = torch.device(cfg.device)
    x, y = random_batch(vit_batch(size, cfg), chans, image_size or image, cfg.seed, dev)
    return optimiser_step(model.to(dev).train(), x, y, cfg.on_gpu if fused_adamw is None else fused_adamw,
                          cfg.torch_dtype, compiled, cfg.compile_mode)


def vit_options(pe: str) -> Dict[str, Any]:
    """The options of ``pe`` in the training-step table (its class's ``bench_vit_options``)."""
    cls = PE_REGISTRY.get(pe)
    return dict(cls.bench_vit_options) if cls is not None else {}


def vit_step(size: str, pe: str, cfg: Any, compiled: bool = False, fused_adamw: Optional[bool] = None,
              image_size: Optional[int] = None) -> Callable[[], None]:
    """The training step of the ViT table for encoding ``pe`` (see ``train_step``)."""
    from ..nn import VisionTransformer, vit_config

    image, patch, chans, _ = VIT_SETTINGS[size]
    image = image_size or image
    torch.manual_seed(cfg.seed)
    model = VisionTransformer(vit_config(size, num_classes=10, in_chans=chans, image_size=(image, image),
                                         patch_size=patch, pe=pe, pe_options=vit_options(pe)))
    return train_step(model, size, cfg, compiled, fused_adamw, image)


def timm_step(size: str, cfg: Any, compiled: bool) -> Callable[[], None]:
    import timm  # optional: the caller records a skipped row when it is missing

    torch.manual_seed(cfg.seed)
    model = timm.create_model(TIMM_MODELS[size], pretrained=False, num_classes=10)
    return train_step(model, size, cfg, compiled)


def release(cfg: Any) -> None:
    if cfg.on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def bench_vit(size: str, cfg: Any, log: Callable[[str], None], compiled: bool = False) -> List[Dict[str, Any]]:
    image, patch, chans, _ = VIT_SETTINGS[size]
    batch = vit_batch(size, cfg)
    mode = "compiled" if compiled else "eager"
    reference = vit_step(size, "absolute", cfg, compiled)
    repeats = cfg.vit_base_repeats if size != "tiny" else cfg.vit_repeats
    records = []
    rows: List[Tuple[str, Callable[[], Callable[[], None]]]] = [
        (pe, (lambda pe=pe: vit_step(size, pe, cfg, compiled))) for pe in cfg.vit_pes]
    if cfg.timm and size in TIMM_MODELS:
        rows.append((f"timm {TIMM_MODELS[size]}", lambda: timm_step(size, cfg, compiled)))
    for label, make in rows:
        rec: Dict[str, Any] = {"kind": "vit", "label": label, "pe": label, "case": f"vit-{size}", "size": size,
                               "mode": mode, "compile_mode": cfg.compile_mode if compiled else None, "batch": batch,
                               "image_size": image, "patch_size": patch, "tokens": (image // patch) ** 2,
                               "dtype": cfg.dtype}
        try:
            step = make()
            t0 = time.perf_counter()
            step()  # the first call compiles (torch.compile) and allocates the optimiser state
            measure.sync(cfg)
            rec["first_step_s"] = time.perf_counter() - t0
            times = measure.round_times({"absolute": reference, "step": step}, repeats, 2 if cfg.on_gpu else 1,
                                         measure.clock_of(cfg))
        except ImportError as e:  # timm missing
            rec["skipped"] = f"{type(e).__name__}: {e}"
            records.append(rec)
            log(f"  vit-{size:4s} {mode:8s} {label:14s} skipped: {rec['skipped']}")
            continue
        except Exception as e:  # an encoding that cannot build, compile (Inductor errors) or fit in memory
            rec["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            records.append(rec)
            log(f"  vit-{size:4s} {mode:8s} {label:14s} skipped: {rec['skipped']}")
            step = None
            release(cfg)
            continue
        rec.update(repeats=repeats, step_ms=measure.median(times["step"]), step_ms_min=min(times["step"]),
                   absolute_step_ms=measure.median(times["absolute"]), absolute_step_ms_min=min(times["absolute"]))
        rec["x_absolute_spread"] = measure.ratio_spread(times["step"], times["absolute"])[1]
        noisy = measure.too_noisy("x absolute", times["step"], times["absolute"], cfg.max_spread)
        if noisy is not None:
            rec["skipped"] = noisy
            records.append(rec)
            log(f"  vit-{size:4s} {mode:8s} {label:14s} {noisy}")
            del step
            release(cfg)
            continue
        rec["x_absolute"] = rec["step_ms"] / rec["absolute_step_ms"]
        log(f"  vit-{size:4s} {mode:8s} {label:14s} step {rec['step_ms']:9.1f} ms  absolute "
            f"{rec['absolute_step_ms']:9.1f} ms  x {rec['x_absolute']:5.2f} (spread "
            f"{100 * rec['x_absolute_spread']:.0f}%)")
        records.append(rec)
        del step
        release(cfg)
    return records


# ----------------------------------------------------------------------------- ropekit against timm
#: ``(label, ropekit encoding, timm model)``: the encodings both libraries implement, each with timm's model of the
#: same shape (timm's rope models are its ports of rope-vit: axial RoPE at base 100, RoPE-Mixed per block and head).
TIMM_PAIRS: Tuple[Tuple[str, str, str], ...] = (
    ("APE", "absolute", "vit_small_patch16_224"),
    ("axial", "axial", "vit_small_patch16_rope_224"),
    ("RoPE-Mixed", "mixed", "vit_small_patch16_rope_mixed_224"),
)


@dataclass
class TimmBenchConfig:
    """Settings of ``ropekit bench timm``: a ViT-S/16 shape (width 384, 6 heads, MLP ratio 4, a class token) of
    ``depth`` blocks on ``image_size`` images, ``batch`` images per step, 10 classes, fp32 on the CPU.

    ``folded``: the folded encodings timed against ropekit's axial step. ``clock``: ``"cpu"`` (process CPU time:
    with one thread it ignores the time the process waits for a core on a shared machine) or ``"wall"``.
    """

    depth: int = 4
    image_size: int = 112
    batch: int = 32
    threads: int = 1
    repeats: int = 10
    warmup: int = 2
    clock: str = "cpu"
    folded: Tuple[str, ...] = ("cayley", "circulant")
    seed: int = 0

    def __post_init__(self) -> None:
        if self.clock not in measure.CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(measure.CLOCKS)}, got {self.clock!r}")
        if self.image_size % 16 or min(self.depth, self.image_size, self.batch, self.threads, self.repeats) < 1:
            raise ValueError(f"depth, batch, threads and repeats must be >= 1 and image_size a positive multiple of "
                             f"16, got {self.depth}, {self.batch}, {self.threads}, {self.repeats}, {self.image_size}")


def _ropekit_small(pe: str, cfg: TimmBenchConfig) -> nn.Module:
    from ..nn import VisionTransformer, vit_config

    torch.manual_seed(cfg.seed)
    cls = "unrotated"  # a class token pooled by it, left unrotated: timm's and rope-vit's convention
    return VisionTransformer(vit_config("small", depth=cfg.depth, num_classes=10, in_chans=3,
                                        image_size=(cfg.image_size, cfg.image_size), patch_size=16, pe=pe, cls=cls,
                                        pe_options=vit_options(pe)))


def _timm_small(name: str, cfg: TimmBenchConfig) -> nn.Module:
    import timm

    torch.manual_seed(cfg.seed)
    return timm.create_model(name, pretrained=False, num_classes=10, img_size=cfg.image_size, depth=cfg.depth)


def run_timm_bench(cfg: Optional[TimmBenchConfig] = None,
                   log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Time every step of :data:`TIMM_PAIRS` (both libraries) and of ``cfg.folded`` in the same rounds (each round
    calls every step once, in turn), after ``cfg.warmup`` untimed rounds. Returns one record per ratio (``kind``
    ``"timm"``: ropekit / timm at one encoding; ``"folded"``: a folded encoding / ropekit's axial) with the medians
    (ms), the ratio of medians, the median and spread of the per-round ratios, then one ``"environment"`` record.
    The number of torch threads is set to ``cfg.threads`` for the run and restored afterwards.

    Raises:
        ImportError: timm is not installed.
    """
    import timm

    cfg = cfg or TimmBenchConfig()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    info = measure.machine_info()
    try:
        x, y = random_batch(cfg.batch, 3, cfg.image_size, cfg.seed)
        steps: Dict[str, Callable[[], None]] = {}
        for _, pe, timm_name in TIMM_PAIRS:
            steps[f"ropekit {pe}"] = optimiser_step(_ropekit_small(pe, cfg).train(), x, y)
            steps[f"timm {timm_name}"] = optimiser_step(_timm_small(timm_name, cfg).train(), x, y)
        for pe in cfg.folded:
            steps[f"ropekit {pe}"] = optimiser_step(_ropekit_small(pe, cfg).train(), x, y)
        log(f"[timm] {len(steps)} training steps (ViT-S/16 shape, depth {cfg.depth}, {cfg.image_size} px, batch "
            f"{cfg.batch}, {cfg.threads} threads, {cfg.clock} clock), {cfg.repeats} rounds")
        t0 = time.perf_counter()
        times = measure.round_times(steps, cfg.repeats, cfg.warmup, measure.CLOCKS[cfg.clock])
        elapsed = time.perf_counter() - t0
    finally:
        torch.set_num_threads(old_threads)
    pairs = [("timm", label, f"ropekit {pe}", f"timm {name}") for label, pe, name in TIMM_PAIRS]
    pairs += [("folded", f"folded {PE_REGISTRY[pe].label if pe in PE_REGISTRY else pe}", f"ropekit {pe}",
               "ropekit axial") for pe in cfg.folded]
    records: List[Dict[str, Any]] = []
    for kind, label, num, den in pairs:
        med, spread = measure.ratio_spread(times[num], times[den])
        records.append({"kind": kind, "label": label, "step": num, "reference": den,
                        "step_ms": measure.median(times[num]), "reference_ms": measure.median(times[den]),
                        "ratio": measure.median(times[num]) / measure.median(times[den]),
                        "round_ratio_median": med, "round_ratio_spread": spread,
                        "ratio_min": min(times[num]) / min(times[den]),
                        "step_times_ms": times[num], "reference_times_ms": times[den]})
        log(f"  {label:18s} {num:22s} {records[-1]['step_ms']:8.1f} ms  {den:38s} "
            f"{records[-1]['reference_ms']:8.1f} ms  x {records[-1]['ratio']:.3f} (spread {100 * spread:.0f}%)")
    records.append({"kind": "environment", **info, "timm": timm.__version__, "config": asdict(cfg),
                    "load_avg_end": measure.machine_info()["load_avg"], "elapsed_s": elapsed})
    return records


def _load_note(env: Dict[str, Any]) -> List[str]:
    """A paragraph saying the machine was shared, when its 1-minute load average reached its CPU count."""
    loads = [v[0] for v in (env.get("load_avg"), env.get("load_avg_end")) if v]
    if not loads or not env.get("cpus") or max(loads) < env["cpus"]:
        return []
    return [f"The machine was loaded (1-minute load average up to {max(loads):.1f} on {env['cpus']} CPUs: other "
            f"jobs shared it): absolute times are inflated by the contention for caches and memory; the ratios, of "
            f"steps alternated in the same rounds, are what to read.", ""]


def format_timm_report(records: Sequence[Dict[str, Any]], command: str = "") -> str:
    """Markdown: the command, machine, versions and load, then the ratio table of :func:`run_timm_bench`."""
    env = next((r for r in records if r.get("kind") == "environment"), {})
    cfg = env.get("config", {})
    clock = "process CPU time" if cfg.get("clock") == "cpu" else "wall-clock time"
    lines = ["# Training step: ropekit against timm, folded encodings against axial RoPE", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [f"Machine: {env.get('cpu')}, {env.get('cpus')} logical CPUs, {cfg.get('threads')} torch threads; "
              f"torch {env.get('torch')}, timm {env.get('timm')}, Python {env.get('python')}; load average (1, 5, "
              f"15 min) {env.get('load_avg')} at the start, {env.get('load_avg_end')} at the end; times are "
              f"{clock}; CPU allocator: {env.get('allocator')}.", "",
              f"Step: forward, cross entropy, backward, AdamW of a ViT-S/16 shape (width 384, 6 heads, MLP ratio 4, "
              f"class token) of depth {cfg.get('depth')}, {cfg.get('image_size')} px images, batch {cfg.get('batch')},"
              f" 10 classes, fp32. Every step is timed once per round, in turn, in the same process "
              f"({cfg.get('repeats')} rounds after {cfg.get('warmup')} untimed ones): a slow phase of the machine "
              f"moves both sides of a ratio. *x* is the ratio of the medians; the per-round column is the median "
              f"and interquartile spread of the ratios of each round's two steps; *min* the ratio of the fastest "
              f"rounds.", "",
              *_load_note(env),
              "| ratio | step | ms (median) | reference | ms (median) | x | per round (spread) | x min |",
              "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in records:
        if r.get("kind") in ("timm", "folded"):
            lines.append(f"| {r['label']} | {r['step']} | {r['step_ms']:.1f} | {r['reference']} | "
                         f"{r['reference_ms']:.1f} | {r['ratio']:.3f} | {r['round_ratio_median']:.3f} "
                         f"({100 * r['round_ratio_spread']:.0f}%) | {r['ratio_min']:.3f} |")
    return "\n".join(lines) + "\n"
