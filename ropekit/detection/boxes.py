"""Oriented 3-D boxes: the 12-vector (translation, first two rotation columns, size), corners, and Monte Carlo 3-D IoU.

A box is a 12-vector ``[t (3), r1 (3), r2 (3), s (3)]``:

* ``t`` — the box centre (metres, in whatever frame the caller uses; the scene generator uses the
  camera frame, see :mod:`ropekit.detection.scenes`);
* ``r1, r2`` — the first two columns of the box's 3×3 rotation matrix (box-local axes x and y expressed in
  the frame).  They need not be orthonormal: :func:`rotation_from_6d` applies Gram–Schmidt
  (``b1 = r1/|r1|``, ``b2 = normalise(r2 − (b1·r2) b1)``) and takes ``b3 = b1 × b2``.  This is the
  continuous 6-D rotation representation, so a network can regress it directly;
* ``s`` — full side lengths (not half sizes) along the box-local axes x, y, z.  Valid boxes have positive
  sizes; negative sizes are tolerated (corners are still defined, IoU uses ``|s|``).

Corner order (fixed; the L1-corner loss depends on it).  Corner ``k`` is ``t + R (σ_k ⊙ s / 2)`` with signs
``σ_k``::

        k :  0   1   2   3   4   5   6   7
      σ_x :  −   +   +   −   −   +   +   −
      σ_y :  −   −   +   +   −   −   +   +
      σ_z :  −   −   −   −   +   +   +   +

i.e. the bottom face (local z = −s_z/2) counter-clockwise seen from +z, then the top face in the same order
(corner ``k + 4`` sits above corner ``k``)::

          7 -------- 6
         /|         /|        z
        4 -------- 5 |        |  y
        | 3 -------|-2        | /
        |/         |/         |/
        0 -------- 1          o----- x

Shape legend: ``...`` any batch shape, ``S`` Monte Carlo samples, ``N``/``M`` boxes in two sets.

Monte Carlo IoU: draw ``S`` points uniformly in the *predicted* box, let ``f`` be the fraction
inside the *target* box; the intersection volume is estimated by ``f·V_pred`` and
``IoU = f·V_pred / (V_pred + V_target − f·V_pred)``.  The standard error of ``f`` is
``sqrt(f(1 − f)/S) ≤ 0.5/sqrt(S)`` (≤ 0.0078 for the default ``S = 4096``).  The estimate is not
differentiable (it is a metric, computed without gradients).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "CORNER_SIGNS",
    "rotation_from_6d",
    "box12_from_parts",
    "box12_to_corners",
    "corners_to_box12",
    "box_volume",
    "points_in_box",
    "box_iou_3d",
    "box_iou_3d_pairwise",
]

# (8, 3) signs of the half sizes for the fixed corner order documented above.
CORNER_SIGNS = torch.tensor(
    [
        [-1.0, -1.0, -1.0],
        [1.0, -1.0, -1.0],
        [1.0, 1.0, -1.0],
        [-1.0, 1.0, -1.0],
        [-1.0, -1.0, 1.0],
        [1.0, -1.0, 1.0],
        [1.0, 1.0, 1.0],
        [-1.0, 1.0, 1.0],
    ]
)

_EPS = 1e-8


def _normalise(v: torch.Tensor, eps: float = _EPS) -> torch.Tensor:
    """Unit vectors along the last axis; ``eps`` keeps the gradient finite at zero."""
    return v / v.norm(dim=-1, keepdim=True).clamp_min(eps)


def rotation_from_6d(r6: torch.Tensor) -> torch.Tensor:
    """Rotation matrices from the 6-D representation by Gram–Schmidt.

    Args:
        r6: ``(..., 6)`` — first column ``r1`` then second column ``r2`` of a rotation (any scale, need not be
            orthogonal; ``r1`` and ``r2`` must not be parallel).

    Returns:
        ``(..., 3, 3)`` rotation matrices ``R = [b1 b2 b3]`` (columns), ``b3 = b1 × b2``, ``det R = +1``.
    """
    a1, a2 = r6[..., 0:3], r6[..., 3:6]
    b1 = _normalise(a1)
    b2 = _normalise(a2 - (b1 * a2).sum(-1, keepdim=True) * b1)
    b3 = torch.linalg.cross(b1, b2, dim=-1)
    return torch.stack([b1, b2, b3], dim=-1)  # (..., 3, 3), columns b1 b2 b3


def box12_from_parts(center: torch.Tensor, rotation: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """Pack ``center (..., 3)``, ``rotation (..., 3, 3)`` and ``size (..., 3)`` into ``(..., 12)``."""
    r6 = torch.cat([rotation[..., :, 0], rotation[..., :, 1]], dim=-1)  # (..., 6)
    return torch.cat([center, r6, size], dim=-1)


def _unpack(box: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(..., 12)`` → centre ``(..., 3)``, rotation ``(..., 3, 3)``, size ``(..., 3)``."""
    if box.shape[-1] != 12:
        raise ValueError(f"expected boxes with last dimension 12, got shape {tuple(box.shape)}")
    return box[..., 0:3], rotation_from_6d(box[..., 3:9]), box[..., 9:12]


