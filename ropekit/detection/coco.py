"""COCO average precision of 2-D detections with pycocotools, with area ranges for small images and AP over
chosen subsets of the categories (e.g. the query classes seen and unseen in detection training).

:func:`coco_ap` builds the ground truth and the detections as COCO data sets in memory and runs pycocotools'
``COCOeval`` (bounding boxes, IoU 0.50:0.05:0.95, 101-point interpolated precision, at most ``max_dets``
detections per image).  It returns COCO's ``AP``, ``AP50``, ``AP75``, ``AP_small``, ``AP_medium``,
``AP_large`` and, for every named group of categories, the mean over that group's categories of their AP
(IoU 0.50:0.95; categories without ground truth are left out of the mean).

Area ranges.  COCO's small / medium / large split at 32² and 96² pixels² suits 640-pixel images; every object
of a 32- or 48-pixel image would be "small".  Here the split is at fractions of the image side ``S`` (the longer
side): small ``< (S / 6)²``, medium ``< (S / 3)²``, large above -- for ``S = 48``, 8² and 16² pixels² --
overridable with ``area_split``.  Areas are the boxes' areas (no masks).

Edge cases (documented, tested): no detection at all gives AP 0 wherever there is ground truth; an image without
objects takes part (its detections are false positives); a category or group without ground truth gives NaN;
boxes are clipped to the image by the caller (:func:`ropekit.detection.owl_task` clips the targets).
"""

from __future__ import annotations

import contextlib
import io
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .._optional import require

__all__ = ["COCO_METRICS", "default_area_split", "coco_ap"]

#: The keys of :func:`coco_ap` besides the groups, in COCOeval's ``stats`` order.
COCO_METRICS = ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large")


def default_area_split(image_size: Tuple[int, int]) -> Tuple[float, float]:
    """``(small_max, medium_max)`` in pixels² for images of ``(H, W)``: ``(S/6)²`` and ``(S/3)²``, ``S = max(H, W)``."""
    s = float(max(image_size))
    return (s / 6) ** 2, (s / 3) ** 2


