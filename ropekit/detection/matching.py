"""Hungarian matching, the set-prediction detection loss and the 3-D detection metrics.

A detector emits ``Q`` predictions per image: class logits over ``C + 1`` classes (the last index ``C`` is
"no object") and a box 12-vector (:mod:`ropekit.detection.boxes`).  Targets are padded to ``M`` objects
per image with a boolean mask.

Shape legend: ``B`` images, ``Q`` predictions per image, ``M`` padded targets per image, ``C`` object
classes (logits have ``C + 1`` entries), ``P`` matched pairs in the batch.

Cost and loss (weights in :class:`DetectionLossConfig`, DETR-style):

* matching cost ``= w_cls · (−p_q(c_m)) + w_box · mean_12 |b_q − b_m| + w_corner · mean_24 |corners_q −
  corners_m|`` (the L1 terms are means over the 12 entries and over the 8×3 corner coordinates);
* loss ``= w_cls · CE + w_box · L1_box + w_corner · L1_corners``: the cross entropy runs over all valid
  predictions, matched ones against their target's class and the rest against "no object" (class weight
  ``no_object_weight``, weighted mean); the L1 terms sum over matched pairs and are divided by the number of
  targets in the batch (at least 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment

from .boxes import box12_to_corners, box_iou_3d, box_iou_3d_pairwise

__all__ = [
    "DetectionLossConfig",
    "linear_assignment",
    "match_cost",
    "batch_match_cost",
    "hungarian_match",
    "detection_loss",
    "postprocess",
    "average_precision",
    "DetectionEvaluator",
]

Indices = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DetectionLossConfig:
    """Weights shared by the matching cost and the loss."""

    num_classes: int
    class_weight: float = 1.0
    box_weight: float = 5.0
    corner_weight: float = 5.0
    no_object_weight: float = 0.1  # relative weight of the "no object" class in the cross entropy


def linear_assignment(cost: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum-cost assignment of a ``(Q, M)`` cost matrix (``min(Q, M)`` pairs, scipy's Hungarian solver).

    Returns:
        ``(rows, cols)`` int64 tensors of equal length, sorted by row.
    """
    c = cost.detach().cpu().double().numpy() if isinstance(cost, torch.Tensor) else np.asarray(cost, float)
    c = np.nan_to_num(c, nan=1e9, posinf=1e9, neginf=-1e9)
    rows, cols = linear_sum_assignment(c)
    return torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(cols, dtype=torch.long)


def match_cost(
    logits: torch.Tensor,
    boxes: torch.Tensor,
    tgt_labels: torch.Tensor,
    tgt_boxes: torch.Tensor,
    config: DetectionLossConfig,
) -> torch.Tensor:
    """Matching cost of one image.

    Args:
        logits: ``(Q, C + 1)``.
        boxes: ``(Q, 12)``.
        tgt_labels: ``(K,)`` in ``[0, C)``.
        tgt_boxes: ``(K, 12)``.
        config: weights.

    Returns:
        ``(Q, K)`` cost.
    """
    return batch_match_cost(logits[None], boxes[None], tgt_labels[None], tgt_boxes[None], config)[0]


def batch_match_cost(logits: torch.Tensor, boxes: torch.Tensor, tgt_labels: torch.Tensor, tgt_boxes: torch.Tensor,
                     config: DetectionLossConfig) -> torch.Tensor:
    """:func:`match_cost` of a whole batch at once (padding targets get finite, meaningless costs).

    Args:
        logits: ``(B, Q, C + 1)``; boxes: ``(B, Q, 12)``; tgt_labels: ``(B, M)`` (padding may be negative);
        tgt_boxes: ``(B, M, 12)``.

    Returns:
        ``(B, Q, M)`` cost, on the inputs' device.
    """
    prob = logits.float().softmax(-1)  # (B, Q, C + 1)
    labels = tgt_labels.long().clamp_min(0)  # (B, M)
    cost_cls = -torch.gather(prob, 2, labels[:, None, :].expand(-1, prob.shape[1], -1))  # (B, Q, M)
    cost_box = torch.cdist(boxes.float(), tgt_boxes.float(), p=1) / 12  # (B, Q, M)
    pc = box12_to_corners(boxes.float()).flatten(-2)  # (B, Q, 24)
    tc = box12_to_corners(tgt_boxes.float()).flatten(-2)  # (B, M, 24)
    cost_corner = torch.cdist(pc, tc, p=1) / 24  # (B, Q, M)
    return config.class_weight * cost_cls + config.box_weight * cost_box + config.corner_weight * cost_corner


