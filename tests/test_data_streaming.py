"""Streamed image folders and tar shards: decoding, the epoch order (pure in seed, epoch, rank, world size),
resuming mid-epoch without decoding the skipped batches, and the ranks' and workers' shares."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ropekit.data import (
    DataFileError,
    ImageFolderStream,
    ShardStream,
    decode_image,
    decode_rgb,
    is_stream,
    load_dataset,
    make_loader,
    open_stream,
    write_fake_image_folder,
    write_shards,
)

N_CLASSES, PER_CLASS = 3, 20  # 60 images


def write_id_folder(root: Path, classes=N_CLASSES, per_class=PER_CLASS, size=6):
    """PNG images whose every pixel encodes the sample's id: R = id % 256, G = id // 256."""
    ids = {}
    i = 0
    for k in range(classes):
        (root / f"c{k}").mkdir(parents=True)
        for j in range(per_class):
            arr = np.zeros((size, size, 3), np.uint8)
            arr[..., 0], arr[..., 1], arr[..., 2] = i % 256, i // 256, 7
            Image.fromarray(arr).save(root / f"c{k}" / f"{j:03d}.png")
            ids[i] = k
            i += 1
    return ids


def batch_ids(images: torch.Tensor) -> list:
    """Ids of a batch of untransformed uint8 (B, 3, H, W) id images."""
    return (images[:, 0, 0, 0].long() + 256 * images[:, 1, 0, 0].long()).tolist()


def epoch_ids(ds, start=0, **kw):
    loader = make_loader(ds, start_batch=start, **kw)
    return [batch_ids(x) for x, _ in loader], len(loader)


@pytest.fixture(scope="module")
def id_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ids")
    ids = write_id_folder(root / "folder")
    write_shards(root / "folder", root / "shards", shard_size=7, val_fraction=0, progress=None)
    return root, ids


@pytest.mark.parametrize("kind", ["folder", "shards"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_start_batch_gives_the_same_batches_from_k_on(id_data, kind, workers, world_size):
    root, ids = id_data
    ds = ImageFolderStream(root / "folder") if kind == "folder" else ShardStream(root / "shards")
    seen = []
    lengths = set()
    for rank in range(world_size):
        kw = dict(batch_size=4, seed=3, epoch=1, rank=rank, world_size=world_size, num_workers=workers)
        full, n = epoch_ids(ds, **kw)
        assert len(full) == n and all(len(b) == 4 for b in full)
        for k in (1, 3, n - 1):
            part, n_k = epoch_ids(ds, start=k, **kw)
            assert n_k == n and part == full[k:], (rank, k)
        lengths.add(n)
        seen += [i for b in full for i in b]
    assert len(lengths) == 1  # every rank runs the same number of steps
    assert len(seen) == len(set(seen)) and set(seen) <= set(ids)  # no sample twice over ranks and workers
    assert len(seen) >= len(ids) - world_size * max(workers, 1) * 4 - 7 * world_size


def test_folder_order_is_independent_of_workers_and_changes_with_epoch(id_data):
    root, _ = id_data
    ds = ImageFolderStream(root / "folder")
    a, _ = epoch_ids(ds, batch_size=5, seed=0, epoch=2, num_workers=0)
    b, _ = epoch_ids(ds, batch_size=5, seed=0, epoch=2, num_workers=2)
    c, _ = epoch_ids(ds, batch_size=5, seed=0, epoch=3, num_workers=0)
    assert a == b and a != c and sorted(sum(a, [])) == sorted(sum(c, [])) == list(range(60))


def test_labels_match_images_and_eval_sees_everything_once(id_data):
    root, ids = id_data
    for ds in (ImageFolderStream(root / "folder"), ShardStream(root / "shards")):
        got = []
        for rank in range(2):
            loader = make_loader(ds, batch_size=8, rank=rank, world_size=2, drop_last=False, shuffle=False,
                                 num_workers=2 if isinstance(ds, ShardStream) else 0)
            for x, y in loader:
                assert x.dtype == torch.uint8 and y.dtype == torch.int64
                assert [ids[i] for i in batch_ids(x)] == y.tolist()
                got += batch_ids(x)
        assert sorted(got) == sorted(ids)


def test_skipped_batches_are_not_decoded(id_data):
    root, _ = id_data
    calls = []

    def transform(img):
        calls.append(1)
        return img

    for ds in (ImageFolderStream(root / "folder", transform), ShardStream(root / "shards", transform)):
        calls.clear()
        loader = make_loader(ds, batch_size=4, seed=1, start_batch=5)
        n = sum(1 for _ in loader)
        assert n == len(loader) - 5 and len(calls) == n * 4


def test_augmentation_is_reproducible_across_workers_and_resume(id_data):
    from torchvision.transforms import v2

    root, _ = id_data
    tf = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(4, antialias=True), v2.ColorJitter(0.5, 0.5)])
    ds = ImageFolderStream(root / "folder", tf)
    a = [x for x, _ in make_loader(ds, batch_size=6, seed=5, epoch=0, num_workers=0)]
    b = [x for x, _ in make_loader(ds, batch_size=6, seed=5, epoch=0, num_workers=2, start_batch=2)]
    assert all(torch.equal(u, v) for u, v in zip(a[2:], b, strict=True))
    state = torch.get_rng_state()
    list(make_loader(ds, batch_size=6, seed=5, epoch=1))
    assert torch.equal(state, torch.get_rng_state())  # the caller's generator is left alone
    sh = ShardStream(root / "shards", tf)
    c = [x for x, _ in make_loader(sh, batch_size=6, seed=5, num_workers=2)]
    d = [x for x, _ in make_loader(sh, batch_size=6, seed=5, num_workers=2, start_batch=3)]
    assert all(torch.equal(u, v) for u, v in zip(c[3:], d, strict=True))


