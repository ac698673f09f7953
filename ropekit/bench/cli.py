"""``ropekit bench`` / ``python -m ropekit.bench``: argument parsing on top of :mod:`ropekit.bench.core`."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any, List, Optional

import torch

from .core import CASES, COMPILE_MODES, DTYPES, QUICK_CLI, VIT_PES, VIT_PES_GPU, BenchConfig, all_rows, run_bench
from .report import format_report, format_summary

__all__ = ["add_arguments", "run", "main", "HelpFormatter"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter that states each default once: not for flags (``store_true`` / ``store_false``),
    nor for an option without a default, nor where the help text already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or re.search(r"\bdefault\b", text):
            return text
        return super()._get_help_string(action)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = HelpFormatter
    p.description = ("Speed and peak memory of every position encoding (the encoding alone, forward and "
                     "forward+backward), as ratios against no encoding, the elementwise floor (q*k) and "
                     "scaled_dot_product_attention measured in the same rounds; naive reference forms; folded "
                     "inference; and a ViT training step per encoding against the absolute-embedding ViT.")
    p.epilog = ("Examples: `ropekit bench --quick`; `ropekit bench --json bench.json --markdown bench.md`; "
                "`ropekit bench --rows cayley circulant --cases grid2d --no-vit`; "
                "`ropekit bench --device cuda --dtype bf16 --json gpu.json --markdown gpu.md` (GPU defaults: batch 64, "
                "CUDA-event timing, the ViT-B/16 training step at batch 128 eager and compiled for "
                + ", ".join(VIT_PES_GPU) + ", plus timm's vit_base_patch16_224). Rows: "
                + ", ".join(r.label for r in all_rows()) + ".")
    d = BenchConfig()
    p.add_argument("--quick", action="store_true",
                   help="reduced run: the grid2d case, 3 rounds per row, no memory profile, no naive reference rows, "
                        "tiny ViT only; 207 s of CPU time on the project's 2-core machine (so 2 to 3.5 min on 2 idle "
                        "cores), measured 8 min on 2 cores shared with other jobs (load 5)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda[:i]): GPU defaults change batch, rounds and the "
                                                   "ViT table (see the examples)")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="q/k dtype and autocast dtype (default: fp32 on the CPU, "
                                                          "bf16 on a GPU)")
    p.add_argument("--vit-batch", type=int, help="batch of the training-step table (default: 32 tiny / 8 base on the "
                                                 "CPU, 128 base on a GPU)")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="also time the training step under torch.compile (default on a GPU)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager training steps only")
    p.add_argument("--compile-mode", choices=COMPILE_MODES,
                   help="torch.compile mode of the compiled table: reduce-overhead captures the step in CUDA graphs, "
                        "which removes the host's launch cost of small per-layer operations (default: default)")
    p.add_argument("--vit-modes", nargs="+", choices=("eager", "compiled"),
                   help="which training-step tables to run (overrides --compile / --no-compile), e.g. "
                        "`--vit-modes compiled` for the compiled table alone")
    p.add_argument("--no-timm", action="store_true", help="skip the timm vit_base_patch16_224 reference row")
    p.add_argument("--json", metavar="FILE", help="write the records (a JSON list) to FILE")
    p.add_argument("--markdown", metavar="FILE", help="also write the markdown report to FILE")
    p.add_argument("--cases", nargs="+", choices=CASES,
                   help="coordinate cases (default: " + " ".join(d.cases) + "; quick: grid2d)")
    p.add_argument("--rows", nargs="+", metavar="ROW", help="rows to run (labels or encoding names; default: all)")
    p.add_argument("--batch", type=int, help=f"B (default {d.batch}, 64 on a GPU)")
    p.add_argument("--heads", type=int, default=d.heads, help="H")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="d")
    p.add_argument("--grid", type=int, default=d.grid, help="g: M = g * g tokens")
    p.add_argument("--repeats", type=int, help=f"timed rounds per row (default {d.repeats}, quick 3, GPU 20)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads")
    p.add_argument("--max-spread", type=float, default=d.max_spread, metavar="FRACTION",
                   help="refuse a row whose ratio (fwd+bwd / floor, step / absolute-embedding step) varies between the "
                        "interleaved rounds by more than this fraction of its median (interquartile range; "
                        "default %(default)s); 0 or less: never refuse")
    p.add_argument("--clock", choices=("wall", "cpu"), default=d.clock,
                   help="wall: wall-clock time; cpu: process CPU time (use with --threads 1 on a shared machine)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the peak / saved memory measurements (--quick skips them too)")
    p.add_argument("--no-check", action="store_true", help="skip comparing naive rows' outputs and gradients")
    p.add_argument("--vit", nargs="*", choices=("tiny", "small", "base"), metavar="SIZE",
                   help="ViT sizes of the training-step table (default: tiny base; quick: tiny; none: skip)")
    p.add_argument("--no-vit", action="store_true", help="skip the training-step table")
    p.add_argument("--vit-pes", nargs="+", metavar="PE", help="encodings of the ViT table (default: "
                   + " ".join(VIT_PES) + "; on a GPU: " + " ".join(VIT_PES_GPU) + ")")
    p.add_argument("--ops", action="store_true",
                   help="instead of timing: count the ATen operations of one ViT training step per encoding of "
                        "--vit-pes (default axial mixed and the folded ones) on the CPU, as a GPU runs the step and "
                        "as the CPU does, with the ratio to axial -- the proxy of an eager GPU step's launches "
                        "(--vit sets the size, default tiny)")
    sub = p.add_subparsers(dest="bench_command", metavar="[data | packing | timm]")
    add_data_arguments(sub.add_parser(
        "data", help="the training input pipeline: ropekit's folder and shard streams against torchvision's "
                     "ImageFolder (images/s, memory)", formatter_class=HelpFormatter))
    add_packing_arguments(sub.add_parser(
        "packing", help="packed vs padded batches of mixed resolutions (images/s), FlexAttention vs SDPA with a "
                        "mask, torch.compile across sequence-length buckets",
        formatter_class=HelpFormatter))
    add_timm_arguments(sub.add_parser(
        "timm", help="ropekit's ViT training step against timm's at the same encoding (APE, axial, RoPE-Mixed), "
                     "and the folded encodings against ropekit's axial step, in the same rounds",
        formatter_class=HelpFormatter))


def add_timm_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ropekit bench timm`` (see :func:`ropekit.bench.training_step.run_timm_bench`)."""
    from .training_step import TimmBenchConfig

    d = TimmBenchConfig()
    p.add_argument("--depth", type=int, default=d.depth, help="blocks of the ViT-S/16 shape")
    p.add_argument("--image-size", type=int, default=d.image_size, help="image side (a multiple of 16)")
    p.add_argument("--batch", type=int, default=d.batch, help="images per step")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed rounds (each times every step once)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed rounds first")
    p.add_argument("--clock", choices=("wall", "cpu"), default=d.clock,
                   help="cpu: process CPU time (with one thread it ignores waiting for a core on a shared machine)")
    p.add_argument("--folded", nargs="*", default=list(d.folded), metavar="PE",
                   help="folded encodings timed against ropekit's axial step")
    p.add_argument("--json", metavar="FILE", help="write the records to FILE")
    p.add_argument("--markdown", metavar="FILE", help="write the markdown report to FILE")


