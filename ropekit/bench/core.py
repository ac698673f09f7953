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
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._platform import numerics_fingerprint
from ..encodings import create_pe
from ..encodings.registry import PE_REGISTRY
from ..encodings.fold import fold_pe, fold_qkv_weight, frequency_rope, rope_form
from .baselines import DenseComRoPE, NaiveLieRE

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
    max_spread: Optional[float] = 0.5  # refuse a row whose headline ratio varies more between rounds (None: never)
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


# ----------------------------------------------------------------------------- measurement primitives
CLOCKS: Dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def _round_times(fns: Dict[str, Callable[[], Any]], repeats: int, warmup: int,
                 clock: Any = time.perf_counter) -> Dict[str, List[float]]:
    """Milliseconds of every function, interleaved: each round calls every function once, in turn.

    ``clock``: a host clock (a function returning seconds), or ``"cuda"``: CUDA events recorded around each call,
    after a synchronisation (the call's launch overhead counts when the GPU would wait for it).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    if clock == "cuda":
        for _ in range(repeats):
            for name, fn in fns.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
        return times
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append((clock() - t0) * 1e3)
    return times


_CYCLES_PER_MS: Dict[int, float] = {}


def _cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured once per device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS[idx] = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    return _CYCLES_PER_MS[idx]


class _SleepPlan:
    """How long a GPU sleep :func:`_gpu_times` queues before each round, and whether a round's calls synchronised.

    Round 0 runs without a sleep and measures the host time ``h`` of queueing one round. Every later round queues
    ``2 h + 0.5`` ms of GPU sleep first. A round whose host time reaches the sleep's length waited for the GPU: one
    of its calls synchronised the host (a ``.item()``, an error check of a factorisation), so the events around the
    calls include host gaps and do not isolate their GPU work. Such a round is counted, and its host time -- the
    sleep plus the work -- is not taken as the host's: it would double the next sleep, and the next, without bound.
    """

    def __init__(self) -> None:
        self.host_ms: Optional[float] = None
        self.synced_rounds = 0

    def sleep_ms(self) -> float:
        """GPU sleep to queue before the next round (0 before the calibration round)."""
        return 0.0 if self.host_ms is None else 2.0 * self.host_ms + 0.5

    def observe(self, host_ms: float) -> None:
        """Record the host time of the round just queued behind ``sleep_ms()`` of sleep."""
        slept = self.sleep_ms()
        if self.host_ms is None:
            self.host_ms = host_ms
        elif host_ms >= 0.9 * slept:  # the host waited for the sleep: a call synchronised
            self.synced_rounds += 1
        else:
            self.host_ms = max(self.host_ms, host_ms)


def _gpu_times(fns: Dict[str, Callable[[], Any]], repeats: int,
               device: torch.device) -> Tuple[Dict[str, List[float]], bool]:
    """GPU milliseconds of every function, host overhead excluded: each round first queues a GPU sleep long enough
    for the host to queue all the round's calls behind it, so that the events around a call see only its GPU work.

    Returns ``(times, synced)``: ``synced`` is True when a call synchronised the host in most rounds -- its
    "GPU time" then includes host gaps and is not the op's GPU cost (see :class:`_SleepPlan`)."""
    times: Dict[str, List[float]] = {name: [] for name in fns}
    plan = _SleepPlan()
    for r in range(repeats + 1):  # round 0 calibrates the host time of one round
        events = []
        torch.cuda.synchronize()
        if r:
            torch.cuda._sleep(int(_cycles_per_ms(device) * plan.sleep_ms()))
        t0 = time.perf_counter()
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((name, start, end))
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        plan.observe(host)
        if r == 0:
            continue
        for name, start, end in events:
            times[name].append(start.elapsed_time(end))
    return times, plan.synced_rounds * 2 > repeats


def _clock(cfg: "BenchConfig") -> Any:
    return "cuda" if cfg.on_gpu else CLOCKS[cfg.clock]


def _sync(cfg: "BenchConfig") -> None:
    if cfg.on_gpu:
        torch.cuda.synchronize()


