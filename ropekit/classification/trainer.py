"""Image / RGB-D / video classification behind ``ropekit train`` (``ropekit eval``: :mod:`.evaluation`).

The loop itself is the shared engine (:func:`ropekit.train.engine.fit`); this module supplies the task
(:class:`ClassificationTask`: data, ViT, cross-entropy, per-epoch evaluation), the resume rules and the run folder.

Reproducibility contract (CPU): the data order of epoch ``e`` is a function of ``(seed, e)`` only
(``DistributedSampler`` with ``set_epoch``); every other random draw (position jitter, augmentation, dropout)
comes from the global torch RNG, whose state is saved with every checkpoint together with the model,
optimiser, scheduler, epoch and step. ``--resume`` therefore continues bit-for-bit, also from a checkpoint
written mid-epoch by Ctrl-C or ``checkpoint_every`` (the batches already done are skipped). Streamed data
(``--data folder-stream`` / ``shards``) keeps the same contract: its loader's order and per-sample augmentation are
functions of ``(seed, epoch, rank, world_size)`` (and the number of workers for shards), and it restarts at the
checkpoint's batch without decoding the ones before.

Run folder layout::

    config.json      resolved TrainConfig ("train": its model / data / optim / run sections, data_root absolute;
                     docs/configuration.md), ViTConfig ("model"), dataset info
                     ("data": counts, class names, the data's fingerprint), "versions" (ropekit, torch, python,
                     git), "engine" (precision, compile, device) and "resumes" (where each resume started, which
                     options it changed, and a data change accepted with --allow-data-change)
    .lock            held while a run writes the folder (removed when it ends)
    checkpoint.pt    latest checkpoint (written atomically after every epoch and on Ctrl-C)
    metrics.csv      epoch,train_loss,train_acc,test_loss,test_acc,lr,epoch_time,elapsed_time (and
                     train_skipped,test_skipped with skip_corrupt)
    curves.png       learning curves
    summary.json     final metrics, wall time, parameter count
    tb/              TensorBoard event files (when tensorboard is installed)
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, DistributedSampler

from ..encodings.counting import count_parameters
from ..encodings.scaling import ResolutionScaling
from ..nn.vit import ViTConfig, VisionTransformer
from ..train import engine
from ..train.augment import random_resize, random_shift
from ..train.engine import seed_everything
from ..train.checkpoint import CHECKPOINT_NAME, load_checkpoint, load_model_state
from .config import DATA_CHANGE, TrainConfig, build_vit_config, is_folder, is_streamed_data, plural, \
    split_pending_scaling
from ..train.distributed import DistContext, init_distributed
from ..train.metrics import METRIC_COLUMNS, plot_curves
from ..train.run_folder import load_run, load_run_config
from ..train.tasks import register_task
from ..train.upgrade import flatten

__all__ = ["TrainResult", "ClassificationTask", "train", "evaluate", "load_data", "build_model",
           "default_run_dir", "fetch_batch", "random_shift", "load_run"]

StepCallback = Callable[[int], Optional[bool]]


@dataclass
class TrainResult:
    """What :func:`train` returns (on rank 0 the files are in ``run_dir``)."""

    run_dir: Path
    history: List[Dict[str, Any]]
    interrupted: bool
    wall_time: float
    model: nn.Module
    final: Dict[str, Any] = field(default_factory=dict)
    is_main: bool = True  # rank 0 (the process that writes files and reports)


# ---------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------


def is_streamed(cfg: TrainConfig) -> bool:
    """Whether ``cfg.data.name`` is decoded as it is read (``imagefolder``, ``shards``) rather than held in memory."""
    return is_streamed_data(cfg.data.name)


def load_data(cfg: TrainConfig, image_size: Any = None) -> Tuple[Dataset, Dataset, Any]:
    """``(train_ds, test_ds, info)`` for ``cfg`` (``image_size`` overrides ``cfg.data.image_size``).

    Streamed data (:func:`is_streamed`) gives two streams for :func:`ropekit.data.streaming.make_loader` with the
    training transform of ``cfg`` (random resized crop, flip, auto augment, random erasing) and the evaluation one
    (resize to ``size / crop_pct``, centre crop); ``image_size`` defaults to :func:`default_image_size` there (an
    image folder: its first image's shorter side, at most 224; shards: 224).
    """
    size = image_size if image_size is not None else cfg.data.image_size
    if is_streamed(cfg):
        return open_streamed_data(cfg, default_image_size(cfg) if size is None else size)
    from ..data import load_dataset

    train_ds, test_ds, info = load_dataset(cfg.data.name, root=cfg.data.data_root, image_size=size,
                                           split_seed=cfg.data.split_seed,
                                           normalize=cfg.data.normalize, **cfg.data.data_options)
    if cfg.data.train_fraction < 1.0:
        train_ds = _stratified_subset(train_ds, cfg.data.train_fraction)
    return train_ds, test_ds, info


#: The default image size of streamed data: an image folder's first image's shorter side, at most this.
MAX_DEFAULT_SIZE = 224


def default_image_size(cfg: TrainConfig) -> Tuple[int, int]:
    """The image size of streamed data when ``cfg.data.image_size`` is not given, one policy for every folder: the
    shorter side of the folder's first image (sorted class, sorted file), at most :data:`MAX_DEFAULT_SIZE`, square;
    shards: :data:`MAX_DEFAULT_SIZE`."""
    from ..data.streaming import first_image_size

    if not is_folder(cfg.data.name) or cfg.data.data_root is None:
        return (MAX_DEFAULT_SIZE, MAX_DEFAULT_SIZE)
    hw = first_image_size(cfg.data.data_root)
    side = min(min(hw), MAX_DEFAULT_SIZE) if hw is not None else MAX_DEFAULT_SIZE
    return (side, side)


def open_streamed_data(cfg: TrainConfig, size: Any, *, whole: bool = False) -> Tuple[Dataset, Dataset, Any]:
    """The streams of ``cfg``; ``whole``: the test stream holds every image of the folder (its ``val/`` in the
    train/val layout), for evaluating a run on a separate folder."""
    from ..data.streaming import open_stream

    if cfg.data.data_root is None:
        raise ValueError(f"--data {cfg.data.name} reads real images: give their folder with --data-root")
    if cfg.data.train_fraction < 1.0 and not is_folder(cfg.data.name):
        raise ValueError("train_fraction applies to image folders and the in-memory data sets, not to shards")
    plain = {} if cfg.data.normalize else {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
    options = {**plain, **cfg.data.data_options}
    train_ds, test_ds, info = open_stream(cfg.data.name, cfg.data.data_root, image_size=size,
                                          split_seed=cfg.data.split_seed,
                                          auto_augment=cfg.data.auto_augment, random_erasing=cfg.data.random_erasing,
                                          scale=tuple(cfg.data.crop_scale), ratio=tuple(cfg.data.crop_ratio),
                                          hflip=cfg.data.hflip,
                                          crop_pct=cfg.data.crop_pct, **options)
    if whole and is_folder(cfg.data.name) and test_ds.root == train_ds.root:  # (a folder split in two: take all of it)
        from ..data.streaming import ImageFolderStream

        test_ds = ImageFolderStream(test_ds.root, test_ds.transform, classes=test_ds.classes,
                                    skip_corrupt=test_ds.skip_corrupt)
    if cfg.data.train_fraction < 1.0:
        keep = _stratified_index(torch.as_tensor(train_ds.labels), cfg.data.train_fraction)
        train_ds = train_ds.subset(keep.tolist())
    return train_ds, test_ds, info


def _labels(ds: Dataset) -> Tensor:
    labels = getattr(ds, "labels", None)
    if isinstance(labels, Tensor):
        return labels
    return torch.as_tensor([int(ds[i][1]) for i in range(len(ds))])  # type: ignore[arg-type]


def _stratified_index(labels: Tensor, fraction: float) -> Tensor:
    """The indices of the first ``round(fraction * n_c)`` (at least 1) examples of each class, sorted."""
    keep = []
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c).flatten()
        keep.append(idx[: max(1, int(round(fraction * len(idx))))])
    return torch.sort(torch.cat(keep)).values


def _stratified_subset(ds: Dataset, fraction: float) -> Dataset:
    """The first ``round(fraction * n_c)`` (at least 1) examples of each class, in dataset order."""
    index = _stratified_index(_labels(ds), fraction)
    if hasattr(ds, "images") and hasattr(ds, "labels"):
        return type(ds)(ds.images[index], ds.labels[index], getattr(ds, "transform", None))  # type: ignore[call-arg]
    return torch.utils.data.Subset(ds, index.tolist())


def fetch_batch(ds: Dataset, index: Sequence[int]) -> Tuple[Tensor, Tensor]:
    """Stack the examples ``index`` of ``ds`` into ``(x (B, ...), y (B,))`` (a slice for in-memory datasets)."""
    images, labels = getattr(ds, "images", None), getattr(ds, "labels", None)
    if isinstance(images, Tensor) and isinstance(labels, Tensor) and getattr(ds, "transform", None) is None:
        idx = torch.as_tensor(index, dtype=torch.long)
        return images[idx], labels[idx]
    items = [ds[int(i)] for i in index]
    return torch.stack([torch.as_tensor(x) for x, _ in items]), torch.as_tensor([int(y) for _, y in items])


# ---------------------------------------------------------------------------------------------------------
# model and optimisation
# ---------------------------------------------------------------------------------------------------------


def build_model(cfg: TrainConfig, info: Any) -> Tuple[VisionTransformer, ViTConfig]:
    """The ViT of ``cfg`` on data described by ``info`` (:func:`build_vit_config`), with a fine-tuning
    resolution scaling resolved (:func:`fine_tune_scaling`)."""
    plain, request = split_pending_scaling(cfg)
    vit_cfg = build_vit_config(plain, info)
    if request:
        vit_cfg = dataclasses.replace(vit_cfg, resolution_scaling=fine_tune_scaling(request, vit_cfg, cfg)).resolved()
    return VisionTransformer(vit_cfg), vit_cfg


def schedule_of(cfg: TrainConfig, steps_per_epoch: int) -> engine.Schedule:
    """The optimiser settings and warm-up + cosine schedule of ``cfg`` for epochs of ``steps_per_epoch`` steps."""
    return engine.Schedule(lr=cfg.optim.peak_lr, total_steps=max(1, cfg.optim.epochs * steps_per_epoch),
                           warmup_steps=int(round(cfg.optim.warmup_epochs * steps_per_epoch)), min_lr=cfg.optim.min_lr,
                           weight_decay=cfg.optim.weight_decay, grad_clip=cfg.optim.grad_clip)


# ---------------------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset, *, batch_size: int = 250, device: Any = "cpu",
             ctx: Optional[DistContext] = None, offsets: Optional[Tensor] = None,
             workers: int = 0) -> Dict[str, float]:
    """Cross-entropy loss and accuracy of ``model`` on ``ds`` (sharded over DDP ranks, summed exactly).

    Args:
        ds: an in-memory dataset, or a stream of :func:`ropekit.data.streaming.open_stream` (read in order through
            :func:`~ropekit.data.streaming.make_loader` with ``workers`` processes).
        offsets: optional ``(len(ds), c)`` global coordinate offsets, one per example (``coord_offset``; in-memory
            data only).

    Returns:
        ``{"test_loss", "test_acc", "num_examples", "skipped"}`` (``skipped``: unreadable files a streamed set
        left out with ``skip_corrupt``).
    """
    ctx = ctx or DistContext()
    was_training = model.training
    model.eval()
    dev = torch.device(device)
    sums = torch.zeros(2, dtype=torch.float64, device=dev if dev.type in ("cpu", "cuda") else "cpu")
    count = 0
    skipped = [0]
    for x, y, off in _eval_batches(ds, batch_size, ctx, offsets, workers, dev.type == "cuda", skipped):
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        logits = model(x, coord_offset=off.to(dev)) if off is not None else model(x)
        sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum").double(),
                             (logits.argmax(-1) == y).sum().double()]).to(sums.device)
        count += len(y)
    loss_sum, correct, count, n_skipped = ctx.all_reduce_sum(sums.tolist() + [float(count), float(skipped[0])])
    model.train(was_training)
    count = max(count, 1.0)
    return {"test_loss": loss_sum / count, "test_acc": correct / count, "num_examples": int(count),
            "skipped": int(n_skipped)}


def _eval_batches(ds: Dataset, batch_size: int, ctx: DistContext, offsets: Optional[Tensor], workers: int,
                  pin: bool, skipped: Optional[List[int]] = None) -> Iterator[Tuple[Tensor, Tensor, Optional[Tensor]]]:
    """This rank's ``(x, y, offsets or None)`` evaluation batches of ``ds``, every example once over the ranks
    (``skipped[0]``: set to the number of unreadable files a streamed set left out, ``skip_corrupt``)."""
    if _is_stream_dataset(ds):
        if offsets is not None:
            raise ValueError("coordinate offsets are drawn per example of in-memory data; this data is streamed")
        from ..data.streaming import make_loader

        loader = make_loader(ds, batch_size=batch_size, rank=ctx.rank, world_size=ctx.world_size, num_workers=workers,
                             pin_memory=pin, drop_last=False, shuffle=False)
        loader.warn = False  # (counted in the result instead)
        for x, y in loader:
            yield x, y, None
        if skipped is not None:
            skipped[0] = loader.skipped
        return
    index = list(range(ctx.rank, len(ds), ctx.world_size))  # (no padding: every example counted once)
    for i in range(0, len(index), batch_size):
        chunk = index[i:i + batch_size]
        x, y = fetch_batch(ds, chunk)
        yield x, y, (offsets[torch.as_tensor(chunk)] if offsets is not None else None)


def _is_stream_dataset(ds: Any) -> bool:
    from ..data.streaming import ImageFolderStream, ShardStream

    return isinstance(ds, (ImageFolderStream, ShardStream))


def training_extent(vit_cfg: ViTConfig, tcfg: TrainConfig) -> Tuple[float, float]:
    """The training extent ``(L_y, L_x)`` of a run in patches (grid coordinates), which resolution scaling measures
    a test grid against: the training grid of a fixed-size run; for a native-resolution run, the side of a square
    at its largest token budget (``max_tokens``, else ``seq_len``), the largest image it saw in training."""
    if tcfg.data.native_resolution:
        from ..data.native import NativeOptions  # the run's options were checked when it trained

        opts = NativeOptions(patch_size=vit_cfg.patch_size, depth=vit_cfg.modality == "rgbd",
                             **tcfg.data.native_options)
        side = math.sqrt(opts.max_image_tokens)
        return side, side
    h, w = vit_cfg.image_size
    return h / vit_cfg.patch_size, w / vit_cfg.patch_size


def original_extent(vit_cfg: ViTConfig, tcfg: TrainConfig) -> Tuple[float, float]:
    """The extent ``(L_y, L_x)`` in patches that a run's encodings were first trained at: the ``train_extent``
    its model's ``resolution_scaling`` records (a run fine-tuned with a scaling), else :func:`training_extent`.

    Raises:
        ValueError: a recorded scaling without ``train_extent`` (one line).
    """
    recorded = vit_cfg.resolution_scaling
    if not recorded:
        return training_extent(vit_cfg, tcfg)
    extent = recorded.get("train_extent")
    if extent is None:
        raise ValueError(f"this model carries resolution_scaling {recorded.get('method')!r} without train_extent, so "
                         f"the extent its encodings were trained at is unknown")
    if not isinstance(extent, (list, tuple)):
        return float(extent), float(extent)
    image_axes = extent[1:3] if vit_cfg.modality == "video" else extent[:2]  # (t, y, x) / (y, x[, z])
    return float(image_axes[0]), float(image_axes[1])


def _scaling_to(method: str, vit_cfg: ViTConfig, grid: Tuple[float, float], extent: Tuple[float, float],
                **options: Any) -> ResolutionScaling:
    """``method`` from a training extent ``(L_y, L_x)`` to a grid ``(g_y, g_x)`` (patches): per image axis
    ``s = max(1, g / L)``, ``s = 1`` on a depth or time axis."""
    if vit_cfg.coords != "grid":
        raise ValueError(f"resolution scaling acts on grid coordinates; this run's model uses {vit_cfg.coords} "
                         f"coordinates, whose extent is the same at every resolution (nothing to scale)")
    scale = [max(1.0, g / ell) for g, ell in zip(grid, extent)]
    ext = [float(ell) for ell in extent]
    if vit_cfg.modality == "video":  # (t, y, x)
        scale, ext = [1.0] + scale, [1.0] + ext
    elif vit_cfg.depth_as_coord:  # (y, x, z)
        scale, ext = scale + [1.0], ext + [1.0]
    return ResolutionScaling.from_dict({**options, "method": method, "scale": scale, "train_extent": ext},
                                       source="resolution scaling")


def eval_scaling(method: str, vit_cfg: ViTConfig, tcfg: TrainConfig, image_size: Any) -> ResolutionScaling:
    """The :class:`~ropekit.encodings.scaling.ResolutionScaling` that evaluates a run's model at ``image_size``
    pixels (an int or ``(H, W)``) with ``method``: per image axis ``s = max(1, g / L)`` (``g`` the test grid,
    ``L`` :func:`original_extent`: for a run fine-tuned with a scaling, the extent before it, so the method
    replaces the recorded one), ``s = 1`` on a depth or time axis.

    Raises:
        ValueError: an unknown method, or a model on normalised coordinates (their extent is 1 at every
            resolution, so there is nothing to scale); one line.
    """
    h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    p = vit_cfg.patch_size
    return _scaling_to(method, vit_cfg, (h / p, w / p), original_extent(vit_cfg, tcfg))


def fine_tune_scaling(requested: Dict[str, Any], vit_cfg: ViTConfig, tcfg: TrainConfig) -> Dict[str, Any]:
    """The resolved ``resolution_scaling`` of a fine-tuning run that asks for one by method only
    (``{"method": "pi"}``, what ``ropekit train --scaling pi`` records before the run starts): measured from the
    extent the ``init_from`` run's encodings were trained at (:func:`original_extent`) to this run's
    (:func:`training_extent` of ``vit_cfg``, the model without the scaling). Other fields of ``requested``
    (``alpha``, ``beta``, ...) are kept.

    Raises:
        ValueError: no ``init_from``, or a scaling that cannot apply (one line).
    """
    method = requested.get("method")
    if not tcfg.model.init_from:
        raise ValueError(f"resolution scaling {method!r} without a scale fine-tunes another run at a new resolution: "
                         f"name it with --init-from RUN (or give the scale)")
    config = load_run_config(tcfg.model.init_from)  # (its weights are read by init_from_checkpoint)
    src_tcfg = TrainConfig.from_dict(config.get("train", {}), source=f"{tcfg.model.init_from}", strict=False)
    src_vit = ViTConfig.from_dict(config["model"], source=f"{tcfg.model.init_from}", strict=False)
    options = {k: v for k, v in requested.items() if k != "method"}
    return _scaling_to(str(method), vit_cfg, training_extent(vit_cfg, tcfg), original_extent(src_vit, src_tcfg),
                       **options).to_dict()


# ---------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------


def default_run_dir(cfg: TrainConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.data.name}-{cfg.model.vit().pe}-{cfg.model.size}-s{cfg.run.seed}-{stamp}"


def _log(msg: str, ctx: DistContext, quiet: bool = False) -> None:
    if ctx.is_main and not quiet:
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stderr)


def resolve_threads(threads: Optional[int], world_size: int = 1) -> int:
    """CPU threads per process: ``threads`` if given, else half the cores shared by the ranks (at least 1).

    Half, because OpenMP threads spin while they wait: when every core has a thread and anything else runs
    (another rank, the OS, a second job), a step of the tiny model measured 20x slower in CPU time with 2 threads
    on 2 busy cores than with 1. The tiny model gains little from intra-op parallelism anyway.
    """
    if threads:
        return int(threads)
    return max(1, (os.cpu_count() or 1) // (2 * max(1, world_size)))


#: Options that may differ when a run is resumed without changing what it computes.
RESUME_FREE = ("out", "device", "threads", "progress", "tensorboard", "compile", "log_every", "checkpoint_every")
#: Options that may change on resume when allowed explicitly (``--allow-change``); the new values are recorded.
RESUME_CHANGEABLE = ("epochs", "precision", "eval_batch_size")


def resume_changes(old: Dict[str, Any], new: TrainConfig, allow: Sequence[str] = ()) -> Dict[str, Tuple[Any, Any]]:
    """The options of ``new`` that differ from the run's saved ``old`` ones, as ``{name: (old, new)}`` (options that
    never change results are left out).

    Raises:
        ValueError: a difference that is not allowed -- listing every difference, and saying which ones
            ``allow`` (``--allow-change``) could admit.
    """
    base = flatten(TrainConfig.from_dict(old, source="the run's config", strict=False).to_nested())
    cur = flatten(new.to_nested())
    _, request = split_pending_scaling(new)
    recorded = dict((base.get("model_options") or {}).get("resolution_scaling") or {})
    if request and recorded and all(recorded.get(k) == v for k, v in request.items()):
        # a scaling asked for by method (``--scaling pi``) is the one the run resolved and recorded when it started
        cur["model_options"] = {**cur["model_options"], "resolution_scaling": recorded}
    changed = {k: (base[k], cur[k]) for k in cur if k not in RESUME_FREE and base.get(k) != cur[k]}
    bad_allow = sorted(set(allow) - set(RESUME_CHANGEABLE))
    if bad_allow:
        raise ValueError(f"--allow-change: {', '.join(bad_allow)} cannot change when resuming; only "
                         f"{', '.join(RESUME_CHANGEABLE)} can")
    refused = {k: v for k, v in changed.items() if k not in allow}
    if refused:
        listed = "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(refused.items()))
        fixable = sorted(k for k in refused if k in RESUME_CHANGEABLE)
        fixed = sorted(k for k in refused if k not in RESUME_CHANGEABLE)
        hint = []
        if fixable:
            hint.append(f"allow {', '.join(fixable)} with --allow-change {','.join(fixable)}")
        if fixed:
            hint.append(f"{', '.join(fixed)} cannot change in a resumed run (start a new run with --out)")
        raise ValueError(f"--resume: options differ from the run's: {listed}; {'; '.join(hint)}")
    return changed


class ClassificationTask:
    """Image / RGB-D / video classification with cross-entropy: what :func:`ropekit.train.engine.fit` needs.

    Batches of in-memory data: this rank's ``DistributedSampler`` order of the epoch (a function of ``(seed,
    epoch)``), cut into ``batch_size / world_size`` indices; the random shift augmentation draws from the global
    torch RNG. Streamed data: this rank's part of the epoch from :func:`ropekit.data.streaming.make_loader`
    (``cfg.data.workers`` processes, pinned memory on CUDA), decoded and augmented in the loader, restarted at the
    checkpoint's batch on resume. MixUp / CutMix (``mixup_alpha``, ``cutmix_alpha``) apply to either on the
    device and draw from the global torch RNG. ``info`` describes the data (:func:`load_data`'s third value).
    """

    name = "train"

    def __init__(self, cfg: TrainConfig, model: nn.Module, train_ds: Dataset, test_ds: Dataset,
                 ctx: DistContext, label: str, quiet: bool = False, run_dir: Optional[Path] = None,
                 info: Any = None) -> None:
        self.cfg, self.model, self.train_ds, self.test_ds = cfg, model, train_ds, test_ds
        self.label, self.quiet, self.run_dir, self.info = label, quiet, run_dir, info
        modality = getattr(getattr(model, "cfg", None), "modality", "image")
        if cfg.data.augment_sizes and modality != "image":
            raise ValueError(f"augment_sizes (scale augmentation) works on images only; this data is {modality}")
        self.per_rank_bs = max(1, cfg.optim.batch_size // ctx.world_size)
        self.streamed = _is_stream_dataset(train_ds)
        self.mix = _mixing(cfg, int(getattr(getattr(model, "cfg", None), "num_classes", 0) or 0), modality)
        if self.streamed:
            from ..data.streaming import make_loader

            self.loader = make_loader(train_ds, batch_size=self.per_rank_bs, seed=cfg.run.seed, rank=ctx.rank,
                                      world_size=ctx.world_size, num_workers=cfg.data.workers,
                                      pin_memory=ctx.device.type == "cuda", persistent_workers=cfg.data.workers > 0,
                                      drop_last=True)
            self.loader.warn = False  # (the count goes into the epoch's row and log line)
            self.steps_per_epoch = len(self.loader)
            return
        self.sampler = DistributedSampler(train_ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                          seed=cfg.run.seed, drop_last=False)
        self.steps_per_epoch = math.ceil(len(self.sampler) / self.per_rank_bs)

    def epoch_batches(self, epoch: int, ctx: DistContext) -> Union[List[List[int]], engine.StreamedEpoch]:
        if self.streamed:
            n = len(self.loader.set_epoch(epoch))
            return engine.StreamedEpoch(n, lambda start: self.loader.set_epoch(epoch, start))
        self.sampler.set_epoch(epoch)
        order = list(self.sampler)  # a function of (seed, epoch) only
        return [order[i:i + self.per_rank_bs] for i in range(0, len(order), self.per_rank_bs)]

    def loss(self, model: nn.Module, batch: Any, device: torch.device) -> Tuple[Tensor, Dict[str, Any]]:
        if self.streamed:
            x, y = batch  # (decoded and augmented by the loader)
        else:
            x, y = fetch_batch(self.train_ds, batch)
            x = random_shift(x, self.cfg.data.augment_shift)
        x = random_resize(x, self.cfg.data.augment_sizes)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        target = y
        if self.mix is not None:
            x, target = self.mix(x, y)  # (B, num_classes) mixed one-hot targets
        logits = model(x)
        loss = F.cross_entropy(logits.float(), target, label_smoothing=self.cfg.optim.label_smoothing)
        top = target.argmax(-1) if target.dim() > 1 else y
        n = y.shape[0]  # (sums stay on the device: the engine reads them once per log interval)
        return loss, {"loss_sum": loss.detach().double() * n, "correct": (logits.argmax(-1) == top).sum(), "count": n}

    def epoch_row(self, epoch: int, sums: Dict[str, float], info: Dict[str, Any], ctx: DistContext) -> Dict[str, Any]:
        skipped = float(self.loader.skipped) if self.streamed else 0.0
        loss_sum, correct, count, skipped = ctx.all_reduce_sum([sums.get("loss_sum", 0.0), sums.get("correct", 0.0),
                                                                sums.get("count", 0.0), skipped])
        t0 = time.time()
        ev = evaluate(self.model, self.test_ds, batch_size=self.cfg.run.eval_batch_size, device=ctx.device, ctx=ctx,
                      workers=self.cfg.data.workers)
        t_eval = time.time() - t0  # (the epoch's time includes its evaluation)
        row = {"epoch": epoch + 1, "train_loss": loss_sum / max(count, 1), "train_acc": correct / max(count, 1),
               "test_loss": ev["test_loss"], "test_acc": ev["test_acc"], "lr": info["lr"],
               "epoch_time": info["epoch_time"] + t_eval, "elapsed_time": info["elapsed"] + t_eval}
        if self.skips:
            row.update(train_skipped=int(skipped), test_skipped=int(ev["skipped"]))
        return row

    @property
    def skips(self) -> bool:
        """Whether unreadable files are skipped (and counted per split): ``skip_corrupt`` of streamed data."""
        return self.streamed and bool(self.cfg.data.data_options.get("skip_corrupt", False))

    def describe(self, row: Dict[str, Any]) -> str:
        skipped = (f"  skipped unreadable: {row['train_skipped']} train, {row['test_skipped']} test"
                   if row.get("train_skipped") or row.get("test_skipped") else "")
        return (f"epoch {row['epoch']}/{self.cfg.optim.epochs}  train loss {row['train_loss']:.4f} acc "
                f"{row['train_acc']:.4f}  test loss {row['test_loss']:.4f} acc {row['test_acc']:.4f}  "
                f"({row['epoch_time']:.1f}s){skipped}")

    def plot(self, history: List[Dict[str, Any]], path: Path) -> None:
        plot_curves(history, path, title=f"{self.cfg.data.name} ViT-{self.cfg.model.size} pe={self.label}")

    def summary(self, history: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The run's identity and final metrics; the engine adds epochs, wall time, parameters and machine."""
        vit_cfg = self.model.cfg  # (the VisionTransformer that build_model made)
        final = history[-1] if history else {}
        out = {"run_dir": str(self.run_dir) if self.run_dir is not None else None, "data": self.cfg.data.name,
               "model": self.cfg.model.size, "pe": vit_cfg.pe,
               "depth_input": vit_cfg.depth_input if vit_cfg.modality == "rgbd" else None, "seed": self.cfg.run.seed,
               **{k: final.get(k) for k in ("train_loss", "train_acc", "test_loss", "test_acc")}}
        if self.skips:  # unreadable files left out, per split (the training count summed over the epochs)
            out["skipped"] = {"train": int(sum(r.get("train_skipped", 0) for r in history)),
                              "test": int(final.get("test_skipped", 0))}
        return out


def _mixing(cfg: TrainConfig, num_classes: int, modality: str) -> Optional[Callable[[Tensor, Tensor], Any]]:
    """torchvision's MixUp / CutMix of ``cfg`` (one of the two per batch when both are on), or ``None``."""
    if cfg.data.mixup_alpha <= 0 and cfg.data.cutmix_alpha <= 0:
        return None
    if modality == "video":
        raise ValueError("mixup_alpha / cutmix_alpha mix (B, C, H, W) image batches; this data is video")
    from torchvision.transforms import v2

    mixes = ([v2.MixUp(alpha=cfg.data.mixup_alpha, num_classes=num_classes)] if cfg.data.mixup_alpha > 0 else []) + \
            ([v2.CutMix(alpha=cfg.data.cutmix_alpha, num_classes=num_classes)] if cfg.data.cutmix_alpha > 0 else [])
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)


