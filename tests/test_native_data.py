"""Native-resolution data (ropekit.data.native): aspect-preserving grids, the epoch plan (a pure function of seed,
epoch and rank; fixed training length; resume mid-epoch exact), depth resized without new values, workers."""

import numpy as np
import pytest
import torch

from ropekit.data.native import NativeLoader, NativeOptions, grid_for, plan_epoch, resize_to_grid
from ropekit.data.streaming import ImageFolderStream


def _folder(tmp_path, sizes, classes=2):
    from PIL import Image

    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate(sizes):
        d = tmp_path / f"c{i % classes}"
        d.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / f"{i:03d}.png")
    return ImageFolderStream(tmp_path)


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("h,w,t,p,want", [
    (224, 224, 196, 16, (14, 14)),  # square: the full budget
    (100, 400, 64, 4, (4, 16)),  # 1:4 kept exactly: 4 * 16 = 64
    (300, 200, 100, 10, (12, 8)),  # f = sqrt(100 * 100 / 60000): 12.2 x 8.2 -> 12 x 8
    (10, 1000, 9, 2, (1, 9)),  # the short side rounds to 0: 1, the long side cut to the budget
    (7, 7, 1, 16, (1, 1)),
])
def test_grid_for_hand_cases(h, w, t, p, want):
    assert grid_for(h, w, t, p) == want


def test_grid_for_bounds_many():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        h, w, t, p = (int(v) for v in (rng.integers(1, 2000), rng.integers(1, 2000), rng.integers(1, 600),
                                       rng.integers(1, 33)))
        gh, gw = grid_for(h, w, t, p)
        assert 1 <= gh and 1 <= gw and gh * gw <= max(t, 1)
        if gh > 1 and gw > 1:  # aspect kept to within one patch per side
            assert abs(gh / gw - h / w) <= (h / w) * (1 / gh + 1 / gw) + 1e-9


def test_plan_is_pure_fixed_length_and_within_budget():
    opts = NativeOptions(patch_size=4, seq_len=32, rows=3, min_tokens=4, max_tokens=20)
    for seed in range(5):
        a = plan_epoch(50, opts, seed=seed, epoch=2, rank=1, world_size=2, steps=4)
        assert a == plan_epoch(50, opts, seed=seed, epoch=2, rank=1, world_size=2, steps=4)
        assert a != plan_epoch(50, opts, seed=seed, epoch=3, rank=1, world_size=2, steps=4)
        assert len(a) == 4 and all(len(b) == 3 for b in a)
        for batch in a:
            for row in batch:
                assert sum(t for _, t in row) <= 32 and all(4 <= t <= 20 for _, t in row)
        # one round (no wrap): the two ranks' images are disjoint shares of the permutation
        r0, r1 = ({i for b in plan_epoch(50, opts, seed=seed, epoch=2, rank=r, world_size=2) for row in b
                   for i, _ in row} for r in (0, 1))
        assert r0 and r1 and not (r0 & r1) and len(r0) + len(r1) <= 50
    ev = plan_epoch(10, NativeOptions(patch_size=4, seq_len=16, rows=2, eval_tokens=5), seed=0, epoch=0, train=False)
    assert [i for b in ev for r in b for i, _ in r] == list(range(10))  # every image once, in order


def test_loader_resume_workers_and_budget(tmp_path):
    sizes = [(20 + 7 * i, 60 - 3 * i) for i in range(12)]
    ds = _folder(tmp_path, sizes)
    opts = NativeOptions(patch_size=4, seq_len=48, rows=2, min_tokens=6, max_tokens=24, token_drop=0.25)
    loader = NativeLoader(ds, opts, seed=3)
    full = list(loader.set_epoch(1))
    assert len(full) == loader.steps() == len(loader)
    for b in full:
        assert b.patches.shape == (2, 48, 4 * 4 * 3)
        assert (b.segment_ids >= 0).sum(1).max() <= 48
    resumed = list(loader.set_epoch(1, start_batch=1))
    assert len(resumed) == len(full) - 1 and all(_same(x, y) for x, y in zip(resumed, full[1:]))
    with_workers = list(NativeLoader(ds, opts, seed=3, num_workers=2).set_epoch(1))
    assert all(_same(x, y) for x, y in zip(with_workers, full))
    other = list(NativeLoader(ds, opts, seed=3).set_epoch(2))
    assert not all(_same(x, y) for x, y in zip(other, full))
    ev = list(NativeLoader(ds, opts, train=False).set_epoch(0))
    labels = torch.cat([b.labels for b in ev])
    assert torch.equal(labels, torch.as_tensor(ds.labels))


def test_depth_resized_with_nearest():
    img = torch.zeros(4, 8, 8)
    img[3, :, :4], img[3, :, 4:] = 1.0, 5.0  # a depth edge
    img[3, 0, 0] = float("nan")
    for grid in ((3, 5), (1, 1), (4, 2)):
        out = resize_to_grid(img, grid, 4, depth=True)
        assert out.shape == (4, 4 * grid[0], 4 * grid[1])
        d = out[3]
        vals = set(d[torch.isfinite(d)].unique().tolist())
        assert vals <= {1.0, 5.0}  # nothing between the two sides of the edge


def test_options_errors():
    with pytest.raises(ValueError, match="min_tokens"):
        NativeOptions(patch_size=4, seq_len=16, min_tokens=20)
    with pytest.raises(ValueError, match="token_drop"):
        NativeOptions(patch_size=4, token_drop=1.0)
    with pytest.raises(ValueError, match="positive"):
        grid_for(0, 4, 4, 4)