@torch.no_grad()
def hungarian_match(
    pred_logits: torch.Tensor,
    pred_boxes: torch.Tensor,
    tgt_labels: torch.Tensor,
    tgt_boxes: torch.Tensor,
    tgt_mask: torch.Tensor,
    config: DetectionLossConfig,
    pred_mask: Optional[torch.Tensor] = None,
) -> Indices:
    """Optimal one-to-one matching per image.

    The costs of the whole batch are computed in one pass on the inputs' device (:func:`batch_match_cost`) and
    copied to the CPU once; only the assignment itself runs per image.

    Args:
        pred_logits: ``(B, Q, C + 1)``.
        pred_boxes: ``(B, Q, 12)``.
        tgt_labels: ``(B, M)``.
        tgt_boxes: ``(B, M, 12)``.
        tgt_mask: ``(B, M)`` bool, True for real targets.
        config: cost weights.
        pred_mask: optional ``(B, Q)`` bool, True for predictions that may be matched.

    Returns:
        per image ``(pred_idx, tgt_idx)``: int64 tensors (on CPU) indexing ``Q`` and the padded ``M``.
    """
    cost = batch_match_cost(pred_logits, pred_boxes, tgt_labels, tgt_boxes, config).cpu()  # (B, Q, M)
    tmask = tgt_mask.bool().cpu()
    pmask = pred_mask.bool().cpu() if pred_mask is not None else None
    out: Indices = []
    for b in range(cost.shape[0]):
        t_idx = torch.nonzero(tmask[b], as_tuple=False).flatten()  # (K,)
        q_idx = (torch.nonzero(pmask[b], as_tuple=False).flatten() if pmask is not None
                 else torch.arange(cost.shape[1]))
        if len(t_idx) == 0 or len(q_idx) == 0:
            out.append((torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)))
            continue
        rows, cols = linear_assignment(cost[b][q_idx][:, t_idx])  # (Q', K) block of real pairs
        out.append((q_idx[rows], t_idx[cols]))
    return out