@register_task("classification", "image, RGB-D and video classification of a ViT with cross-entropy",
               config=TrainConfig, train="ropekit.train.commands:train_classification")
def build_classification_task(cfg: TrainConfig, ctx: Optional[DistContext] = None, *,
                              run_dir: Optional[Path] = None, quiet: bool = False) -> ClassificationTask:
    """The :class:`ClassificationTask` of ``cfg``: its data loaded and its ViT built (seeded by ``cfg.run.seed``,
    identical on every rank); ``ctx``: this process's place in the run (default: one process on the CPU)."""
    ctx = ctx or DistContext()
    if cfg.data.native_resolution:  # packed batches at each image's own aspect ratio (ropekit.classification.native)
        from ..train.tasks import lookup_task

        return lookup_task("native-resolution").build(cfg, ctx, run_dir=run_dir, quiet=quiet)
    train_ds, test_ds, info = load_data(cfg)
    seed_everything(cfg.run.seed)  # model initialisation: identical on every rank
    model, vit_cfg = build_model(cfg, info)
    label = f"{vit_cfg.pe}" + (f", depth as {vit_cfg.depth_input}" if vit_cfg.modality == "rgbd" else "")
    return ClassificationTask(cfg, model, train_ds, test_ds, ctx, label, quiet, run_dir=run_dir, info=info)