def test_set_epoch_reuses_the_loader(id_data):
    root, _ = id_data
    ds = ImageFolderStream(root / "folder")
    loader = make_loader(ds, batch_size=5, seed=0, epoch=0, num_workers=2, persistent_workers=True)
    e0 = [batch_ids(x) for x, _ in loader]
    e1 = [batch_ids(x) for x, _ in loader.set_epoch(1)]
    e1b = [batch_ids(x) for x, _ in loader.set_epoch(1, start_batch=4)]
    assert e0 == epoch_ids(ds, batch_size=5, seed=0, epoch=0)[0] and e1 != e0 and e1b == e1[4:]
    sh = ShardStream(id_data[0] / "shards")
    sl = make_loader(sh, batch_size=3, seed=0, epoch=0)
    assert [batch_ids(x) for x, _ in sl.set_epoch(2)] == epoch_ids(sh, batch_size=3, seed=0, epoch=2)[0]


def test_shard_length_equalises_ranks_and_refuses_too_few(id_data, tmp_path):
    root, _ = id_data
    sh = ShardStream(root / "shards")
    assert len(sh) == 60 and sh.counts == [7] * 8 + [4]
    assert len(make_loader(sh, batch_size=4, world_size=2, rank=0)) == len(make_loader(sh, batch_size=4,
                                                                                         world_size=2, rank=1))
    with pytest.raises(ValueError, match="no full batch"):
        make_loader(sh, batch_size=64)
    # a list of tars without the manifest: counted by listing them
    tars = sorted(str(p) for p in (root / "shards").glob("train-*.tar"))
    assert ShardStream(tars).counts == sh.counts


# ------------------------------------------------------------------------------------------------------
# decoding of image modes
# ------------------------------------------------------------------------------------------------------


