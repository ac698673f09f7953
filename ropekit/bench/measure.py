"""The measurement primitives of ``ropekit bench``: interleaved rounds of timed calls (host clocks, CUDA events,
GPU time with the host's overhead hidden), the spread of a ratio over rounds, peak and saved memory, and the
machine's description stamped into every record.

Interleaving is the point: each round calls every function once, in turn, so a slow phase of a shared machine
slows both sides of a ratio. Everything here is independent of what is timed (encodings, ViT steps, pipelines).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._platform import numerics_fingerprint

__all__ = ["CLOCKS", "round_times", "gpu_times", "clock_of", "sync", "median", "impossible_timing", "ratio_spread",
           "too_noisy", "native_output_to_stderr", "peak_memory_mb", "cuda_peak_memory_mb", "saved_memory_mb",
           "machine_info", "ALLOCATOR_VARIABLES", "allocator_settings", "device_info"]


CLOCKS: Dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def round_times(fns: Dict[str, Callable[[], Any]], repeats: int, warmup: int,
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


CYCLES_PER_MS: Dict[int, float] = {}


def cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured once per device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        CYCLES_PER_MS[idx] = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    return CYCLES_PER_MS[idx]


class SleepPlan:
    """How long a GPU sleep :func:`gpu_times` queues before each round, and whether a round's calls synchronised.

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


def gpu_times(fns: Dict[str, Callable[[], Any]], repeats: int,
               device: torch.device) -> Tuple[Dict[str, List[float]], bool]:
    """GPU milliseconds of every function, host overhead excluded: each round first queues a GPU sleep long enough
    for the host to queue all the round's calls behind it, so that the events around a call see only its GPU work.

    Returns ``(times, synced)``: ``synced`` is True when a call synchronised the host in most rounds -- its
    "GPU time" then includes host gaps and is not the op's GPU cost (see :class:`SleepPlan`)."""
    times: Dict[str, List[float]] = {name: [] for name in fns}
    plan = SleepPlan()
    for r in range(repeats + 1):  # round 0 calibrates the host time of one round
        events = []
        torch.cuda.synchronize()
        if r:
            torch.cuda._sleep(int(cycles_per_ms(device) * plan.sleep_ms()))
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


def clock_of(cfg: Any) -> Any:
    """The clock of a benchmark configuration ``cfg`` (``on_gpu``, ``clock``): ``"cuda"`` events or a host clock."""
    return "cuda" if cfg.on_gpu else CLOCKS[cfg.clock]


def sync(cfg: Any) -> None:
    """Wait for the GPU when ``cfg.on_gpu`` (nothing on the CPU)."""
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


def median(v: Sequence[float]) -> float:
    """The median of ``v`` as a Python float."""
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