def train(cfg: TrainConfig, *, resume: bool = False, on_step: Optional[StepCallback] = None,
          quiet: bool = False, allow_change: Sequence[str] = ()) -> TrainResult:
    """Train a ViT as ``cfg`` says; see the module docstring for the run folder.

    Args:
        cfg: the resolved configuration (``cfg.run.out`` is the run folder).
        resume: continue from ``<out>/checkpoint.pt``; ``cfg`` must equal the run's saved configuration except
            for the options in ``RESUME_FREE`` and, when named in ``allow_change``, those in ``RESUME_CHANGEABLE``
            (more epochs stretch the cosine schedule to the new total; what ran is recorded in ``config.json``).
        on_step: called after every optimiser step with the global step; returning ``True`` stops the run
            like Ctrl-C does (a checkpoint is saved mid-epoch).
        quiet: no log lines (the progress bar follows ``cfg.run.progress``).
        allow_change: option names that may differ from the run's when resuming.

    Raises:
        ValueError, FileNotFoundError, CheckpointError: bad configuration, data path, or checkpoint;
        RunLockedError: another process writes the run folder; NonFiniteLossError: the loss became NaN / Inf;
        SaveError: a checkpoint could not be written.
    """
    cfg.validate()
    ctx = init_distributed(cfg.run.device)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(resolve_threads(cfg.run.threads, ctx.world_size))
    lock = None
    try:
        run_dir = Path(cfg.run.out) if cfg.run.out else default_run_dir(cfg)
        if not cfg.run.out:
            # every rank must agree on the default folder name: rank 0 picks it
            run_dir = Path(ctx.gather_objects(str(run_dir))[0])
            cfg = cfg.replace(**{"run.out": str(run_dir)})
        if ctx.is_main:
            existed = run_dir.exists()
            lock = engine.RunLock(run_dir).acquire()  # before the data loads: a second run refuses at once
            lock.created = not existed  # type: ignore[attr-defined]
        return _train(cfg, ctx, run_dir, resume=resume, on_step=on_step, quiet=quiet, allow_change=allow_change)
    except BaseException:
        if lock is not None and getattr(lock, "created", False):
            _remove_if_empty(run_dir)
        raise
    finally:
        if lock is not None:
            lock.release()
        torch.set_num_threads(previous_threads)
        ctx.close()


