"""``ropekit train --native-resolution``: packed batches from a folder of mixed sizes or from the shards converted
from it, a run stopped mid-epoch resumes bit-exactly (both sources), RGB-D in-memory data and RGB-D shards, and the
options' errors."""

import numpy as np
import pytest
import torch

from ropekit.train import load_checkpoint
from ropekit.classification.config import TrainConfig
from ropekit.classification.trainer import train

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def _folder(root):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 16), ("val", 6)):
        for i in range(n):
            d = root / split / f"c{i % 2}"
            d.mkdir(parents=True, exist_ok=True)
            a = rng.integers(0, 256, (int(rng.integers(12, 48)), int(rng.integers(12, 48)), 3), dtype=np.uint8)
            a[..., 0] = 255 * (i % 2)
            Image.fromarray(a).save(d / f"{i}.png")
    return root


def _cfg(root, out, **kw):
    base = dict(data="folder-stream", data_root=str(root), native_resolution=True, patch_size=8, epochs=2,
                model_options={"depth": 2}, out=str(out), device="cpu", progress=False, tensorboard=False,
                native_options={"seq_len": 32, "rows": 2, "min_tokens": 4, "max_tokens": 16, "token_drop": 0.2},
                jitter=0.5, log_every=1)
    base.update(kw)
    return TrainConfig.from_dict(base)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _shards(root, out):
    from ropekit.data.shards import write_shards

    write_shards(root, out, shard_size=5)  # root/train + root/val: both splits, 4 and 2 shards
    return out


@pytest.mark.parametrize("data", ["folder-stream", "shards"])
def test_native_train_resumes_mid_epoch_bit_exactly(tmp_path, data):
    root = _folder(tmp_path / "data")
    if data == "shards":
        root = _shards(root, tmp_path / "shards")
    full = train(_cfg(root, tmp_path / "full", data=data), quiet=True)
    assert len(full.history) == 2 and full.final["test_acc"] >= 0.0
    stopped = train(_cfg(root, tmp_path / "part", data=data), quiet=True, on_step=lambda s: s == 3)
    assert stopped.interrupted
    ckpt = load_checkpoint(tmp_path / "part")
    assert ckpt["step_in_epoch"] > 0  # stopped inside an epoch
    torch.manual_seed(123)
    again = train(_cfg(root, tmp_path / "part", data=data), resume=True, quiet=True)
    a, b = _state(full.model), _state(again.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["train_loss"] for r in again.history] == [r["train_loss"] for r in full.history]


def test_native_train_rgbd_in_memory(tmp_path):
    cfg = TrainConfig.from_dict(dict(data="rgbd-digits", native_resolution=True, epochs=1, pe="circulant",
                      pe_options={"block_size": 8}, model_options={"depth": 1}, out=str(tmp_path / "r"), device="cpu",
                      progress=False, tensorboard=False, data_options={"num_train": 64, "num_test": 32},
                      native_options={"seq_len": 48, "rows": 4, "min_tokens": 4, "max_tokens": 24}))
    res = train(cfg, quiet=True)
    assert np.isfinite(res.final["test_loss"])


def test_native_train_rgbd_shards(tmp_path):
    from test_native_shards import _rgbd_shards

    _rgbd_shards(tmp_path / "d")
    res = train(_cfg(tmp_path / "d", tmp_path / "r", data="shards", epochs=1, workers=1), quiet=True)
    assert np.isfinite(res.final["test_loss"])
    assert res.model.cfg.modality == "rgbd"  # the depth entries made it an RGB-D model


def test_native_errors(tmp_path):
    root = _folder(tmp_path / "data")
    with pytest.raises(FileNotFoundError, match="no manifest"):
        train(_cfg(root, tmp_path / "z", data="shards"), quiet=True)
    with pytest.raises(ValueError, match="unknown key"):
        train(_cfg(root, tmp_path / "x", native_options={"seq": 3}), quiet=True)
    with pytest.raises(ValueError, match="absolute"):
        train(_cfg(root, tmp_path / "y", pe="absolute"), quiet=True)
    # options of fixed-size batches that packing would record and not read: refused, nothing written
    for change, words in (({"mixup_alpha": 0.2}, "augment_sizes, mixup and cutmix do not apply"),
                          ({"augment_shift": 3}, "--augment-shift 3: packed images are not shifted")):
        with pytest.raises(ValueError, match=words):
            train(_cfg(root, tmp_path / "w", **change), quiet=True)
        assert not (tmp_path / "w").exists()


def test_native_run_evaluates_as_it_trained_on_the_images_a_fixed_size_run_holds_out(tmp_path):
    """A flat folder: the native-resolution run holds out the same stratified images as the fixed-size reader
    (``folder_splits``; before, packing held out another, unstratified 10 %, so ``ropekit eval`` scored training
    images), honours ``test_fraction``, and ``ropekit eval RUN`` reproduces the run's last evaluation (packed at
    ``eval_tokens``) instead of scoring square crops; options packing never reads are refused."""
    from ropekit.classification.native import native_sources
    from ropekit.classification import evaluate_run
    from ropekit.data.streaming import open_stream

    flat = _folder(tmp_path / "data") / "train"  # 16 images, 8 per class
    out = tmp_path / "run"
    res = train(_cfg(flat, out, epochs=1), quiet=True)
    _, held, _ = native_sources(_cfg(flat, out, epochs=1))
    _, val, _ = open_stream("imagefolder", flat, image_size=16)
    assert len(held) == len(val) == 4 and sorted(held._files.tolist()) == sorted(val._files.tolist())
    assert sorted(held.labels.tolist()) == [0, 0, 1, 1]  # stratified: 2 of each class's 8
    _, half, _ = native_sources(_cfg(flat, out, data_options={"test_fraction": 0.5}))
    assert len(half) == 8

    ev = evaluate_run(out)
    last = res.history[-1]
    assert ev["image_size"] is None and ev["native_tokens"] == 16 and ev["num_examples"] == 4
    assert ev["test_loss"] == pytest.approx(last["test_loss"], rel=1e-6) and ev["test_acc"] == last["test_acc"]
    square = evaluate_run(out, image_size=16)  # one size, the fixed-size pipeline: another evaluation
    assert square["image_size"] == [16, 16] and square["native_tokens"] is None and square["num_examples"] == 4
    with pytest.raises(ValueError, match="evaluated packed"):
        evaluate_run(out, offset_std=1.0)
    for change, words in (({"hflip": 0.2}, "hflip are the fixed-size pipeline's transforms"),
                          ({"data_options": {"mean": [0.5, 0.5, 0.5]}}, "data_options mean are not read")):
        with pytest.raises(ValueError, match=words):
            train(_cfg(flat, tmp_path / "w", **change), quiet=True)
        assert not (tmp_path / "w").exists()
