"""``ropekit bench packing``: the records of a small run, packing's padding accounting, and the compile claim
(one recompile at most across five sequence-length buckets, no graph break)."""

import pytest

from ropekit.bench.packing import PackingBenchConfig, _batches, _compile_buckets, format_packing_report, mixed_images

pytestmark = pytest.mark.slow


def test_padded_and_packed_batches_hold_the_same_images():
    cfg = PackingBenchConfig(images=20, rows=3, seq_len=64, min_tokens=4)
    images = mixed_images(cfg.images, cfg)
    for packed in (False, True):
        batches = _batches(images, cfg, packed)
        assert all(b.segment_ids.shape == (3, 64) for b in batches)
        labels = [l for b in batches for l in b.labels.tolist()]
        assert labels == [im.label for im in images]  # every image once, in order
        tokens = sum(int((b.segment_ids >= 0).sum()) for b in batches)
        assert tokens == sum(im.patches.shape[0] for im in images)
    assert len(_batches(images, cfg, True)) < len(_batches(images, cfg, False))


def test_compile_buckets_one_recompile_no_graph_break():
    cfg = PackingBenchConfig(images=16, buckets=(32, 48, 64, 80, 96), seq_len=96, min_tokens=4, patch_size=8)
    records = _compile_buckets(cfg, lambda s: None)
    summary = records[-1]
    assert summary["graph_breaks"] == 0 and summary["recompiles"] <= 1
    report = format_packing_report([{"table": "machine", "torch": "x", "python": "y", "processor": "z", "threads": 1,
                                     "config": vars(cfg)}] + records)
    assert "0 graph break(s)" in report