def _remove_if_empty(run_dir: Path) -> None:
    """Remove a run folder this run created when the run failed before its first checkpoint (bad data, a wrong
    option found late, Ctrl-C while loading): it holds nothing to resume, and a half-made folder would make the next
    try refuse or mislead. Only the files a run writes are removed; a folder holding anything else is kept."""
    import shutil

    ours = {".lock", "config.json", "metrics.csv", "summary.json", "curves.png", "tb", CHECKPOINT_NAME}
    try:
        names = {p.name for p in run_dir.iterdir()}
        if CHECKPOINT_NAME in names or not names <= ours | {n for n in names if n.startswith(".")}:
            return
        shutil.rmtree(run_dir)
    except OSError:
        pass


def _train(cfg: TrainConfig, ctx: DistContext, run_dir: Path, *, resume: bool, on_step: Optional[StepCallback],
           quiet: bool, allow_change: Sequence[str]) -> TrainResult:
    ckpt_path = run_dir / CHECKPOINT_NAME
    ckpt = None
    changes: Dict[str, Tuple[Any, Any]] = {}
    previous_config: Dict[str, Any] = {}
    if resume:
        ckpt = load_checkpoint(ckpt_path)
        previous_config, _ = load_run(run_dir)
        changes = resume_changes(previous_config.get("train") or ckpt.get("train_config", {}), cfg,
                                 [a for a in allow_change if a != DATA_CHANGE])
        if "epochs" in changes and cfg.optim.epochs < int(ckpt["epoch"]):
            raise ValueError(f"--epochs {cfg.optim.epochs}: the run has already done {int(ckpt['epoch'])} epochs")
    elif ckpt_path.exists():
        raise ValueError(f"run folder {run_dir} already holds a checkpoint; continue it with --resume or choose "
                         f"another --out")

    task = build_classification_task(cfg, ctx, run_dir=run_dir, quiet=quiet)
    model, vit_cfg, info, train_ds, test_ds = task.model, task.model.cfg, task.info, task.train_ds, task.test_ds
    if cfg.model.options.get("resolution_scaling", {}) != vit_cfg.resolution_scaling:
        # a scaling asked for by method (--scaling) is recorded resolved: a resume needs no init_from run
        cfg = cfg.replace(model_options={"resolution_scaling": vit_cfg.resolution_scaling})
    if ckpt is not None:  # (checked here, before anything is said or written; the engine restores the rest)
        load_model_state(model, ckpt["model"], source=f"checkpoint {ckpt['path']}")
    if cfg.model.init_from and ckpt is None:
        from ..train.finetune import init_from_checkpoint

        _log(init_from_checkpoint(model, load_checkpoint(cfg.model.init_from)), ctx, quiet)

    fingerprint = data_fingerprint(train_ds, test_ds)
    data_changed = check_same_data(previous_config.get("data") or {}, fingerprint, len(train_ds), len(test_ds),
                                   DATA_CHANGE in allow_change) if ckpt is not None else None
    schedule = schedule_of(cfg, task.steps_per_epoch)
    n_params = count_parameters(model)  # encodings by their effective count
    config_doc = {"train": cfg.to_nested(), "model": vit_cfg.to_dict(),
                  "data": {**_info_dict(info, len(train_ds), len(test_ds)), "fingerprint": fingerprint},
                  "depth_input": vit_cfg.depth_input if vit_cfg.modality == "rgbd" else None}
    resumes = list(previous_config.get("resumes", []))
    if ckpt is not None:
        step0 = int(ckpt.get("global_step", 0))
        entry: Dict[str, Any] = {"epoch": int(ckpt["epoch"]), "step_in_epoch": int(ckpt.get("step_in_epoch", 0)),
                                 "global_step": step0}
        if changes:
            entry["changed"] = {k: [a, b] for k, (a, b) in changes.items()}
        if data_changed:
            entry["data_changed"] = {"fingerprint": data_changed, "num_train": len(train_ds),
                                     "num_test": len(test_ds)}
            _log(f"resuming on changed data ({len(train_ds)} train / {len(test_ds)} test; --allow-data-change, "
                 f"recorded in config.json)", ctx, quiet)
        if "epochs" in changes:
            old_cfg = cfg.replace(**{"optim.epochs": int(changes["epochs"][0])})
            old = schedule_of(old_cfg, task.steps_per_epoch)
            f_old = engine.warmup_cosine(old.total_steps, old.warmup_steps, cfg.optim.min_lr / cfg.optim.peak_lr)
            f_new = engine.warmup_cosine(schedule.total_steps, schedule.warmup_steps,
                                         cfg.optim.min_lr / cfg.optim.peak_lr)
            entry["schedule"] = (f"cosine decay stretched from {old.total_steps} to {schedule.total_steps} steps: "
                                 f"the learning rate at step {step0 + 1} is "
                                 f"{cfg.optim.peak_lr * f_new(step0):.3g} instead of "
                                 f"{cfg.optim.peak_lr * f_old(step0):.3g}")
            _log(f"epochs {changes['epochs'][0]} -> {changes['epochs'][1]}: {entry['schedule']}", ctx, quiet)
        resumes.append(entry)
        for k, (a, b) in changes.items():
            if k != "epochs":
                _log(f"resuming with {k} {a!r} -> {b!r} (recorded in config.json)", ctx, quiet)
        _log(f"resuming {run_dir} at epoch {int(ckpt['epoch']) + 1}, step {int(ckpt.get('step_in_epoch', 0))}",
             ctx, quiet)
    if resumes:
        config_doc["resumes"] = resumes
    _log(start_line(cfg, vit_cfg, info, len(train_ds), len(test_ds), n_params, ctx, run_dir), ctx, quiet)

    def fresh_start(c: DistContext) -> None:
        seed_everything(cfg.run.seed + 1_000_003 * (c.rank + 1))  # per-rank stream for jitter/augmentation/dropout

    res = engine.fit(task, engine.FitOptions(
        schedule, cfg.optim.epochs, execution=cfg.run.engine_options(), run_dir=run_dir,
        checkpoint_name=CHECKPOINT_NAME,
        resume=ckpt is not None, ctx=ctx, on_step=on_step, quiet=quiet, config_doc=config_doc,
        checkpoint_extra={"vit_config": vit_cfg.to_dict(), "train_config": cfg.to_nested()},
        metric_columns=METRIC_COLUMNS + (("train_skipped", "test_skipped") if task.skips else ()),
        fresh_start=fresh_start, log_every=cfg.run.log_every,
        checkpoint_every=cfg.run.checkpoint_every))
    history = res.history
    final = dict(history[-1]) if history else {}
    return TrainResult(run_dir=run_dir, history=history, interrupted=res.interrupted, wall_time=res.wall_time,
                       model=model, final=final, is_main=ctx.is_main)