def detection_loss(
    pred_logits: torch.Tensor,
    pred_boxes: torch.Tensor,
    tgt_labels: torch.Tensor,
    tgt_boxes: torch.Tensor,
    tgt_mask: torch.Tensor,
    config: DetectionLossConfig,
    pred_mask: Optional[torch.Tensor] = None,
    indices: Optional[Indices] = None,
) -> dict[str, torch.Tensor | Indices]:
    """Set-prediction loss (Hungarian-matched class + L1 box + L1 corner terms).

    Args:
        pred_logits: ``(B, Q, C + 1)``, last class = "no object".
        pred_boxes: ``(B, Q, 12)``.
        tgt_labels: ``(B, M)`` (padding entries ignored).
        tgt_boxes: ``(B, M, 12)``.
        tgt_mask: ``(B, M)`` bool.
        config: weights.
        pred_mask: optional ``(B, Q)`` bool; masked-out predictions take no part in matching or loss.
        indices: a precomputed matching (from :func:`hungarian_match`); computed if ``None``.

    Returns:
        ``{"loss", "loss_class", "loss_box", "loss_corners"}`` scalar tensors and ``"indices"``.
    """
    bsz, q, c1 = pred_logits.shape
    if c1 != config.num_classes + 1:
        raise ValueError(f"logits have {c1} classes, expected num_classes + 1 = {config.num_classes + 1}")
    if indices is None:
        indices = hungarian_match(pred_logits, pred_boxes, tgt_labels, tgt_boxes, tgt_mask, config, pred_mask)
    dev = pred_logits.device
    batch_idx = torch.cat([torch.full_like(p, b) for b, (p, _) in enumerate(indices)]).to(dev)  # (P,)
    src_idx = torch.cat([p for p, _ in indices]).to(dev)  # (P,)
    tgt_idx = torch.cat([t for _, t in indices]).to(dev)  # (P,)

    target_cls = torch.full((bsz, q), config.num_classes, dtype=torch.long, device=dev)  # (B, Q)
    target_cls[batch_idx, src_idx] = tgt_labels[batch_idx, tgt_idx].long()
    if pred_mask is not None:
        target_cls = target_cls.masked_fill(~pred_mask, -100)
    weight = torch.ones(c1, device=dev)
    weight[config.num_classes] = config.no_object_weight
    loss_class = F.cross_entropy(pred_logits.float().flatten(0, 1), target_cls.flatten(), weight=weight,
                                 ignore_index=-100)

    num_targets = tgt_mask.sum().clamp_min(1).float()
    pb = pred_boxes[batch_idx, src_idx].float()  # (P, 12)
    tb = tgt_boxes[batch_idx, tgt_idx].float()  # (P, 12)
    loss_box = (pb - tb).abs().sum() / (12 * num_targets)
    loss_corners = (box12_to_corners(pb) - box12_to_corners(tb)).abs().sum() / (24 * num_targets)
    loss = config.class_weight * loss_class + config.box_weight * loss_box + config.corner_weight * loss_corners
    return {"loss": loss, "loss_class": loss_class, "loss_box": loss_box, "loss_corners": loss_corners,
            "indices": indices}


