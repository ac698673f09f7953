"""``ropekit bench``: speed and memory of every position encoding, as ratios measured side by side in one run.

>>> from ropekit.bench import BenchConfig, run_bench, format_report
>>> records = run_bench(BenchConfig.quick_config(vit=()))           # doctest: +SKIP
>>> print(format_report(records))                                     # doctest: +SKIP

Command line: ``ropekit bench [--quick] [--json FILE]`` or ``python -m ropekit.bench``. See
:mod:`ropekit.bench.core` for what is measured and how, and ``docs/performance.md`` for the latest results.
"""

from .core import CASES, VIT_PES, BenchConfig, Row, all_rows, peak_memory_mb, run_bench, saved_memory_mb
from .report import evaluate_targets, format_report

__all__ = ["BenchConfig", "Row", "all_rows", "CASES", "VIT_PES", "run_bench", "format_report", "evaluate_targets",
           "peak_memory_mb", "saved_memory_mb"]