def run_timm(args: argparse.Namespace, command: str) -> int:
    """``ropekit bench timm``."""
    from .training_step import TimmBenchConfig, format_timm_report, run_timm_bench

    cfg = TimmBenchConfig(depth=args.depth, image_size=args.image_size, batch=args.batch, threads=args.threads,
                          repeats=args.repeats, warmup=args.warmup, clock=args.clock, folded=tuple(args.folded))
    records = run_timm_bench(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    return _write(args, records, format_timm_report(records, command=command).rstrip("\n"))


def add_packing_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ropekit bench packing`` (see :mod:`ropekit.bench.packing`)."""
    from .packing import PackingBenchConfig

    d = PackingBenchConfig()
    p.add_argument("--model", default=d.model, help="ViT size")
    p.add_argument("--pe", default=d.pe, help="position encoding")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per packed row")
    p.add_argument("--rows", type=int, default=d.rows, help="rows per step")
    p.add_argument("--images", type=int, default=d.images, help="images of the packed-vs-padded table")
    p.add_argument("--rounds", type=int, default=d.rounds, help="timed rounds")
    p.add_argument("--no-flex-compile", action="store_true", help="skip the compiled FlexAttention row")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--json", metavar="FILE", help="write the records to FILE")
    p.add_argument("--markdown", metavar="FILE", help="write the markdown report to FILE")


def run_packing(args: argparse.Namespace, command: str) -> int:
    """``ropekit bench packing``."""
    from .packing import PackingBenchConfig, format_packing_report, run_packing_bench

    cfg = PackingBenchConfig(model=args.model, pe=args.pe, seq_len=args.seq_len, rows=args.rows, images=args.images,
                             rounds=args.rounds, flex_compiled=not args.no_flex_compile, threads=args.threads)
    records = run_packing_bench(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    return _write(args, records, format_packing_report(records, command=command).rstrip("\n"))


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ropekit bench data`` (see :mod:`ropekit.bench.data`)."""
    from .data import PIPELINES, DataBenchConfig

    d = DataBenchConfig()
    p.description = ("Images per second through decode, RandomResizedCrop, flip, RandAugment and normalisation, "
                     "for ropekit's folder stream and shards against torchvision's ImageFolder + DataLoader (same "
                     "transform, batch and workers), alternated in rounds; and the peak memory of the main process "
                     "and its workers at two dataset sizes. Generated JPEGs, in a temporary folder deleted after.")
    p.add_argument("--images", type=int, default=d.images, help="images of the throughput rounds")
    p.add_argument("--memory-sizes", type=int, nargs="*", default=list(d.memory_sizes),
                   help="dataset sizes of the memory runs (none: skip)")
    p.add_argument("--image-size", type=int, default=d.image_size, help="side of the generated JPEGs")
    p.add_argument("--crop", type=int, default=d.crop, help="RandomResizedCrop output side")
    p.add_argument("--classes", type=int, default=d.classes)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--workers", type=int, default=d.workers, help="DataLoader workers of every pipeline")
    p.add_argument("--rounds", type=int, default=d.rounds, help="throughput epochs per pipeline")
    p.add_argument("--auto-augment", default=d.auto_augment, help="policy (none to leave it out)")
    p.add_argument("--shard-size", type=int, default=d.shard_size)
    p.add_argument("--folder", help="an existing image folder for the throughput rounds (default: generated)")
    p.add_argument("--pipelines", nargs="+", choices=PIPELINES, default=list(PIPELINES))
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads of the main process")
    p.add_argument("--json", metavar="FILE", help="write the records (a JSON list) to FILE")
    p.add_argument("--markdown", metavar="FILE", help="also write the markdown report to FILE")


def run_data(args: argparse.Namespace, command: str) -> int:
    """``ropekit bench data``."""
    from .data import DataBenchConfig, format_data_report, run_data_bench

    cfg = DataBenchConfig(images=args.images, memory_sizes=tuple(args.memory_sizes), image_size=args.image_size,
                          crop=args.crop, classes=args.classes, batch_size=args.batch_size, workers=args.workers,
                          rounds=args.rounds, shard_size=args.shard_size, folder=args.folder,
                          auto_augment=None if str(args.auto_augment).lower() == "none" else args.auto_augment,
                          pipelines=tuple(args.pipelines), threads=args.threads)
    records = run_data_bench(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    report = format_data_report(records, command=command)
    print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(report)
    return 0


def check_rows(rows: Any) -> None:
    """One-line ``ValueError`` for a ``--rows`` entry that is neither a row label nor an encoding name (with the
    closest known one); a run that would measure nothing is an error, not an empty table."""
    import difflib

    known = sorted({r.label for r in all_rows()} | {r.pe for r in all_rows()})
    for row in rows or ():
        if row not in known:
            close = difflib.get_close_matches(row, known, n=1, cutoff=0.6)
            raise ValueError(f"--rows: unknown row {row!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                             f"rows are labels or encoding names: {', '.join(known)}")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    check_rows(args.rows)
    kw = dict(heads=args.heads, head_dim=args.head_dim, grid=args.grid,
              rows=tuple(args.rows) if args.rows else None, threads=args.threads, clock=args.clock,
              check=not args.no_check, device=args.device, timm=not args.no_timm,
              max_spread=args.max_spread if args.max_spread and args.max_spread > 0 else None)
    if args.cases:  # (otherwise the configuration's: both cases, grid2d for --quick)
        kw["cases"] = tuple(args.cases)
    if args.no_memory:
        kw["memory"] = False
    for name in ("batch", "repeats", "dtype", "vit_batch", "compile", "compile_mode"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.vit_modes:
        kw["vit_modes"] = tuple(args.vit_modes)
    if args.vit_pes:
        kw["vit_pes"] = tuple(args.vit_pes)
    if args.no_vit:
        kw["vit"] = ()
    elif args.vit is not None:
        kw["vit"] = tuple(args.vit)
    if torch.device(args.device).type == "cuda":
        if args.quick:
            kw = {"repeats": 5, "warmup": 2, "vit": ("base",), "vit_base_repeats": 3, "quick": True, **kw}
        return BenchConfig.cuda_config(**kw)
    return BenchConfig.quick_config(**{**QUICK_CLI, **kw}) if args.quick else BenchConfig(**kw)


#: The encodings of ``--ops`` by default: the reference, RoPE-Mixed (learned frequencies, not folded) and the
#: folded ones whose target is axial's count.
OPS_PES = ("axial", "mixed", "cayley", "circulant", "comrope-ld")


def _run_ops(args: argparse.Namespace, command: str) -> int:
    from .ops import format_op_counts, step_op_counts

    size = (args.vit or ["tiny"])[0]
    records = step_op_counts(args.vit_pes or OPS_PES, size=size, batch=args.vit_batch)
    return _write(args, records, format_op_counts(records, command=command.strip()))


def _write(args: argparse.Namespace, records: list, report: str) -> int:
    """Print the report and write the records (``--json``) and the report (``--markdown``)."""
    print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(report + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_argv", None) is not None:  # python -m ropekit.bench
        command = "python -m ropekit.bench " + " ".join(shlex.quote(a) for a in args._argv)
    else:  # ropekit bench (sys.argv: ropekit, bench, options)
        command = "ropekit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if getattr(args, "bench_command", None) == "data":
        return run_data(args, command.strip())
    if getattr(args, "bench_command", None) == "packing":
        return run_packing(args, command.strip())
    if getattr(args, "bench_command", None) == "timm":
        return run_timm(args, command.strip())
    if args.ops:
        return _run_ops(args, command)
    cfg = config_from_args(args)

    def save(records: list) -> None:  # after every row: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
        if args.markdown:
            Path(args.markdown).write_text(format_report(records, command=command.strip()) + "\n")

    records = run_bench(cfg, log=lambda s: print(s, file=sys.stderr, flush=True), on_record=save)
    report = format_report(records, command=command.strip())
    if not (args.json or args.markdown):  # stdout is the only copy: everything, the summary first
        print(report)
        return 0
    save(records)
    print(format_summary(records))
    print("Details (every table and target): " + " and ".join(f for f in (args.markdown, args.json) if f))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ropekit.bench")
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args._argv = argv
    return run(args)
