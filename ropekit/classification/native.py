"""Native-resolution classification (``ropekit train --native-resolution``): the ViT trained and evaluated on packed
batches of images at their own aspect ratio and a sampled resolution (:mod:`ropekit.data.native`,
:mod:`ropekit.nn.packing`), with the engine, run folder, checkpoints and resume of ordinary classification.

Data: ``--data folder-stream`` or ``--data imagefolder`` with ``--data-root`` (``root/train`` and ``root/val``
when both exist, else ``test_fraction`` -- 0.2, ``--data-opt test_fraction=F`` -- of each class of ``root`` held
out: the images a fixed-size run of the folder holds out, :func:`ropekit.data.streaming.folder_splits`), read file
by file in ``--workers`` processes;
``--data shards`` with ``--data-root`` the directory of ``shards.json`` (``ropekit data convert`` writes it; its
``train`` and ``val`` splits), read sample by sample through an in-memory index of the tars
(:class:`~ropekit.data.shard_source.ShardSource`; RGB-D when the samples carry ``depth.npy``); or any in-memory
data set of ``ropekit.data`` (RGB-D too: depth as the last channel, resized with nearest).
``--native-opt KEY=VALUE`` sets :class:`~ropekit.data.native.NativeOptions` fields (``seq_len``, ``rows``,
``min_tokens``, ``max_tokens``, ``eval_tokens``, ``max_images``, ``token_drop``, ``hflip``, ``aspect``);
``patch_size`` is the model's. ``--batch-size`` is not used: a batch is ``rows`` packed rows of ``seq_len`` tokens.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from ..data._common import canonical_name
from ..data.native import NativeLoader, NativeOptions
from ..nn.packing import PackedBatch
from ..train import engine
from .config import TrainConfig
from ..train.distributed import DistContext
from ..train.engine import seed_everything
from ..train.tasks import register_task
from .trainer import ClassificationTask, build_model

_DEFAULT_SHIFT = TrainConfig().data.augment_shift

__all__ = ["NativeClassificationTask", "build_native_task", "native_sources", "native_options", "evaluate_packed",
           "evaluate_native_run"]

FOLDER_DATA = ("folder-stream", "imagefolder")
SHARD_DATA = ("shards", "wds")
_OPTION_KEYS = {f.name for f in dataclasses.fields(NativeOptions)} - {"patch_size", "depth", "mean", "std"}


def _check_option_keys(cfg: TrainConfig) -> None:
    bad = sorted(set(cfg.data.native_options) - _OPTION_KEYS)
    if bad:
        raise ValueError(f"native_options: unknown key(s) {', '.join(bad)}; known: {', '.join(sorted(_OPTION_KEYS))}")


def _check_unread_data_options(cfg: TrainConfig) -> None:
    """One-line ``ValueError`` naming the fixed-size pipeline's options ``cfg`` sets that packed batches never read
    (they would be recorded and not applied): its transforms, and the streamed data's ``data_options`` besides
    ``test_fraction`` (of a flat folder)."""
    from .config import DataConfig

    d, default = cfg.data, DataConfig()
    unread = [n for n in DataConfig.STREAM_ONLY if n != "workers" and getattr(d, n) != getattr(default, n)]
    if unread:
        raise ValueError(f"--native-resolution: {', '.join(unread)} are the fixed-size pipeline's transforms; packed "
                         f"images are resized to their sampled grid and flipped with --native-opt hflip=P")
    name = canonical_name(d.name)
    keep = ("test_fraction",) if name in FOLDER_DATA else ()
    unread = sorted(k for k in d.data_options if k not in keep)
    if unread and name in FOLDER_DATA + SHARD_DATA:
        raise ValueError(f"--native-resolution: data_options {', '.join(unread)} are not read by the packing loader"
                         f"{' (it reads test_fraction)' if keep else ''}")


def native_options(cfg: TrainConfig, patch_size: int, depth: bool) -> NativeOptions:
    """The loader options of ``cfg`` (``native_options``), with the model's patch size."""
    _check_option_keys(cfg)
    return NativeOptions(patch_size=patch_size, depth=depth, **cfg.data.native_options)


def _nominal_size(cfg: TrainConfig) -> Tuple[int, int]:
    """The square image size the model is built for (it sizes no table: any grid is accepted)."""
    patch = cfg.model.patch_size or 16
    size = patch * max(1, math.isqrt(native_options(cfg, patch, depth=False).max_image_tokens))
    return size, size