def cuda_peak_memory_mb(fn: Callable[[], Any], device: Any = None) -> float:
    """Growth (MiB) of the CUDA allocator's peak over what was allocated before, while ``fn`` runs."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20


def _median(v: Sequence[float]) -> float:
    return float(statistics.median(v))


def impossible_timing(fwd: Sequence[float], fwdbwd: Sequence[float]) -> Optional[str]:
    """Why a row's timings cannot be reported, or ``None``: a forward pass is part of forward + backward, so in the
    interleaved rounds (one ``fwd`` and one ``fwdbwd`` call each, back to back) the ratio ``fwd / fwdbwd`` is below 1
    on a quiet machine. When its median over the rounds is 1 or more, the machine's noise exceeded the difference
    being measured and every ratio of the row would mislead; the message gives the median ratio and its spread (the
    interquartile range over the rounds, relative to the median)."""
    ratios = [f / b for f, b in zip(fwd, fwdbwd) if b > 0]
    if not ratios:
        return None
    med = float(statistics.median(ratios))
    if med < 1.0:
        return None
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (med, med, med)
    return (f"refused: forward alone took {med:.2f}x forward+backward (median of {len(ratios)} interleaved rounds, "
            f"spread {100 * (q3 - q1) / med:.0f}%): timing noise larger than the work; rerun on a quieter machine")


def ratio_spread(num: Sequence[float], den: Sequence[float]) -> Tuple[float, float]:
    """``(median, spread)`` of the per-round ratios ``num[i] / den[i]`` of interleaved rounds (round ``i`` timed both
    calls back to back, so a slow phase of the machine moves both): the spread is the interquartile range of the
    ratios relative to their median (0 for one round; ``inf`` for a median of 0). Rounds with ``den[i] <= 0`` are
    left out; no usable round gives ``(nan, inf)``."""
    ratios = [n / d for n, d in zip(num, den) if d > 0]
    if not ratios:
        return float("nan"), float("inf")
    med = float(statistics.median(ratios))
    if len(ratios) == 1:
        return med, 0.0
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return med, (float(q3 - q1) / med if med > 0 else float("inf"))


def too_noisy(name: str, num: Sequence[float], den: Sequence[float], max_spread: Optional[float]) -> Optional[str]:
    """Why a row is refused because its ratio ``name`` varies too much between the interleaved rounds (its spread,
    see :func:`ratio_spread`, is above ``max_spread``), or ``None``. A ratio known only to within more than
    ``max_spread`` of itself cannot decide a target or rank two encodings."""
    if max_spread is None:
        return None
    _, spread = ratio_spread(num, den)
    if spread <= max_spread:
        return None
    return (f"refused: {name} varied by {100 * spread:.0f}% between rounds (interquartile range of {len(num)} "
            f"interleaved rounds, limit {100 * max_spread:.0f}%): timing noise larger than the differences measured; "
            f"rerun on a quieter machine or with more --repeats")


@contextlib.contextmanager
def native_output_to_stderr() -> Iterator[None]:
    """Send what native code writes to standard output (the profiler's and the drivers' start-up lines: ``USDT ...
    profiler_start``, ``gpuGetDeviceCount failed ...``) to standard error while the block runs, so that the
    benchmark's stdout holds its report only. C's buffers are flushed before the descriptor is given back."""
    import ctypes

    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).fflush(None)
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def peak_memory_mb(fn: Callable[[], Any]) -> float:
    """Peak extra CPU memory (MiB) allocated by torch while ``fn`` runs, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with native_output_to_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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
    """The numerics fingerprint of this process (CPU, instruction set, torch, threads) plus what else moves a
    timing: CPU count, Python, load average and allocator settings."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {**numerics_fingerprint(), "cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": load,
            "allocator": allocator_settings()}


#: Environment variables that change how the C library allocates the CPU's tensors (glibc's tunables, a preloaded
#: allocator such as jemalloc or tcmalloc): on the CPU they move the figures of rows with large temporaries.
ALLOCATOR_VARIABLES = ("LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                       "MALLOC_ARENA_MAX", "GLIBC_TUNABLES", "MALLOC_CONF")


def allocator_settings() -> str:
    """The allocator settings of this process as one line: ``"C library defaults"`` or the variables that are set,
    e.g. ``"MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824"``."""
    set_ = [f"{k}={os.environ[k]}" for k in ALLOCATOR_VARIABLES if os.environ.get(k)]
    return " ".join(set_) if set_ else "C library defaults"


def device_info(device: Any) -> Dict[str, Any]:
    """Name, capability and library versions of a CUDA device (empty for the CPU)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    info: Dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev), "capability": ".".join(
        map(str, torch.cuda.get_device_capability(dev))), "cuda": torch.version.cuda,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        pass
    return info


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
        _sync(cfg)
        first = time.perf_counter() - t0
        per_round = first * (3 if row.kind != "pe" else 2) + 0.05
        repeats = max(3, min(cfg.repeats, int(cfg.row_budget_s / per_round)))
        warmup = cfg.warmup if first < 1.0 else 0
        times = _round_times(fns, repeats, warmup, _clock(cfg))
    except RuntimeError as e:  # out of memory on a huge naive row
        rec["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return rec
    rec["repeats"] = repeats
    for name, v in times.items():
        key = name if name in ("fwd", "fwdbwd") else f"{name}_fwdbwd" if name in ("floor", "sdpa", "none") else name
        rec[f"{key}_ms"] = _median(v)
        rec[f"{key}_ms_min"] = min(v)
    contradiction = impossible_timing(times["fwd"], times["fwdbwd"])
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
        gpu, synced = _gpu_times({k: fns[k] for k in ("fwd", "fwdbwd", "floor", "sdpa", "none")}, repeats,
                                 case.q.device)
        if synced:  # the op waits for the GPU inside the call: its GPU time cannot be isolated from host gaps
            rec["gpu_synced"] = True
        for name, v in gpu.items():
            key = name if name in ("fwd", "fwdbwd") else f"{name}_fwdbwd"
            rec[f"{key}_gpu_ms"] = _median(v)
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


# ----------------------------------------------------------------------------- the training-step table
VIT_SETTINGS = {
    # size: (image size, patch size, channels, batch on the CPU) -- tiny: the MNIST default; base: ViT-B/16 at 224
    "tiny": (28, 4, 1, 32),
    "small": (224, 16, 3, 8),
    "base": (224, 16, 3, 8),
}

#: timm's model of the same shape as ropekit's named size (the external reference of the training-step table).
TIMM_MODELS = {"base": "vit_base_patch16_224", "small": "vit_small_patch16_224"}


def _vit_batch(size: str, cfg: BenchConfig) -> int:
    if cfg.vit_batch is not None:
        return cfg.vit_batch
    return 128 if (cfg.on_gpu and size == "base") else VIT_SETTINGS[size][3]


def _train_step(model: nn.Module, size: str, cfg: BenchConfig, compiled: bool, fused_adamw: Optional[bool] = None,
                image_size: Optional[int] = None) -> Callable[[], None]:
    """One optimisation step (forward, cross entropy, backward, AdamW) of ``model`` on fixed random data (fused
    AdamW on a GPU, or where ``fused_adamw`` asks for it; images of ``image_size``, default the size's)."""
    image, _, chans, _ = VIT_SETTINGS[size]
    image = image_size or image
    batch = _vit_batch(size, cfg)
    dev = torch.device(cfg.device)
    model = model.to(dev).train()
    fused = {"fused": True} if (cfg.on_gpu if fused_adamw is None else fused_adamw) else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(batch, chans, image, image, generator=g).to(dev)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)
    dt = cfg.torch_dtype
    fwd = torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode) if compiled else model

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with (torch.autocast(dev.type, dtype=dt) if dt != torch.float32 else contextlib.nullcontext()):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()

    return step


