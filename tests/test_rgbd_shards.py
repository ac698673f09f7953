"""RGB-D WebDataset shards: ``ropekit data convert`` from an RGB-D folder (``<stem>.depth.npy`` beside each image) and
from the embedded RGB-D data sets, read back streamed at a fixed size (ShardStream, open_stream) and at native
resolution (ShardSource, NativeLoader): the round trip against the in-memory samples, depth moved with its image by
crops, resizes and flips without an interpolated value, depth aligned with its tokens in packed batches, mid-epoch
resume, and ``ropekit train --data shards`` training a ViT on RGB-D for one epoch."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ropekit.data import (DataFileError, DatasetInfo, ImageFolderStream, ShardSource, ShardStream, TensorImageDataset,
                          load_dataset, make_loader, open_stream)
from ropekit.data.native import NativeLoader, NativeOptions
from ropekit.data.shards import check_data, write_dataset_shards, write_shards

pytest.importorskip("webdataset")

DATA_OPTS = dict(num_train=40, num_test=12)  # rgbd-digits, small


def _key(depth):
    """A depth map's identity: its float32 bytes (every generated map differs; NaN payloads compare as bytes)."""
    return np.ascontiguousarray(np.asarray(depth, dtype=np.float32)).tobytes()


def _same_nan(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a, 7.0),
                                                                       torch.nan_to_num(b, 7.0))


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("rgbd") / "shards"
    train, test, info = load_dataset("rgbd-digits", image_size=12, split_seed=3, **DATA_OPTS)
    m = write_dataset_shards((train, test, info), out, shard_size=16, seed=3)
    return out, m, train, test


def test_dataset_shards_round_trip_equals_the_in_memory_samples(digits):
    out, m, train, test = digits
    assert m["depth"] and m["splits"]["train"]["count"] == 40 and m["splits"]["val"]["count"] == 12
    assert [e["count"] for e in m["splits"]["train"]["shards"]] == [16, 16, 8]
    for split, ref in (("train", train), ("val", test)):
        src = ShardSource(out, split=split)
        by_depth = {_key(ref.images[i, 3]): i for i in range(len(ref))}
        assert src.depth and len(src) == len(ref) == len(by_depth)
        seen = set()
        for j in range(len(src)):
            (rgb, depth), y = src[j]
            i = by_depth[_key(depth[0])]  # depth is stored bit for bit, NaN and 0 (invalid) included
            seen.add(i)
            x = ref.images[i]
            assert int(y) == int(ref.labels[i]) and depth.dtype == torch.float32 and depth.shape == (1, 12, 12)
            assert _same_nan(depth[0], x[3])
            # 8-bit PNG: exactly round(255 x), so within half a grey level of the float values
            assert rgb.dtype == torch.uint8 and torch.equal(rgb, torch.round(x[:3] * 255).to(torch.uint8))
            assert (rgb.float() / 255 - x[:3]).abs().max() <= 0.5 / 255 + 1e-6
        assert len(seen) == len(ref)
    assert np.isnan(test.images[:, 3].numpy()).any() and (test.images[:, 3] == 0).any()  # the hard values occur


def test_fixed_size_stream_gives_the_model_what_the_in_memory_set_does(digits):
    """At the stored size with ``crop_pct=1`` and no standardisation the evaluation transform changes nothing, so the
    batches the ViT gets are the in-memory ``(4, H, W)`` samples: depth bit for bit, RGB at 8 bits (``k / 255``, to
    the one float32 rounding of torchvision's ``k * (1 / 255)``: 2^-24 below 1)."""
    out, _, _, test = digits
    _, val, info = open_stream("shards", out, image_size=12, crop_pct=1.0, mean=(0, 0, 0), std=(1, 1, 1))
    assert (info.kind, info.in_chans, info.num_classes, info.image_size) == ("rgbd", 3, 10, (12, 12))
    by_depth = {_key(test.images[i, 3]): i for i in range(len(test))}
    n = 0
    for x, y in make_loader(val, batch_size=5, drop_last=False, shuffle=False):
        assert x.shape[1:] == (4, 12, 12) and x.dtype == torch.float32
        for k in range(len(y)):
            i = by_depth[_key(x[k, 3])]
            assert _same_nan(x[k, 3], test.images[i, 3]) and int(y[k]) == int(test.labels[i])
            assert (x[k, :3] - torch.round(test.images[i, :3] * 255) / 255).abs().max() <= 2.0 ** -24
            n += 1
    assert n == len(test)


