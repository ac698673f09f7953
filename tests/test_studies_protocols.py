"""The study protocols that remove confounds: whole-patch content shifts on a background canvas, frame shuffling
and reversal, equal-step schedules, both coordinate conventions, and the complete ablation grid."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from ropekit_studies import run_experiment, study_config
from ropekit_studies.ablations import BLOCK_CANDIDATES, block_sizes
from ropekit_studies.data_efficiency import equal_step_schedule
from ropekit_studies.evaluation import background_value
from ropekit_studies.exact_vs_relaxed import canvas_shift
from ropekit_studies.recipes import recipe
from ropekit_studies.video import reverse_frames, shuffle_frames


def test_canvas_shift_moves_whole_patches_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 2, 8, 12, generator=g)
    bg = torch.tensor([-0.5, 2.0])
    p, pad = 4, 2
    base = canvas_shift(x, p, pad, 0, bg)
    assert base.shape == (3, 2, 8 + 16, 12 + 16)
    assert torch.equal(base[..., 8:16, 8:20], x)  # content at pad patches from the corner
    assert torch.all(base[:, 0, :8] == -0.5) and torch.all(base[:, 1, :, :8] == 2.0)  # background, per channel
    for k in (1, 2):
        moved = canvas_shift(x, p, pad, k, bg)
        o = (pad + k) * p
        assert torch.equal(moved[..., o:o + 8, o:o + 12], x)  # same pixels, k patches further: no resampling
        # every patch of the moved canvas is a patch of the unshifted canvas, k grid steps away
        assert torch.equal(moved[..., k * p:, k * p:], base[..., :base.shape[-2] - k * p, :base.shape[-1] - k * p])
    with pytest.raises(ValueError, match="leaves a canvas"):
        canvas_shift(x, p, pad, 3, bg)


def test_background_value_is_black_after_normalisation():
    class Info:
        mean, std = (0.25, 0.5), (0.5, 0.25)

    bg = background_value(Info(), 2)
    assert torch.allclose((bg * torch.tensor([0.5, 0.25])) + torch.tensor([0.25, 0.5]), torch.zeros(2))
    assert torch.equal(background_value(object(), 3), torch.zeros(3))


def test_frame_shuffle_and_reversal():
    x = torch.arange(2 * 1 * 5 * 2 * 2, dtype=torch.float32).reshape(2, 1, 5, 2, 2)
    s = shuffle_frames(x, torch.Generator().manual_seed(3))
    assert s.shape == x.shape
    for b in range(2):  # a permutation of whole frames, per clip
        frames = {tuple(x[b, :, t].flatten().tolist()) for t in range(5)}
        assert {tuple(s[b, :, t].flatten().tolist()) for t in range(5)} == frames
    assert not torch.equal(s, x)
    assert torch.equal(reverse_frames(x)[:, :, 0], x[:, :, -1])


@pytest.mark.parametrize("n_full,n_sub,bs", [(4000, 400, 64), (4000, 1000, 64), (4000, 2000, 32), (400, 200, 32)])
def test_equal_step_schedule(n_full, n_sub, bs):
    epochs, warm = 10, 1.0
    full_steps = epochs * math.ceil(n_full / bs)
    s = equal_step_schedule(epochs, warm, bs, n_full, n_sub)
    per = math.ceil(n_sub / bs)
    assert s["steps"] == s["epochs"] * per
    assert abs(s["steps"] - full_steps) <= per / 2 + 1e-9  # within half an epoch of the full budget
    assert s["warmup_epochs"] * per == pytest.approx(warm * math.ceil(n_full / bs))  # warm-up: same steps


def test_ablation_grid_is_complete():
    r = recipe("ablations", "default")["study"]["options"]
    learnable = {"mixed", "cayley", "circulant", "liere", "liere-commute", "comrope-ap", "comrope-ld"}
    assert set(r["sharing_pe"]) == learnable and set(r["groups"]) == {"sharing", "block", "jitter"}
    assert set(r["block_pe"]) == {"liere", "comrope-ap", "comrope-ld", "circulant"}
    for preset, d in (("default", 32), ("gpu", 64)):
        cfg = study_config("ablations", preset=preset)
        assert cfg.model_options["embed_dim"] // cfg.model_options["num_heads"] == d
        assert block_sizes("liere", d, 2, BLOCK_CANDIDATES["liere"]) == [2, 4, 8, None]
        assert block_sizes("comrope-ap", d, 2, BLOCK_CANDIDATES["comrope-ap"]) == [2, 4, 8]
        assert block_sizes("comrope-ld", d, 2, BLOCK_CANDIDATES["comrope-ld"]) == [2, 4, 8]
    # circulant 4 ... 64: the CPU head dimension (32) reaches 32, the GPU one (64) reaches 64
    assert block_sizes("circulant", 32, 2, BLOCK_CANDIDATES["circulant"]) == [4, 8, 16, None]
    assert block_sizes("circulant", 64, 2, BLOCK_CANDIDATES["circulant"]) == [4, 8, 16, 32, None]


@pytest.mark.slow
def test_quick_protocol_outputs(tmp_path):
    """resolution trains the three coordinate conventions, data-efficiency both budgets, video labels direction."""
    cache = str(tmp_path / "cache")
    over = {"cache_dir": cache, "progress": False}
    res = run_experiment("resolution", out=tmp_path / "res", quick=True, overrides={**over, "pes": ["mixed"]})
    with open(tmp_path / "res" / "resolution.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["coords"] for r in rows} == {"grid", "normalized", "normalized+scale"}
    assert {r["mode"] for r in rows} == {"resize", "pad"}
    assert {r["train_sizes"] for r in rows if r["coords"] == "normalized+scale"} == {"24 28 32"}
    assert {r["train_sizes"] for r in rows if r["coords"] != "normalized+scale"} == {"28"}
    assert "RoPE-Mixed (normalized)" in res.table and "RoPE-Mixed (normalized+scale)" in res.table

    run_experiment("data-efficiency", out=tmp_path / "de", quick=True, overrides={**over, "pes": ["absolute"]})
    with open(tmp_path / "de" / "equal-steps.csv", newline="") as f:
        steps = {float(r["fraction"]): r for r in csv.DictReader(f)}
    with open(tmp_path / "de" / "data-efficiency.csv", newline="") as f:
        epochs = {float(r["fraction"]): r for r in csv.DictReader(f)}
    assert int(steps[0.5]["epochs"]) == 2 * int(epochs[0.5]["epochs"])  # half the data, twice the epochs
    assert abs(int(steps[0.5]["steps"]) - int(epochs[1.0]["steps"])) <= 1
    assert int(epochs[0.5]["steps"]) < int(epochs[1.0]["steps"])  # equal epochs: fewer steps

    vid = run_experiment("video", out=tmp_path / "vid", quick=True, overrides={**over, "pes": ["mixed"]})
    with open(tmp_path / "vid" / "video.csv", newline="") as f:
        row = next(csv.DictReader(f))
    assert {"frames_shuffled_acc", "reversed_acc", "shuffled_acc"} <= set(row)
    assert "label: direction" in vid.table
