"""Where a ViT training step's time goes: the measurements behind docs/performance.md's profile figures.

Four commands, each on the training step that ``ropekit bench`` times (``ropekit.bench.core.vit_step``):

* ``profile PE [c:PE ...]`` -- on a CUDA device: wall time per step, the ``torch.profiler`` table of the ops with
  the most GPU time, the number of CUDA kernels launched per step and the GPU time per step (``c:PE`` compiles
  the model first). A step whose GPU time is well below its wall time is bound by the host.
* ``syncs PE [c:PE ...]`` -- on a CUDA device: the host synchronisations of one training step (forward, backward,
  AdamW) under ``torch.cuda.set_sync_debug_mode("warn")``, counted and listed by the Python line that caused them.
  A step bound by the host with few launches (the Cayley step's 78 ms wall for 44 ms of GPU work) points at one;
  a batched LU factorisation of ``64 x 64`` matrices (Cayley's solve) is a suspect on some torch builds.
* ``ops PE`` -- on the CPU: top-level ATen operations per step (all, and those that are not views), with the
  per-layer Cayley bases solved together (as the ViT does) and, for comparison, one layer at a time, in the CPU
  form (``ropekit bench --ops`` counts the device form too, for several encodings at once).
* ``ab PE --what loop-threshold|batched-bases`` -- on the CPU, one thread: process CPU time per step of two
  settings timed in alternation in one process (medians), for a change whose effect is smaller than the
  machine's drift between separate runs.

Examples::

    PYTHONPATH=$PWD python tools/profile_step.py profile cayley comrope-ld c:mixed     # one GPU, ViT-B/16
    PYTHONPATH=$PWD python tools/profile_step.py ops cayley --size tiny
    PYTHONPATH=$PWD python tools/profile_step.py ab cayley --what loop-threshold --size tiny
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch
from torch.profiler import ProfilerActivity, profile

import ropekit.encodings.ops.rotation as rotation
import ropekit.nn.vit as vit
from ropekit.bench.core import BenchConfig, vit_step
from ropekit.bench.ops import count_step_ops
from ropekit.fold import rope_form, rope_forms_stacked

def _per_layer_forms(pes):
    return [rope_form(pe) for pe in pes], []  # as rope_forms_stacked, without stacked forms


def cmd_profile(args: argparse.Namespace) -> None:
    cfg = BenchConfig.cuda_config()
    for arg in args.pes:
        compiled = arg.startswith("c:")
        pe = arg[2:] if compiled else arg
        step = vit_step(args.size, pe, cfg, compiled=compiled)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        print(f"== {arg}: {(time.perf_counter() - t) / 5 * 1e3:.1f} ms/step wall", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
        kernels = sum(e.count for e in ka if e.device_type == torch.autograd.DeviceType.CUDA) / 2
        gpu_ms = sum(e.self_device_time_total for e in ka) / 2e3
        print(f"{arg}: CUDA kernels per step {kernels:.0f}; self CUDA total per step {gpu_ms:.1f} ms", flush=True)
        del step
        torch.cuda.empty_cache()


def cmd_syncs(args: argparse.Namespace) -> None:
    import collections
    import warnings

    if not torch.cuda.is_available():
        raise SystemExit("syncs needs a CUDA device (host synchronisations are a GPU matter)")
    cfg = BenchConfig.cuda_config()
    for arg in args.pes:
        compiled = arg.startswith("c:")
        step = vit_step(args.size, arg[2:] if compiled else arg, cfg, compiled=compiled)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        where = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught
                                    if "synchroniz" in str(w.message).lower())
        print(f"== {arg}: {sum(where.values())} host synchronisations in one training step", flush=True)
        for place, count in where.most_common(12):
            print(f"   {count:4d}  {place}")
        del step
        torch.cuda.empty_cache()


def cmd_ops(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    step = vit_step(args.size, args.pe, BenchConfig())
    for name, forms in (("bases together", rope_forms_stacked), ("bases per layer", _per_layer_forms)):
        vit.rope_forms_stacked = forms
        counts = count_step_ops(step)
        print(f"{args.pe} ({args.size}), {name}: top-level ATen ops per step {counts['all']}, "
              f"non-view {counts['non_view']}")
    vit.rope_forms_stacked = rope_forms_stacked


def cmd_ab(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    settings: Dict[str, Callable[[], None]] = {
        "loop-threshold": {"loop (0 B)": lambda: setattr(rotation, "LOOP_MIN_BYTES", 0),
                           "threshold (256 KiB)": lambda: setattr(rotation, "LOOP_MIN_BYTES", 256 * 1024)},
        "batched-bases": {"bases together": lambda: setattr(vit, "rope_forms_stacked", rope_forms_stacked),
                          "bases per layer": lambda: setattr(vit, "rope_forms_stacked", _per_layer_forms)},
    }[args.what]
    before = rotation.LOOP_MIN_BYTES, vit.rope_forms_stacked
    step = vit_step(args.size, args.pe, BenchConfig())
    for _ in range(2):
        step()
    times: Dict[str, List[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, apply in settings.items():
            apply()
            t = time.process_time()
            step()
            step()
            times[name].append((time.process_time() - t) / 2 * 1e3)
    rotation.LOOP_MIN_BYTES, vit.rope_forms_stacked = before
    print(f"{args.pe} ({args.size}), one thread, process CPU ms per step, median of {args.rounds} alternating "
          "rounds: " + ", ".join(f"{n} {statistics.median(v):.1f}" for n, v in times.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("profile", help="CUDA profile of training steps")
    sp.add_argument("pes", nargs="+", help="encodings; c:NAME compiles the model")
    sp.add_argument("--size", default="base", choices=("tiny", "base"))
    sy = sub.add_parser("syncs", help="host synchronisations of one CUDA training step")
    sy.add_argument("pes", nargs="+", help="encodings; c:NAME compiles the model")
    sy.add_argument("--size", default="base", choices=("tiny", "base"))
    so = sub.add_parser("ops", help="ATen operations per CPU training step")
    so.add_argument("pe")
    so.add_argument("--size", default="tiny", choices=("tiny", "base"))
    sa = sub.add_parser("ab", help="two settings timed in alternation on the CPU")
    sa.add_argument("pe")
    sa.add_argument("--what", required=True, choices=("loop-threshold", "batched-bases"))
    sa.add_argument("--size", default="tiny", choices=("tiny", "base"))
    sa.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    {"profile": cmd_profile, "syncs": cmd_syncs, "ops": cmd_ops, "ab": cmd_ab}[args.cmd](args)


if __name__ == "__main__":
    main()
