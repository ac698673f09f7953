"""The v2 transform pipelines: output contract, the evaluation geometry against its closed form, and RGB-D
where depth must follow RGB's crop and flip exactly (nearest neighbour) while colour operations leave it alone."""

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from ropekit.data import build_eval_transform, build_train_transform
from ropekit.data.transforms import parse_auto_augment

H, W = 160, 200


def ramp():
    """uint8 (3, H, W): R = x, G = y, B = 0 (exact in 8 bits as H, W <= 256); depth (H, W) = y * W + x."""
    yy, xx = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    rgb = torch.stack([xx, yy, torch.zeros_like(xx)]).to(torch.uint8)
    return rgb, (yy * W + xx).float()


def test_train_transform_contract():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (120, 90, 3), dtype=np.uint8))
    torch.manual_seed(0)
    for aa in (None, "randaugment", "trivialaugment", "rand-m7-n3"):
        t = build_train_transform(48, auto_augment=aa, random_erasing=0.5)
        for x in (img, torch.from_numpy(np.array(img)).permute(2, 0, 1)):
            out = t(x)
            assert out.shape == (3, 48, 48) and out.dtype == torch.float32 and torch.isfinite(out).all()
    const = Image.new("RGB", (64, 64), (255, 0, 128))
    out = build_train_transform(16, mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))(const)
    torch.testing.assert_close(out.mean(dim=(1, 2)), torch.tensor([2.0, -1.0, 128 / 255 - 0.5]), atol=1e-5, rtol=0)


def test_auto_augment_names():
    assert parse_auto_augment(None) is None and parse_auto_augment("none") is None
    assert parse_auto_augment("rand-m9-n2") == {"policy": "rand", "num_ops": 2, "magnitude": 9}
    with pytest.warns(UserWarning, match="mstd0.5 ignored"):
        assert parse_auto_augment("rand-m9-mstd0.5")["magnitude"] == 9
    for bad in ("autoaugment-x", "rand-q3", "rand-m99"):
        with pytest.raises(ValueError, match="auto_augment"):
            parse_auto_augment(bad)
    with pytest.raises(ValueError, match="interpolation"):
        build_train_transform(8, interpolation="lanczos9")


def test_eval_transform_is_resize_then_centre_crop():
    rgb, _ = ramp()
    # short side 160 -> 80 (scale 2, crop_pct 0.8 of 64), long side 200 -> 100; centre crop 64: top 8, left 18
    out = build_eval_transform(64, crop_pct=0.8, mean=(0, 0, 0), std=(1, 1, 1), interpolation="bilinear")(rgb)
    assert out.shape == (3, 64, 64)
    i = torch.arange(64, dtype=torch.float32)
    x_src = (i + 18 + 0.5) * 2 - 0.5  # pixel centres mapped back to the input
    y_src = (i + 8 + 0.5) * 2 - 0.5
    inner = slice(2, 62)
    torch.testing.assert_close(out[0, 10, inner] * 255, x_src[inner], atol=0.6, rtol=0)
    torch.testing.assert_close(out[1, inner, 10] * 255, y_src[inner], atol=0.6, rtol=0)


def _source_xy(depth_out):
    d = depth_out.long()
    return d % W, d // W  # (H', W') source column and row of each output pixel


@pytest.mark.parametrize("seed", range(6))
def test_rgbd_train_transform_moves_depth_with_rgb(seed):
    rgb, depth = ramp()
    t = build_train_transform(40, mean=(0, 0, 0), std=(1, 1, 1), interpolation="bilinear", rgbd=True)
    torch.manual_seed(seed)
    out = t((rgb, depth))
    assert out.shape == (4, 40, 40) and out.dtype == torch.float32
    assert torch.equal(out[3], out[3].round()) and set(out[3].unique().tolist()) <= set(depth.unique().tolist())
    sx, sy = _source_xy(out[3])  # nearest neighbour: every depth value is one of the input's
    # RGB carries the continuous source position; nearest picks a pixel within one of it (two when shrinking)
    crop_scale = max(float(sx[0].max() - sx[0].min()) / 39, float(sy[:, 0].max() - sy[:, 0].min()) / 39, 1.0)
    tol = 0.5 * crop_scale + 1.0
    assert (out[0] * 255 - sx).abs()[2:-2, 2:-2].max() <= tol
    assert (out[1] * 255 - sy).abs()[2:-2, 2:-2].max() <= tol


@pytest.mark.parametrize("seed", range(4))
def test_rgbd_colour_policy_never_moves_depth(seed):
    rgb, depth = ramp()
    t = build_train_transform(32, auto_augment="rand-m30-n4", rgbd=True)
    torch.manual_seed(seed)
    out = t((rgb, depth))
    sx, sy = _source_xy(out[3])
    # an axis-aligned crop (+ flip): the source column depends on the output column only, the row on the row
    assert (sx == sx[:1]).all() and (sy == sy[:, :1]).all()
    assert (sy[1:, 0] >= sy[:-1, 0]).all()
    steps = sx[0, 1:] - sx[0, :-1]
    assert (steps >= 0).all() or (steps <= 0).all()


def test_rgbd_eval_and_bad_depth():
    rgb, depth = ramp()
    depth[0, 0] = float("nan")
    e = build_eval_transform(32, crop_pct=1.0, mean=(0, 0, 0), std=(1, 1, 1), rgbd=True)
    out = e(torch.cat([rgb.float() / 255, depth[None]]))  # an in-memory (4, H, W) sample works too
    assert out.shape == (4, 32, 32)
    sx, sy = _source_xy(out[3])
    assert (sx == sx[:1]).all() and (sy == sy[:, :1]).all()
    assert int(sy[16, 0]) in range(H // 2 - 6, H // 2 + 6) and int(sx[0, 16]) in range(W // 2 - 6, W // 2 + 6)
    with pytest.raises(ValueError, match="differ in size"):
        e((rgb, depth[:-1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_train_transform(8, rgbd=True)