def _ramp_folder(root, sizes=((48, 64), (40, 56), (64, 48)), per_class=3, step=False):
    """An RGB-D folder of PNGs: R and G are ramps of the column and the row (``round(255 x / (W - 1))``), and the
    depth map beside each image codes the image and its pixel, ``4096 n + y W + x + 1`` (float32, exact), or with
    ``step`` is a step edge:
    1 m left of column ``W // 2``, 5 m from it on, which B shows too (0 / 255)."""
    n = 0
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for k in range(per_class):
            h, w = sizes[n % len(sizes)]
            yy, xx = np.mgrid[0:h, 0:w]
            rgb = np.stack([np.round(255 * xx / (w - 1)), np.round(255 * yy / (h - 1)),
                            255 * (xx >= w // 2)], -1).astype(np.uint8)
            depth = np.where(xx >= w // 2, 5.0, 1.0) if step else 4096 * n + yy * w + xx + 1.0
            Image.fromarray(rgb).save(root / c / f"{k:03d}.png")
            np.save(root / c / f"{k:03d}.depth.npy", depth.astype(np.float32))
            n += 1
    return root


def test_folder_shards_round_trip_exactly(tmp_path):
    folder = _ramp_folder(tmp_path / "f")
    m = write_shards(folder, tmp_path / "s", shard_size=4, val_fraction=0)
    assert m["depth"] and json.loads((tmp_path / "s" / "shards.json").read_text())["depth"] is True
    want = {}
    for p in sorted(folder.rglob("*.png")):
        d = np.load(p.with_name(p.stem + ".depth.npy"))
        want[_key(d)] = (torch.from_numpy(np.array(Image.open(p))).permute(2, 0, 1), d, p.parent.name)
    src = ShardSource(tmp_path / "s")
    stream = ShardStream(tmp_path / "s")
    assert src.depth and stream.depth and len(src) == len(want) == 6
    for j in range(len(src)):
        (rgb, depth), y = src[j]
        r, d, cls = want[_key(depth[0])]
        assert torch.equal(rgb, r) and torch.equal(depth[0], torch.from_numpy(d)) and src.classes[int(y)] == cls
    got = 0
    for s in range(len(stream.shards)):  # the stream decodes the same pairs
        for _, pos, raw in stream.shard_samples(s):
            (rgb, depth), y = stream._decode(s, pos, raw, None)
            r, d, _ = want[_key(depth[0])]
            assert torch.equal(rgb, r) and torch.equal(depth[0], torch.from_numpy(d))
            got += 1
    assert got == 6 and check_data(tmp_path / "s")["bad"] == []


def test_rgbd_folder_errors_are_one_line(tmp_path):
    folder = _ramp_folder(tmp_path / "f")
    (folder / "b" / "001.depth.npy").unlink()
    with pytest.raises(DataFileError, match=r"001.png: has no depth map 001.depth.npy beside it") as e:
        write_shards(folder, tmp_path / "s1", val_fraction=0)
    assert "\n" not in str(e.value)
    np.save(folder / "b" / "001.depth.npy", np.zeros((3, 3), np.float32))
    with pytest.raises(DataFileError, match=r"must be a numeric \(H, W\) = \(\d+, \d+\) array, got float32 \(3, 3\)"):
        write_shards(folder, tmp_path / "s2", val_fraction=0)
    for p in folder.rglob("*.depth.npy"):
        p.unlink()
    np.save(folder / "b" / "002.depth.npy", np.zeros((48, 64), np.float32))
    with pytest.raises(DataFileError, match="a depth map, but the folder's first image"):
        write_shards(folder, tmp_path / "s3", val_fraction=0)
    image = TensorImageDataset(torch.zeros(2, 3, 4, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="kind 'image'"):
        write_dataset_shards((image, image, DatasetInfo("toy", 2, 3, (4, 4))), tmp_path / "s4")


@pytest.mark.parametrize("seed", range(8))
def test_crops_and_flips_move_depth_with_its_image_and_never_blend_an_edge(tmp_path, seed):
    """The training transform of RGB-D shards (random resized crop, shrinking up to 64 / 12, flip): a step edge stays
    two-valued and sits where the image's B step is; a pixel-coded depth map names, for every output pixel, the
    source pixel under it, which the R / G ramps place independently. Bound: nearest sampling is within half a source
    pixel of the centred sample position, plus half an 8-bit step of the ramp (``(W - 1) / 510`` pixels), away from
    the crop's border where the antialiasing filter is clipped."""
    step = _ramp_folder(tmp_path / "step", step=True, per_class=6)
    coded = _ramp_folder(tmp_path / "coded", sizes=((48, 64),), per_class=6)
    for folder in (step, coded):
        write_shards(folder, folder.with_suffix(".s"), shard_size=3, val_fraction=0.5)  # 6 train, 6 val
    kw = dict(image_size=12, mean=(0, 0, 0), std=(1, 1, 1), interpolation="bilinear", scale=(0.3, 1.0))
    tr_step, _, _ = open_stream("shards", step.with_suffix(".s"), **kw)
    tr_coded, _, _ = open_stream("shards", coded.with_suffix(".s"), **kw)
    for x, _ in make_loader(tr_step, batch_size=3, seed=seed):
        for img in x:
            assert set(img[3].unique().tolist()) <= {1.0, 5.0}  # no interpolated depth at the edge
            far = img[3] == 5.0
            # B is the same step, blended by the colour filter: clearly far (> 0.75) is far in depth, clearly near
            # (< 0.25) near
            assert bool(far[img[2] > 0.75].all()) and not bool(far[img[2] < 0.25].any())
    n = 0
    h, w = 48, 64
    for x, _ in make_loader(tr_coded, batch_size=3, seed=seed):
        for img in x:
            code = (img[3].long() - 1) % 4096
            sy, sx = code // w, code % w  # the source pixel under each output pixel
            assert bool((code >= 0).all()) and int(sy.max()) < h
            assert float((img[0] * (w - 1) - sx).abs()[2:-2, 2:-2].max()) <= 0.5 + (w - 1) / 510 + 1e-4
            assert float((img[1] * (h - 1) - sy).abs()[2:-2, 2:-2].max()) <= 0.5 + (h - 1) / 510 + 1e-4
            n += 1
    assert n == 6


def test_native_packing_keeps_depth_on_its_tokens(tmp_path):
    """Packed native-resolution batches of RGB-D shards: in every token the depth channel names source pixels whose
    position the R / G ramps of the same token give (to the bound of the fixed-size test), token dropping and flips
    included, and the per-token mean depth is the mean of the token's depth pixels."""
    folder = _ramp_folder(tmp_path / "f", sizes=((48, 64),), per_class=4)
    write_shards(folder, tmp_path / "s", shard_size=3, val_fraction=0)
    src = ShardSource(tmp_path / "s")
    p = 4
    opts = NativeOptions(patch_size=p, seq_len=200, rows=2, min_tokens=40, max_tokens=100, depth=True,
                         token_drop=0.25, mean=(0, 0, 0), std=(1, 1, 1))
    h, w = 48, 64
    tokens = 0
    for seed in range(3):
        for batch in NativeLoader(src, opts, seed=seed).set_epoch(seed):
            tok = batch.patches.view(*batch.patches.shape[:2], p, p, 4)[batch.segment_ids >= 0]  # (T, p, p, RGB + D)
            code = (tok[..., 3].long() - 1) % 4096
            sy, sx = code // w, code % w  # the source pixel under each of the token's pixels
            assert bool((code >= 0).all()) and int(sy.max()) < h
            assert torch.equal(batch.depth[batch.segment_ids >= 0], tok[..., 3].mean((-1, -2)))
            inner = (sx >= 8) & (sx < w - 8) & (sy >= 8) & (sy < h - 8)  # the resize filter is not clipped there
            assert float((tok[..., 0] * (w - 1) - sx).abs()[inner].max()) <= 0.5 + (w - 1) / 510 + 1e-4
            assert float((tok[..., 1] * (h - 1) - sy).abs()[inner].max()) <= 0.5 + (h - 1) / 510 + 1e-4
            tokens += len(tok)
    assert tokens > 100


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_from_rgbd_shards_is_exact(digits, workers):
    out, _, _, _ = digits
    train, _, _ = open_stream("shards", out, image_size=10, hflip=0.5, scale=(0.5, 1.0))
    kw = dict(batch_size=4, seed=3, epoch=1, num_workers=workers)
    full = [x for x, _ in make_loader(train, **kw)]
    assert len(full) >= 5 and all(x.shape == (4, 4, 10, 10) for x in full)
    for k in (1, 3, len(full) - 1):
        part = [x for x, _ in make_loader(train, start_batch=k, **kw)]
        assert len(part) == len(full) - k and all(_same_nan(a, b) for a, b in zip(part, full[k:]))
    src = ShardSource(out)
    opts = NativeOptions(patch_size=4, seq_len=24, rows=2, min_tokens=4, max_tokens=9, depth=True, token_drop=0.2)
    native = list(NativeLoader(src, opts, seed=5, num_workers=workers).set_epoch(2))
    again = list(NativeLoader(src, opts, seed=5, num_workers=workers).set_epoch(2, start_batch=2))
    assert len(again) == len(native) - 2 >= 1
    assert all(_same_nan(a, b) if a.is_floating_point() else torch.equal(a, b)
               for x, y in zip(again, native[2:]) for a, b in zip(x, y) if isinstance(a, torch.Tensor))


@pytest.mark.usefixtures("one_thread")
def test_train_a_vit_on_rgbd_shards_for_one_epoch(digits, tmp_path):
    from ropekit.cli import main
    from ropekit.train import load_checkpoint

    out, _, _, _ = digits
    args = ["train", "--data", "shards", "--data-root", str(out), "--image-size", "12", "--patch-size", "4",
            "--model-opt", "embed_dim=16", "--model-opt", "depth=1", "--model-opt", "num_heads=1", "--epochs", "1",
            "--batch-size", "8", "--no-progress", "--no-tensorboard", "--threads", "1", "--device", "cpu",
            "--out", str(tmp_path / "run")]
    assert main(args) == 0
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt["vit_config"]["modality"] == "rgbd" and ckpt["vit_config"]["in_chans"] == 3
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    data = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert summary["epochs_done"] == 1 and summary["depth_input"] == "coord" and np.isfinite(summary["train_loss"])
    assert (data["kind"], data["num_train"], data["num_test"]) == ("rgbd", 40, 12)


def test_rgbd_folder_streams_as_its_shards_do(tmp_path):
    """An RGB-D folder streamed directly (``--data imagefolder``): the same (rgb, depth) pairs as the files, kind
    "rgbd" with 4-channel batches, and at native resolution the same packed batches as the shards converted from it."""
    folder = _ramp_folder(tmp_path / "f", per_class=4)
    write_shards(folder, tmp_path / "s", shard_size=3, val_fraction=0)
    stream = ImageFolderStream(folder)
    assert stream.depth and len(stream) == 8
    for i in range(len(stream)):
        (rgb, depth), _ = stream[i]
        p = stream.path(i)
        assert torch.equal(rgb, torch.from_numpy(np.array(Image.open(p))).permute(2, 0, 1))
        assert torch.equal(depth[0], torch.from_numpy(np.load(p.with_name(p.stem + ".depth.npy"))))
    train, val, info = open_stream("imagefolder", folder, image_size=8, test_fraction=0.25)
    assert info.kind == "rgbd" and train.depth and val.depth
    x, _ = next(iter(make_loader(train, batch_size=3)))
    assert x.shape == (3, 4, 8, 8)
    shards = ShardSource(tmp_path / "s")
    by_depth = {_key(stream[i][0][1][0]): i for i in range(len(stream))}
    ordered = stream.subset([by_depth[_key(shards[j][0][1][0])] for j in range(len(shards))])  # the shards' order
    opts = NativeOptions(patch_size=4, seq_len=120, rows=2, min_tokens=20, max_tokens=60, depth=True, token_drop=0.2)
    for seed in range(2):
        want = list(NativeLoader(ordered, opts, seed=seed).set_epoch(seed))
        got = list(NativeLoader(shards, opts, seed=seed).set_epoch(seed))
        assert len(want) == len(got) >= 1
        assert all(torch.equal(a, b) for x, y in zip(want, got) for a, b in zip(x, y) if isinstance(a, torch.Tensor))


def test_rgbd_folder_bad_depth_is_named(tmp_path):
    folder = _ramp_folder(tmp_path / "f")
    np.save(folder / "b" / "002.depth.npy", np.zeros((2, 2), np.float32))
    stream = ImageFolderStream(folder)
    i = next(i for i in range(len(stream)) if stream.path(i).name == "002.png" and stream.path(i).parent.name == "b")
    with pytest.raises(DataFileError, match=r"002.depth.npy: depth entry depth.npy must be a numeric"):
        stream[i]
    assert ImageFolderStream(folder, skip_corrupt=True)[i] is None
    bad = check_data(folder)["bad"]
    assert len(bad) == 1 and "002.depth.npy" in bad[0]
    (folder / "b" / "002.depth.npy").unlink()
    with pytest.raises(DataFileError, match=r"002.png: has no depth map 002.depth.npy beside it"):
        stream[i]
    bad = check_data(folder)["bad"]  # the check names it as the readers do
    assert len(bad) == 1 and bad[0].endswith("002.png: has no depth map 002.depth.npy beside it (the folder's first "
                                             "image has one, so every image needs one)")
    _ramp_folder(tmp_path / "tv" / "train")
    for p in _ramp_folder(tmp_path / "tv" / "val").rglob("*.depth.npy"):
        p.unlink()
    with pytest.raises(ValueError, match="the training images have depth maps, the validation images have none"):
        open_stream("imagefolder", tmp_path / "tv", image_size=8)


@pytest.mark.usefixtures("one_thread")
def test_native_resolution_trains_on_an_rgbd_folder(tmp_path):
    from ropekit.cli import main

    folder = _ramp_folder(tmp_path / "f", per_class=5)
    args = ["train", "--native-resolution", "--data", "imagefolder", "--data-root", str(folder), "--patch-size", "8",
            "--native-opt", "seq_len=32", "--native-opt", "rows=2", "--native-opt", "min_tokens=4",
            "--native-opt", "max_tokens=16", "--model-opt", "embed_dim=16", "--model-opt", "depth=1",
            "--model-opt", "num_heads=1", "--epochs", "1", "--no-progress", "--no-tensorboard", "--threads", "1",
            "--device", "cpu", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["depth_input"] == "coord" and np.isfinite(summary["train_loss"])  # an RGB-D model
