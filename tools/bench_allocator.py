"""How much of the CPU bench is the C library's allocator? The encoding table with glibc's defaults and with its
large-buffer thresholds raised, side by side.

glibc serves every buffer above its mmap threshold (128 KiB at first, raised adaptively up to 32 MiB) with a fresh
``mmap`` and returns it to the system on ``free``; the next buffer of that size is page-faulted in again, one 4 KiB
page at a time. A q or k tensor of the bench (8 x 12 x 196 x 64 float32, 4.8 MB) is above it, so a row that
allocates temporaries of that size pays page faults on top of its arithmetic. ``MALLOC_MMAP_THRESHOLD_=33554432
MALLOC_TRIM_THRESHOLD_=1073741824`` keeps such buffers in the heap and reuses them; numerics are unchanged.

Each round runs ``python -m ropekit.bench`` twice at the same time, one process per core (``--threads 1 --clock
cpu``), once with the defaults and once with those variables, so that both see the same machine load. Writes
``default-<i>.json``, ``tuned-<i>.json`` and ``summary.md`` (each row's share of SDPA per round, both settings)
to ``--out``::

    python tools/bench_allocator.py --rounds 3 --out docs/bench/cpu-allocator
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ropekit.bench.core import ALLOCATOR_VARIABLES

TUNED = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
BENCH = ["--threads", "1", "--clock", "cpu", "--rows", "axial", "mixed", "cayley", "circulant", "comrope-ld",
         "--no-vit"]


def _env(tuned: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
    return {**env, **TUNED} if tuned else env


def run_round(out: Path, i: int) -> None:
    procs = []
    for name, tuned in (("default", False), ("tuned", True)):
        cmd = [sys.executable, "-m", "ropekit.bench", *BENCH, "--json", str(out / f"{name}-{i}.json")]
        procs.append(subprocess.Popen(cmd, env=_env(tuned), stdout=subprocess.DEVNULL))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"bench failed with exit code {p.returncode}")


def summarise(out: Path, rounds: int, command: str) -> str:
    table: dict = {}
    meta = {}
    for name in ("default", "tuned"):
        for i in range(rounds):
            for r in json.loads((out / f"{name}-{i}.json").read_text()):
                meta.setdefault(name, r)
                if r["kind"] in ("pe", "train"):
                    table.setdefault((r["case"], r["label"]), {}).setdefault(name, []).append(100 * r["frac_sdpa"])
    m = meta["default"]
    lines = [f"Command: `{command}`", "",
             f"Machine: {m['cpu']}, {m['cpus']} cores visible, torch {m['torch']}; `ropekit bench --threads 1 "
             "--clock cpu` (process CPU time), the two settings run at the same time, one per core. Allocator: "
             f"`{meta['tuned']['allocator']}` against {meta['default']['allocator']}.", "",
             "Each encoding's forward + backward as a share of SDPA's forward + backward timed in the same rounds "
             f"(per round of {rounds}; lower is better). *In training* rows are the folded work of one attention "
             "layer (see docs/performance.md).", "",
             "| case | row | C library defaults | thresholds raised | change of the mean |",
             "|---|---|---|---|---:|"]
    for (case, label), v in table.items():
        d, t = v["default"], v["tuned"]
        md, mt = sum(d) / len(d), sum(t) / len(t)
        lines.append(f"| {case} | {label} | {' / '.join(f'{x:.1f}%' for x in d)} | "
                     f"{' / '.join(f'{x:.1f}%' for x in t)} | {100 * (mt - md) / md:+.0f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-allocator"))
    ap.add_argument("--summary-only", action="store_true", help="rewrite summary.md from the JSON files in --out")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        for i in range(args.rounds):
            print(f"[allocator] round {i + 1}/{args.rounds}", flush=True)
            run_round(args.out, i)
    command = f"python tools/bench_allocator.py --rounds {args.rounds} --out {args.out}"
    (args.out / "summary.md").write_text(summarise(args.out, args.rounds, command))
    print((args.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