def test_decode_modes(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    cases = {
        "l.png": (Image.fromarray(rgb[..., 0], "L"), np.repeat(rgb[..., :1], 3, -1)),
        "rgba.png": (Image.fromarray(np.dstack([rgb, np.full((5, 7), 9, np.uint8)]), "RGBA"), rgb),
        "p.png": (Image.fromarray(rgb).quantize(16), None),
        "cmyk.jpg": (Image.fromarray(rgb).convert("CMYK"), None),
        "rgb.jpg": (Image.fromarray(rgb), None),
        "l.jpg": (Image.fromarray(rgb[..., 0], "L"), None),
        "one.png": (Image.fromarray(rgb[..., 0] > 127),
                    np.repeat(((rgb[..., :1] > 127) * 255).astype(np.uint8), 3, -1)),
    }
    for name, (img, want) in cases.items():
        img.save(tmp_path / name)
        out = np.array(decode_rgb(tmp_path / name))
        assert out.shape == (5, 7, 3) and out.dtype == np.uint8, name
        if want is not None:
            np.testing.assert_array_equal(out, want, err_msg=name)
        # the streams' decoder (torchvision's for JPEG) gives Pillow's pixels as a (3, H, W) tensor
        np.testing.assert_array_equal(decode_image(tmp_path / name).permute(1, 2, 0).numpy(), out, err_msg=name)
    # 16-bit greyscale: scaled to 8 bits, not clipped at 255
    wide = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    Image.fromarray(wide).save(tmp_path / "w.png")
    assert Image.open(tmp_path / "w.png").mode.startswith("I")
    np.testing.assert_array_equal(np.array(decode_rgb(tmp_path / "w.png"))[0, :, 0], [0, 1, 128, 255])
    # palette with transparency keeps its colours
    p = Image.fromarray(rgb).quantize(4)
    p.info["transparency"] = 0
    p.save(tmp_path / "pt.png", transparency=0)
    np.testing.assert_array_equal(np.array(decode_rgb(tmp_path / "pt.png")), np.array(p.convert("RGB")))


# ------------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------------


@pytest.fixture
def bad_folder(tmp_path):
    root = tmp_path / "bad"
    write_fake_image_folder(root, classes=2, per_class=6, size=16)
    good = (root / "class_0" / "000000.jpg").read_bytes()
    (root / "class_0" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "class_1" / "text.jpg").write_text("not an image")
    (root / "class_1" / "notes.txt").write_text("ignored: not an image extension")
    return root


def test_corrupt_files_raise_naming_them_or_are_skipped_and_counted(bad_folder):
    ds = ImageFolderStream(bad_folder)
    assert len(ds) == 14 and ds.ignored == 1
    for workers in (0, 2):  # a worker's error reaches the caller as itself, one line, not a RuntimeError
        with pytest.raises(DataFileError, match=r"^[^\n]*(truncated|text)\.jpg: not a readable image[^\n]*$"):
            list(make_loader(ds, batch_size=4, drop_last=False, shuffle=False, num_workers=workers))
    ds = ImageFolderStream(bad_folder, skip_corrupt=True)
    loader = make_loader(ds, batch_size=4, drop_last=False, shuffle=False, num_workers=2)
    with pytest.warns(UserWarning, match="skipped 2 unreadable"):
        sizes = [len(y) for _, y in loader]
    assert sum(sizes) == 12 and loader.skipped == 2


def test_corrupt_sample_in_shards(bad_folder, tmp_path):
    write_shards(bad_folder, tmp_path / "s", shard_size=5, val_fraction=0, skip_corrupt=True)
    manifest = json.loads((tmp_path / "s" / "shards.json").read_text())
    assert sorted(Path(p).name for p in manifest["skipped"]) == ["text.jpg", "truncated.jpg"]
    assert manifest["splits"]["train"]["count"] == 12
    with pytest.raises(DataFileError, match="(text|truncated).jpg"):
        write_shards(bad_folder, tmp_path / "s2", shard_size=5)
    good = (bad_folder / "class_0" / "000001.jpg").read_bytes()
    samples = [{"__key__": f"k{i}", "jpg": good, "cls": str(i % 2)} for i in range(5)]
    samples[3]["jpg"] = good[: len(good) // 2]  # truncated: only a full decode finds it
    _tar(tmp_path / "t.tar", samples)
    for workers in (0, 1):
        with pytest.raises(DataFileError, match=r"t\.tar\[k3\]: not a readable image"):
            list(make_loader(ShardStream([tmp_path / "t.tar"]), batch_size=2, drop_last=False, num_workers=workers))
    loader = make_loader(ShardStream([tmp_path / "t.tar"], skip_corrupt=True), batch_size=2, drop_last=False)
    with pytest.warns(UserWarning, match="skipped 1"):
        assert sum(len(y) for _, y in loader) == 4
    assert loader.skipped == 1


def test_empty_class_folder_and_missing_root(tmp_path):
    write_fake_image_folder(tmp_path / "f", classes=2, per_class=2, size=16)
    (tmp_path / "f" / "class_9").mkdir()
    with pytest.raises(ValueError, match="class folder.* without images: class_9"):
        ImageFolderStream(tmp_path / "f")
    assert len(ImageFolderStream(tmp_path / "f", allow_empty=True).classes) == 3
    with pytest.raises(FileNotFoundError, match="no such directory"):
        ImageFolderStream(tmp_path / "missing")


def _tar(path, samples):
    import webdataset as wds

    with wds.TarWriter(str(path)) as w:
        for s in samples:
            w.write(s)


def test_bad_shards(tmp_path):
    buf = tmp_path / "x.png"
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(buf)
    img = buf.read_bytes()
    _tar(tmp_path / "nolabel.tar", [{"__key__": "a", "png": img, "cls": "0"}, {"__key__": "b", "png": img}])
    _tar(tmp_path / "noimage.tar", [{"__key__": "a", "txt": "hello", "cls": "1"}])
    for name, msg in (("nolabel", r"nolabel\.tar\[b\]: sample has no label"),
                      ("noimage", r"noimage\.tar\[a\]: sample has no image")):
        with pytest.raises(DataFileError, match=msg):
            list(make_loader(ShardStream([tmp_path / f"{name}.tar"]), batch_size=1, drop_last=False))
    with pytest.raises(FileNotFoundError, match="missing shard .*gone.tar"):
        ShardStream([tmp_path / "nolabel.tar", tmp_path / "gone.tar"])
    raw = (tmp_path / "nolabel.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(raw[:700])
    with pytest.raises(DataFileError, match="cut.tar"):
        list(make_loader(ShardStream([tmp_path / "cut.tar"]), batch_size=1, drop_last=False, num_workers=1))
    # a manifest that disagrees with its shard
    m = {"format": "ropekit-shards", "version": 1, "classes": ["a", "b"],
         "splits": {"train": {"shards": [{"file": "nolabel.tar", "count": 5}]}}}
    (tmp_path / "shards.json").write_text(json.dumps(m))
    with pytest.raises(DataFileError, match="holds 2 samples, the manifest says 5"):
        list(make_loader(ShardStream(tmp_path, skip_corrupt=True), batch_size=1))
    (tmp_path / "shards.json").write_text("{not json")
    with pytest.raises(DataFileError, match="not a shard manifest"):
        ShardStream(tmp_path)


# ------------------------------------------------------------------------------------------------------
# open_stream
# ------------------------------------------------------------------------------------------------------


def test_open_stream_layouts(tmp_path):
    write_fake_image_folder(tmp_path / "inet", classes=3, per_class=8, val_per_class=2, size=40)
    train, val, info = open_stream("folder-stream", tmp_path / "inet", image_size=32, auto_augment="randaugment")
    assert (len(train), len(val), info.num_classes, info.image_size) == (24, 6, 3, (32, 32))
    assert info.class_names == ("class_0", "class_1", "class_2") and info.mean is not None
    x, y = next(iter(make_loader(train, batch_size=4, seed=0)))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (4,)
    assert -3 < float(x.mean()) < 3 and float(x.std()) > 0.1  # normalised, not [0, 255]
    flat, _, _ = open_stream("imagefolder", tmp_path / "inet" / "train", image_size=16, test_fraction=0.25)
    assert len(flat) == 18
    write_shards(tmp_path / "inet", tmp_path / "sh", shard_size=5)
    strain, sval, sinfo = open_stream("shards", tmp_path / "sh", image_size=16)
    assert (len(strain), len(sval), sinfo.num_classes, sinfo.name) == (24, 6, 3, "shards")
    xv, _ = next(iter(make_loader(sval, batch_size=6, shuffle=False, drop_last=False)))
    assert xv.shape == (6, 3, 16, 16)
    assert is_stream("shards") and is_stream("folder-stream") and not is_stream("imagefolder")
    with pytest.raises(ValueError, match="open_stream"):
        load_dataset("shards")
    with pytest.raises(ValueError, match="known streams"):
        open_stream("nope", tmp_path)


def test_mixed_modes_and_sizes_in_one_batch(tmp_path):
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    for k in range(2):
        (tmp_path / f"c{k}").mkdir()
    Image.fromarray(rgb).save(tmp_path / "c0" / "rgb.jpg")
    Image.fromarray(rgb[..., 0]).save(tmp_path / "c0" / "grey.png")
    Image.fromarray(np.dstack([rgb, rgb[..., :1]])).save(tmp_path / "c1" / "rgba.png")
    Image.fromarray(rgb).convert("CMYK").save(tmp_path / "c1" / "cmyk.jpg")
    Image.fromarray((rgb[:20, :25, 0].astype(np.uint16) * 257)).save(tmp_path / "c1" / "wide.png")
    train, val, info = open_stream("folder-stream", tmp_path, image_size=16, test_fraction=0.4)
    ds = ImageFolderStream(tmp_path, train.transform)
    x, y = next(iter(make_loader(ds, batch_size=5)))
    assert x.shape == (5, 3, 16, 16) and torch.isfinite(x).all() and sorted(y.tolist()) == [0, 0, 1, 1, 1]


def test_make_loader_over_an_in_memory_dataset():
    from ropekit.data import TensorImageDataset

    ds = TensorImageDataset(torch.arange(30.0).view(30, 1, 1, 1), torch.arange(30) % 3)
    full = [x.view(-1).long().tolist() for x, _ in make_loader(ds, batch_size=4, seed=2, epoch=1)]
    assert [x.view(-1).long().tolist() for x, _ in make_loader(ds, batch_size=4, seed=2, epoch=1,
                                                               start_batch=3)] == full[3:]
    assert len(full) == 7 and len({i for b in full for i in b}) == 28
