"""COCO AP of 2-D detections (ropekit.detection.coco) on hand-built cases with known values.

COCO's AP is the mean, over the 10 IoU thresholds 0.50:0.95 and the 101 recall points 0:0.01:1, of the
interpolated precision (the best precision at any recall >= the point; 0 beyond the highest recall reached).
The expected values below are worked out from that definition by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("pycocotools")

from ropekit.detection.coco import coco_ap, default_area_split  # noqa: E402

SIZE = (48, 48)
A = np.array([[2.0, 2.0, 14.0, 14.0]])   # 144 px²: medium at 48 px (8² <= a < 16²)
B = np.array([[20.0, 20.0, 44.0, 44.0]])  # 576 px²: large
S = np.array([[30.0, 2.0, 34.0, 6.0]])    # 16 px²: small


def _gt(boxes, labels):
    return {"boxes": np.asarray(boxes, float).reshape(-1, 4), "labels": np.asarray(labels, int)}


def _det(boxes, labels, scores):
    return {"boxes": np.asarray(boxes, float).reshape(-1, 4), "labels": np.asarray(labels, int),
            "scores": np.asarray(scores, float)}


def test_perfect_detections_score_one():
    gt = [_gt(np.concatenate([A, B]), [0, 1]), _gt(S, [2])]
    dets = [_det(np.concatenate([A, B]), [0, 1], [0.9, 0.8]), _det(S, [2], [0.7])]
    m = coco_ap(gt, dets, 3, SIZE, groups={"seen": [0, 1], "unseen": [2]})
    for k in ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large", "AP_seen", "AP_unseen"):
        assert m[k] == pytest.approx(1.0), k


def test_a_missed_object_halves_recall():
    # two objects of one class, one found exactly: precision 1 up to recall 0.5, then 0 -> 51 of 101 points
    gt = [_gt(np.concatenate([A, B]), [0, 0])]
    m = coco_ap(gt, [_det(A, [0], [0.9])], 1, SIZE)
    assert m["AP"] == pytest.approx(51 / 101)
    assert m["AP_medium"] == pytest.approx(1.0)  # the found one is the medium one
    assert m["AP_large"] == pytest.approx(0.0)


def test_a_duplicate_is_a_false_positive():
    # scores: A (tp), A again (fp), B (tp): precision 1 to recall 0.5, then 2/3 up to recall 1
    gt = [_gt(np.concatenate([A, B]), [0, 0])]
    dets = [_det(np.concatenate([A, A, B]), [0, 0, 0], [0.9, 0.8, 0.7])]
    m = coco_ap(gt, dets, 1, SIZE)
    assert m["AP"] == pytest.approx((51 + 50 * 2 / 3) / 101)


def test_empty_predictions_score_zero_and_empty_ground_truth_is_nan():
    gt = [_gt(A, [0]), _gt(np.zeros((0, 4)), [])]
    m = coco_ap(gt, [_det(np.zeros((0, 4)), [], []), _det(np.zeros((0, 4)), [], [])], 2, SIZE,
                groups={"seen": [0], "unseen": [1]})
    assert m["AP"] == 0.0 and m["AP50"] == 0.0 and m["AP_medium"] == 0.0
    assert math.isnan(m["AP_large"]) and math.isnan(m["AP_unseen"]) and m["AP_seen"] == 0.0
    m = coco_ap([_gt(np.zeros((0, 4)), [])], [_det(A, [0], [0.5])], 1, SIZE)
    assert math.isnan(m["AP"])


def test_an_image_without_objects_contributes_false_positives():
    # image 1: the object found (score 0.5); image 2: no object, a detection with score 0.9 -> precision 1/2
    gt = [_gt(A, [0]), _gt(np.zeros((0, 4)), [])]
    dets = [_det(A, [0], [0.5]), _det(B, [0], [0.9])]
    m = coco_ap(gt, dets, 1, SIZE)
    assert m["AP"] == pytest.approx(0.5)


def test_groups_average_their_categories():
    # class 0 perfect, class 1 half found: seen = class 0, unseen = class 1
    gt = [_gt(np.concatenate([A, B, S]), [0, 1, 1])]
    m = coco_ap(gt, [_det(np.concatenate([A, B]), [0, 1], [0.9, 0.8])], 2, SIZE,
                groups={"seen": [0], "unseen": [1], "all": [0, 1]})
    assert m["AP_seen"] == pytest.approx(1.0)
    assert m["AP_unseen"] == pytest.approx(51 / 101)
    assert m["AP_all"] == pytest.approx((1 + 51 / 101) / 2) == pytest.approx(m["AP"])


def test_area_split_and_bad_input():
    assert default_area_split((48, 32)) == (64.0, 256.0)
    with pytest.raises(ValueError, match="outside"):
        coco_ap([_gt(A, [3])], [_det(A, [0], [1.0])], 2, SIZE)
    with pytest.raises(ValueError, match=r"\(n, 4\)"):
        coco_ap([_gt(A, [0])], [{"boxes": np.ones((1, 3)), "labels": [0], "scores": [1.0]}], 2, SIZE)
    with pytest.raises(ValueError, match="ground-truth images"):
        coco_ap([_gt(A, [0])], [], 2, SIZE)