def postprocess(pred_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and labels from ``(..., C + 1)`` logits: the most probable real class and its probability.

    Returns:
        ``scores (...)`` float, ``labels (...)`` int64 in ``[0, C)``.
    """
    prob = pred_logits.float().softmax(-1)[..., :-1]  # (..., C)
    scores, labels = prob.max(-1)
    return scores, labels


def average_precision(scores: np.ndarray, true_positive: np.ndarray, num_gt: int) -> float:
    """All-point interpolated average precision (area under the monotone precision–recall curve).

    Args:
        scores: ``(D,)`` detection scores.
        true_positive: ``(D,)`` bool, whether each detection matched a ground truth.
        num_gt: number of ground-truth objects (NaN is returned when 0).

    Returns:
        AP in [0, 1].
    """
    if num_gt == 0:
        return float("nan")
    order = np.argsort(-np.asarray(scores, float), kind="stable")
    tp = np.asarray(true_positive, bool)[order].astype(float)
    if len(tp) == 0:
        return 0.0
    ctp, cfp = np.cumsum(tp), np.cumsum(1 - tp)
    recall = ctp / num_gt
    precision = ctp / np.maximum(ctp + cfp, 1e-12)
    mrec = np.concatenate([[0.0], recall, [1.0]])
    mpre = np.concatenate([[0.0], precision, [0.0]])
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]  # precision envelope
    step = np.flatnonzero(mrec[1:] != mrec[:-1])
    return float(np.sum((mrec[step + 1] - mrec[step]) * mpre[step + 1]))


class DetectionEvaluator:
    """Accumulates AP at 3-D IoU thresholds and the mean IoU of Hungarian-matched pairs over a data set.

    Per image, every valid prediction is a detection with the score and label of :func:`postprocess`;
    detections are matched greedily in score order to unmatched ground truth of the same class with the
    highest 3-D IoU, a true positive if that IoU ≥ the threshold.  AP per class is :func:`average_precision`;
    ``mAP@t`` averages over classes that have ground truth.  ``mean_iou`` is the IoU between each target and
    the prediction the Hungarian matching assigns to it (unmatched targets count as 0).  IoUs are Monte
    Carlo estimates with ``num_samples`` points per predicted box from a generator seeded with ``seed``.

    Args:
        config: loss config (number of classes, matching weights).
        iou_thresholds: e.g. ``(0.25, 0.5)``.
        num_samples: Monte Carlo points per predicted box.
        seed: seed of the sampling generator.
    """

    def __init__(
        self,
        config: DetectionLossConfig,
        iou_thresholds: Sequence[float] = (0.25, 0.5),
        num_samples: int = 4096,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.iou_thresholds = tuple(float(t) for t in iou_thresholds)
        self.num_samples = num_samples
        self.generator = torch.Generator().manual_seed(seed)
        self.reset()

    def reset(self) -> None:
        c = self.config.num_classes
        self._scores: list[list[float]] = [[] for _ in range(c)]
        self._tp: dict[float, list[list[bool]]] = {t: [[] for _ in range(c)] for t in self.iou_thresholds}
        self._num_gt = np.zeros(c, dtype=np.int64)
        self._matched_iou: list[float] = []

    @torch.no_grad()
    def update(
        self,
        pred_logits: torch.Tensor,
        pred_boxes: torch.Tensor,
        tgt_labels: torch.Tensor,
        tgt_boxes: torch.Tensor,
        tgt_mask: torch.Tensor,
        pred_mask: Optional[torch.Tensor] = None,
    ) -> None:
        """Add a batch (shapes as in :func:`detection_loss`)."""
        pred_logits, pred_boxes = pred_logits.detach().cpu().float(), pred_boxes.detach().cpu().float()
        tgt_labels, tgt_boxes, tgt_mask = tgt_labels.cpu().long(), tgt_boxes.cpu().float(), tgt_mask.cpu().bool()
        pm = pred_mask.cpu().bool() if pred_mask is not None else None
        indices = hungarian_match(pred_logits, pred_boxes, tgt_labels, tgt_boxes, tgt_mask, self.config, pm)
        scores, labels = postprocess(pred_logits)  # (B, Q)
        for b, (src, tgt) in enumerate(indices):
            k_valid = int(tgt_mask[b].sum())
            if k_valid:
                ious = box_iou_3d(pred_boxes[b, src], tgt_boxes[b, tgt], self.num_samples, self.generator)
                self._matched_iou.extend(ious.tolist() + [0.0] * (k_valid - len(src)))
            q_sel = torch.nonzero(pm[b]).flatten() if pm is not None else torch.arange(pred_logits.shape[1])
            t_sel = torch.nonzero(tgt_mask[b]).flatten()
            gl = tgt_labels[b, t_sel].numpy()
            np.add.at(self._num_gt, gl, 1)
            if len(q_sel) == 0:
                continue
            iou = box_iou_3d_pairwise(pred_boxes[b, q_sel], tgt_boxes[b, t_sel], self.num_samples,
                                      self.generator).numpy()  # (Q', K)
            sc, lb = scores[b, q_sel].numpy(), labels[b, q_sel].numpy()
            order = np.argsort(-sc, kind="stable")
            for t in self.iou_thresholds:
                used = np.zeros(len(t_sel), bool)
                for i in order:
                    cand = np.flatnonzero((gl == lb[i]) & ~used)
                    hit = False
                    if len(cand):
                        j = cand[np.argmax(iou[i, cand])]
                        if iou[i, j] >= t:
                            used[j], hit = True, True
                    self._tp[t][lb[i]].append(hit)
            for i in order:
                self._scores[lb[i]].append(float(sc[i]))

    def compute(self) -> dict[str, float]:
        """``{"mAP@t": ..., "AP@t/<class index>": ..., "mean_iou": ..., "num_targets": ...}``."""
        out: dict[str, float] = {}
        for t in self.iou_thresholds:
            aps = []
            for c in range(self.config.num_classes):
                ap = average_precision(np.array(self._scores[c]), np.array(self._tp[t][c], bool),
                                       int(self._num_gt[c]))
                out[f"AP@{t:g}/{c}"] = ap
                if not np.isnan(ap):
                    aps.append(ap)
            out[f"mAP@{t:g}"] = float(np.mean(aps)) if aps else float("nan")
        out["mean_iou"] = float(np.mean(self._matched_iou)) if self._matched_iou else float("nan")
        out["num_targets"] = float(self._num_gt.sum())
        return out
