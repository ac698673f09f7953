"""``ropekit experiment NAME``: the studies from the command line.

Every option defaults to the study's pinned recipe (:mod:`ropekit_studies.recipes`; ``--preset gpu`` for the
GPU one, ``--quick`` for the tiny one); options given on the command line override it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from .arguments import OPTION_FIELDS, add_arguments, overrides

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> Optional[int]:
    from pathlib import Path

    from .registry import STUDIES
    from .runner import run_experiment

    if args.name == "verify":
        return _verify(args)
    if args.folder is not None:
        raise ValueError(f"experiment {args.name} takes no folder argument ({args.folder!r}); only verify does")
    names = list(STUDIES) if args.name == "all" else [args.name]
    given = overrides(args)
    options = {k: v for k, v in vars(args).items() if k in OPTION_FIELDS}
    outs = {name: (Path("runs") / "experiments" / name if args.out is None else
                   Path(args.out) / name if args.name == "all" else Path(args.out)) for name in names}
    if not getattr(args, "overwrite", False):
        for out in outs.values():  # (all checked before anything trains)
            refuse_results_folder(out)
    caches = []
    for name in names:
        result = run_experiment(name, out=outs[name], quick=args.quick, preset=args.preset, overrides=given,
                                **options)
        print(result.table)
        print(f"wrote {len(result.files)} files to {result.out_dir}: "
              f"{', '.join(p.name for p in result.files)}", file=sys.stderr)
        if result.cache_dir is not None and result.cache_dir not in caches:
            caches.append(result.cache_dir)
    # where a re-run finds the trained runs: only for studies that used the run cache (the others keep their runs
    # under their own --out), once per cache
    for cache in caches:
        print(f"trained runs are cached in {cache} (--cache-dir)", file=sys.stderr)
    return 0


def refuse_results_folder(out: "Path") -> None:
    """One-line ``ValueError`` when ``out`` already holds a study's results (files at its top level: a report,
    tables, plots), which are never overwritten without ``--overwrite``. A folder holding only run folders
    (``runs/``, as the studies that train into their output folder leave while running) and hidden lock files
    is taken up where it stopped: another process may be training in it."""
    held = sorted(p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(".")) if out.is_dir() \
        else []
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ValueError(f"{out} already holds results ({shown}); pass --overwrite to replace them (trained runs "
                         f"come from the cache) or choose another --out")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder")


def _verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .verify import render_verification, verify_study

    if args.folder is None:
        raise ValueError("experiment verify needs the committed study folder, e.g. docs/results/classify")
    doc = verify_study(args.folder, arms=getattr(args, "pe", None), seeds=getattr(args, "seeds", None),
                       sample=args.sample, metrics=[m for m in args.metric.split(",") if m], out=args.out,
                       cache_dir=getattr(args, "cache_dir", None), threads=getattr(args, "threads", None),
                       rerun=args.rerun)
    text = render_verification(doc)
    print(text)
    if args.report:
        Path(args.report).write_text(text)
    return 0 if doc["holds"] == doc["total"] else 1
