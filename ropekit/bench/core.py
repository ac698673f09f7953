"""Speed and peak memory of every position encoding, as ratios measured side by side in one run.

Shape legend: ``B`` batch, ``H`` heads, ``M`` tokens (a ``g x g`` patch grid), ``d`` head dimension, ``c``
coordinate dimension.

**What is timed.** For every row (an encoding, a naive reference form, or a folded encoding) and case:

* ``fwd`` -- the encoding of ``q`` and ``k`` (``(B, H, M, d)``, float32) under ``torch.no_grad()``;
* ``fwdbwd`` -- the encoding of ``q`` and ``k`` (both requiring grad) and its backward pass with fixed output
  gradients, reaching ``q``, ``k`` and every learnable parameter of the encoding;

and, *in the same rounds* (each round times every function once, in turn), the references

* ``floor`` -- ``y = q * k`` forward + backward: the elementwise memory floor;
* ``sdpa`` -- ``scaled_dot_product_attention(q, k, v)`` forward + backward on the same shapes;
* ``none`` -- the identity encoding forward + backward;

plus, for a naive row, the fast row it is the reference of, and for a folded row, axial RoPE and the unfolded
encoding. Times are medians over the rounds after warm-up (minima are recorded too); ratios are ratios of
medians from the same rounds, so a slow phase of a shared machine affects both sides. Threads are fixed
(``torch.set_num_threads``). Slow rows get fewer rounds (at least 3) so that every row fits a time budget.
The clock is wall time by default; ``clock="cpu"`` times with the process CPU time instead, which -- with one
thread -- ignores the time the process spends descheduled, so it stays meaningful on a machine shared with
other jobs (with several threads it would add up their CPU time, spin-waits included).

**Cases.** ``grid2d``: the coordinates are the ``g x g`` patch grid ``(M, 2)`` shared by the batch (integer
patch indices). ``rgbd3d``: per-example 3-D coordinates ``(B, M, 3)`` -- the grid plus a depth per patch
(uniform in ``[0, 4)`` patch units) -- so nothing can be shared across the batch.

**Memory.** CPU tensors are invisible to ``tracemalloc``, so ``peak_mb`` comes from torch's profiler with
``profile_memory=True``: every allocation and free of the CPU allocator during one forward + backward, in time
order; the peak of their running sum is the memory the encoding needed on top of what existed before (its
outputs, gradients and temporaries). ``saved_mb`` is measured with ``torch.autograd.graph.saved_tensors_hooks``:
the distinct storages autograd keeps for the backward pass, excluding the inputs, the outputs and the
parameters (which exist anyway) -- the activation memory a model pays per encoded layer.

**Training step.** ``vit-tiny`` / ``vit-base``: one optimisation step (forward, cross entropy, backward, AdamW)
of ``ropekit.nn.VisionTransformer`` with each encoding, timed in alternation with the same model with a learned
absolute embedding (``pe="absolute"``).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..encodings import create_pe
from ..fold import fold_pe
from .baselines import DenseComRoPE, NaiveLieRE

__all__ = ["Row", "ROWS", "CASES", "VIT_PES", "BenchConfig", "run_bench", "peak_memory_mb", "saved_memory_mb",
           "machine_info"]

CASES = ("grid2d", "rgbd3d")


@dataclass(frozen=True)
class Row:
    """One line of the encoding table.

    ``kind``: ``"pe"`` (``create_pe(pe, **options)``), ``"naive"`` (a reference form from
    :mod:`ropekit.bench.baselines` wrapping the encoding ``pe``; ``base`` names the fast row), or ``"folded"``
    (``fold_pe`` of ``pe``; ``base`` names the unfolded row). ``heavy`` rows are left out by ``--quick``.
    """

    label: str
    pe: str
    options: Tuple[Tuple[str, Any], ...] = ()
    kind: str = "pe"
    base: Optional[str] = None
    heavy: bool = False

    @property
    def opts(self) -> Dict[str, Any]:
        return dict(self.options)


ROWS: List[Row] = [
    Row("none", "none"),
    Row("axial", "axial"),
    Row("mixed", "mixed"),
    Row("liere-commute", "liere-commute"),
    Row("cayley", "cayley"),
    Row("circulant", "circulant"),
    Row("circulant (b=16)", "circulant", (("block_size", 16),)),
    Row("comrope-ap (b=8)", "comrope-ap", (("block_size", 8),)),
    Row("comrope-ld (b=8)", "comrope-ld", (("block_size", 8),)),
    Row("tensor", "tensor"),
    Row("liere (b=8)", "liere", (("block_size", 8),)),
    Row("liere (dense)", "liere"),
    Row("string", "string"),
    Row("relaxed", "relaxed"),
    Row("relaxed (exact)", "relaxed", (("exact", True),)),
    Row("folded cayley", "cayley", kind="folded", base="cayley"),
    Row("folded circulant", "circulant", kind="folded", base="circulant"),
    Row("folded comrope-ld (b=8)", "comrope-ld", (("block_size", 8),), kind="folded", base="comrope-ld (b=8)"),
    Row("naive liere (b=8)", "liere", (("block_size", 8),), kind="naive", base="liere (b=8)"),
    Row("naive liere (dense)", "liere", kind="naive", base="liere (dense)", heavy=True),
    Row("dense d x d comrope-ld (b=8)", "comrope-ld", (("block_size", 8),), kind="naive", base="comrope-ld (b=8)"),
    Row("dense d x d comrope-ap (b=8)", "comrope-ap", (("block_size", 8),), kind="naive", base="comrope-ap (b=8)",
        heavy=True),
]

#: Encodings of the training-step table (``absolute`` is the reference every ratio is taken against).
VIT_PES = ("none", "axial", "mixed", "liere-commute", "cayley", "circulant", "comrope-ap", "comrope-ld", "tensor",
           "liere", "string", "relaxed")


@dataclass
class BenchConfig:
    """What ``ropekit bench`` measures (defaults: one attention layer of ViT-B/16, batch 8)."""

    batch: int = 8
    heads: int = 12
    head_dim: int = 64
    grid: int = 14
    cases: Tuple[str, ...] = CASES
    rows: Optional[Tuple[str, ...]] = None  # labels (or encoding names) to run; None: all
    repeats: int = 9  # timed rounds per row (fewer for slow rows)
    warmup: int = 2
    threads: int = 2
    clock: str = "wall"  # "wall" (perf_counter) or "cpu" (process CPU time: with 1 thread, blind to other jobs)
    row_budget_s: float = 30.0  # a row gets at most this much timing (but at least 3 rounds)
    memory: bool = True
    check: bool = True  # compare naive rows' outputs and gradients with the fast rows
    vit: Tuple[str, ...] = ("tiny", "base")
    vit_pes: Tuple[str, ...] = VIT_PES
    vit_repeats: int = 5
    vit_base_repeats: int = 2
    quick: bool = False
    seed: int = 0

    @classmethod
    def quick_config(cls, **overrides: Any) -> "BenchConfig":
        """The ``--quick`` variant: every encoding on both cases and the folded rows, 3 rounds, no memory profile of
        slow rows, no naive reference rows (each costs seconds per call), tiny ViT only."""
        base = dict(repeats=3, warmup=1, row_budget_s=3.0, vit=("tiny",), vit_repeats=2, quick=True)
        base.update(overrides)
        return cls(**base)

    def selected_rows(self) -> List[Row]:
        rows = [r for r in ROWS if not (self.quick and (r.heavy or r.kind == "naive"))]
        if self.rows:
            wanted = set(self.rows)
            rows = [r for r in rows if r.label in wanted or r.pe in wanted]
        return rows


# ----------------------------------------------------------------------------- measurement primitives
CLOCKS: Dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def _round_times(fns: Dict[str, Callable[[], Any]], repeats: int, warmup: int,
                 clock: Callable[[], float] = time.perf_counter) -> Dict[str, List[float]]:
    """Milliseconds of every function on ``clock``, interleaved: each round calls every function once, in turn."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append((clock() - t0) * 1e3)
    return times