def box12_to_corners(box: torch.Tensor) -> torch.Tensor:
    """The 8 corners of boxes, in the fixed order of :data:`CORNER_SIGNS`.

    Args:
        box: ``(..., 12)`` boxes ``[t, r1, r2, s]``.

    Returns:
        ``(..., 8, 3)`` corners ``t + R (σ_k ⊙ s/2)``.  Differentiable in all 12 entries.
    """
    center, rot, size = _unpack(box)
    signs = CORNER_SIGNS.to(device=box.device, dtype=box.dtype)  # (8, 3)
    local = signs * (0.5 * size).unsqueeze(-2)  # (..., 8, 3)
    return center.unsqueeze(-2) + torch.einsum("...ij,...kj->...ki", rot, local)  # (..., 8, 3)


def corners_to_box12(corners: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`box12_to_corners` for corners in the fixed order.

    The centre is the mean of the corners; the local axes are the means of the four parallel edges of each
    direction (x: 0→1, 3→2, 4→5, 7→6; y: 0→3, 1→2, 4→7, 5→6; z: 0→4, 1→5, 2→6, 3→7).  The
    rotation columns are returned orthonormalised (Gram–Schmidt, third = cross product) and the sizes are the edge
    vectors projected on them (``s_x, s_y ≥ 0``; ``s_z`` takes the sign that reproduces the corners).

    Ambiguity: one solid box has several 12-vectors (turning it by π about a local axis, or relabelling
    axes, gives the same point set with the corners in another order; rescaled or non-orthogonal ``r1, r2``
    give the same box).  Because the corner *order* is fixed, this function recovers the canonical
    12-vector of the ordered corners: ``corners_to_box12(box12_to_corners(b))`` equals ``b`` with its
    rotation columns orthonormalised, and ``box12_to_corners(corners_to_box12(c)) == c`` for the corners
    ``c`` of any box.  It cannot tell which description produced a *permuted* corner set.

    Args:
        corners: ``(..., 8, 3)``.

    Returns:
        ``(..., 12)`` boxes.
    """
    c = corners
    center = c.mean(dim=-2)  # (..., 3)
    ex = (c[..., 1, :] - c[..., 0, :] + c[..., 2, :] - c[..., 3, :]
          + c[..., 5, :] - c[..., 4, :] + c[..., 6, :] - c[..., 7, :]) / 4  # (..., 3)
    ey = (c[..., 3, :] - c[..., 0, :] + c[..., 2, :] - c[..., 1, :]
          + c[..., 7, :] - c[..., 4, :] + c[..., 6, :] - c[..., 5, :]) / 4
    ez = (c[..., 4, :] - c[..., 0, :] + c[..., 5, :] - c[..., 1, :]
          + c[..., 6, :] - c[..., 2, :] + c[..., 7, :] - c[..., 3, :]) / 4
    rot = rotation_from_6d(torch.cat([ex, ey], dim=-1))  # (..., 3, 3)
    size = torch.stack(
        [(ex * rot[..., :, 0]).sum(-1), (ey * rot[..., :, 1]).sum(-1), (ez * rot[..., :, 2]).sum(-1)], dim=-1
    )  # (..., 3)
    return box12_from_parts(center, rot, size)


def box_volume(box: torch.Tensor) -> torch.Tensor:
    """``(..., 12)`` → ``(...)`` volumes ``|s_x s_y s_z|``."""
    return box[..., 9:12].prod(dim=-1).abs()


def points_in_box(points: torch.Tensor, box: torch.Tensor, rel_tol: float = 1e-5) -> torch.Tensor:
    """Whether points lie inside boxes (boundary included, up to a relative tolerance).

    Args:
        points: ``(..., P, 3)``.
        box: ``(..., 12)`` (broadcast against the batch shape of ``points``).
        rel_tol: slack relative to the half sizes, so points sampled on a face count as inside.

    Returns:
        ``(..., P)`` boolean.
    """
    center, rot, size = _unpack(box)
    local = torch.einsum("...ji,...pj->...pi", rot, points - center.unsqueeze(-2))  # R^T (p − t), (..., P, 3)
    half = (0.5 * size.abs()).unsqueeze(-2)  # (..., 1, 3)
    return (local.abs() <= half * (1 + rel_tol) + 1e-9).all(dim=-1)


def _sample_in_boxes(box: torch.Tensor, num_samples: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Points uniform in each box: ``box (P, 12)`` → ``(P, S, 3)``."""
    center, rot, size = _unpack(box)
    dev = generator.device if generator is not None else box.device
    u = torch.rand(box.shape[0], num_samples, 3, generator=generator, device=dev, dtype=box.dtype)
    local = (u.to(box.device) - 0.5) * size.unsqueeze(-2)  # (P, S, 3)
    return center.unsqueeze(-2) + torch.einsum("pij,psj->psi", rot, local)  # (P, S, 3)


def _iou_from_fraction(f: torch.Tensor, v_pred: torch.Tensor, v_target: torch.Tensor) -> torch.Tensor:
    inter = f * v_pred
    union = v_pred + v_target - inter
    return torch.where(union > 0, inter / union.clamp_min(1e-30), torch.zeros_like(union))


@torch.no_grad()
def box_iou_3d(
    pred: torch.Tensor,
    target: torch.Tensor,
    num_samples: int = 4096,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Monte Carlo 3-D IoU of corresponding boxes (elementwise, broadcast over the batch shape).

    Args:
        pred: ``(..., 12)`` predicted boxes (points are sampled in these).
        target: ``(..., 12)`` target boxes (broadcastable against ``pred``).
        num_samples: points per pair ``S``; standard error of the inside fraction ≤ ``0.5/sqrt(S)``.
        generator: optional ``torch.Generator`` for reproducible samples.

    Returns:
        ``(...)`` IoU in [0, 1] (fp32 or the input dtype if fp64); 0 for zero-volume pairs.
    """
    pred, target = torch.broadcast_tensors(pred, target)
    batch_shape = pred.shape[:-1]
    dtype = torch.float64 if pred.dtype == torch.float64 else torch.float32
    p = pred.detach().reshape(-1, 12).to(dtype)  # (P, 12)
    t = target.detach().reshape(-1, 12).to(dtype)
    chunk = max(1, (1 << 22) // max(1, num_samples))  # bounds memory to ~ 4M points per step
    fracs = []
    for i in range(0, p.shape[0], chunk):
        pts = _sample_in_boxes(p[i : i + chunk], num_samples, generator)  # (c, S, 3)
        fracs.append(points_in_box(pts, t[i : i + chunk]).to(dtype).mean(dim=-1))  # (c,)
    f = torch.cat(fracs) if fracs else p.new_zeros(0)
    return _iou_from_fraction(f, box_volume(p), box_volume(t)).reshape(batch_shape)


@torch.no_grad()
def box_iou_3d_pairwise(
    pred: torch.Tensor,
    target: torch.Tensor,
    num_samples: int = 4096,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Monte Carlo 3-D IoU between every predicted and every target box.

    The same ``S`` points sampled in a predicted box are tested against all targets.

    Args:
        pred: ``(N, 12)``.
        target: ``(M, 12)``.
        num_samples: points per predicted box ``S``.
        generator: optional ``torch.Generator``.

    Returns:
        ``(N, M)`` IoU.
    """
    dtype = torch.float64 if pred.dtype == torch.float64 else torch.float32
    p = pred.detach().reshape(-1, 12).to(dtype)  # (N, 12)
    t = target.detach().reshape(-1, 12).to(dtype)  # (M, 12)
    n, m = p.shape[0], t.shape[0]
    if n == 0 or m == 0:
        return p.new_zeros(n, m)
    chunk = max(1, (1 << 22) // max(1, num_samples * m))
    fracs = []
    for i in range(0, n, chunk):
        pts = _sample_in_boxes(p[i : i + chunk], num_samples, generator)  # (c, S, 3)
        inside = points_in_box(pts.unsqueeze(1), t.unsqueeze(0))  # (c, 1, S, 3) vs (1, M, 12) → (c, M, S)
        fracs.append(inside.to(dtype).mean(dim=-1))  # (c, M)
    f = torch.cat(fracs)  # (N, M)
    return _iou_from_fraction(f, box_volume(p)[:, None], box_volume(t)[None, :])
