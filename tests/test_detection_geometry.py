"""Box geometry, Monte Carlo 3-D IoU, Hungarian matching, detection loss and metrics of the 3-D detection study.

Monte Carlo tolerance: IoU tests use S = 20 000 points per box and a fixed generator seed.  The inside
fraction f has standard error sqrt(f(1 − f)/S) ≤ 0.0035 and dIoU/df ≤ 1 for the cases below, so
``MC_TOL = 0.015`` is more than 4 standard errors; exact cases (f ∈ {0, 1}) are checked to 1e-6.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from ropekit.detection.boxes import (
    CORNER_SIGNS,
    box12_from_parts,
    box12_to_corners,
    box_iou_3d,
    box_iou_3d_pairwise,
    box_volume,
    corners_to_box12,
    rotation_from_6d,
)
from ropekit.detection.matching import (
    DetectionEvaluator,
    DetectionLossConfig,
    average_precision,
    batch_match_cost,
    detection_loss,
    hungarian_match,
    linear_assignment,
    match_cost,
)

S = 20_000
MC_TOL = 0.015


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rz(angle: float) -> torch.Tensor:
    c, s = math.cos(angle), math.sin(angle)
    return torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)


def _box(center=(0.0, 0.0, 0.0), size=(1.0, 1.0, 1.0), rot=None) -> torch.Tensor:
    rot = torch.eye(3, dtype=torch.float64) if rot is None else rot
    return box12_from_parts(torch.tensor(center, dtype=torch.float64), rot, torch.tensor(size, dtype=torch.float64))


def _random_boxes(n: int, seed: int = 0) -> torch.Tensor:
    g = _gen(seed)
    b = torch.randn(n, 12, generator=g, dtype=torch.float64)
    b[:, 9:] = b[:, 9:].abs() + 0.1
    return b


# ----------------------------------------------------------------------------------- corners and rotations


def test_rotation_from_6d_is_proper_rotation():
    r = rotation_from_6d(torch.randn(50, 6, generator=_gen(), dtype=torch.float64))
    eye = torch.eye(3, dtype=torch.float64).expand(50, 3, 3)
    assert torch.allclose(r.transpose(-1, -2) @ r, eye, atol=1e-12)
    assert torch.allclose(torch.linalg.det(r), torch.ones(50, dtype=torch.float64), atol=1e-12)


def test_corner_order_matches_documented_table():
    b = _box(center=(1.0, 2.0, 3.0), size=(2.0, 4.0, 6.0))
    expected = torch.tensor([1.0, 2.0, 3.0]) + CORNER_SIGNS * torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(box12_to_corners(b).float(), expected)
    # bottom face first (z = 0), counter-clockwise from +z; corner k + 4 above corner k
    c = box12_to_corners(b)
    assert torch.all(c[:4, 2] == 0.0) and torch.all(c[4:, 2] == 6.0)
    assert torch.allclose(c[4:, :2], c[:4, :2])


def test_box_round_trip():
    b = _random_boxes(64)
    c = box12_to_corners(b)  # (64, 8, 3)
    b2 = corners_to_box12(c)
    assert torch.allclose(box12_to_corners(b2), c, atol=1e-10)
    # centre and size are recovered exactly; rotation columns come back orthonormalised
    assert torch.allclose(b2[:, :3], b[:, :3], atol=1e-10)
    assert torch.allclose(b2[:, 9:], b[:, 9:], atol=1e-10)
    r = rotation_from_6d(b[:, 3:9])
    assert torch.allclose(b2[:, 3:9], torch.cat([r[..., 0], r[..., 1]], -1), atol=1e-10)
    # second round trip is the identity on the canonical form
    assert torch.allclose(corners_to_box12(box12_to_corners(b2)), b2, atol=1e-10)


def test_corners_differentiable():
    b = _random_boxes(4).requires_grad_(True)
    box12_to_corners(b).square().sum().backward()
    assert torch.isfinite(b.grad).all() and b.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------- Monte Carlo IoU


def test_iou_identical_and_disjoint():
    b = _random_boxes(8)
    assert torch.allclose(box_iou_3d(b, b, S, _gen()), torch.ones(8, dtype=torch.float64), atol=1e-6)
    far = b.clone()
    far[:, :3] += 100.0
    assert torch.all(box_iou_3d(b, far, S, _gen()) == 0.0)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_iou_half_shift_is_one_third(axis):
    center = [0.0, 0.0, 0.0]
    center[axis] = 0.5
    iou = box_iou_3d(_box(center), _box(), S, _gen(axis)).item()
    assert abs(iou - 1.0 / 3.0) < MC_TOL


def test_iou_half_shift_invariant_to_rigid_motion():
    # a non-cubic box shifted by half its length along its own x axis, the pair turned and moved
    rot = rotation_from_6d(torch.tensor([0.3, -0.2, 0.9, 0.5, 0.8, 0.1], dtype=torch.float64))
    t = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    size = (0.6, 0.3, 0.2)
    a = _box(tuple(t.tolist()), size, rot)
    b = _box(tuple((t + rot[:, 0] * 0.3).tolist()), size, rot)
    assert abs(box_iou_3d(b, a, S, _gen()).item() - 1.0 / 3.0) < MC_TOL


def test_iou_nested_is_volume_ratio():
    big, small = _box(size=(2.0, 1.0, 1.5)), _box(center=(0.3, 0.1, -0.2), size=(0.5, 0.4, 0.6))
    ratio = (box_volume(small) / box_volume(big)).item()
    # points sampled in the small box are all inside the big one: exact
    assert abs(box_iou_3d(small, big, S, _gen()).item() - ratio) < 1e-6
    assert abs(box_iou_3d(big, small, S, _gen()).item() - ratio) < MC_TOL


def test_iou_cube_rotated_90_is_one():
    assert abs(box_iou_3d(_box(rot=_rz(math.pi / 2)), _box(), S, _gen()).item() - 1.0) < 1e-6


def test_iou_cube_rotated_45_octagon():
    # Cross-section: a square of side a and its 45° turn intersect in a regular octagon with apothem a/2,
    # area 8 (a/2)^2 tan(π/8) = 2(√2 − 1) a^2; the heights agree, so IoU = A / (2a^2 − A) = 1/√2.
    octagon = 8 * 0.25 * math.tan(math.pi / 8)
    expected = octagon / (2 - octagon)
    assert abs(expected - 1 / math.sqrt(2)) < 1e-12
    iou = box_iou_3d(_box(rot=_rz(math.pi / 4)), _box(), S, _gen()).item()
    assert abs(iou - expected) < MC_TOL


def test_iou_pairwise_matches_elementwise():
    a, b = _random_boxes(5, seed=1) * 0.3, _random_boxes(3, seed=2) * 0.3
    a[:, 9:], b[:, 9:] = a[:, 9:].abs() + 0.3, b[:, 9:].abs() + 0.3
    pw = box_iou_3d_pairwise(a, b, S, _gen())
    assert pw.shape == (5, 3)
    ew = box_iou_3d(a[:, None], b[None, :], S, _gen(1))
    assert ew.shape == (5, 3)
    assert torch.allclose(pw, ew, atol=MC_TOL)
    assert box_iou_3d_pairwise(a, b[:0]).shape == (5, 0)


def test_iou_reproducible_with_generator():
    a, b = _random_boxes(4, 3), _random_boxes(4, 4)
    assert torch.equal(box_iou_3d(a, b, 512, _gen(7)), box_iou_3d(a, b, 512, _gen(7)))


# ----------------------------------------------------------------------------------- matching and loss


def test_linear_assignment_optimal_where_greedy_fails():
    cost = torch.tensor([[1.0, 2.0, 9.0], [1.5, 8.0, 9.0], [4.0, 3.0, 2.5]])
    rows, cols = linear_assignment(cost)
    best = min(itertools.permutations(range(3)), key=lambda p: sum(cost[i, p[i]] for i in range(3)))
    assert rows.tolist() == [0, 1, 2] and cols.tolist() == list(best) == [1, 0, 2]
    # rectangular: 2 targets, 3 predictions
    rows, cols = linear_assignment(cost[:, :2])
    assert sorted(zip(rows.tolist(), cols.tolist())) == [(0, 1), (1, 0)]


def _targets(bsz=2, m=4, num_classes=3, seed=0):
    g = _gen(seed)
    boxes = torch.randn(bsz, m, 12, generator=g)
    boxes[..., 9:] = boxes[..., 9:].abs() + 0.2
    labels = torch.randint(0, num_classes, (bsz, m), generator=g)
    mask = torch.ones(bsz, m, dtype=torch.bool)
    mask[1, 2:] = False  # second image has 2 targets
    labels[~mask] = -1
    return boxes, labels, mask


def test_hungarian_recovers_permutation_with_padding():
    cfg = DetectionLossConfig(num_classes=3)
    boxes, labels, mask = _targets()
    q = 6
    perm = [torch.tensor([4, 0, 5, 2]), torch.tensor([3, 1])]
    pred_boxes = torch.randn(2, q, 12, generator=_gen(1)) * 5 + 20  # far from every target
    pred_logits = torch.zeros(2, q, 4)
    for b in range(2):
        k = int(mask[b].sum())
        pred_boxes[b, perm[b]] = boxes[b, :k] + 0.01
        pred_logits[b, perm[b], labels[b, :k]] = 5.0
    idx = hungarian_match(pred_logits, pred_boxes, labels, boxes, mask, cfg)
    for b in range(2):
        src, tgt = idx[b]
        assert dict(zip(tgt.tolist(), src.tolist())) == {j: int(perm[b][j]) for j in range(int(mask[b].sum()))}
    # masked-out predictions are never matched
    pred_mask = torch.ones(2, q, dtype=torch.bool)
    pred_mask[0, 4] = False
    src, _ = hungarian_match(pred_logits, pred_boxes, labels, boxes, mask, cfg, pred_mask)[0]
    assert 4 not in src.tolist() and len(src) == 4


def test_batched_matching_equals_the_per_image_costs():
    """The batch's costs in one pass are match_cost's per image (padding ignored), and give the same matching as
    assigning each image's own cost matrix."""
    g = _gen(3)
    cfg = DetectionLossConfig(num_classes=3, class_weight=2.0, box_weight=5.0, corner_weight=3.0)
    b, q, m = 4, 7, 5
    logits, boxes = torch.randn(b, q, 4, generator=g), torch.randn(b, q, 12, generator=g)
    tgt_boxes, labels = torch.randn(b, m, 12, generator=g), torch.randint(0, 3, (b, m), generator=g)
    mask = torch.rand(b, m, generator=g) < 0.6
    mask[0] = False  # an image without targets
    labels[~mask] = -1
    pred_mask = torch.rand(b, q, generator=g) < 0.8
    cost = batch_match_cost(logits, boxes, labels, tgt_boxes, cfg)  # (B, Q, M)
    got = hungarian_match(logits, boxes, labels, tgt_boxes, mask, cfg, pred_mask)
    for i in range(b):
        t_idx, q_idx = torch.nonzero(mask[i]).flatten(), torch.nonzero(pred_mask[i]).flatten()
        ref = match_cost(logits[i, q_idx], boxes[i, q_idx], labels[i, t_idx], tgt_boxes[i, t_idx], cfg)
        assert torch.allclose(cost[i][q_idx][:, t_idx], ref, atol=1e-6)
        # and both are the DETR cost written out: class probability, L1 of the 12-vectors and of the corners
        p = logits[i, q_idx].softmax(-1)[:, labels[i, t_idx]]
        l1 = (boxes[i, q_idx, None] - tgt_boxes[i, None, t_idx]).abs().mean(-1)
        corners = (box12_to_corners(boxes[i, q_idx])[:, None] - box12_to_corners(tgt_boxes[i, t_idx])[None])
        assert torch.allclose(ref, -2.0 * p + 5.0 * l1 + 3.0 * corners.abs().mean((-1, -2)), atol=1e-5)
        if len(t_idx) == 0:
            assert len(got[i][0]) == 0 and len(got[i][1]) == 0
            continue
        rows, cols = linear_assignment(ref)
        assert torch.equal(got[i][0], q_idx[rows]) and torch.equal(got[i][1], t_idx[cols])