def native_sources(cfg: TrainConfig) -> Tuple[Dataset, Dataset, Any]:
    """``(train, test, info)``: image folders read file by file, or an in-memory data set (see the module
    docstring)."""
    from ..data import DatasetInfo

    data = canonical_name(cfg.data.name)
    if data in FOLDER_DATA:
        from ..data.streaming import folder_splits

        if cfg.data.data_root is None:
            raise ValueError(f"--native-resolution with --data {cfg.data.name} needs --data-root")
        train, test = folder_splits(cfg.data.data_root, split_seed=cfg.data.split_seed,
                                    **{k: v for k, v in cfg.data.data_options.items() if k == "test_fraction"})
        info = DatasetInfo(name=data, num_classes=len(train.classes), in_chans=3, image_size=_nominal_size(cfg),
                           kind="rgbd" if train.depth else "image", class_names=tuple(train.classes))
        return train, test, info
    if data in SHARD_DATA:
        from ..data.shard_source import ShardSource

        if cfg.data.data_root is None:
            raise ValueError(f"--native-resolution with --data {cfg.data.name} needs --data-root (the directory of "
                             "shards.json)")
        train = ShardSource(cfg.data.data_root, split="train", workers=cfg.data.workers)
        test = ShardSource(cfg.data.data_root, split="val", workers=cfg.data.workers)
        if not train.classes or len(train.classes) < 2:
            raise ValueError(f"shards {cfg.data.data_root}: the manifest must name at least 2 classes")
        if test.depth != train.depth:
            raise ValueError(f"shards {cfg.data.data_root}: the train split "
                             f"{'has' if train.depth else 'has no'} depth, "
                             f"the val split {'has' if test.depth else 'has no'}")
        info = DatasetInfo(name="shards", num_classes=len(train.classes), in_chans=3,
                           image_size=_nominal_size(cfg), kind="rgbd" if train.depth else "image",
                           class_names=tuple(train.classes))
        return train, test, info
    from ..data import load_dataset

    train, test, info = load_dataset(cfg.data.name, root=cfg.data.data_root, image_size=cfg.data.image_size,
                                     split_seed=cfg.data.split_seed, normalize=cfg.data.normalize,
                                     **cfg.data.data_options)
    if info.kind == "video":
        raise ValueError("--native-resolution packs images and RGB-D images, not video")
    return train, test, info


class NativeClassificationTask(ClassificationTask):
    """Classification on packed native-resolution batches: :class:`~ropekit.classification.trainer.ClassificationTask`'s
    metrics, plots and summary; batches from :class:`~ropekit.data.native.NativeLoader` (a training epoch has a
    fixed number of batches, a pure function of ``(seed, epoch, rank)``, restarted at the checkpoint's batch on
    resume); the model takes a :class:`~ropekit.nn.packing.PackedBatch` (``VisionTransformer.forward``)."""

    name = "train"

    def __init__(self, cfg: TrainConfig, model: nn.Module, train_ds: Dataset, test_ds: Dataset, ctx: DistContext,
                 label: str, opts: NativeOptions, quiet: bool = False, run_dir: Optional[Path] = None,
                 info: Any = None) -> None:
        self.cfg, self.model, self.train_ds, self.test_ds = cfg, model, train_ds, test_ds
        self.label, self.quiet, self.run_dir, self.info, self.opts = label, quiet, run_dir, info, opts
        self.streamed, self.mix = True, None
        pin = ctx.device.type == "cuda"
        self.loader = NativeLoader(train_ds, opts, seed=cfg.run.seed, rank=ctx.rank, world_size=ctx.world_size,
                                   num_workers=cfg.data.workers, pin_memory=pin)
        self.eval_loader = NativeLoader(test_ds, opts, seed=cfg.run.seed, rank=ctx.rank, world_size=ctx.world_size,
                                        train=False, num_workers=cfg.data.workers, pin_memory=pin)
        self.steps_per_epoch = self.loader.steps()

    def epoch_batches(self, epoch: int, ctx: DistContext) -> engine.StreamedEpoch:
        return engine.StreamedEpoch(len(self.loader.plan(epoch)), lambda start: self.loader.set_epoch(epoch, start))

    def loss(self, model: nn.Module, batch: PackedBatch, device: torch.device) -> Tuple[Tensor, Dict[str, Any]]:
        batch = batch.to(device)
        y = batch.labels
        logits = model(batch)  # (I, K): one row per packed image
        loss = F.cross_entropy(logits.float(), y, label_smoothing=self.cfg.optim.label_smoothing)
        n = y.shape[0]
        return loss, {"loss_sum": loss.detach().double() * n, "correct": (logits.argmax(-1) == y).sum(), "count": n}

    def evaluate(self, device: torch.device, ctx: DistContext) -> Dict[str, float]:
        """Loss and accuracy on the test images, each at ``eval_tokens`` with its aspect ratio, packed."""
        return evaluate_packed(self.model, self.eval_loader, device, ctx)

    def epoch_row(self, epoch: int, sums: Dict[str, float], info: Dict[str, Any], ctx: DistContext) -> Dict[str, Any]:
        loss_sum, correct, count = ctx.all_reduce_sum([sums.get("loss_sum", 0.0), sums.get("correct", 0.0),
                                                       sums.get("count", 0.0)])
        t0 = time.time()
        ev = self.evaluate(ctx.device, ctx)
        t_eval = time.time() - t0
        return {"epoch": epoch + 1, "train_loss": loss_sum / max(count, 1), "train_acc": correct / max(count, 1),
                "test_loss": ev["test_loss"], "test_acc": ev["test_acc"], "lr": info["lr"],
                "epoch_time": info["epoch_time"] + t_eval, "elapsed_time": info["elapsed"] + t_eval}