def _median(v: Sequence[float]) -> float:
    return float(statistics.median(v))


def peak_memory_mb(fn: Callable[[], Any]) -> float:
    """Peak extra CPU memory (MiB) allocated by torch while ``fn`` runs, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: List[Tuple[int, int]] = []
    try:
        from torch._C._profiler import _EventType

        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation:
                events.append((node.start_time_ns, int(node.extra_fields.alloc_size)))
            stack.extend(node.children)
    except (AttributeError, ImportError):  # older profiler API: per-op net usage (an underestimate of the peak)
        events = [(int(e.time_range.start), int(e.cpu_memory_usage)) for e in prof.events() if e.cpu_memory_usage]
    events.sort()
    running = peak = 0
    for _, size in events:
        running += size
        peak = max(peak, running)
    return peak / 2 ** 20


def saved_memory_mb(forward: Callable[[], Any], exclude: Sequence[Tensor]) -> float:
    """MiB of distinct storages autograd saves for backward during ``forward()``, excluding those of ``exclude``
    and of the returned tensors."""
    seen: Dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    outs = out if isinstance(out, (tuple, list)) else (out,)
    skip = {t.untyped_storage().data_ptr() for t in list(exclude) + [o for o in outs if isinstance(o, Tensor)]}
    return sum(n for ptr, n in seen.items() if ptr not in skip) / 2 ** 20


def machine_info() -> Dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu": model, "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "load_avg": load}


# ----------------------------------------------------------------------------- cases and rows
@dataclass
class _Case:
    name: str
    q: Tensor
    k: Tensor
    v: Tensor
    gq: Tensor
    gk: Tensor
    coords: Tensor
    extra_grads: Dict[Tuple[int, ...], Tensor] = field(default_factory=dict)

    def grads_for(self, out: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """Fixed output gradients: ``gq``, ``gk`` for ``(B, H, M, d)`` outputs, fixed random tensors otherwise
        (the tensor-product encoding widens q and k)."""
        if out[0].shape == self.gq.shape:
            return self.gq, self.gk
        shape = tuple(out[0].shape)
        if shape not in self.extra_grads:
            g = torch.Generator().manual_seed(1)
            self.extra_grads[shape] = torch.randn(2, *shape, generator=g)
        return tuple(self.extra_grads[shape].unbind(0))

    @property
    def coord_dim(self) -> int:
        return self.coords.shape[-1]

    def zero_grads(self, *modules: nn.Module) -> None:
        self.q.grad = self.k.grad = self.v.grad = None
        for m in modules:
            for p in m.parameters():
                p.grad = None


def _make_case(name: str, cfg: BenchConfig) -> _Case:
    g = torch.Generator().manual_seed(cfg.seed)
    b, h, d, m = cfg.batch, cfg.heads, cfg.head_dim, cfg.grid * cfg.grid

    def t() -> Tensor:
        return torch.randn(b, h, m, d, generator=g)

    ys, xs = torch.meshgrid(torch.arange(cfg.grid, dtype=torch.float32), torch.arange(cfg.grid, dtype=torch.float32),
                            indexing="ij")
    grid = torch.stack([ys.reshape(-1), xs.reshape(-1)], dim=-1)  # (M, 2), row-major (y, x)
    if name == "grid2d":
        coords = grid
    elif name == "rgbd3d":
        depth = torch.rand(b, m, 1, generator=g) * 4.0
        coords = torch.cat([grid.expand(b, -1, -1), depth], dim=-1)  # (B, M, 3)
    else:
        raise ValueError(f"unknown case {name!r}; known: {', '.join(CASES)}")
    return _Case(name, t().requires_grad_(), t().requires_grad_(), t().requires_grad_(), t(), t(), coords)


def _pe(row: Row, case: _Case, cfg: BenchConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)
    return create_pe(row.pe, head_dim=cfg.head_dim, coord_dim=case.coord_dim, num_heads=cfg.heads, **row.opts)


def _naive(row: Row, pe: nn.Module) -> nn.Module:
    return NaiveLieRE(pe) if row.pe == "liere" else DenseComRoPE(pe)


def _fns(module: nn.Module, case: _Case) -> Tuple[Callable[[], Any], Callable[[], Any]]:
    """``(fwd, fwdbwd)`` closures of an encoding-like ``module(q, k, coords) -> (q', k')``."""

    def fwd() -> None:
        with torch.no_grad():
            module(case.q, case.k, case.coords)

    def fwdbwd() -> None:
        out = module(case.q, case.k, case.coords)
        torch.autograd.backward(out, case.grads_for(out))
        case.zero_grads(module)

    return fwd, fwdbwd


def _reference_fns(case: _Case, cfg: BenchConfig) -> Dict[str, Callable[[], Any]]:
    none = create_pe("none", head_dim=cfg.head_dim, coord_dim=case.coord_dim, num_heads=cfg.heads)

    def floor() -> None:
        (case.q * case.k).backward(case.gq)
        case.zero_grads()

    def sdpa() -> None:
        F.scaled_dot_product_attention(case.q, case.k, case.v).backward(case.gq)
        case.zero_grads()

    return {"floor": floor, "sdpa": sdpa, "none": _fns(none, case)[1]}


def _max_rel_err(fast: nn.Module, naive: nn.Module, case: _Case) -> float:
    """Largest relative difference of outputs and of gradients (q, k, parameters) between two forms."""
    params = [p for p in fast.parameters() if p.requires_grad]
    inputs = [case.q, case.k] + params
    results = []
    for mod in (fast, naive):
        out = mod(case.q, case.k, case.coords)
        grads = torch.autograd.grad(out, inputs, case.grads_for(out))
        results.append([o.detach() for o in out] + list(grads))
    err = 0.0
    for a, b in zip(*results):
        err = max(err, float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
    return err


# ----------------------------------------------------------------------------- the encoding table
def _bench_row(row: Row, case: _Case, cfg: BenchConfig, log: Callable[[str], None]) -> Dict[str, Any]:
    rec: Dict[str, Any] = {"kind": row.kind, "label": row.label, "pe": row.pe, "options": row.opts,
                           "case": case.name, "batch": cfg.batch, "heads": cfg.heads, "tokens": cfg.grid ** 2,
                           "head_dim": cfg.head_dim, "coord_dim": case.coord_dim, "base": row.base}
    try:
        pe = _pe(row, case, cfg)
    except ValueError as e:  # e.g. comrope-ap cannot split 8 blocks over 3 axes
        rec["skipped"] = str(e)
        return rec
    fns = dict(_reference_fns(case, cfg))
    module: nn.Module = pe
    if row.kind == "naive":
        module = _naive(row, pe)
        fns["fast_fwd"], fns["fast_fwdbwd"] = _fns(pe, case)
    elif row.kind == "folded":
        module, _ = fold_pe(pe)  # q, k stand for P q, P k: at inference P is inside the projection weights
        axial = create_pe("axial", head_dim=cfg.head_dim, coord_dim=case.coord_dim, num_heads=cfg.heads)
        fns["axial_fwd"], fns["axial_fwdbwd"] = _fns(axial, case)
        fns["unfolded_fwd"], _ = _fns(pe, case)
    fns["fwd"], fns["fwdbwd"] = _fns(module, case)

    try:
        # one call to size the number of rounds to the budget
        t0 = time.perf_counter()
        fns["fwdbwd"]()
        first = time.perf_counter() - t0
        per_round = first * (3 if row.kind != "pe" else 2) + 0.05
        repeats = max(3, min(cfg.repeats, int(cfg.row_budget_s / per_round)))
        warmup = cfg.warmup if first < 1.0 else 0
        times = _round_times(fns, repeats, warmup, CLOCKS[cfg.clock])
    except RuntimeError as e:  # out of memory on a huge naive row
        rec["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return rec
    rec["repeats"] = repeats
    for name, v in times.items():
        key = name if name in ("fwd", "fwdbwd") else f"{name}_fwdbwd" if name in ("floor", "sdpa", "none") else name
        rec[f"{key}_ms"] = _median(v)
        rec[f"{key}_ms_min"] = min(v)
    rec["x_none"] = rec["fwdbwd_ms"] / rec["none_fwdbwd_ms"]
    rec["x_floor"] = rec["fwdbwd_ms"] / rec["floor_fwdbwd_ms"]
    rec["frac_sdpa"] = rec["fwdbwd_ms"] / rec["sdpa_fwdbwd_ms"]
    if row.kind == "naive":
        rec["speedup_fwdbwd"] = rec["fwdbwd_ms"] / rec["fast_fwdbwd_ms"]
        rec["speedup_fwd"] = rec["fwd_ms"] / rec["fast_fwd_ms"]
        if cfg.check:
            rec["check_max_rel_err"] = _max_rel_err(pe, module, case)
            case.zero_grads(pe)
    if row.kind == "folded":
        rec["x_axial_fwd"] = rec["fwd_ms"] / rec["axial_fwd_ms"]
        rec["x_axial_fwdbwd"] = rec["fwdbwd_ms"] / rec["axial_fwdbwd_ms"]

    if cfg.memory:
        fwdbwd = fns["fwdbwd"]
        rec["peak_mb"] = peak_memory_mb(fwdbwd)
        rec["floor_peak_mb"] = peak_memory_mb(fns["floor"])
        exclude = [case.q, case.k, case.coords] + list(module.parameters()) + list(module.buffers())
        rec["saved_mb"] = saved_memory_mb(lambda: module(case.q, case.k, case.coords), exclude)
        case.zero_grads(module)
    log(f"  {case.name:7s} {row.label:30s} fwd {rec['fwd_ms']:9.2f} ms  fwd+bwd {rec['fwdbwd_ms']:9.2f} ms  "
        f"x floor {rec['x_floor']:7.2f}  SDPA {100 * rec['frac_sdpa']:6.1f}%"
        + (f"  peak {rec['peak_mb']:8.1f} MB" if "peak_mb" in rec else ""))
    return rec


# ----------------------------------------------------------------------------- the training-step table
VIT_SETTINGS = {
    # size: (image size, patch size, channels, batch) -- tiny: the MNIST default; base: ViT-B/16 at 224, batch 8
    "tiny": (28, 4, 1, 32),
    "base": (224, 16, 3, 8),
}


def _vit_step(size: str, pe: str, cfg: BenchConfig) -> Callable[[], None]:
    from ..nn import VisionTransformer, vit_config

    image, patch, chans, batch = VIT_SETTINGS[size]
    torch.manual_seed(cfg.seed)
    model = VisionTransformer(vit_config(size, num_classes=10, in_chans=chans, image_size=(image, image),
                                         patch_size=patch, pe=pe))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(batch, chans, image, image, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _bench_vit(size: str, cfg: BenchConfig, log: Callable[[str], None]) -> List[Dict[str, Any]]:
    image, patch, chans, batch = VIT_SETTINGS[size]
    reference = _vit_step(size, "absolute", cfg)
    repeats = cfg.vit_base_repeats if size == "base" else cfg.vit_repeats
    records = []
    for pe in cfg.vit_pes:
        rec: Dict[str, Any] = {"kind": "vit", "label": pe, "pe": pe, "case": f"vit-{size}", "size": size,
                               "batch": batch, "image_size": image, "patch_size": patch, "tokens": (image // patch) ** 2}
        try:
            step = _vit_step(size, pe, cfg)
        except ValueError as e:
            rec["skipped"] = str(e)
            records.append(rec)
            continue
        times = _round_times({"absolute": reference, "step": step}, repeats, 1, CLOCKS[cfg.clock])
        rec.update(repeats=repeats, step_ms=_median(times["step"]), step_ms_min=min(times["step"]),
                   absolute_step_ms=_median(times["absolute"]), absolute_step_ms_min=min(times["absolute"]))
        rec["x_absolute"] = rec["step_ms"] / rec["absolute_step_ms"]
        log(f"  vit-{size:4s} {pe:14s} step {rec['step_ms']:9.1f} ms  absolute {rec['absolute_step_ms']:9.1f} ms  "
            f"x {rec['x_absolute']:5.2f}")
        records.append(rec)
        del step
    return records


# ----------------------------------------------------------------------------- driver
def run_bench(cfg: Optional[BenchConfig] = None, log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Run the benchmark; returns the records (one per row and case, then one per ViT size and encoding).

    The number of torch threads is set to ``cfg.threads`` for the run and restored afterwards.
    """
    cfg = cfg or BenchConfig()
    if cfg.clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {cfg.clock!r}")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    info = machine_info()
    records: List[Dict[str, Any]] = []
    try:
        t_start = time.perf_counter()
        for case_name in cfg.cases:
            case = _make_case(case_name, cfg)
            log(f"[{case_name}] B={cfg.batch} H={cfg.heads} M={cfg.grid ** 2} d={cfg.head_dim} c={case.coord_dim}, "
                f"{cfg.threads} threads")
            for row in cfg.selected_rows():
                records.append(_bench_row(row, case, cfg, log))
        for size in cfg.vit:
            log(f"[vit-{size}] training step, batch {VIT_SETTINGS[size][3]}")
            records.extend(_bench_vit(size, cfg, log))
        elapsed = time.perf_counter() - t_start
    finally:
        torch.set_num_threads(old_threads)
    load_end = machine_info()["load_avg"]
    for rec in records:
        rec.update(threads=cfg.threads, clock=cfg.clock, cpu=info["cpu"], cpus=info["cpus"], torch=info["torch"], quick=cfg.quick,
                   load_avg_start=info["load_avg"], load_avg_end=load_end)
    log(f"done in {elapsed:.0f} s")
    return records


def as_dict(cfg: BenchConfig) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)
