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

plus, for a naive row, the fast row it is the reference of (whose peak and saved memory the naive row records
too: ``fast_peak_mb``, ``fast_saved_mb`` and the ratios ``peak_ratio``, ``saved_ratio`` of fast to naive), and
for a folded row, axial RoPE and the unfolded encoding. Times are medians over the rounds after warm-up (minima
are recorded too); ratios are ratios of medians from the same rounds, so a slow phase of a shared machine affects
both sides. Threads are fixed (``torch.set_num_threads``). Slow rows get fewer rounds (at least 3) so that
every row fits a time budget.
The clock is wall time by default; ``clock="cpu"`` times with the process CPU time instead, which -- with one
thread -- ignores the time the process spends descheduled, so it stays meaningful on a machine shared with
other jobs (with several threads it would add up their CPU time, spin-waits included).

**Cases.** ``grid2d``: the coordinates are the ``g x g`` patch grid ``(M, 2)`` shared by the batch (integer
patch indices). ``rgbd3d``: per-example 3-D coordinates ``(B, M, 3)`` -- the grid plus a depth per patch
(uniform in ``[0, 4)`` patch units) -- so nothing can be shared across the batch.

**In training** (rows of kind ``train``). Inside ``ropekit.nn.Attention`` a commuting encoding does not apply
its basis ``P`` to every token: the layer merges ``P`` into the q/k rows of its projection weight once per step
(``fold=True``, the default) and then rotates each token by its frequencies. What the encoding adds to one
layer's training step is therefore ``fwdbwd`` of: its RoPE form (``ropekit.fold.rope_form``: ``P`` and the
frequencies from its parameters), the merge (``fold_qkv_weight`` of a ``(3 H d, H d)`` weight and bias) and the
rotation of q and k (``frequency_rope``), backward through all three with fixed output gradients. The product of
the projection with the tokens is left out: it is the same with or without the encoding. (Timing a whole layer
with and without the encoding measures the same difference from the outside, but on a CPU the layer's GEMMs
vary by more than the encoding costs.) The form is counted once per layer, as for an encoding of its own; an
encoding shared by several layers computes it once per model forward.

**Memory.** CPU tensors are invisible to ``tracemalloc``, so ``peak_mb`` comes from torch's profiler with
``profile_memory=True``: every allocation and free of the CPU allocator during one forward + backward, in time
order; the peak of their running sum is the memory the encoding needed on top of what existed before (its
outputs, gradients and temporaries). ``saved_mb`` is measured with ``torch.autograd.graph.saved_tensors_hooks``:
the distinct storages autograd keeps for the backward pass, excluding the inputs, the outputs and the
parameters (which exist anyway) -- the activation memory a model pays per encoded layer.

**Training step.** ``vit-tiny`` / ``vit-base``: one optimisation step (forward, cross entropy, backward, AdamW)
of ``ropekit.nn.VisionTransformer`` with each encoding, timed in alternation with the same model with a learned
absolute embedding (``pe="absolute"``). With ``compile`` the table is repeated with ``torch.compile``d models
(the absolute-embedding reference compiled too), and for ``base`` timm's ``vit_base_patch16_224`` (same batch,
same optimiser) is timed in alternation with ropekit's absolute-embedding ViT as an external reference.

**On a GPU** (``device="cuda"``): every call is timed with CUDA events, after a ``torch.cuda.synchronize()`` so
that the queue is empty -- a call's time (its *latency*) then includes its host-side launch overhead when that
dominates (small tensors) and the GPU time otherwise. The encoding table also records the *GPU time* alone
(``*_gpu_ms``, ``x_floor_gpu``): each round first queues a GPU sleep that outlasts the host's queueing of the
round, so the events around a call measure only its kernels -- what the op costs inside a model whose GPU work
hides the host overhead. An op that synchronises the host inside the call (an error check of a factorisation, an
``.item()``) defeats this: its row is marked ``gpu_synced`` and its GPU-time targets are reported as not
isolable. q and k are created in ``dtype`` and the encodings run under ``torch.autocast`` for bf16 / fp16
(parameters stay fp32); the ViT steps use autocast and fused AdamW. The floor is then ``q * c, k * c`` (two
elementwise products with a fixed ``(M, d)`` table, forward + backward): the memory traffic of a rotation of q
and k without its arithmetic. ``peak_mb`` is the growth of
``torch.cuda.max_memory_allocated`` during one forward + backward. Rows of kind ``kernel`` time
``ropekit.kernels.fused_rotary`` alone (per-head mixed frequencies), where the device can run it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..encodings import create_pe
from ..encodings.registry import PE_REGISTRY
from ..encodings.fold import fold_pe, fold_qkv_weight, frequency_rope, rope_form
from . import measure
from .baselines import DenseComRoPE, NaiveLieRE
from .measure import (CLOCKS, cuda_peak_memory_mb, device_info, impossible_timing, machine_info, peak_memory_mb,
                      ratio_spread, saved_memory_mb, too_noisy)