def test_loss_zero_box_terms_at_targets_and_decreases():
    cfg = DetectionLossConfig(num_classes=3)
    boxes, labels, mask = _targets()
    q = 6
    torch.manual_seed(0)
    logits = torch.zeros(2, q, 4, requires_grad=True)
    pred = (torch.randn(2, q, 12) * 0.5).requires_grad_(True)
    opt = torch.optim.Adam([logits, pred], lr=0.1)
    losses = []
    for _ in range(30):
        out = detection_loss(logits, pred, labels, boxes, mask, cfg)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.25 * losses[0]
    # exact predictions at the matched slots → zero L1 terms
    exact = pred.detach().clone()
    for b, (src, tgt) in enumerate(out["indices"]):
        exact[b, src] = boxes[b, tgt]
    res = detection_loss(logits.detach(), exact, labels, boxes, mask, cfg, indices=out["indices"])
    assert res["loss_box"].item() == 0.0 and res["loss_corners"].item() < 1e-6


def test_loss_no_targets_is_class_only():
    cfg = DetectionLossConfig(num_classes=3)
    logits = torch.randn(2, 5, 4, requires_grad=True)
    pred = torch.randn(2, 5, 12, requires_grad=True)
    out = detection_loss(logits, pred, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, 12),
                         torch.zeros(2, 0, dtype=torch.bool), cfg)
    assert out["loss_box"].item() == 0.0 and torch.isfinite(out["loss"])
    out["loss"].backward()
    assert logits.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------- metrics