def data_fingerprint(train_ds: Dataset, test_ds: Dataset) -> Optional[str]:
    """A SHA-256 of what a run trains and tests on, split included: for an image folder each file's path (relative
    to the folder), size and label, per split; for shards each shard's name, size and sample count; for data held in
    memory the bytes of its images and labels. ``None`` for data of another kind. Two runs with one fingerprint
    saw the same files in the same split; a file added, removed, resized or moved across the split changes it."""
    import hashlib

    h = hashlib.sha256()
    for name, ds in (("train", train_ds), ("test", test_ds)):
        h.update(f"[{name}]\n".encode())
        files, labels = getattr(ds, "_files", None), getattr(ds, "labels", None)
        if files is not None and labels is not None and hasattr(ds, "path"):  # an ImageFolderStream
            for i, rel in enumerate(files):
                try:
                    size = os.stat(ds.path(i)).st_size
                except OSError:
                    size = -1
                h.update(rel + f"\t{size}\t{int(labels[i])}\n".encode())
        elif hasattr(ds, "shards") and hasattr(ds, "counts"):  # a ShardStream
            for shard, count in zip(ds.shards, ds.counts):
                size = Path(shard).stat().st_size if Path(shard).exists() else -1
                h.update(f"{Path(shard).name}\t{size}\t{count}\n".encode())
        elif isinstance(getattr(ds, "images", None), Tensor) and isinstance(labels, Tensor):
            h.update(ds.images.detach().cpu().contiguous().numpy().tobytes())
            h.update(labels.detach().cpu().contiguous().numpy().tobytes())
        else:
            return None
    return h.hexdigest()