from .training_step import bench_vit, vit_batch, vit_step

__all__ = ["Row", "all_rows", "ROW_KINDS", "CASES", "VIT_PES", "VIT_PES_GPU", "DTYPES", "BenchConfig", "run_bench",
           "ratio_spread", "too_noisy",
           "peak_memory_mb", "cuda_peak_memory_mb", "saved_memory_mb", "device_info", "machine_info", "vit_step"]

CASES = ("grid2d", "rgbd3d")


@dataclass(frozen=True)
class Row:
    """One line of the encoding table.

    ``kind``: ``"pe"`` (``create_pe(pe, **options)``), ``"naive"`` (a reference form from
    :mod:`ropekit.bench.baselines` wrapping the encoding ``pe``; ``base`` names the fast row), or ``"folded"``
    (``fold_pe`` of ``pe``; ``base`` names the unfolded row), or ``"train"`` (the encoding's work in one
    attention layer's training step, folded as ``ropekit.nn.Attention`` does it; ``base`` names the encoding
    alone). ``heavy`` rows are left out by ``--quick``.
    """

    label: str
    pe: str
    options: Tuple[Tuple[str, Any], ...] = ()
    kind: str = "pe"
    base: Optional[str] = None
    heavy: bool = False
    device: Optional[str] = None  # only on this device type (e.g. "cuda" for the Triton kernel rows)

    @property
    def opts(self) -> Dict[str, Any]:
        return dict(self.options)


#: Kinds of rows, in the order of the table.
ROW_KINDS = ("pe", "folded", "train", "naive", "kernel")
#: Rows of the table that are no encoding's: the fused rotation kernel alone.
KERNEL_ROWS = (Row("fused kernel (mixed freqs)", "mixed", kind="kernel", device="cuda"),)


def all_rows() -> List[Row]:
    """Every row of the encoding table: the rows each registered encoding declares (``register_pe(...,
    bench_rows=...)``), by kind (``ROW_KINDS``) and then in registration order, then the kernel row."""
    rows = [Row(r.label, name, r.options, r.kind, r.base, r.heavy)
            for name, cls in PE_REGISTRY.items() for r in cls.bench_rows] + list(KERNEL_ROWS)
    return sorted(rows, key=lambda r: ROW_KINDS.index(r.kind))


#: Encodings of the training-step table (``absolute`` is the reference every ratio is taken against): every
#: registered one, with its ``bench_vit_options``.
VIT_PES = tuple(PE_REGISTRY)
#: The training-step table on a GPU (ViT-B/16 at batch 128 by default): the encodings registered with
#: ``bench_vit_gpu=True``.
VIT_PES_GPU = tuple(name for name, cls in PE_REGISTRY.items() if cls.bench_vit_gpu)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: ``torch.compile`` modes of the compiled training-step table.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


#: What ``ropekit bench --quick`` changes on top of :meth:`BenchConfig.quick_config` unless given: the rgbd3d case
#: and the profiler's memory measurements were half of its time.
QUICK_CLI: Dict[str, Any] = {"cases": ("grid2d",), "memory": False}


