"""The native-resolution loader reading WebDataset shards (ropekit.data.shard_source.ShardSource): the same samples
and packed batches as the folder the shards were converted from, RGB-D shards against an in-memory reference, worker
and fork safety, mid-epoch resume, and one-line errors for bad shards."""

import io
import json
import pickle
import tarfile

import numpy as np
import pytest
import torch

from ropekit.data import DataFileError
from ropekit.data import shard_source as shard_source_mod
from ropekit.data.native import IMAGENET_MEAN, IMAGENET_STD, NativeLoader, NativeOptions
from ropekit.data.shard_source import ShardSource
from ropekit.data.shards import write_shards
from ropekit.data.streaming import ImageFolderStream

pytest.importorskip("webdataset")


def _folder(root, n=14, seed=0):
    """Mixed sizes and formats: RGB PNG, greyscale PNG, RGBA PNG and JPEG (decoded by another library)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        d = root / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        h, w = int(rng.integers(9, 70)), int(rng.integers(9, 70))
        a = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
        kind = i % 4
        if kind == 0:
            Image.fromarray(a[..., :3]).save(d / f"{i:03d}.png")
        elif kind == 1:
            Image.fromarray(a[..., 0], "L").save(d / f"{i:03d}.png")
        elif kind == 2:
            Image.fromarray(a, "RGBA").save(d / f"{i:03d}.png")
        else:
            Image.fromarray(a[..., :3]).save(d / f"{i:03d}.jpg", quality=80)
    return root


def _tar_images(out):
    """Each sample's encoded image bytes in the manifest's shard order, read with tarfile (independent of the
    index under test)."""
    m = json.loads((out / "shards.json").read_text())
    got = []
    for e in m["splits"]["train"]["shards"]:
        with tarfile.open(out / e["file"]) as tf:
            for mem in tf.getmembers():
                if mem.name.rsplit(".", 1)[-1] in ("png", "jpg"):
                    got.append(tf.extractfile(mem).read())
    return got


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def _converted(tmp_path, shard_size=4):
    folder = ImageFolderStream(_folder(tmp_path / "img"))
    out = tmp_path / "shards"
    write_shards(tmp_path / "img", out, shard_size=shard_size, val_fraction=0)
    by_bytes = {folder.path(i).read_bytes(): i for i in range(len(folder))}
    order = [by_bytes[b] for b in _tar_images(out)]  # shard sample k is folder image order[k]
    return folder.subset(order), ShardSource(out), out


def test_shards_give_the_folder_samples_and_eval_batches(tmp_path):
    folder, shards, _ = _converted(tmp_path)
    assert len(shards) == len(folder) == 14 and len(shards.shards) == 4 and shards.counts == [4, 4, 4, 2]
    assert shards.classes == folder.classes and not shards.depth
    assert np.array_equal(shards.labels, folder.labels)
    for i in range(len(folder)):
        (a, ya), (b, yb) = folder[i], shards[i]
        assert a.dtype == b.dtype == torch.uint8 and torch.equal(a, b) and int(ya) == int(yb)
    opts = NativeOptions(patch_size=4, seq_len=40, rows=2, eval_tokens=12)
    ev_f = list(NativeLoader(folder, opts, train=False).set_epoch(0))
    ev_s = list(NativeLoader(shards, opts, train=False).set_epoch(0))
    assert len(ev_f) == len(ev_s) and all(_same(x, y) for x, y in zip(ev_f, ev_s))


def test_shards_give_the_folder_training_batches(tmp_path):
    folder, shards, _ = _converted(tmp_path)
    opts = NativeOptions(patch_size=4, seq_len=40, rows=2, min_tokens=3, max_tokens=20, token_drop=0.3, aspect=1.5)
    for seed in range(3):
        want = list(NativeLoader(folder, opts, seed=seed).set_epoch(seed))
        got = list(NativeLoader(shards, opts, seed=seed).set_epoch(seed))
        assert len(want) == len(got) >= 1 and all(_same(x, y) for x, y in zip(want, got))


@pytest.mark.slow
def test_shards_resume_mid_epoch_and_workers(tmp_path, monkeypatch):
    folder, shards, _ = _converted(tmp_path, shard_size=3)
    monkeypatch.setattr(shard_source_mod, "OPEN_SHARDS", 2)  # 5 shards, 2 open: handles are closed and reopened
    opts = NativeOptions(patch_size=4, seq_len=32, rows=2, min_tokens=3, max_tokens=16, token_drop=0.2)
    full = list(NativeLoader(folder, opts, seed=5).set_epoch(3))
    assert len(full) >= 2
    for start in range(len(full) + 1):
        resumed = list(NativeLoader(shards, opts, seed=5).set_epoch(3, start_batch=start))
        assert len(resumed) == len(full) - start and all(_same(x, y) for x, y in zip(resumed, full[start:]))
    shards[0]  # handles opened in this process must not be shared with forked workers
    workers = list(NativeLoader(shards, opts, seed=5, num_workers=2).set_epoch(3, start_batch=1))
    assert all(_same(x, y) for x, y in zip(workers, full[1:]))
    again = pickle.loads(pickle.dumps(shards))  # what a spawned worker receives
    assert all(torch.equal(again[i][0], folder[i][0]) for i in range(len(folder)))
    again = ShardSource(shards.shards[0].parent, workers=2)  # the index built in two processes
    assert again.counts == shards.counts and np.array_equal(again.labels, shards.labels)
    assert all(torch.equal(again[i][0], folder[i][0]) for i in range(len(folder)))


def _rgbd_shards(out, n=9, bad_depth=None):
    """RGB-D shards written with webdataset's TarWriter: PNG colour, ``depth.npy`` (with 0 and NaN), ``cls``;
    returns the in-memory reference ``[(float (4, H, W), label)]`` with colour standardised as the loader does."""
    import webdataset as wds
    from PIL import Image

    rng = np.random.default_rng(1)
    out.mkdir(parents=True)
    ref, entries = [], []
    for s in range(2):
        name = f"train-{s:06d}.tar"
        with wds.TarWriter(str(out / name)) as w:
            k = 0
            for i in range(s * 5, min(n, s * 5 + 5)):
                h, wd = int(rng.integers(8, 50)), int(rng.integers(8, 50))
                rgb = rng.integers(0, 256, (h, wd, 3), dtype=np.uint8)
                depth = rng.uniform(0.5, 9.0, (h, wd)).astype(np.float64)
                depth[0, 0], depth[-1, -1] = 0.0, np.nan
                buf, png = io.BytesIO(), io.BytesIO()
                np.save(buf, depth if i != bad_depth else depth[:-1])
                Image.fromarray(rgb).save(png, format="png")
                w.write({"__key__": f"s{i:04d}", "png": png.getvalue(), "depth.npy": buf.getvalue(),
                         "cls": str(i % 2)})
                x = torch.from_numpy(rgb).permute(2, 0, 1).float() / 255.0
                x = (x - torch.tensor(IMAGENET_MEAN).view(-1, 1, 1)) / torch.tensor(IMAGENET_STD).view(-1, 1, 1)
                ref.append((torch.cat([x, torch.from_numpy(depth).float()[None]]), i % 2))
                k += 1
        entries.append({"file": name, "count": k})
    manifest = {"format": "ropekit-shards", "version": 1, "classes": ["a", "b"],
                "splits": {"train": {"shards": entries}, "val": {"shards": entries}}}
    (out / "shards.json").write_text(json.dumps(manifest))
    return ref


def _equal_nan(a, b):
    return all(torch.equal(torch.nan_to_num(x, nan=-7.0), torch.nan_to_num(y, nan=-7.0))
               and torch.equal(torch.isnan(x), torch.isnan(y)) if isinstance(x, torch.Tensor) and x.is_floating_point()
               else (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y) for x, y in zip(a, b))


def test_rgbd_shards_match_in_memory_reference(tmp_path):
    ref = _rgbd_shards(tmp_path / "d")
    src = ShardSource(tmp_path / "d")
    assert src.depth and len(src) == 9
    (rgb, depth), y = src[3]
    assert rgb.dtype == torch.uint8 and depth.dtype == torch.float32 and depth.shape == (1, *rgb.shape[-2:])
    assert torch.isnan(depth[0, -1, -1]) and depth[0, 0, 0] == 0 and int(y) == 1
    opts = NativeOptions(patch_size=4, seq_len=36, rows=2, min_tokens=3, max_tokens=18, depth=True, token_drop=0.2)
    for seed in range(3):
        want = list(NativeLoader(ref, opts, seed=seed).set_epoch(0))
        got = list(NativeLoader(src, opts, seed=seed).set_epoch(0))
        assert len(want) == len(got) >= 1 and all(_equal_nan(x, y) for x, y in zip(want, got))


def test_shard_errors_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no manifest"):
        ShardSource(tmp_path)
    _, _, out = _converted(tmp_path)
    tar = out / "train-000001.tar"
    data = tar.read_bytes()
    tar.write_bytes(data[:len(data) // 2])  # truncated
    with pytest.raises(DataFileError, match="train-000001.tar") as e:
        ShardSource(out)
    assert "\n" not in str(e.value)
    tar.write_bytes(b"not a tar at all" * 64)
    with pytest.raises(DataFileError, match="train-000001.tar.*not a readable") as e:
        ShardSource(out)
    assert "\n" not in str(e.value)
    tar.write_bytes(data)
    m = json.loads((out / "shards.json").read_text())
    m["splits"]["train"]["shards"][1]["count"] = 5
    (out / "shards.json").write_text(json.dumps(m))
    with pytest.raises(DataFileError, match="manifest says 5"):
        ShardSource(out)


@pytest.mark.slow
def test_corrupt_image_in_a_worker_and_bad_depth(tmp_path):
    import webdataset as wds

    out = tmp_path / "bad"
    out.mkdir()
    with wds.TarWriter(str(out / "train-000000.tar")) as w:
        for i in range(6):
            w.write({"__key__": f"k{i}", "png": b"\x89PNG garbage" if i == 4 else _png(i), "cls": str(i % 2)})
    (out / "shards.json").write_text(json.dumps({"format": "ropekit-shards", "classes": ["a", "b"], "splits": {
        "train": {"shards": [{"file": "train-000000.tar", "count": 6}]}}}))
    src = ShardSource(out)
    opts = NativeOptions(patch_size=4, seq_len=16, rows=1, eval_tokens=8)
    for workers in (0, 1):
        with pytest.raises(DataFileError, match=r"train-000000.tar\[k4\]: not a readable image") as e:
            list(NativeLoader(src, opts, train=False, num_workers=workers).set_epoch(0))
        assert "\n" not in str(e.value)
    _, _, out = _converted(tmp_path / "c")
    (out / "train-000002.tar").write_bytes(b"\0" * 100)
    with pytest.raises(DataFileError, match="train-000002.tar: not a readable") as e:
        ShardSource(out, workers=2)  # raised in an index worker, re-raised as itself
    assert "\n" not in str(e.value)
    _rgbd_shards(tmp_path / "d", bad_depth=2)
    with pytest.raises(DataFileError, match=r"\[s0002\]: depth entry depth.npy must be"):
        ShardSource(tmp_path / "d")[2]


def _png(i):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8 + i, 12, 3), 20 * i, dtype=np.uint8)).save(buf, format="png")
    return buf.getvalue()