def _vit_options(pe: str) -> Dict[str, Any]:
    """The options of ``pe`` in the training-step table (its class's ``bench_vit_options``)."""
    cls = PE_REGISTRY.get(pe)
    return dict(cls.bench_vit_options) if cls is not None else {}


def vit_step(size: str, pe: str, cfg: BenchConfig, compiled: bool = False, fused_adamw: Optional[bool] = None,
              image_size: Optional[int] = None) -> Callable[[], None]:
    """The training step of the ViT table for encoding ``pe`` (see ``_train_step``)."""
    from ..nn import VisionTransformer, vit_config

    image, patch, chans, _ = VIT_SETTINGS[size]
    image = image_size or image
    torch.manual_seed(cfg.seed)
    model = VisionTransformer(vit_config(size, num_classes=10, in_chans=chans, image_size=(image, image),
                                         patch_size=patch, pe=pe, pe_options=_vit_options(pe)))
    return _train_step(model, size, cfg, compiled, fused_adamw, image)


def _timm_step(size: str, cfg: BenchConfig, compiled: bool) -> Callable[[], None]:
    import timm  # optional: the caller records a skipped row when it is missing

    torch.manual_seed(cfg.seed)
    model = timm.create_model(TIMM_MODELS[size], pretrained=False, num_classes=10)
    return _train_step(model, size, cfg, compiled)


