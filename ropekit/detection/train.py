"""Training and evaluation of :class:`~ropekit.detection.model.Detector3D` on a :class:`SceneSet`.

Shape legend: ``B`` images, ``M`` predictions (patch tokens) per image, ``T`` padded targets per image.

* Training: the shared engine (:func:`ropekit.train.engine.fit`: AdamW without weight decay on norms, biases,
  encoding parameters and the depth lift, linear warm-up then cosine decay, gradient clipping, mixed precision,
  DDP, exact resume) with the Hungarian set loss :func:`~ropekit.detection.detection_loss`.
  Each training image contributes at most ``max_train_objects`` objects, drawn at random every time it is
  seen; the remaining objects are simply absent from that step's targets.
* Evaluation uses every object: :class:`~ropekit.detection.DetectionEvaluator` (AP at 3-D IoU thresholds
  and the mean IoU of Hungarian-matched pairs; Monte Carlo IoU with ``iou_samples`` points per predicted box
  and a fixed generator seed).
* The learning curve: with ``val_scenes > 0`` and held-out scenes given to :func:`train_detector`, every
  metrics row (each ``log_every`` steps) also holds ``val_mean_iou``, the mean IoU of the Hungarian-matched
  pairs on the first ``val_scenes`` of them (:func:`matched_mean_iou`).  It draws nothing from the global RNGs,
  so a run trains the same with or without it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from ..train import engine
from ..train.engine import seed_everything
from .boxes import box_iou_3d, rotation_from_6d
from .matching import DetectionEvaluator, DetectionLossConfig, detection_loss, hungarian_match
from .model import Detector3D, DetectorConfig, detector_config
from .scenes import SceneDataset, SceneSet, collate_detection

__all__ = ["DetTrainConfig", "DetectionTask", "DetectionTaskConfig", "build_detection_task", "new_detector", "load_scenes",
           "batch_indices", "scene_batch", "mean_box",
           "train_detector", "evaluate_detector", "matched_mean_iou",
           "matched_errors", "predict", "seed_everything"]

Batch = Tuple[Tensor, Tensor, Dict[str, Tensor]]


@dataclass
class DetTrainConfig:
    """Optimisation and evaluation settings of one detector run (saved with the run)."""

    steps: int = 300
    batch_size: int = 32
    lr: float = 1e-3
    min_lr: float = 1e-5
    weight_decay: float = 0.05
    warmup_steps: int = 30
    grad_clip: float = 1.0
    max_train_objects: int = 4  # objects per training image sampled each step; all at evaluation
    class_weight: float = 1.0
    box_weight: float = 5.0
    corner_weight: float = 5.0
    no_object_weight: float = 0.1
    eval_batch_size: int = 100
    iou_samples: int = 1024  # Monte Carlo points per predicted box in the metrics
    iou_thresholds: Tuple[float, ...] = (0.25, 0.5)
    log_every: int = 25
    val_scenes: int = 0  # held-out scenes of the learning curve (val_mean_iou at every log row; 0: none)
    seed: int = 0

    def loss_config(self, num_classes: int) -> DetectionLossConfig:
        return DetectionLossConfig(num_classes=num_classes, class_weight=self.class_weight,
                                   box_weight=self.box_weight, corner_weight=self.corner_weight,
                                   no_object_weight=self.no_object_weight)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["iou_thresholds"] = list(self.iou_thresholds)
        return d


def scene_batch(scenes: SceneSet, index: Sequence[int], max_targets: Optional[int] = None) -> Batch:
    """``(images (B, 4, H, W), K (B, 3, 3), {"boxes": (B, T, 12), "labels": (B, T), "mask": (B, T)})``.

    With ``max_targets``, at most that many objects per image, drawn with the global torch RNG.
    """
    ds = SceneDataset(scenes, max_targets=max_targets)
    images, targets = collate_detection([ds[int(i)] for i in index])
    K = torch.from_numpy(np.ascontiguousarray(scenes.K[np.asarray(index)])).float()  # (B, 3, 3)
    return images, K, targets


def mean_box(scenes: SceneSet) -> Tensor:
    """Mean 12-vector of the visible objects of ``scenes`` (the box head's initial output)."""
    boxes = scenes.boxes[scenes.valid]  # (N, 12)
    if len(boxes) == 0:
        return torch.tensor([0, 0, 1.0, 1, 0, 0, 0, 1, 0, 0.1, 0.1, 0.1])
    return torch.from_numpy(boxes.mean(0)).float()


def batch_indices(n: int, cfg: DetTrainConfig) -> List[List[int]]:
    """The scene indices of every training step: consecutive slices of random permutations of the ``n`` scenes
    (a new permutation whenever one is used up), seeded by ``cfg.seed``; ``min(batch_size, n)`` or a few more
    per step (a step that crosses into a new permutation takes up to ``batch_size`` from it)."""
    rng = np.random.default_rng(cfg.seed)
    order, pos = rng.permutation(n), 0
    out: List[List[int]] = []
    for _ in range(cfg.steps):
        idx: List[int] = []
        while len(idx) < min(cfg.batch_size, n):
            if pos == n:
                order, pos = rng.permutation(n), 0
            take = min(cfg.batch_size - len(idx), n - pos)
            idx.extend(order[pos:pos + take].tolist())
            pos += take
        out.append(idx)
    return out


class DetectionTask:
    """The Hungarian set loss of :class:`Detector3D` on a :class:`SceneSet`, for :func:`ropekit.train.engine.fit`.

    An epoch is ``cfg.log_every`` steps (one metrics row each). Under DDP each rank takes every ``world_size``-th
    scene of the step's global batch. The sampled training objects (``max_train_objects``) come from the global
    torch RNG, saved with every checkpoint.
    """

    name = "detect3d"
    find_unused_parameters = True  # (heads of absent inputs, e.g. the intrinsics conditioning, may get no gradient)

    def __init__(self, model: Detector3D, scenes: SceneSet, cfg: DetTrainConfig,
                 log: Optional[Callable[[Dict[str, float]], None]] = None,
                 val_scenes: Optional[SceneSet] = None) -> None:
        if len(scenes) == 0:
            raise ValueError("no training scenes")
        self.model, self.scenes, self.cfg, self.log = model, scenes, cfg, log
        self.val_index = list(range(min(cfg.val_scenes, len(val_scenes)))) if val_scenes is not None else []
        self.val_scenes = val_scenes
        self.loss_cfg = cfg.loss_config(model.num_classes)
        self.index = batch_indices(len(scenes), cfg)  # steps lists of B indices
        self.epochs = math.ceil(cfg.steps / cfg.log_every)

    def epoch_batches(self, epoch: int, ctx: Any) -> List[List[int]]:
        lo, hi = epoch * self.cfg.log_every, min((epoch + 1) * self.cfg.log_every, self.cfg.steps)
        return [self.index[s][ctx.rank::ctx.world_size] for s in range(lo, hi)]

    def loss(self, model: nn.Module, batch: List[int], device: torch.device) -> Tuple[Tensor, Dict[str, float]]:
        images, K, tg = scene_batch(self.scenes, batch, self.cfg.max_train_objects)
        images, K = images.to(device), K.to(device)
        tg = {k: v.to(device) for k, v in tg.items()}
        out = model(images, K)
        losses = detection_loss(out["logits"].float(), out["boxes"].float(), tg["labels"], tg["boxes"], tg["mask"],
                                self.loss_cfg)
        return losses["loss"], {k: losses[k].detach() for k in ("loss", "loss_class", "loss_box",
                                                                 "loss_corners")} | {"count": 1.0}

    def epoch_row(self, epoch: int, sums: Dict[str, float], info: Dict[str, Any], ctx: Any) -> Dict[str, float]:
        keys = ("loss", "loss_class", "loss_box", "loss_corners", "count")
        totals = dict(zip(keys, ctx.all_reduce_sum([sums.get(k, 0.0) for k in keys])))
        count = max(totals.pop("count"), 1.0)
        row = {"step": info["global_step"], **{k: v / count for k, v in totals.items()}, "lr": info["lr"],
               "seconds": info["elapsed"]}
        if self.val_index:
            was_training = self.model.training
            row["val_mean_iou"] = matched_mean_iou(self.model, self.val_scenes, self.cfg, self.val_index)
            self.model.train(was_training)
        if self.log is not None and ctx.is_main:
            self.log(row)
        return row

    def summary(self, history: List[Dict[str, Any]]) -> Dict[str, Any]:
        return {"steps": history[-1]["step"] if history else 0, "loss": history[-1]["loss"] if history else None}


@dataclass
class DetectionTaskConfig:
    """What builds a :class:`DetectionTask`: ``scenes``, the path of a scene file (the ``.npz`` of a
    :class:`SceneSet`'s ``arrays()``, as :func:`~ropekit.detection.generate_scenes` caches them), the detector and
    its training settings."""

    scenes: str
    detector: DetectorConfig = field(default_factory=detector_config)
    train: DetTrainConfig = field(default_factory=DetTrainConfig)


def load_scenes(path: Union[str, Path]) -> SceneSet:
    """The :class:`SceneSet` saved in the ``.npz`` file ``path`` (the arrays of :meth:`SceneSet.arrays`)."""
    with np.load(Path(path), allow_pickle=False) as z:
        return SceneSet.from_arrays({k: z[k] for k in z.files})


def build_detection_task(cfg: DetectionTaskConfig) -> DetectionTask:
    """The :class:`DetectionTask` of ``cfg``: its scenes loaded, its detector built (:func:`new_detector`)."""
    scenes = load_scenes(cfg.scenes)
    return DetectionTask(new_detector(cfg.detector, scenes, cfg.train.seed), scenes, cfg.train)


def new_detector(config: DetectorConfig, scenes: SceneSet, seed: int) -> Detector3D:
    """The untrained detector of ``config`` (seeded by ``seed``) with the box head starting at the mean box of
    ``scenes``."""
    seed_everything(seed)
    model = Detector3D(config.validate())
    model.init_box_prior(mean_box(scenes))
    return model


def train_detector(model: Detector3D, scenes: SceneSet, cfg: DetTrainConfig,
                   log: Optional[Callable[[Dict[str, float]], None]] = None, *,
                   out_dir: Optional[Union[str, Path]] = None, resume: bool = False,
                   options: Optional[engine.EngineOptions] = None,
                   val_scenes: Optional[SceneSet] = None) -> List[Dict[str, float]]:
    """Train ``model`` in place for ``cfg.steps`` steps on random batches of ``scenes``.

    Batches are drawn by epochs of a random permutation (seeded by ``cfg.seed``, :func:`batch_indices`).  Returns
    one row per ``cfg.log_every`` steps (and the last step) with the mean losses since the previous row, the
    learning rate and the elapsed seconds; ``log`` is called with each row. The loop is the shared engine
    (:func:`ropekit.train.engine.fit`), so the run can be distributed (``torchrun``), mixed-precision or compiled
    through ``options``, and, with ``out_dir``, checkpointed and resumed exactly (``resume=True``).

    Args:
        out_dir: run folder for ``checkpoint.pt``, ``config.json``, ``metrics.csv``, ``curves.png``.
        options: device (default CPU, and the model comes back on its original device), precision, compile...
        val_scenes: held-out scenes; with ``cfg.val_scenes > 0`` each row gets ``val_mean_iou`` on the first
            ``cfg.val_scenes`` of them (the learning curve).

    Raises:
        ValueError: no training scenes. NonFiniteLossError (a ``FloatingPointError``): the loss became NaN / Inf.
    """
    opts = options or engine.EngineOptions(device="cpu", progress=False, tensorboard=False)
    home = next(model.parameters()).device
    task = DetectionTask(model, scenes, cfg, log, val_scenes)
    schedule = engine.Schedule(lr=cfg.lr, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps, min_lr=cfg.min_lr,
                               weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
    config = {"train": cfg.to_dict(), "model": _model_config(model), "scenes": len(scenes)}
    res = engine.fit(task, engine.FitOptions(schedule, task.epochs, execution=opts, run_dir=out_dir, resume=resume,
                                             config_doc=config, checkpoint_extra={"det_train_config": cfg.to_dict()},
                                             quiet=True))
    model.to(home)
    model.eval()
    if res.interrupted:
        raise KeyboardInterrupt(f"detector training interrupted; checkpoint saved in {out_dir}")
    return res.history


def _model_config(model: nn.Module) -> Optional[Dict[str, Any]]:
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    to_dict = getattr(cfg, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return asdict(cfg) if cfg is not None and hasattr(cfg, "__dataclass_fields__") else None


@torch.no_grad()
def predict(model: Detector3D, scenes: SceneSet, index: Sequence[int]) -> Dict[str, Tensor]:
    """Model outputs for scenes ``index``: ``{"logits": (B, M, C + 1), "boxes": (B, M, 12)}`` (on the model's
    device)."""
    model.eval()
    device = next(model.parameters()).device
    images, K, _ = scene_batch(scenes, index)
    return model(images.to(device), K.to(device))


@torch.no_grad()
def evaluate_detector(model: Detector3D, scenes: SceneSet, cfg: DetTrainConfig,
                      seed: int = 0) -> Dict[str, float]:
    """AP at ``cfg.iou_thresholds`` (``mAP@0.25``, ``mAP@0.5``, per class ``AP@t/<c>``), ``mean_iou`` of the
    Hungarian-matched pairs (every object of every scene; unmatched objects count 0) and the mean loss with all
    objects, over ``scenes``.  Monte Carlo IoU uses ``cfg.iou_samples`` points per predicted box.  The model
    runs on its own device; the metrics are computed on the CPU."""
    model.eval()
    device = next(model.parameters()).device
    loss_cfg = cfg.loss_config(model.num_classes)
    ev = DetectionEvaluator(loss_cfg, cfg.iou_thresholds, num_samples=cfg.iou_samples, seed=seed)
    total, n_img = 0.0, 0
    for lo in range(0, len(scenes), cfg.eval_batch_size):
        idx = list(range(lo, min(lo + cfg.eval_batch_size, len(scenes))))
        images, K, tg = scene_batch(scenes, idx)
        out = {k: v.float().cpu() for k, v in model(images.to(device), K.to(device)).items()}
        losses = detection_loss(out["logits"], out["boxes"], tg["labels"], tg["boxes"], tg["mask"], loss_cfg)
        total += float(losses["loss"]) * len(idx)
        n_img += len(idx)
        ev.update(out["logits"], out["boxes"], tg["labels"], tg["boxes"], tg["mask"])
    metrics = ev.compute()
    metrics["loss"] = total / max(1, n_img)
    return metrics


@torch.no_grad()
def matched_mean_iou(model: Detector3D, scenes: SceneSet, cfg: DetTrainConfig, index: Sequence[int]) -> float:
    """Mean 3-D IoU of the Hungarian-matched pairs over scenes ``index`` (every object; an unmatched one counts
    0) -- the ``mean_iou`` of :func:`evaluate_detector` without the AP part, for the learning curve.

    Runs in eval mode on the model's device, in batches of ``cfg.eval_batch_size``; the Monte Carlo IoU
    (``cfg.iou_samples`` points per box) uses its own generator with seed 0, never the global RNGs.  Leaves the
    model in eval mode.
    """
    model.eval()
    device = next(model.parameters()).device
    loss_cfg = cfg.loss_config(model.num_classes)
    gen = torch.Generator().manual_seed(0)
    ious: List[float] = []
    for lo in range(0, len(index), cfg.eval_batch_size):
        idx = list(index[lo:lo + cfg.eval_batch_size])
        images, K, tg = scene_batch(scenes, idx)
        out = model(images.to(device), K.to(device))
        logits, boxes = out["logits"].float().cpu(), out["boxes"].float().cpu()
        for b, (src, tgt) in enumerate(hungarian_match(logits, boxes, tg["labels"], tg["boxes"], tg["mask"],
                                                       loss_cfg)):
            k_valid = int(tg["mask"][b].sum())
            if k_valid:
                iou = box_iou_3d(boxes[b, src], tg["boxes"][b, tgt], cfg.iou_samples, gen)  # (len(src),)
                ious.extend(iou.tolist() + [0.0] * (k_valid - len(src)))
    return float(np.mean(ious)) if ious else float("nan")


@torch.no_grad()
def matched_errors(model: Detector3D, scenes: SceneSet, cfg: DetTrainConfig) -> Dict[str, float]:
    """Where the boxes go wrong: mean errors of the Hungarian-matched (prediction, object) pairs over ``scenes``.

    Returns ``lateral_err`` (metres, ``|(Δx, Δy)|`` of the centre), ``depth_err`` (metres, ``|Δz|``),
    ``size_err`` (metres, mean ``|Δs|`` over the three sides), ``rot_err_deg`` (geodesic angle between the
    rotations, degrees; symmetric shapes are compared in the generator's canonical heading), ``class_acc``
    (matched label correct) and, for scale, ``depth_err_const`` (the ``|Δz|`` of always answering the median
    object depth of ``scenes``).  The model runs on its own device.
    """
    model.eval()
    device = next(model.parameters()).device
    loss_cfg = cfg.loss_config(model.num_classes)
    pred, true, pl, tl = [], [], [], []
    for lo in range(0, len(scenes), cfg.eval_batch_size):
        idx = list(range(lo, min(lo + cfg.eval_batch_size, len(scenes))))
        images, K, tg = scene_batch(scenes, idx)
        out = {k: v.float().cpu() for k, v in model(images.to(device), K.to(device)).items()}
        for b, (src, tgt) in enumerate(hungarian_match(out["logits"], out["boxes"], tg["labels"], tg["boxes"],
                                                       tg["mask"], loss_cfg)):
            pred.append(out["boxes"][b, src])
            true.append(tg["boxes"][b, tgt])
            pl.append(out["logits"][b, src, :-1].argmax(-1))
            tl.append(tg["labels"][b, tgt])
    if not pred:
        return {}
    p, t = torch.cat(pred).double(), torch.cat(true).double()  # (P, 12)
    rel = rotation_from_6d(p[:, 3:9]).transpose(-1, -2) @ rotation_from_6d(t[:, 3:9])  # (P, 3, 3)
    cos = ((rel.diagonal(dim1=-2, dim2=-1).sum(-1) - 1) / 2).clamp(-1, 1)
    z = t[:, 2]
    return {
        "lateral_err": float((p[:, :2] - t[:, :2]).norm(dim=-1).mean()),
        "depth_err": float((p[:, 2] - z).abs().mean()),
        "size_err": float((p[:, 9:] - t[:, 9:]).abs().mean()),
        "rot_err_deg": float(torch.rad2deg(torch.arccos(cos)).mean()),
        "class_acc": float((torch.cat(pl) == torch.cat(tl)).double().mean()),
        "depth_err_const": float((z - z.median()).abs().mean()),
    }