@torch.no_grad()
def evaluate_packed(model: nn.Module, loader: NativeLoader, device: torch.device,
                    ctx: Optional[DistContext] = None) -> Dict[str, float]:
    """``test_loss``, ``test_acc`` and ``num_examples`` of ``model`` on ``loader``'s packed evaluation batches
    (summed over the ranks of ``ctx``); the model's training mode is restored."""
    was = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in loader.set_epoch(0):
        batch = batch.to(device)
        logits = model(batch)  # (I, K)
        sums += torch.stack([F.cross_entropy(logits.float(), batch.labels, reduction="sum").double(),
                             (logits.argmax(-1) == batch.labels).sum().double(),
                             torch.tensor(float(batch.labels.numel()), dtype=torch.float64, device=device)])
    loss_sum, correct, count = (ctx or DistContext()).all_reduce_sum(sums.tolist())
    model.train(was)
    count = max(count, 1.0)
    return {"test_loss": loss_sum / count, "test_acc": correct / count, "num_examples": int(count)}


def evaluate_native_run(model: nn.Module, cfg: TrainConfig, patch_size: int, device: torch.device) -> Dict[str, Any]:
    """A native-resolution run's own evaluation of ``model``: its test images packed, each at ``eval_tokens`` with
    its aspect ratio, as the run evaluated them after every epoch (:func:`evaluate_packed`, plus ``eval_tokens``)."""
    _, test_ds, info = native_sources(cfg)
    opts = native_options(cfg, patch_size, info.kind == "rgbd")
    loader = NativeLoader(test_ds, opts, seed=cfg.run.seed, train=False, num_workers=cfg.data.workers)
    return {**evaluate_packed(model, loader, device), "eval_tokens": opts.eval_image_tokens}


@register_task("native-resolution", "classification on packed batches of images at their own aspect ratio "
                                    "(ropekit train --native-resolution)", config=TrainConfig,
               defaults={"native_resolution": True},
               train="ropekit.train.commands:train_classification")
def build_native_task(cfg: TrainConfig, ctx: Optional[DistContext] = None, *, run_dir: Optional[Path] = None,
                      quiet: bool = False) -> NativeClassificationTask:
    """The native-resolution task of ``cfg`` (data sources opened, ViT built and seeded by ``cfg.run.seed``)."""
    ctx = ctx or DistContext()
    if cfg.model.vit().ape != "none" or cfg.model.vit().pe in ("absolute", "sincos"):
        raise ValueError("--native-resolution packs images of different grids: use a rotary encoding without an "
                         "absolute embedding")
    if cfg.data.augment_sizes or cfg.data.mixup_alpha > 0 or cfg.data.cutmix_alpha > 0:
        raise ValueError("--native-resolution samples resolutions itself; augment_sizes, mixup and cutmix do not "
                         "apply to packed batches")
    if cfg.data.augment_shift not in (0, _DEFAULT_SHIFT):  # (the default is classification's; never read here)
        raise ValueError(f"--augment-shift {cfg.data.augment_shift}: packed images are not shifted in pixels "
                         f"(--coord-augment augments their coordinates)")
    _check_unread_data_options(cfg)
    _check_option_keys(cfg)  # (before any data is read)
    train_ds, test_ds, info = native_sources(cfg)
    if cfg.model.patch_size is None and canonical_name(cfg.data.name) in FOLDER_DATA + SHARD_DATA:
        cfg = cfg.replace(**{"model.patch_size": 16})
    seed_everything(cfg.run.seed)
    model, vit_cfg = build_model(cfg, info)
    opts = native_options(cfg, vit_cfg.patch_size, info.kind == "rgbd")
    label = f"{vit_cfg.pe}, native resolution" + (f", depth as {vit_cfg.depth_input}" if info.kind == "rgbd" else "")
    return NativeClassificationTask(cfg, model, train_ds, test_ds, ctx, label, opts, quiet, run_dir=run_dir, info=info)