def coco_ap(gt: Sequence[Mapping[str, np.ndarray]], dets: Sequence[Mapping[str, np.ndarray]], num_classes: int,
            image_size: Tuple[int, int], *, groups: Optional[Mapping[str, Sequence[int]]] = None,
            area_split: Optional[Tuple[float, float]] = None, max_dets: int = 100) -> Dict[str, float]:
    """COCO box AP of ``dets`` against ``gt`` (one entry per image, in the same order).

    Args:
        gt: per image ``{"boxes": (T, 4) xyxy pixels, "labels": (T,) in [0, num_classes)}`` (``T`` may be 0).
        dets: per image ``{"boxes": (D, 4) xyxy pixels, "labels": (D,), "scores": (D,)}`` (``D`` may be 0).
        num_classes: the categories ``0 .. num_classes - 1``.
        image_size: ``(H, W)`` of every image (for the area ranges).
        groups: name -> category ids; the result gets ``AP_<name>`` (mean per-category AP over the group).
        area_split: ``(small_max, medium_max)`` pixels² (default :func:`default_area_split`).
        max_dets: detections kept per image (the highest scores).

    Returns:
        ``{"AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large", "AP_<group>"..., "AP/<c>"...}`` in
        ``[0, 1]`` (NaN where there is no ground truth to score).

    Raises:
        ValueError: ``gt`` and ``dets`` of different lengths, a label outside ``[0, num_classes)``, a box that is
            not ``(n, 4)``.
    """
    coco_mod = require("pycocotools.coco", "studies", "COCO average precision")
    cocoeval_mod = require("pycocotools.cocoeval", "studies", "COCO average precision")
    if len(gt) != len(dets):
        raise ValueError(f"{len(gt)} ground-truth images but {len(dets)} detection images")
    H, W = image_size
    images, anns, results = [], [], []
    for i, (g, d) in enumerate(zip(gt, dets)):
        images.append({"id": i + 1, "height": int(H), "width": int(W)})
        gb, gl = _boxes(g["boxes"], "ground-truth"), np.asarray(g["labels"], int).reshape(-1)
        db, dl = _boxes(d["boxes"], "detection"), np.asarray(d["labels"], int).reshape(-1)
        ds = np.asarray(d["scores"], float).reshape(-1)
        for what, lab in (("ground-truth", gl), ("detection", dl)):
            if len(lab) and (lab.min() < 0 or lab.max() >= num_classes):
                raise ValueError(f"a {what} label is outside [0, {num_classes}) in image {i}")
        for b, c in zip(gb, gl):
            w, h = b[2] - b[0], b[3] - b[1]
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": int(c) + 1, "iscrowd": 0,
                         "bbox": [float(b[0]), float(b[1]), float(w), float(h)], "area": float(w * h)})
        for b, c, s in zip(db, dl, ds):
            results.append({"image_id": i + 1, "category_id": int(c) + 1, "score": float(s),
                            "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]})
    cats = [{"id": c + 1, "name": str(c)} for c in range(num_classes)]
    small, medium = area_split or default_area_split(image_size)
    nan = float("nan")
    out: Dict[str, float] = {k: nan for k in COCO_METRICS}
    groups = dict(groups or {})
    out.update({f"AP_{name}": nan for name in groups})
    out.update({f"AP/{c}": nan for c in range(num_classes)})
    if not anns:
        return out
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = coco_mod.COCO()
        coco_gt.dataset = {"images": images, "annotations": anns, "categories": cats}
        coco_gt.createIndex()
        if not results:  # pycocotools cannot load an empty result list: nothing detected scores 0
            return _no_detections(out, anns, groups, small, medium)
        coco_dt = coco_gt.loadRes(results)
        ev = cocoeval_mod.COCOeval(coco_gt, coco_dt, "bbox")
        ev.params.areaRng = [[0, 1e10], [0, small], [small, medium], [medium, 1e10]]
        ev.params.maxDets = [1, 10, int(max_dets)]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    stats = [nan if s < 0 else float(s) for s in ev.stats[:6]]
    out.update(dict(zip(COCO_METRICS, stats)))
    prec = ev.eval["precision"][:, :, :, 0, -1]  # (T IoUs, R recalls, K cats) at area "all", max_dets
    per_cat = []
    for k in range(num_classes):
        p = prec[:, :, k]
        per_cat.append(float(p[p > -1].mean()) if (p > -1).any() else nan)
        out[f"AP/{k}"] = per_cat[-1]
    for name, ids in groups.items():
        vals = [per_cat[c] for c in ids if not np.isnan(per_cat[c])]
        out[f"AP_{name}"] = float(np.mean(vals)) if vals else nan
    return out


def _boxes(b: np.ndarray, what: str) -> np.ndarray:
    b = np.asarray(b, float)
    if b.size == 0:
        return b.reshape(0, 4)
    if b.ndim != 2 or b.shape[1] != 4:
        raise ValueError(f"{what} boxes must be (n, 4) x0, y0, x1, y1; got shape {b.shape}")
    return b


def _no_detections(out: Dict[str, float], anns: List[Dict], groups: Mapping[str, Sequence[int]], small: float,
                   medium: float) -> Dict[str, float]:
    """The scores of an empty detection list: 0 wherever ground truth exists, NaN elsewhere."""
    areas = np.array([a["area"] for a in anns])
    present = {a["category_id"] - 1 for a in anns}
    out.update({"AP": 0.0, "AP50": 0.0, "AP75": 0.0})
    for key, sel in (("AP_small", areas < small), ("AP_medium", (areas >= small) & (areas < medium)),
                     ("AP_large", areas >= medium)):
        out[key] = 0.0 if sel.any() else float("nan")
    for c in present:
        out[f"AP/{c}"] = 0.0
    for name, ids in groups.items():
        out[f"AP_{name}"] = 0.0 if present & set(ids) else float("nan")
    return out
