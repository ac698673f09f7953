"""The training loop behind ``ropekit train`` and the evaluation behind ``ropekit eval``.

Reproducibility contract (CPU): the data order of epoch ``e`` is a function of ``(seed, e)`` only
(``DistributedSampler`` with ``set_epoch``); every other random draw (position jitter, augmentation, dropout)
comes from the global torch RNG, whose state is saved with every checkpoint together with the model,
optimiser, scheduler, epoch and step. ``--resume`` therefore continues bit-for-bit, also from a checkpoint
written mid-epoch by Ctrl-C (the batches already done are skipped).

Run folder layout::

    config.json      resolved TrainConfig ("train"), ViTConfig ("model"), dataset info ("data")
    checkpoint.pt    latest checkpoint (written atomically after every epoch and on Ctrl-C)
    metrics.csv      epoch,train_loss,train_acc,test_loss,test_acc,lr,epoch_time,elapsed_time
    curves.png       learning curves
    summary.json     final metrics, wall time, parameter count
    tb/              TensorBoard event files (when tensorboard is installed)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, DistributedSampler

from ..nn.vit import ViTConfig, VisionTransformer
from .checkpoint import CHECKPOINT_NAME, CheckpointError, atomic_save, capture_rng, load_checkpoint, \
    load_model_state, restore_rng
from .config import TrainConfig, build_vit_config
from .distributed import DistContext, init_distributed
from .metrics import TensorBoardLogger, atomic_write_text, plot_curves, write_metrics_csv

__all__ = ["TrainResult", "train", "evaluate", "evaluate_run", "load_data", "build_model", "build_optimizer",
           "build_scheduler", "default_run_dir", "fetch_batch", "random_shift", "load_run"]

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


def load_data(cfg: TrainConfig, image_size: Any = None) -> Tuple[Dataset, Dataset, Any]:
    """``(train_ds, test_ds, info)`` for ``cfg`` (``image_size`` overrides ``cfg.image_size``)."""
    from ..data import load_dataset

    size = image_size if image_size is not None else cfg.image_size
    train_ds, test_ds, info = load_dataset(cfg.data, root=cfg.data_root, image_size=size, split_seed=cfg.split_seed,
                                           normalize=cfg.normalize, **cfg.data_options)
    if cfg.train_fraction < 1.0:
        train_ds = _stratified_subset(train_ds, cfg.train_fraction)
    return train_ds, test_ds, info


def _labels(ds: Dataset) -> Tensor:
    labels = getattr(ds, "labels", None)
    if isinstance(labels, Tensor):
        return labels
    return torch.as_tensor([int(ds[i][1]) for i in range(len(ds))])  # type: ignore[arg-type]


def _stratified_subset(ds: Dataset, fraction: float) -> Dataset:
    """The first ``round(fraction * n_c)`` (at least 1) examples of each class, in dataset order."""
    labels = _labels(ds)
    keep = []
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c).flatten()
        keep.append(idx[: max(1, int(round(fraction * len(idx))))])
    index = torch.sort(torch.cat(keep)).values
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


def random_shift(x: Tensor, max_shift: int) -> Tensor:
    """Translate each example by up to ``max_shift`` pixels along H and W, filling with zeros.

    ``x``: ``(B, C, H, W)`` or ``(B, C, T, H, W)`` (every frame of a clip moves together; a zero-filled depth
    pixel is invalid, as it should be). Draws from the global torch RNG.
    """
    if max_shift <= 0:
        return x
    s = int(max_shift)
    h, w = x.shape[-2:]
    padded = F.pad(x, (s, s, s, s))  # (..., H + 2s, W + 2s)
    offsets = torch.randint(0, 2 * s + 1, (x.shape[0], 2)).tolist()
    return torch.stack([padded[i, ..., dy:dy + h, dx:dx + w] for i, (dy, dx) in enumerate(offsets)])


# ---------------------------------------------------------------------------------------------------------
# model and optimisation
# ---------------------------------------------------------------------------------------------------------


def _is_2d_to_3d(src: Dict[str, Any], vit_cfg: Any) -> bool:
    """Whether checkpoint ``src`` holds a model without a depth coordinate and ``vit_cfg`` lifts depth to one."""
    if "vit_config" not in src or getattr(vit_cfg, "modality", None) != "rgbd":
        return False
    try:
        src_model = VisionTransformer(ViTConfig.from_dict(src["vit_config"]))
    except (TypeError, ValueError):
        return False
    new_model = VisionTransformer(vit_cfg)
    return _coord_dim(src_model) < _coord_dim(new_model)


def _coord_dim(model: Any) -> int:
    from ..encodings import PositionEncoding

    dims = [m.coord_dim for m in model.modules() if isinstance(m, PositionEncoding)]
    return max(dims, default=0)


def build_model(cfg: TrainConfig, info: Any) -> Tuple[VisionTransformer, ViTConfig]:
    vit_cfg = build_vit_config(cfg, info)
    return VisionTransformer(vit_cfg), vit_cfg


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay for ``model.no_weight_decay()`` (encodings, depth lift, CLS, APE) and for every
    parameter with fewer than two dimensions (norms, biases)."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    named = dict(model.named_parameters(remove_duplicate=False))
    skip_ids = {id(named[n]) for n in skip if n in named}
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if id(p) in skip_ids or p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999))


def build_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int):
    """Per-step schedule: linear warm-up over ``warmup_epochs``, then cosine decay to ``min_lr``."""
    total = max(1, cfg.epochs * steps_per_epoch)
    warm = min(int(round(cfg.warmup_epochs * steps_per_epoch)), total - 1)
    floor = min(1.0, cfg.min_lr / cfg.lr)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        t = (step - warm) / max(1, total - warm)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


# ---------------------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset, *, batch_size: int = 250, device: Any = "cpu",
             ctx: Optional[DistContext] = None, offsets: Optional[Tensor] = None) -> Dict[str, float]:
    """Cross-entropy loss and accuracy of ``model`` on ``ds`` (sharded over DDP ranks, summed exactly).

    Args:
        offsets: optional ``(len(ds), c)`` global coordinate offsets, one per example (``coord_offset``).

    Returns:
        ``{"test_loss", "test_acc", "num_examples"}``.
    """
    ctx = ctx or DistContext()
    was_training = model.training
    model.eval()
    index = list(range(ctx.rank, len(ds), ctx.world_size))  # (no padding: every example counted once)
    loss_sum = correct = 0.0
    for i in range(0, len(index), batch_size):
        chunk = index[i:i + batch_size]
        x, y = fetch_batch(ds, chunk)
        x, y = x.to(device), y.to(device)
        off = offsets[torch.as_tensor(chunk)].to(device) if offsets is not None else None
        logits = model(x, coord_offset=off) if off is not None else model(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
    loss_sum, correct, count = ctx.all_reduce_sum([loss_sum, correct, float(len(index))])
    model.train(was_training)
    count = max(count, 1.0)
    return {"test_loss": loss_sum / count, "test_acc": correct / count, "num_examples": int(count)}


def load_run(run_dir: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(config, checkpoint)`` of a run folder; one-line ``FileNotFoundError`` / ``CheckpointError``."""
    run = Path(run_dir).expanduser()
    if not run.exists():
        raise FileNotFoundError(f"run folder not found: {run}")
    if run.is_file():  # a checkpoint file: take the config from it
        ckpt = load_checkpoint(run)
        return {"train": ckpt.get("train_config", {}), "model": ckpt["vit_config"]}, ckpt
    cfg_path = run / "config.json"
    ckpt = load_checkpoint(run)
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON ({e.msg})") from None
    else:
        config = {"train": ckpt.get("train_config", {}), "model": ckpt.get("vit_config", {})}
    return config, ckpt


