"""``resolution-comrope-paper``: ComRoPE's resolution protocol with the authors' random start, against the
``resolution-comrope`` recipe that starts ComRoPE as axial RoPE."""

from __future__ import annotations

import csv

import pytest
import torch

from ropekit.train.upgrade import flatten
from ropekit_studies import run_experiment, study_config


def test_comrope_arms_start_from_random_bases_and_the_rest_is_the_protocol():
    paper, rope = study_config("resolution-comrope-paper"), study_config("resolution-comrope")
    assert paper.pes == ["comrope-ap", "comrope-ld", "circulant", "liere", "absolute"]
    for pe in ("comrope-ap", "comrope-ld"):
        a, b = flatten(paper.train_config(pe, 0).to_nested()), flatten(rope.train_config(pe, 0).to_nested())
        assert a["pe_options"] == {"init": "normal", "init_std": 1.0} and b["pe_options"] == {}
        assert a["pe_sharing"] == b["pe_sharing"] == "head"
        # nothing else differs between the two recipes' ComRoPE runs
        assert {k for k in a if a[k] != b[k]} == {"pe_options"}
    assert paper.train_config("liere", 0).model.vit().pe_sharing == "model"
    assert paper.train_config("circulant", 0).model.vit().pe_options == {}


def test_the_random_start_differs_from_the_rope_start():
    from ropekit.encodings import create_pe

    torch.manual_seed(0)
    normal = create_pe("comrope-ld", head_dim=32, coord_dim=2, num_heads=2, init="normal", init_std=1.0)
    torch.manual_seed(0)
    rope = create_pe("comrope-ld", head_dim=32, coord_dim=2, num_heads=2)
    pn = torch.cat([p.detach().flatten() for p in normal.parameters()])
    pr = torch.cat([p.detach().flatten() for p in rope.parameters()])
    assert pn.shape == pr.shape and not torch.allclose(pn, pr)
    # K = B - B^T with B ~ N(0, 1): each free entry is N(0, 2); the sample sd of m entries has a standard
    # error of about sqrt(2) / sqrt(2 m): within five of them
    m = normal.block_params.numel()
    assert abs(float(normal.block_params.std()) - 2 ** 0.5) < 5 * 2 ** 0.5 / (2 * m) ** 0.5


@pytest.mark.slow
def test_quick_study_runs(tmp_path):
    out = tmp_path / "study"
    run_experiment("resolution-comrope-paper", out=out, preset="quick",
                   overrides={"progress": False, "cache_dir": str(tmp_path / "cache")})
    rows = list(csv.DictReader((out / "resolution.csv").open())) if (out / "resolution.csv").is_file() else \
        list(csv.DictReader(next(out.glob("*.csv")).open()))
    assert {r["pe"].split("/")[0] for r in rows} == {"comrope-ld", "absolute"}