def check_same_data(previous: Dict[str, Any], fingerprint: Optional[str], n_train: int, n_test: int,
                    allow: bool) -> Optional[List[Any]]:
    """``[old, new]`` fingerprints when a resumed run's data changed and ``allow`` accepts it, ``None`` when
    nothing changed (or the run recorded no fingerprint).

    Raises:
        ValueError: the data changed and ``allow`` is false (one line, with the counts before and after).
    """
    old = previous.get("fingerprint")
    if old is None or fingerprint is None or old == fingerprint:
        return None
    if not allow:
        counts = (f"{previous.get('num_train')} -> {n_train} training, {previous.get('num_test')} -> {n_test} test "
                  f"images" if (previous.get("num_train"), previous.get("num_test")) != (n_train, n_test)
                  else "the same counts, other files or sizes")
        raise ValueError(f"--resume: the data changed since the run started ({counts}); images already trained on "
                         f"may now be in the test set. Restore the data, start a new run, or continue anyway with "
                         f"--allow-data-change (recorded in config.json)")
    return [old, fingerprint]


def start_line(cfg: TrainConfig, vit_cfg: ViTConfig, info: Any, n_train: int, n_test: int, n_params: int,
               ctx: DistContext, run_dir: Path) -> str:
    """The start-of-run line: data (where from, counts), image size, patch size and tokens per image, model,
    encoding and how its parameters are shared, schedule, run folder."""
    h, w = (int(v) for v in vit_cfg.image_size)
    p = int(vit_cfg.patch_size)
    tokens = (h // p) * (w // p)
    if vit_cfg.modality == "video":
        tokens *= max(1, int(vit_cfg.num_frames or 1) // int(vit_cfg.tubelet_size or 1))
    where = f" {cfg.data.data_root}" if cfg.data.data_root else ""
    size_note = "" if cfg.data.image_size is not None or not is_streamed(cfg) else " (default)"
    resolved = vit_cfg.resolved() if hasattr(vit_cfg, "resolved") else vit_cfg
    sharing = resolved.pe_sharing + (", per head" if resolved.per_head else "")
    pe = vit_cfg.pe + (f" ({sharing})" if vit_cfg.rotary is not None else "")
    return (f"ropekit train: {cfg.data.name}{where} ({n_train} train / {n_test} test, {info.kind}), {h}x{w} px"
            f"{size_note}, patch {p}, {tokens} tokens/image, ViT-{cfg.model.size} {n_params / 1e6:.2f}M params, pe={pe}"
            f"{f', depth as {vit_cfg.depth_input}' if vit_cfg.modality == 'rgbd' else ''}, "
            f"{plural(cfg.optim.epochs, 'epoch')}, batch {cfg.optim.batch_size}"
            f"{f' over {ctx.world_size} processes' if ctx.enabled else ''}"
            f"{f', {cfg.run.precision}' if cfg.run.precision != 'fp32' else ''}"
            f"{', compiled' if cfg.run.compile else ''}"
            f", run folder {run_dir}")


def _info_dict(info: Any, n_train: int, n_test: int) -> Dict[str, Any]:
    d = dataclasses.asdict(info) if dataclasses.is_dataclass(info) else dict(vars(info))
    if d.get("class_names") is not None:
        d["class_names"] = [str(c) for c in d["class_names"]]
    d["num_train"], d["num_test"] = n_train, n_test
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