def evaluate_run(run_dir: Any, *, image_size: Optional[int] = None, offset_std: float = 0.0, seed: int = 0,
                 batch_size: Optional[int] = None, device: str = "auto") -> Dict[str, Any]:
    """Evaluate a run's checkpoint on its test set, optionally at another resolution and with one random
    global coordinate offset per image drawn from ``N(0, offset_std^2 I)`` (seeded by ``seed``)."""
    config, ckpt = load_run(run_dir)
    tcfg = TrainConfig.from_dict(config.get("train", {}), source="config.json")
    vit_cfg = ViTConfig.from_dict(ckpt["vit_config"])
    model = VisionTransformer(vit_cfg)
    load_model_state(model, ckpt["model"], source=f"checkpoint {ckpt['path']}")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    model.to(dev)
    _, test_ds, info = load_data(tcfg, image_size=image_size)
    offsets = None
    if offset_std > 0:
        g = torch.Generator().manual_seed(int(seed))
        offsets = torch.randn(len(test_ds), model.coord_dim, generator=g) * float(offset_std)  # (N_test, c)
    res = evaluate(model, test_ds, batch_size=batch_size or tcfg.eval_batch_size, device=dev, offsets=offsets)
    return {
        "run_dir": str(run_dir), "checkpoint": ckpt["path"], "epoch": int(ckpt.get("epoch", 0)), "data": tcfg.data,
        "pe": vit_cfg.pe, "image_size": list(info.image_size), "offset_std": float(offset_std), "seed": int(seed),
        "coord_dim": model.coord_dim, "test_acc": res["test_acc"], "test_loss": res["test_loss"],
        "num_examples": res["num_examples"],
    }


