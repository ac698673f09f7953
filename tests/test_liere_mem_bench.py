"""``ropekit bench``: a naive row records the fast row's peak and saved memory measured in the same run, and the
report states the memory targets against the naive per-token ``matrix_exp``."""

from __future__ import annotations

import pytest

from ropekit.bench import BenchConfig, format_report, run_bench


def test_bench_reports_fast_and_naive_memory_of_one_run():
    cfg = BenchConfig.quick_config(rows=("naive liere (b=8)",), cases=("rgbd3d",), batch=1, heads=4, head_dim=16,
                                   grid=3, threads=1, vit=(), quick=False, repeats=1, warmup=0)
    recs = run_bench(cfg, log=lambda s: None)
    r = next(x for x in recs if x["label"] == "naive liere (b=8)")
    assert r["peak_mb"] > 0 and r["fast_peak_mb"] > 0 and r["saved_mb"] > 0
    assert r["peak_ratio"] == pytest.approx(r["fast_peak_mb"] / r["peak_mb"])
    assert r["saved_ratio"] == pytest.approx(r["fast_saved_mb"] / r["saved_mb"])
    # one (B, M, d, d) float32 rotation saved by the fast form vs a generator and a rotation per head (naive)
    assert r["saved_ratio"] < 0.5
    report = format_report(recs)
    assert "liere (b=8) saved memory <= 1/5 of one matrix_exp per token | rgbd3d" in report
    assert "(saved " in report