def _release(cfg: BenchConfig) -> None:
    if cfg.on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _bench_vit(size: str, cfg: BenchConfig, log: Callable[[str], None], compiled: bool = False) -> List[Dict[str, Any]]:
    image, patch, chans, _ = VIT_SETTINGS[size]
    batch = _vit_batch(size, cfg)
    mode = "compiled" if compiled else "eager"
    reference = vit_step(size, "absolute", cfg, compiled)
    repeats = cfg.vit_base_repeats if size != "tiny" else cfg.vit_repeats
    records = []
    rows: List[Tuple[str, Callable[[], Callable[[], None]]]] = [
        (pe, (lambda pe=pe: vit_step(size, pe, cfg, compiled))) for pe in cfg.vit_pes]
    if cfg.timm and size in TIMM_MODELS:
        rows.append((f"timm {TIMM_MODELS[size]}", lambda: _timm_step(size, cfg, compiled)))
    for label, make in rows:
        rec: Dict[str, Any] = {"kind": "vit", "label": label, "pe": label, "case": f"vit-{size}", "size": size,
                               "mode": mode, "compile_mode": cfg.compile_mode if compiled else None, "batch": batch,
                               "image_size": image, "patch_size": patch, "tokens": (image // patch) ** 2,
                               "dtype": cfg.dtype}
        try:
            step = make()
            t0 = time.perf_counter()
            step()  # the first call compiles (torch.compile) and allocates the optimiser state
            _sync(cfg)
            rec["first_step_s"] = time.perf_counter() - t0
            times = _round_times({"absolute": reference, "step": step}, repeats, 2 if cfg.on_gpu else 1,
                                 _clock(cfg))
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
            _release(cfg)
            continue
        rec.update(repeats=repeats, step_ms=_median(times["step"]), step_ms_min=min(times["step"]),
                   absolute_step_ms=_median(times["absolute"]), absolute_step_ms_min=min(times["absolute"]))
        rec["x_absolute_spread"] = ratio_spread(times["step"], times["absolute"])[1]
        noisy = too_noisy("x absolute", times["step"], times["absolute"], cfg.max_spread)
        if noisy is not None:
            rec["skipped"] = noisy
            records.append(rec)
            log(f"  vit-{size:4s} {mode:8s} {label:14s} {noisy}")
            del step
            _release(cfg)
            continue
        rec["x_absolute"] = rec["step_ms"] / rec["absolute_step_ms"]
        log(f"  vit-{size:4s} {mode:8s} {label:14s} step {rec['step_ms']:9.1f} ms  absolute "
            f"{rec['absolute_step_ms']:9.1f} ms  x {rec['x_absolute']:5.2f} (spread "
            f"{100 * rec['x_absolute_spread']:.0f}%)")
        records.append(rec)
        del step
        _release(cfg)
    return records


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
                log(f"[vit-{size}] training step, batch {_vit_batch(size, cfg)}, {cfg.dtype}"
                    + ((", torch.compile" + ("" if cfg.compile_mode == "default" else f" (mode={cfg.compile_mode})"))
                       if compiled else ""))
                recs = _bench_vit(size, cfg, log, compiled)
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
