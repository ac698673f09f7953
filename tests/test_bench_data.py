"""``ropekit bench data`` on a tiny generated folder: every pipeline runs, the report has its tables."""

import pytest

from ropekit.bench.data import PIPELINES, DataBenchConfig, format_data_report, run_data_bench, tree_memory
from ropekit.cli import main


@pytest.mark.slow  # three pipelines, nine epochs and the torchvision.datasets import: about 5 s
def test_data_bench_records_and_report():
    cfg = DataBenchConfig(images=24, memory_sizes=(24,), image_size=24, crop=16, classes=2, batch_size=8,
                          workers=0, rounds=2, shard_size=8)
    records = run_data_bench(cfg, log=lambda s: None)
    thr = [r for r in records if r.get("kind") == "throughput"]
    assert sorted((r["round"], r["pipeline"]) for r in thr) == sorted((i, p) for i in range(2) for p in PIPELINES)
    assert all(r["images"] == 24 and r["images_per_s"] > 0 for r in thr)  # 3 full batches each epoch
    mem = [r for r in records if r.get("kind") == "memory"]
    assert len(mem) == 3 and all(r["peak_rss_mb"] > 50 and r["peak_pss_mb"] > 10 for r in mem)
    report = format_data_report(records, command="ropekit bench data")
    assert "| folder-stream |" in report and "ratio to torchvision" in report and "peak RSS" in report
    assert "shards throughput ≥ 0.95 × torchvision" in report


def test_tree_memory_counts_this_process():
    rss, pss = tree_memory()
    assert rss > 10 * 2 ** 20 and 0 < pss <= rss


def test_bench_data_cli(tmp_path, capsys):
    out = tmp_path / "r.md"
    assert main(["bench", "data", "--images", "16", "--memory-sizes", "--image-size", "20", "--crop", "16",
                 "--classes", "2", "--batch-size", "8", "--workers", "0", "--rounds", "1",
                 "--pipelines", "torchvision", "folder-stream", "--markdown", str(out)]) == 0
    text = out.read_text()
    assert "| torchvision |" in text and "| folder-stream |" in text and "| shards |" not in text