@dataclass
class BenchConfig:
    """What ``ropekit bench`` measures (defaults: one attention layer of ViT-B/16, batch 8 on the CPU; use
    :meth:`cuda_config` for the GPU defaults)."""

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
    max_spread: Optional[float] = 0.5  # refuse a row whose headline ratio varies more between rounds, or whose
    # forward alone took longer than forward + backward (None: never refuse, e.g. for tests of the plumbing)
    memory: bool = True
    check: bool = True  # compare naive rows' outputs and gradients with the fast rows
    vit: Tuple[str, ...] = ("tiny", "base")
    vit_pes: Tuple[str, ...] = VIT_PES
    vit_repeats: int = 5
    vit_base_repeats: int = 2
    quick: bool = False
    seed: int = 0
    device: str = "cpu"
    dtype: str = "fp32"  # q/k dtype and autocast dtype ("fp32": no autocast)
    vit_batch: Optional[int] = None  # batch of the ViT steps (None: 32 tiny, 8 base on the CPU; 128 base on a GPU)
    compile: bool = False  # also the training-step table under torch.compile
    compile_mode: str = "default"  # torch.compile's mode: "default", "reduce-overhead" (CUDA graphs), "max-autotune"
    vit_modes: Optional[Tuple[str, ...]] = None  # "eager" and/or "compiled"; None: eager (+ compiled if compile)
    timm: bool = True  # timm's vit_base_patch16_224 row (base size only)

    @classmethod
    def quick_config(cls, **overrides: Any) -> "BenchConfig":
        """The reduced variant: every encoding and the folded rows, 3 rounds, no naive reference rows (each costs
        seconds per call), tiny ViT only. ``ropekit bench --quick`` also keeps to the ``grid2d`` case and leaves
        out the memory profile (:data:`QUICK_CLI`)."""
        base = dict(repeats=3, warmup=1, row_budget_s=3.0, vit=("tiny",), vit_repeats=2, quick=True)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def cuda_config(cls, **overrides: Any) -> "BenchConfig":
        """GPU defaults: one attention layer of ViT-B/16 at batch 64 in bf16, 20 rounds, the ViT-B/16 training step
        at batch 128 (eager and compiled) for :data:`VIT_PES_GPU`, a 3 s budget per row."""
        base = dict(device="cuda", dtype="bf16", batch=64, repeats=20, warmup=3, row_budget_s=3.0, vit=("base",),
                    vit_pes=VIT_PES_GPU, vit_batch=128, vit_base_repeats=10, compile=True)
        base.update(overrides)
        return cls(**base)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]

    @property
    def on_gpu(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def selected_rows(self) -> List[Row]:
        dev = torch.device(self.device).type
        rows = [r for r in all_rows() if not (self.quick and (r.heavy or r.kind == "naive"))
                and (r.device is None or r.device == dev)]
        if self.rows:
            wanted = set(self.rows)
            rows = [r for r in rows if r.label in wanted or r.pe in wanted]
        return rows


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
    table: Optional[Tensor] = None  # (M, d) fixed table of the GPU floor q * c, k * c
    autocast: Optional[torch.dtype] = None
    extra_grads: Dict[Tuple[int, ...], Tensor] = field(default_factory=dict)

    def grads_for(self, out: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """Fixed output gradients: ``gq``, ``gk`` for ``(B, H, M, d)`` q and k, fixed random tensors otherwise
        (the tensor-product encoding widens q and k; a training row also returns the folded weight and bias)."""
        if out[0].shape == self.gq.shape:
            head: Tuple[Tensor, ...] = (self.gq, self.gk)
        else:
            head = tuple(self._fixed(tuple(out[0].shape), 2, out[0].dtype).unbind(0))
        return head + tuple(self._fixed(tuple(o.shape), 1, o.dtype)[0] for o in out[2:])

    def _fixed(self, shape: Tuple[int, ...], n: int, dtype: torch.dtype) -> Tensor:
        """``n`` fixed random tensors of ``shape``, stacked (made once per shape and count)."""
        key = (n,) + shape
        if key not in self.extra_grads:
            g = torch.Generator().manual_seed(1)
            self.extra_grads[key] = torch.randn(n, *shape, generator=g).to(self.gq.device, dtype)
        return self.extra_grads[key]

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
    dev, dt = torch.device(cfg.device), cfg.torch_dtype

    def leaf() -> Tensor:
        return t().to(dev, dt).requires_grad_()

    table = torch.randn(m, d, generator=g).to(dev, dt) if cfg.on_gpu else None
    autocast = dt if dt != torch.float32 else None
    return _Case(name, leaf(), leaf(), leaf(), t().to(dev, dt), t().to(dev, dt), coords.to(dev), table, autocast)


def _autocast(case: _Case):
    if case.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(case.q.device.type, dtype=case.autocast)


def _pe(row: Row, case: _Case, cfg: BenchConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)
    return create_pe(row.pe, head_dim=cfg.head_dim, coord_dim=case.coord_dim, num_heads=cfg.heads,
                     **row.opts).to(cfg.device)


class _KernelRotation(nn.Module):
    """``ropekit.kernels.fused_rotary`` with learnable per-head frequencies ``(H, c, d / 2)``: the kernel alone."""

    def __init__(self, heads: int, coord_dim: int, head_dim: int, device: Any) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.freqs = nn.Parameter((torch.rand(heads, coord_dim, head_dim // 2, generator=g) * 0.5).to(device))

    def forward(self, q: Tensor, k: Tensor, coords: Tensor) -> Tuple[Tensor, Tensor]:
        from ..kernels import fused_rotary

        return fused_rotary(q, k, coords, self.freqs)


class _TrainingPath(nn.Module):
    """What a foldable encoding adds to one attention layer's training step (``ropekit.nn.Attention`` with
    ``fold=True``): its RoPE form from its parameters, the merge of the basis into a ``(3 H d, H d)`` q/k/v
    projection weight and bias, and the frequency rotation of q and k. Returns ``(q', k')`` and, when the
    encoding has a basis, the folded ``(weight, bias)`` too, so that a backward pass reaches every parameter as
    in training. The projection's product with the tokens is not included: it costs the same without the
    encoding."""

    def __init__(self, pe: nn.Module, heads: int, head_dim: int, device: Any, seed: int) -> None:
        super().__init__()
        dim = heads * head_dim
        g = torch.Generator().manual_seed(seed)
        self.pe, self.heads = pe, heads
        self.weight = nn.Parameter((torch.randn(3 * dim, dim, generator=g) * dim ** -0.5).to(device))
        self.bias = nn.Parameter(torch.zeros(3 * dim, device=device))

    def forward(self, q: Tensor, k: Tensor, coords: Tensor) -> Tuple[Tensor, ...]:
        form = rope_form(self.pe)
        q, k = frequency_rope(q, k, coords, form)
        if form.basis is None:  # the RoPE family: nothing to merge
            return q, k
        weight, bias = fold_qkv_weight(self.weight, self.bias, form.basis, self.heads, blocks=form.blocks)
        return q, k, weight, bias


def _naive(row: Row, pe: nn.Module) -> nn.Module:
    return NaiveLieRE(pe) if row.pe == "liere" else DenseComRoPE(pe)


def _fns(module: nn.Module, case: _Case) -> Tuple[Callable[[], Any], Callable[[], Any]]:
    """``(fwd, fwdbwd)`` closures of an encoding-like ``module(q, k, coords) -> (q', k')``."""

    def fwd() -> None:
        with torch.no_grad(), _autocast(case):
            module(case.q, case.k, case.coords)

    def fwdbwd() -> None:
        with _autocast(case):
            out = module(case.q, case.k, case.coords)
        torch.autograd.backward(out, case.grads_for(out))
        case.zero_grads(module)

    return fwd, fwdbwd


def _reference_fns(case: _Case, cfg: BenchConfig) -> Dict[str, Callable[[], Any]]:
    none = create_pe("none", head_dim=cfg.head_dim, coord_dim=case.coord_dim, num_heads=cfg.heads).to(cfg.device)

    def floor() -> None:
        if case.table is None:  # CPU: one product, q * k
            (case.q * case.k).backward(case.gq)
        else:  # GPU: the traffic of rotating q and k, q * c and k * c
            torch.autograd.backward((case.q * case.table, case.k * case.table), (case.gq, case.gk))
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
        with _autocast(case):
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
        if row.kind == "kernel":
            from ..kernels import available

            if not available(cfg.device):
                rec["skipped"] = f"the Triton kernel cannot run on {cfg.device}"
                return rec
            pe = _KernelRotation(cfg.heads, case.coord_dim, cfg.head_dim, cfg.device)
        else:
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
        axial = create_pe("axial", head_dim=cfg.head_dim, coord_dim=case.coord_dim, num_heads=cfg.heads).to(cfg.device)
        fns["axial_fwd"], fns["axial_fwdbwd"] = _fns(axial, case)
        fns["unfolded_fwd"], _ = _fns(pe, case)
    elif row.kind == "train":
        module = _TrainingPath(pe, cfg.heads, cfg.head_dim, cfg.device, cfg.seed)
    fns["fwd"], fns["fwdbwd"] = _fns(module, case)

    try:
        # one call to size the number of rounds to the budget
        t0 = time.perf_counter()
        fns["fwdbwd"]()
        measure.sync(cfg)
        first = time.perf_counter() - t0
        per_round = first * (3 if row.kind != "pe" else 2) + 0.05
        repeats = max(3, min(cfg.repeats, int(cfg.row_budget_s / per_round)))
        warmup = cfg.warmup if first < 1.0 else 0
        times = measure.round_times(fns, repeats, warmup, measure.clock_of(cfg))
    except RuntimeError as e:  # out of memory on a huge naive row
        rec["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return rec
    rec["repeats"] = repeats
    for name, v in times.items():
        key = name if name in ("fwd", "fwdbwd") else f"{name}_fwdbwd" if name in ("floor", "sdpa", "none") else name
        rec[f"{key}_ms"] = measure.median(v)
        rec[f"{key}_ms_min"] = min(v)
    contradiction = impossible_timing(times["fwd"], times["fwdbwd"]) if cfg.max_spread is not None else None
    if contradiction is not None:  # (the numbers stay in the record; the tables leave the row out, saying why)
        rec["skipped"] = contradiction
        log(f"  {case.name:7s} {row.label:30s} {contradiction}")
        return rec
    for ratio, ref in (("x_none", "none"), ("x_floor", "floor"), ("frac_sdpa", "sdpa")):
        rec[f"{ratio}_spread"] = ratio_spread(times["fwdbwd"], times[ref])[1]
    noisy = too_noisy("x floor", times["fwdbwd"], times["floor"], cfg.max_spread)
    if noisy is not None:
        rec["skipped"] = noisy
        log(f"  {case.name:7s} {row.label:30s} {noisy}")
        return rec
    rec["x_none"] = rec["fwdbwd_ms"] / rec["none_fwdbwd_ms"]
    rec["x_floor"] = rec["fwdbwd_ms"] / rec["floor_fwdbwd_ms"]
    rec["frac_sdpa"] = rec["fwdbwd_ms"] / rec["sdpa_fwdbwd_ms"]
    if cfg.on_gpu:  # GPU time alone (host overhead hidden behind a queued sleep): what the op costs in a model
        gpu, synced = measure.gpu_times({k: fns[k] for k in ("fwd", "fwdbwd", "floor", "sdpa", "none")}, repeats,
                                 case.q.device)
        if synced:  # the op waits for the GPU inside the call: its GPU time cannot be isolated from host gaps
            rec["gpu_synced"] = True
        for name, v in gpu.items():
            key = name if name in ("fwd", "fwdbwd") else f"{name}_fwdbwd"
            rec[f"{key}_gpu_ms"] = measure.median(v)
        rec["x_floor_gpu"] = rec["fwdbwd_gpu_ms"] / rec["floor_fwdbwd_gpu_ms"]
        rec["frac_sdpa_gpu"] = rec["fwdbwd_gpu_ms"] / rec["sdpa_fwdbwd_gpu_ms"]
    if row.kind == "naive":
        rec["speedup_fwdbwd"] = rec["fwdbwd_ms"] / rec["fast_fwdbwd_ms"]
        rec["speedup_fwd"] = rec["fwd_ms"] / rec["fast_fwd_ms"]
        if cfg.check:
            rec["check_max_rel_err"] = _max_rel_err(pe, module, case)
            case.zero_grads(pe)
    if row.kind == "folded":
        rec["x_axial_fwd"] = rec["fwd_ms"] / rec["axial_fwd_ms"]
        rec["x_axial_fwd_spread"] = ratio_spread(times["fwd"], times["axial_fwd"])[1]
        rec["x_axial_fwdbwd"] = rec["fwdbwd_ms"] / rec["axial_fwdbwd_ms"]

    if cfg.memory:
        fwdbwd = fns["fwdbwd"]
        peak = (lambda fn: cuda_peak_memory_mb(fn, case.q.device)) if cfg.on_gpu else peak_memory_mb
        rec["peak_mb"] = peak(fwdbwd)
        rec["floor_peak_mb"] = peak(fns["floor"])
        exclude = [case.q, case.k, case.coords] + list(module.parameters()) + list(module.buffers())

        def forward() -> Any:
            with _autocast(case):
                return module(case.q, case.k, case.coords)

        rec["saved_mb"] = saved_memory_mb(forward, exclude)
        case.zero_grads(module)
        if row.kind == "naive":  # the fast row's memory measured in this run too: the ratios of one run
            rec["fast_peak_mb"] = peak(fns["fast_fwdbwd"])

            def fast_forward() -> Any:
                with _autocast(case):
                    return pe(case.q, case.k, case.coords)

            rec["fast_saved_mb"] = saved_memory_mb(fast_forward, exclude)
            case.zero_grads(pe)
            rec["peak_ratio"] = rec["fast_peak_mb"] / max(rec["peak_mb"], 1e-9)
            rec["saved_ratio"] = rec["fast_saved_mb"] / max(rec["saved_mb"], 1e-9)
    log(f"  {case.name:7s} {row.label:30s} fwd {rec['fwd_ms']:9.2f} ms  fwd+bwd {rec['fwdbwd_ms']:9.2f} ms  "
        f"x floor {rec['x_floor']:7.2f} (spread {100 * rec['x_floor_spread']:3.0f}%)  "
        f"SDPA {100 * rec['frac_sdpa']:6.1f}%"
        + (f"  GPU time {rec['fwdbwd_gpu_ms']:7.3f} ms x floor {rec['x_floor_gpu']:5.2f}" if cfg.on_gpu else "")
        + ("  (synchronises the host)" if rec.get("gpu_synced") else "")
        + (f"  peak {rec['peak_mb']:8.1f} MB" if "peak_mb" in rec else ""))
    return rec



# ----------------------------------------------------------------------------- driver
def run_bench(cfg: Optional[BenchConfig] = None, log: Callable[[str], None] = print,
              on_record: Optional[Callable[[List[Dict[str, Any]]], None]] = None) -> List[Dict[str, Any]]:
    """Run the benchmark; returns the records (one per row and case, then one per ViT size and encoding).

    ``on_record(records)`` is called with the records so far after each row (e.g. to save partial results of a
    run that may be cut short).

    The number of torch threads is set to ``cfg.threads`` for the run and restored afterwards.
    """
    cfg = cfg or BenchConfig()
    if cfg.clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {cfg.clock!r}")
    cfg.torch_dtype  # validates the name
    if cfg.on_gpu and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r} requested but CUDA is not available")
    modes = cfg.vit_modes or (("eager", "compiled") if cfg.compile else ("eager",))
    for mode in modes:  # checked before anything is measured
        if mode not in ("eager", "compiled"):
            raise ValueError(f"ViT modes are 'eager' and 'compiled', got {mode!r}")
    if cfg.compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {cfg.compile_mode!r}")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    info = machine_info()
    info.update(device_info(cfg.device))
    records: List[Dict[str, Any]] = []
    try:
        t_start = time.perf_counter()
        for case_name in cfg.cases:
            case = _make_case(case_name, cfg)
            log(f"[{case_name}] B={cfg.batch} H={cfg.heads} M={cfg.grid ** 2} d={cfg.head_dim} c={case.coord_dim}, "
                f"{cfg.dtype} on {cfg.device}, {cfg.threads} threads")
            for row in cfg.selected_rows():
                records.append(_bench_row(row, case, cfg, log))
                _stamp(records[-1:], cfg, info)
                if on_record:
                    on_record(records)
        for size in cfg.vit:
            for mode in modes:
                compiled = mode == "compiled"
                log(f"[vit-{size}] training step, batch {vit_batch(size, cfg)}, {cfg.dtype}"
                    + ((", torch.compile" + ("" if cfg.compile_mode == "default" else f" (mode={cfg.compile_mode})"))
                       if compiled else ""))
                recs = bench_vit(size, cfg, log, compiled)
                _stamp(recs, cfg, info)
                records.extend(recs)
                if on_record:
                    on_record(records)
        elapsed = time.perf_counter() - t_start
    finally:
        torch.set_num_threads(old_threads)
    load_end = machine_info()["load_avg"]
    for rec in records:
        rec["load_avg_end"] = load_end
    log(f"done in {elapsed:.0f} s")
    return records


def _stamp(records: List[Dict[str, Any]], cfg: BenchConfig, info: Dict[str, Any]) -> None:
    """Machine, device and settings into each record."""
    for rec in records:
        rec.update(threads=cfg.threads, clock="cuda events" if cfg.on_gpu else cfg.clock, cpu=info["cpu"],
                   cpus=info["cpus"], torch=info["torch"], quick=cfg.quick, load_avg_start=info["load_avg"],
                   allocator=info["allocator"],
                   device=cfg.device, dtype=cfg.dtype,
                   **{k: info[k] for k in ("gpu", "capability", "cuda", "triton", "tf32_matmul") if k in info})