def test_average_precision_closed_forms():
    assert average_precision(np.array([0.9, 0.8]), np.array([True, True]), 2) == pytest.approx(1.0)
    # a false positive ranked below every true positive does not lower AP
    assert average_precision(np.array([0.9, 0.1]), np.array([True, False]), 1) == pytest.approx(1.0)
    # ranked above: precision 1/2 at recall 1
    assert average_precision(np.array([0.9, 0.5]), np.array([False, True]), 1) == pytest.approx(0.5)
    # half the ground truth never found
    assert average_precision(np.array([0.9]), np.array([True]), 2) == pytest.approx(0.5)
    assert math.isnan(average_precision(np.array([]), np.array([], bool), 0))


def test_evaluator_perfect_and_wrong_predictions():
    cfg = DetectionLossConfig(num_classes=3)
    boxes, labels, mask = _targets()
    q = 5
    logits = torch.full((2, q, 4), -5.0)
    logits[..., 3] = 5.0  # "no object" everywhere ...
    pred = torch.randn(2, q, 12, generator=_gen(3)) + 50
    for b in range(2):
        k = int(mask[b].sum())
        pred[b, :k] = boxes[b, :k]
        logits[b, torch.arange(k), labels[b, :k]] = 10.0  # ... except at the true objects
    ev = DetectionEvaluator(cfg, num_samples=2048)
    ev.update(logits, pred, labels, boxes, mask)
    res = ev.compute()
    assert res["mAP@0.25"] == pytest.approx(1.0) and res["mAP@0.5"] == pytest.approx(1.0)
    assert res["mean_iou"] == pytest.approx(1.0, abs=1e-6) and res["num_targets"] == 6
    ev.reset()
    ev.update(logits, pred + torch.cat([torch.full((3,), 100.0), torch.zeros(9)]), labels, boxes, mask)
    res = ev.compute()
    assert res["mAP@0.25"] == 0.0 and res["mean_iou"] == 0.0