# ---------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------


class _StopRequest:
    """SIGINT / SIGTERM set a flag that the loop checks after each step (a second Ctrl-C aborts at once)."""

    def __init__(self, verbose: bool) -> None:
        self.requested = False
        self.verbose = verbose
        self._old: Dict[int, Any] = {}

    def __enter__(self) -> "_StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # (background jobs ignore SIGINT: keep it so)
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.verbose:
            print("\nstopping after this step and saving a checkpoint (press Ctrl-C again to abort)",
                  file=sys.stderr, flush=True)


def default_run_dir(cfg: TrainConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.data}-{cfg.pe}-{cfg.model}-s{cfg.seed}-{stamp}"


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _log(msg: str, ctx: DistContext, quiet: bool = False) -> None:
    if ctx.is_main and not quiet:
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stderr)


def train(cfg: TrainConfig, *, resume: bool = False, on_step: Optional[StepCallback] = None,
          quiet: bool = False) -> TrainResult:
    """Train a ViT as ``cfg`` says; see the module docstring for the run folder.

    Args:
        cfg: the resolved configuration (``cfg.out`` is the run folder).
        resume: continue from ``<out>/checkpoint.pt``.
        on_step: called after every optimiser step with the global step; returning ``True`` stops the run
            like Ctrl-C does (a checkpoint is saved mid-epoch).
        quiet: no log lines (the progress bar follows ``cfg.progress``).

    Raises:
        ValueError, FileNotFoundError, CheckpointError: bad configuration, data path, or checkpoint.
    """
    cfg.validate()
    ctx = init_distributed(cfg.device)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(resolve_threads(cfg.threads, ctx.world_size))
    try:
        return _train(cfg, ctx, resume=resume, on_step=on_step, quiet=quiet)
    finally:
        torch.set_num_threads(previous_threads)
        ctx.close()


