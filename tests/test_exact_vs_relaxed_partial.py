"""The exact-vs-relaxed study's optional relaxed arm with fewer active planes than ``head_dim / 2``."""

import csv

import pytest

from ropekit_studies import run_experiment


def test_partial_planes_must_be_fewer_than_the_recipes(tmp_path):
    for bad in ([8], [0]):  # the quick recipe has 8 active planes (head dimension 16)
        with pytest.raises(ValueError, match="partial_planes"):
            run_experiment("exact-vs-relaxed", quick=True, out=tmp_path, partial_planes=bad,
                           overrides={"cache_dir": str(tmp_path / "cache"), "progress": False})


@pytest.mark.slow
def test_partial_planes_trains_a_third_variant(tmp_path):
    res = run_experiment("exact-vs-relaxed", quick=True, out=tmp_path / "out", partial_planes=[4],
                         overrides={"cache_dir": str(tmp_path / "cache"), "progress": False, "eval_limit": 50})
    with open(tmp_path / "out" / "diagnostics.csv", newline="") as f:
        diag = {r["variant"]: r for r in csv.DictReader(f)}
    assert set(diag) == {"exact", "relaxed", "relaxed-4"}
    assert int(diag["relaxed-4"]["active_dims"]) == 8 and int(diag["relaxed"]["active_dims"]) == 16
    assert float(diag["relaxed-4"]["commutator_abs"]) > 0  # still relaxed: its generators do not commute
    assert "relaxed-4 STRING" in res.table
