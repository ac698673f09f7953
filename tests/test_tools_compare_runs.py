"""tools/compare_runs.py matches two study folders run by run and measures how far the shared runs moved."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "tools" / "compare_runs.py")
compare_runs = importlib.util.module_from_spec(spec)
sys.modules["compare_runs"] = compare_runs
spec.loader.exec_module(compare_runs)


def _folder(path: Path, study: str, rows):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"study": study}))
    lines = ["pe,seed,test_acc,run"] + [f"{pe},{seed},{acc},{run}" for pe, seed, acc, run in rows]
    (path / f"{study}.csv").write_text("\n".join(lines) + "\n")
    return path


def test_shared_runs_are_matched_and_differences_measured(tmp_path):
    new = _folder(tmp_path / "new", "scale", [("absolute", 0, 0.841, "a0"), ("absolute", 1, 0.876, "a1"),
                                              ("cayley", 0, 0.862, "c0"), ("cayley", 1, 0.800, "x1")])
    old = _folder(tmp_path / "old", "classify", [("absolute", 0, 0.846, "a0"), ("absolute", 1, 0.876, "a1"),
                                                 ("cayley", 0, 0.862, "c0")])
    doc = compare_runs.compare(new, [old])
    assert doc["matched"] == 3 and doc["identical"] == 2  # x1 is in no old folder
    assert doc["max_abs_diff"] == pytest.approx(0.005) and doc["mean_abs_diff"] == pytest.approx(0.005 / 3)
    # seed spreads of the new folder per encoding: stdev(0.841, 0.876) and stdev(0.862, 0.800), median of the two
    assert doc["median_seed_std"] == pytest.approx((0.02474873734 + 0.04384062043) / 2, abs=1e-9)
    assert "identical: 2 of 3" in compare_runs.render(doc)
    compare_runs.plot(doc, tmp_path / "runs.png")
    assert (tmp_path / "runs.png").stat().st_size > 1000


def test_no_shared_run_is_an_error(tmp_path, capsys):
    new = _folder(tmp_path / "new", "scale", [("absolute", 0, 0.8, "a0")])
    old = _folder(tmp_path / "old", "classify", [("absolute", 0, 0.8, "b0")])
    assert compare_runs.main([str(new), str(old)]) == 2
    assert "no run of" in capsys.readouterr().err
