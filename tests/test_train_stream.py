"""``ropekit train`` on streamed data (an image folder, WebDataset shards): the augmentation and evaluation
options, MixUp / CutMix with soft targets, the DeiT recipe, and exact resume from a mid-epoch checkpoint (one
process, and two gloo processes)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ropekit.cli import main as cli_main
from ropekit.data.fake import write_fake_image_folder
from ropekit.data.shards import write_shards
from ropekit.train import load_checkpoint
from ropekit.classification import train
from ropekit.classification.config import TrainConfig, build_vit_config

sys.path.insert(0, str(Path(__file__).parent))
from test_train import tiny_cfg  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_VIT = dict(depth=1, embed_dim=24, num_heads=1)


def _folder(root: Path, per_class: int = 24) -> Path:
    write_fake_image_folder(root, classes=3, per_class=per_class, size=32, seed=0)
    return root


def _stream_cfg(data_root: Path, out: Path, **kw) -> TrainConfig:
    base = dict(data="folder-stream", data_root=str(data_root), image_size=24, patch_size=8, model_options=TINY_VIT,
                epochs=2, batch_size=8, lr=2e-3, progress=False, tensorboard=False, threads=1, device="cpu",
                out=str(out), eval_batch_size=32)
    base.update(kw)
    return TrainConfig.from_dict(base).validate()


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------ configuration


def test_stream_only_options_are_refused_for_in_memory_data_and_checked():
    with pytest.raises(ValueError, match=r"^auto_augment, random_erasing apply to streamed data .*'digits'"):
        TrainConfig.from_dict({"data": "digits", "auto_augment": "randaugment", "random_erasing": 0.25})
    for bad, msg in (({"hflip": 1.5}, "hflip is a probability"), ({"crop_scale": [0.5, 0.2]}, "crop_scale must be"),
                     ({"crop_ratio": [1.0]}, "crop_ratio must be"), ({"crop_pct": 0.0}, "crop_pct must be in"),
                     ({"auto_augment": "autoaugment"}, "auto_augment must be"), ({"workers": -1}, "workers must"),
                     ({"mixup_alpha": -0.1}, "mixup_alpha must"), ({"lr_base_batch": 0}, "lr_base_batch must"),
                     ({"checkpoint_every": -2}, "checkpoint_every must"), ({"log_every": 0}, "log_every must")):
        with pytest.raises(ValueError, match=msg):
            TrainConfig.from_dict({"data": "shards", **bad})
    # (mixing is opt-in for in-memory data too)
    TrainConfig.from_dict({"data": "digits", "mixup_alpha": 0.2, "cutmix_alpha": 1.0})


def test_deit_preset_resolves_to_the_paper_recipe_with_a_vit_b16(monkeypatch):
    from ropekit.train import commands

    seen = {}

    def fake_train(cfg, **kw):
        seen["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr("ropekit.classification.trainer.train", fake_train)
    with pytest.raises(SystemExit):
        cli_main(["train", "--preset", "deit-b16", "--data-root", ".", "--batch-size", "2048", "--device", "cpu"])
    cfg = seen["cfg"]
    assert (cfg.data.name, cfg.model.size, cfg.model.patch_size, cfg.data.image_size, cfg.optim.epochs) == (
        "shards", "base", 16, 224, 300)
    assert cfg.optim.peak_lr == pytest.approx(5e-4 * 2048 / 512)  # the command line's batch, scaled as the paper says
    assert (cfg.optim.weight_decay, cfg.optim.warmup_epochs, cfg.optim.label_smoothing) == (0.05, 5, 0.1)
    assert (cfg.data.mixup_alpha, cfg.data.cutmix_alpha, cfg.data.random_erasing, cfg.data.auto_augment) == (
        0.8, 1.0, 0.25, "rand-m9-n2")
    from ropekit.data import DatasetInfo

    vit = build_vit_config(cfg, DatasetInfo("shards", 1000, 3, (224, 224), "image"))
    assert (vit.embed_dim, vit.depth, vit.num_heads, vit.patch_size, vit.drop_path_rate) == (768, 12, 12, 16, 0.1)
    from ropekit.nn.vit import VisionTransformer

    with torch.device("meta"):
        model = VisionTransformer(vit)
    rates = [b.drop_path.p for b in model.blocks]
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.1) and rates == sorted(rates)  # stochastic depth
    with pytest.raises(ValueError, match="unknown preset 'deit-x'; known: deit-b16"):
        commands.config_from_args(_args(["--preset", "deit-x"]))
    with pytest.raises(Exception, match="--preset starts a run"):
        commands.config_from_args(_args(["--preset", "deit-b16", "--resume", "somewhere"]))


def _args(argv):
    import argparse

    from ropekit.train.commands import add_train_arguments

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ mixing


def test_mixup_cutmix_train_on_soft_targets_with_label_smoothing(tmp_path):
    """In-memory data, opt-in: the loss is the cross-entropy against the mixed one-hot targets, smoothed (the
    streamed runs below train with mixing end to end)."""
    from ropekit.classification.trainer import build_classification_task

    cfg = tiny_cfg(tmp_path / "r", mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1)
    task = build_classification_task(cfg)
    seen = {}
    mix = task.mix

    def recording(x, y):
        seen["x"], seen["target"] = mix(x, y)
        seen["y"] = y
        return seen["x"], seen["target"]

    task.mix = recording
    batch = task.epoch_batches(0, __import__("ropekit.train.distributed", fromlist=["DistContext"]).DistContext())[0]
    torch.manual_seed(3)
    loss, sums = task.loss(task.model, batch, torch.device("cpu"))
    target = seen["target"]
    assert target.shape == (len(batch), 10) and torch.allclose(target.sum(-1), torch.ones(len(batch)))
    assert (target.max(-1).values < 1).any()  # mixed: not one-hot
    logp = F.log_softmax(task.model(seen["x"]), -1)
    smoothed = target * 0.9 + 0.1 / 10
    assert loss.item() == pytest.approx(-(smoothed * logp).sum(-1).mean().item(), rel=1e-5)
    # the training accuracy counts the predictions of each mixed target's largest class
    assert int(sums["correct"]) == int((task.model(seen["x"]).argmax(-1) == target.argmax(-1)).sum())


# ------------------------------------------------------------------------------------------------ streamed runs


@pytest.mark.slow
def test_folder_stream_run_stopped_mid_epoch_resumes_bit_exactly(tmp_path):
    data = _folder(tmp_path / "data")  # 72 images: 57 train / 15 test (stratified), 7 steps of 8 an epoch
    kw = dict(auto_augment="randaugment", random_erasing=0.25, mixup_alpha=0.8, log_every=2, checkpoint_every=3)
    full = train(_stream_cfg(data, tmp_path / "full", **kw), quiet=True)
    assert full.history[-1]["epoch"] == 2
    part = _stream_cfg(data, tmp_path / "part", **kw)
    stopped = train(part, quiet=True, on_step=lambda s: s == 4)
    ckpt = load_checkpoint(tmp_path / "part")
    assert stopped.interrupted and (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, 4)
    torch.manual_seed(99)
    resumed = train(part, resume=True, quiet=True)
    assert _same(full.model.state_dict(), resumed.model.state_dict())
    assert [r["train_loss"] for r in resumed.history] == [r["train_loss"] for r in full.history]
    assert [r["test_acc"] for r in resumed.history] == [r["test_acc"] for r in full.history]
    import json

    doc = json.loads((tmp_path / "part" / "config.json").read_text())
    assert doc["train"]["data"]["auto_augment"] == "randaugment" and doc["train"]["data"]["crop_pct"] == 0.875
    assert doc["data"]["num_train"] + doc["data"]["num_test"] == 72


def test_streamed_data_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="--data imagefolder reads real images: give their folder with --data-root"):
        train(_stream_cfg(tmp_path, tmp_path / "r").replace(data_root=None), quiet=True)
    from ropekit.classification.trainer import load_data

    # train_fraction applies to folders now: the first round(f * n_c) training images of each class
    cfg = _stream_cfg(_folder(tmp_path / "d", per_class=5), tmp_path / "r2", train_fraction=0.5)
    assert [len(ds) for ds in load_data(cfg)[:2]] == [6, 3]  # 3 classes x (4 train -> 2, 1 test)
    write_shards(tmp_path / "d", tmp_path / "s", shard_size=100)
    with pytest.raises(ValueError, match="train_fraction applies to image folders and the in-memory data sets, not "
                                         "to shards"):
        train(cfg.replace(data="shards", data_root=str(tmp_path / "s"), out=str(tmp_path / "r3")), quiet=True)


@pytest.mark.slow
def test_two_gloo_processes_folder_and_shards_stop_mid_epoch_and_resume_exactly(tmp_path, torchrun):
    """torchrun, 2 processes, the DeiT augmentations scaled down: for a JPEG folder and for its shards, a run stopped
    mid-epoch and resumed ends with the weights of an uninterrupted run, on both ranks."""
    write_fake_image_folder(tmp_path / "folder", classes=3, per_class=24, size=32, seed=1, val_per_class=4)
    write_shards(tmp_path / "folder", tmp_path / "shards", shard_size=12)  # 6 train shards: 3 per rank
    torchrun("stream_ddp_worker.py", tmp_path, timeout=240)
    for kind in ("folder", "shards"):
        states = {(run, r): torch.load(tmp_path / f"{kind}-{run}-rank{r}.pt", weights_only=True)
                  for run in ("full", "resumed") for r in (0, 1)}
        assert _same(states["full", 0], states["full", 1]), kind  # DDP kept the ranks together
        assert _same(states["full", 0], states["resumed", 0]), kind
        assert _same(states["resumed", 0], states["resumed", 1]), kind
        ckpt = load_checkpoint(tmp_path / f"{kind}-part")
        assert ckpt["world_size"] == 2 and ckpt["epoch"] == 2
        hist = torch.load(tmp_path / f"{kind}-history.pt", weights_only=True)
        assert hist["resumed"] == [{**r, **{k: hist["resumed"][i][k] for k in ("epoch_time", "elapsed_time")}}
                                   for i, r in enumerate(hist["full"])]  # the same metrics, other timings
        assert (tmp_path / f"{kind}-part" / "config.json").exists()