def resolve_threads(threads: Optional[int], world_size: int = 1) -> int:
    """CPU threads per process: ``threads`` if given, else half the cores shared by the ranks (at least 1).

    Half, because OpenMP threads spin while they wait: when every core has a thread and anything else runs
    (another rank, the OS, a second job), a step of the tiny model measured 20x slower in CPU time with 2 threads
    on 2 busy cores than with 1. The tiny model gains little from intra-op parallelism anyway.
    """
    if threads:
        return int(threads)
    return max(1, (os.cpu_count() or 1) // (2 * max(1, world_size)))


def _train(cfg: TrainConfig, ctx: DistContext, *, resume: bool, on_step: Optional[StepCallback],
           quiet: bool) -> TrainResult:
    t_start = time.time()
    run_dir = Path(cfg.out) if cfg.out else default_run_dir(cfg)
    if not cfg.out:
        # every rank must agree on the default folder name: rank 0 picks it
        run_dir = Path(ctx.gather_objects(str(run_dir))[0])
        cfg = dataclasses.replace(cfg, out=str(run_dir))
    ckpt_path = run_dir / CHECKPOINT_NAME
    ckpt = None
    if resume:
        ckpt = load_checkpoint(ckpt_path)
    elif ckpt_path.exists():
        raise ValueError(f"run folder {run_dir} already holds a checkpoint; continue it with --resume or choose "
                         f"another --out")

    device = ctx.device
    train_ds, test_ds, info = load_data(cfg)
    _seed_everything(cfg.seed)  # model initialisation: identical on every rank
    model, vit_cfg = build_model(cfg, info)
    if cfg.init_from and ckpt is None:
        src = load_checkpoint(cfg.init_from)
        if _is_2d_to_3d(src, vit_cfg):
            # SPEC §4: a 2-D checkpoint into a 3-D (RGB-D) model -- encoding parameters widened 2 -> 3 with the new
            # axis at zero, depth lift at zero, so the first forward pass equals the 2-D model's.
            from ..integrations.finetune import init_3d_from_2d

            source = VisionTransformer(ViTConfig.from_dict(src["vit_config"]))
            load_model_state(source, src["model"], source=f"checkpoint {src['path']}")
            report = init_3d_from_2d(model, source.eval())
            _log(f"initialised the 3-D model from the 2-D checkpoint {src['path']} "
                 f"({len(report['copied'])} copied, {len(report['widened'])} encoding tensors widened, "
                 f"{len(report['zeroed']) + len(report['depth_lift'])} new set to zero)", ctx, quiet)
        else:
            report = load_model_state(model, src["model"], strict=False, source=f"checkpoint {src['path']}")
            _log(f"initialised {len(report['loaded'])} tensors from {src['path']} "
                 f"({len(report['missing'])} new, {len(report['skipped'])} skipped)", ctx, quiet)
    model.to(device)

    per_rank_bs = max(1, cfg.batch_size // ctx.world_size)
    sampler = DistributedSampler(train_ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                 seed=cfg.seed, drop_last=False)
    steps_per_epoch = math.ceil(len(sampler) / per_rank_bs)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, steps_per_epoch)

    start_epoch, start_step, global_step, elapsed_before = 0, 0, 0, 0.0
    history: List[Dict[str, Any]] = []
    partial = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0, "time": 0.0}
    if ckpt is not None:
        load_model_state(model, ckpt["model"], source=f"checkpoint {ckpt['path']}")
        try:
            opt.load_state_dict(ckpt["optimizer"])
            sched.load_state_dict(ckpt["scheduler"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {ckpt['path']} does not match the optimiser: {str(e).splitlines()[0]}") from None
        start_epoch, start_step = int(ckpt["epoch"]), int(ckpt.get("step_in_epoch", 0))
        global_step, elapsed_before = int(ckpt.get("global_step", 0)), float(ckpt.get("elapsed_time", 0.0))
        history = list(ckpt.get("history", []))
        partial = dict(ckpt.get("partial") or partial)
        rng = ckpt.get("rng") or []
        if start_step > steps_per_epoch:
            raise CheckpointError(f"checkpoint {ckpt['path']} stopped at step {start_step} of an epoch, but an "
                                  f"epoch now has {steps_per_epoch} steps (batch size or data changed)")
        if ctx.rank < len(rng):
            restore_rng(rng[ctx.rank])
    else:
        _seed_everything(cfg.seed + 1_000_003 * (ctx.rank + 1))  # per-rank stream for jitter/augmentation/dropout

    n_params = sum(p.numel() for p in model.parameters())
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        config_doc = {"train": cfg.to_dict(), "model": vit_cfg.to_dict(),
                      "data": _info_dict(info, len(train_ds), len(test_ds)),
                      "depth_input": vit_cfg.depth_input if vit_cfg.modality == "rgbd" else None,
                      "world_size": ctx.world_size, "num_params": n_params}
        atomic_write_text(run_dir / "config.json", json.dumps(config_doc, indent=2) + "\n")
        if history:
            write_metrics_csv(run_dir / "metrics.csv", history)
    tb = TensorBoardLogger(run_dir / "tb", enabled=cfg.tensorboard and ctx.is_main)
    label = f"{vit_cfg.pe}" + (f", depth as {vit_cfg.depth_input}" if vit_cfg.modality == "rgbd" else "")
    if ckpt is not None:
        _log(f"resuming {run_dir} at epoch {start_epoch + 1}, step {start_step}", ctx, quiet)
    _log(f"ropekit train: {cfg.data} ({len(train_ds)} train / {len(test_ds)} test, {info.kind}), ViT-{cfg.model} "
         f"{n_params / 1e6:.2f}M params, pe={label}, {cfg.epochs} epochs, batch {cfg.batch_size}"
         f"{f' over {ctx.world_size} processes' if ctx.enabled else ''}, run folder {run_dir}", ctx, quiet)

    ddp_model: nn.Module = model
    if ctx.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    def save(epoch_done: int, step_in_epoch: int) -> None:
        rng_states = ctx.gather_objects(capture_rng())
        if not ctx.is_main:
            return
        atomic_save({
            "format": "ropekit-checkpoint", "version": 1, "model": model.state_dict(),
            "vit_config": vit_cfg.to_dict(), "train_config": cfg.to_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "epoch": epoch_done, "step_in_epoch": step_in_epoch,
            "global_step": global_step, "elapsed_time": elapsed_before + (time.time() - t_start),
            "rng": rng_states, "history": history, "partial": partial, "world_size": ctx.world_size,
        }, ckpt_path)

    from tqdm import tqdm

    interrupted = False
    show_bar = cfg.progress and ctx.is_main
    with _StopRequest(verbose=ctx.is_main and not quiet) as stop:
        for epoch in range(start_epoch, cfg.epochs):
            sampler.set_epoch(epoch)
            order = list(sampler)  # a function of (seed, epoch) only
            batches = [order[i:i + per_rank_bs] for i in range(0, len(order), per_rank_bs)]
            t_epoch = time.time() - partial.get("time", 0.0)
            model.train()
            bar = tqdm(total=len(batches), initial=start_step, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                       disable=not show_bar, leave=False, dynamic_ncols=True, file=sys.stderr)
            for step in range(start_step, len(batches)):
                x, y = fetch_batch(train_ds, batches[step])
                x = random_shift(x, cfg.augment_shift)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = ddp_model(x)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=cfg.label_smoothing)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip > 0:
                    nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                sched.step()
                global_step += 1
                n = y.shape[0]
                partial["loss_sum"] += loss.item() * n
                partial["correct"] += (logits.argmax(-1) == y).sum().item()
                partial["count"] += n
                bar.update(1)
                bar.set_postfix(loss=f"{partial['loss_sum'] / partial['count']:.4f}",
                                acc=f"{partial['correct'] / partial['count']:.3f}", refresh=False)
                wants_stop = bool(on_step(global_step)) if on_step is not None else False
                if ctx.any(stop.requested or wants_stop):
                    partial["time"] = time.time() - t_epoch
                    save(epoch, step + 1)
                    interrupted = True
                    break
            bar.close()
            if interrupted:
                break
            start_step = 0
            loss_sum, correct, count = ctx.all_reduce_sum([partial["loss_sum"], partial["correct"], partial["count"]])
            ev = evaluate(model, test_ds, batch_size=cfg.eval_batch_size, device=device, ctx=ctx)
            row = {"epoch": epoch + 1, "train_loss": loss_sum / max(count, 1), "train_acc": correct / max(count, 1),
                   "test_loss": ev["test_loss"], "test_acc": ev["test_acc"], "lr": opt.param_groups[0]["lr"],
                   "epoch_time": time.time() - t_epoch, "elapsed_time": elapsed_before + time.time() - t_start}
            history.append(row)
            partial = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0, "time": 0.0}
            save(epoch + 1, 0)
            if ctx.is_main:
                write_metrics_csv(run_dir / "metrics.csv", history)
                tb.log(row)
            _log(f"epoch {epoch + 1}/{cfg.epochs}  train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f}  "
                 f"test loss {row['test_loss']:.4f} acc {row['test_acc']:.4f}  ({row['epoch_time']:.1f}s)", ctx, quiet)
            if ctx.any(stop.requested):
                interrupted = epoch + 1 < cfg.epochs
                break
    tb.close()

    wall = elapsed_before + time.time() - t_start
    final = dict(history[-1]) if history else {}
    if ctx.is_main:
        if history:
            plot_curves(history, run_dir / "curves.png", title=f"{cfg.data} ViT-{cfg.model} pe={label}")
        summary = {"run_dir": str(run_dir), "data": cfg.data, "model": cfg.model, "pe": vit_cfg.pe,
                   "depth_input": vit_cfg.depth_input if vit_cfg.modality == "rgbd" else None,
                   "seed": cfg.seed, "epochs_done": len(history), "interrupted": interrupted,
                   "wall_time": wall, "num_params": n_params, "world_size": ctx.world_size,
                   **{k: final.get(k) for k in ("train_loss", "train_acc", "test_loss", "test_acc")}}
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    ctx.barrier()
    return TrainResult(run_dir=run_dir, history=history, interrupted=interrupted, wall_time=wall, model=model,
                       final=final, is_main=ctx.is_main)


def _info_dict(info: Any, n_train: int, n_test: int) -> Dict[str, Any]:
    d = dataclasses.asdict(info) if dataclasses.is_dataclass(info) else dict(vars(info))
    d.pop("class_names", None)
    d["num_train"], d["num_test"] = n_train, n_test
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

