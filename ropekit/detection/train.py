"""Training and evaluation of :class:`~ropekit.detection.model.Detector3D` on a :class:`SceneSet` (SPEC §6.8).

Shape legend: ``B`` images, ``M`` predictions (patch tokens) per image, ``T`` padded targets per image.

* Training: AdamW (no weight decay on norms, biases, encoding parameters and the depth lift), linear warm-up
  then cosine decay, gradient clipping, the Hungarian set loss :func:`~ropekit.detection.detection_loss`.
  Each training image contributes at most ``max_train_objects`` objects, drawn at random every time it is
  seen (SPEC §6.8); the remaining objects are simply absent from that step's targets.
* Evaluation uses every object: :class:`~ropekit.detection.DetectionEvaluator` (AP at 3-D IoU thresholds
  and the mean IoU of Hungarian-matched pairs; Monte Carlo IoU with ``iou_samples`` points per predicted box
  and a fixed generator seed).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from .boxes import rotation_from_6d
from .matching import DetectionEvaluator, DetectionLossConfig, detection_loss, hungarian_match
from .model import Detector3D
from .scenes import SceneDataset, SceneSet, collate_detection

__all__ = ["DetTrainConfig", "scene_batch", "mean_box", "build_optimizer", "train_detector", "evaluate_detector",
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
    max_train_objects: int = 4  # objects per training image sampled each step (SPEC §6.8); all at evaluation
    class_weight: float = 1.0
    box_weight: float = 5.0
    corner_weight: float = 5.0
    no_object_weight: float = 0.1
    eval_batch_size: int = 100
    iou_samples: int = 1024  # Monte Carlo points per predicted box in the metrics
    iou_thresholds: Tuple[float, ...] = (0.25, 0.5)
    log_every: int = 25
    seed: int = 0

    def loss_config(self, num_classes: int) -> DetectionLossConfig:
        return DetectionLossConfig(num_classes=num_classes, class_weight=self.class_weight,
                                   box_weight=self.box_weight, corner_weight=self.corner_weight,
                                   no_object_weight=self.no_object_weight)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["iou_thresholds"] = list(self.iou_thresholds)
        return d


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


def build_optimizer(model: nn.Module, cfg: DetTrainConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay for ``model.no_weight_decay()`` names and every parameter with < 2 dimensions."""
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
    return torch.optim.AdamW(groups, lr=cfg.lr)


def _lr_factor(cfg: DetTrainConfig) -> Callable[[int], float]:
    total, warm = max(1, cfg.steps), min(cfg.warmup_steps, max(0, cfg.steps - 1))
    floor = min(1.0, cfg.min_lr / cfg.lr)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        t = (step - warm) / max(1, total - warm)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))

    return factor


def train_detector(model: Detector3D, scenes: SceneSet, cfg: DetTrainConfig,
                   log: Optional[Callable[[Dict[str, float]], None]] = None) -> List[Dict[str, float]]:
    """Train ``model`` in place for ``cfg.steps`` steps on random batches of ``scenes``.

    Batches are drawn by epochs of a random permutation (seeded by ``cfg.seed``).  Returns one row per
    ``cfg.log_every`` steps (and the last step) with the mean losses since the previous row, the learning rate
    and the elapsed seconds; ``log`` is called with each row.
    """
    loss_cfg = cfg.loss_config(model.num_classes)
    opt = build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(cfg))
    rng = np.random.default_rng(cfg.seed)
    n = len(scenes)
    if n == 0:
        raise ValueError("no training scenes")
    order, pos = rng.permutation(n), 0
    rows: List[Dict[str, float]] = []
    acc: Dict[str, float] = {}
    count = 0
    t0 = time.perf_counter()
    model.train()
    for step in range(cfg.steps):
        idx = []
        while len(idx) < min(cfg.batch_size, n):
            if pos == n:
                order, pos = rng.permutation(n), 0
            take = min(cfg.batch_size - len(idx), n - pos)
            idx.extend(order[pos:pos + take].tolist())
            pos += take
        images, K, tg = scene_batch(scenes, idx, cfg.max_train_objects)
        out = model(images, K)
        losses = detection_loss(out["logits"], out["boxes"], tg["labels"], tg["boxes"], tg["mask"], loss_cfg)
        loss = losses["loss"]
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite detection loss at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        for k in ("loss", "loss_class", "loss_box", "loss_corners"):
            acc[k] = acc.get(k, 0.0) + float(losses[k].detach())
        count += 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            row = {"step": step + 1, **{k: v / count for k, v in acc.items()},
                   "lr": opt.param_groups[0]["lr"], "seconds": time.perf_counter() - t0}
            rows.append(row)
            if log is not None:
                log(row)
            acc, count = {}, 0
    model.eval()
    return rows


