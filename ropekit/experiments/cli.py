"""``ropekit experiment NAME``: the studies from the command line.

Every option defaults to the study's pinned recipe (:mod:`ropekit.experiments.recipes`; ``--preset gpu`` for the
GPU one, ``--quick`` for the tiny one); options given on the command line override it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from .arguments import _OPTION_FIELDS, add_arguments, overrides

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
    options = {k: v for k, v in vars(args).items() if k in _OPTION_FIELDS}
    for name in names:
        if args.out is None:
            out = Path("runs") / "experiments" / name
        else:
            out = Path(args.out) / name if args.name == "all" else Path(args.out)
        result = run_experiment(name, out=out, quick=args.quick, preset=args.preset, overrides=given, **options)
        print(result.table)
        print(f"wrote {len(result.files)} files to {result.out_dir}: "
              f"{', '.join(p.name for p in result.files)}", file=sys.stderr)
    return 0


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