@torch.no_grad()
def predict(model: Detector3D, scenes: SceneSet, index: Sequence[int]) -> Dict[str, Tensor]:
    """Model outputs for scenes ``index``: ``{"logits": (B, M, C + 1), "boxes": (B, M, 12)}``."""
    model.eval()
    images, K, _ = scene_batch(scenes, index)
    return model(images, K)


@torch.no_grad()
def evaluate_detector(model: Detector3D, scenes: SceneSet, cfg: DetTrainConfig,
                      seed: int = 0) -> Dict[str, float]:
    """AP at ``cfg.iou_thresholds`` (``mAP@0.25``, ``mAP@0.5``, per class ``AP@t/<c>``), ``mean_iou`` of the
    Hungarian-matched pairs (every object of every scene; unmatched objects count 0) and the mean loss with all
    objects, over ``scenes``.  Monte Carlo IoU uses ``cfg.iou_samples`` points per predicted box."""
    model.eval()
    loss_cfg = cfg.loss_config(model.num_classes)
    ev = DetectionEvaluator(loss_cfg, cfg.iou_thresholds, num_samples=cfg.iou_samples, seed=seed)
    total, n_img = 0.0, 0
    for lo in range(0, len(scenes), cfg.eval_batch_size):
        idx = list(range(lo, min(lo + cfg.eval_batch_size, len(scenes))))
        images, K, tg = scene_batch(scenes, idx)
        out = model(images, K)
        losses = detection_loss(out["logits"], out["boxes"], tg["labels"], tg["boxes"], tg["mask"], loss_cfg)
        total += float(losses["loss"]) * len(idx)
        n_img += len(idx)
        ev.update(out["logits"], out["boxes"], tg["labels"], tg["boxes"], tg["mask"])
    metrics = ev.compute()
    metrics["loss"] = total / max(1, n_img)
    return metrics


@torch.no_grad()
def matched_errors(model: Detector3D, scenes: SceneSet, cfg: DetTrainConfig) -> Dict[str, float]:
    """Where the boxes go wrong: mean errors of the Hungarian-matched (prediction, object) pairs over ``scenes``.

    Returns ``lateral_err`` (metres, ``|(Δx, Δy)|`` of the centre), ``depth_err`` (metres, ``|Δz|``),
    ``size_err`` (metres, mean ``|Δs|`` over the three sides), ``rot_err_deg`` (geodesic angle between the
    rotations, degrees; symmetric shapes are compared in the generator's canonical heading), ``class_acc``
    (matched label correct) and, for scale, ``depth_err_const`` (the ``|Δz|`` of always answering the median
    object depth of ``scenes``).
    """
    model.eval()
    loss_cfg = cfg.loss_config(model.num_classes)
    pred, true, pl, tl = [], [], [], []
    for lo in range(0, len(scenes), cfg.eval_batch_size):
        idx = list(range(lo, min(lo + cfg.eval_batch_size, len(scenes))))
        images, K, tg = scene_batch(scenes, idx)
        out = model(images, K)
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
