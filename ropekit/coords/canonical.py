"""Canonical coordinates: map 3-D points so that rotations become translations .

Shape legend: ``...`` any leading axes (``(N,)``, ``(B, N)``), ``c`` coordinate dimension, ``d`` head dimension,
``Hp`` heads that own encoding parameters.

A commuting encoding (STRING, RoPE-Mixed, axial, ...) makes attention logits depend on coordinate *offsets*
only, so a model that pools without position (mean pooling) is invariant to a global translation of its
coordinates. Feeding it coordinates in which a group acts by translation makes it invariant to that group:

* :func:`cylindrical` ``(theta, h, rho)`` about an axis: a rotation by ``a`` about the axis adds ``a`` to
  ``theta``; a translation along the axis adds to ``h``. (``radius="log"`` gives ``log rho``: a radial
  stretch away from the axis, ``h`` unchanged, then adds to it.)
* :func:`spherical` ``(azimuth, polar, log r)``: a rotation about the axis adds to the azimuth, an isotropic
  scaling about the origin adds to ``log r``. A shift of the *polar* angle moves every point along its own
  meridian (a rotation of that point about the horizontal axis perpendicular to its meridian plane): it is one
  rigid rotation of the whole set only when all points share a meridian plane, and it is valid only while no
  point is pushed past a pole (the polar angle lives in ``[0, pi]`` and does not wrap). So the model is invariant
  to rotations about the axis, to scaling, and to the (non-rigid) polar shift map -- not to all of ``SO(3)``.

**Wrap-around.** The azimuth is periodic: a rotation moves points across the cut at ``theta = +-pi`` where the
coordinate jumps by ``2 pi``. The offset ``theta_j - theta_i`` then changes by ``+-2 pi`` for pairs split by the
cut, and the encoding sees the same relative position only if ``R(2 pi e_theta) = I`` -- for the RoPE family and
Cayley-STRING: every frequency on the azimuth axis is an integer (RoPE-Mixed / Cayley with
:func:`integer_frequencies`, kept integer during training by :func:`freeze_periodic_`). With non-integer
frequencies, invariance holds only for rotations that carry no point across the cut. :func:`periodicity_error`
measures ``max |R(r + 2 pi e_theta) x - R(r) x|``.

**Degenerate points.** On the axis (``rho = 0``) the azimuth is undefined (returned as 0): such a point stays put
under a rotation while its azimuth "should" shift, so exact invariance needs points off the axis (drop them, or
give them the azimuth of a neighbour). ``log`` radii are clamped at ``log(eps)``.

Example::

    pts = torch.randn(8, 100, 3)                           # (B, N, 3)
    coords = spherical(pts)                                 # (B, N, 3): (azimuth, polar, log r)
    pe = create_pe("cayley", head_dim=32, coord_dim=3, num_heads=2,
                   freqs=integer_frequencies(32, 3, periodic=(0,)))
    freeze_periodic_(pe, axes=(0,))                         # azimuth frequencies stay integers in training
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..encodings import PositionEncoding
from ..encodings.ops.frequencies import mixed_frequencies

__all__ = [
    "axis_frame", "cylindrical", "from_cylindrical", "spherical", "from_spherical", "rotate_about_axis",
    "integer_frequencies", "freeze_periodic_", "periodicity_error", "RADIUS_MODES",
]

RADIUS_MODES = ("linear", "log")


def _vec(v: Optional[Sequence[float] | Tensor], like: Tensor, default: Sequence[float]) -> Tensor:
    v = default if v is None else v
    return torch.as_tensor(v, dtype=like.dtype, device=like.device)


def axis_frame(axis: Sequence[float] | Tensor = (0.0, 0.0, 1.0), reference: Optional[Sequence[float] | Tensor] = None,
               *, dtype: torch.dtype = torch.float32) -> Tensor:
    """An orthonormal, right-handed frame ``(3, 3)``: rows ``(u, v, w)`` with ``w`` along ``axis`` and ``u`` the
    direction of azimuth 0 (``reference`` projected off the axis; by default the world axis least aligned with
    ``axis``). For the z-axis this is the identity: azimuth measured from x towards y.
    """
    w = torch.as_tensor(axis, dtype=torch.float64)
    if w.shape != (3,) or not float(w.norm()) > 0:
        raise ValueError(f"axis must be a non-zero 3-vector, got {axis!r}")
    w = w / w.norm()
    if reference is None:
        reference = torch.eye(3, dtype=torch.float64)[int(torch.argmin(w.abs()))]
    u = torch.as_tensor(reference, dtype=torch.float64)
    u = u - (u @ w) * w
    if not float(u.norm()) > 1e-9:
        raise ValueError("reference must not be parallel to the axis")
    u = u / u.norm()
    v = torch.linalg.cross(w, u)
    return torch.stack([u, v, w]).to(dtype)


def _local(points: Tensor, axis, origin, reference) -> Tensor:
    if points.shape[-1] != 3:
        raise ValueError(f"points must have shape (..., 3), got {tuple(points.shape)}")
    if not points.is_floating_point():
        points = points.float()
    frame = axis_frame(axis if axis is not None else (0.0, 0.0, 1.0), reference, dtype=points.dtype).to(points.device)
    return (points - _vec(origin, points, (0.0, 0.0, 0.0))) @ frame.T  # (..., 3) in (u, v, w)


def _radius(r: Tensor, mode: str, eps: float) -> Tensor:
    if mode not in RADIUS_MODES:
        raise ValueError(f"radius must be one of {RADIUS_MODES}, got {mode!r}")
    return torch.log(r.clamp_min(eps)) if mode == "log" else r


def cylindrical(points: Tensor, *, axis=None, origin=None, reference=None, radius: str = "linear",
                eps: float = 1e-6) -> Tensor:
    """``(..., 3)`` points -> ``(..., 3)`` ``(theta, h, rho)`` (or ``(theta, h, log rho)``) about ``axis``.

    ``theta`` in ``(-pi, pi]`` from ``reference`` (see :func:`axis_frame`), ``h`` the height along the axis above
    ``origin``, ``rho`` the distance from the axis. Rotations about the axis shift ``theta``; translations along it
    shift ``h``.
    """
    p = _local(points, axis, origin, reference)  # (..., 3)
    rho = torch.hypot(p[..., 0], p[..., 1])
    theta = torch.atan2(p[..., 1], p[..., 0])
    return torch.stack([theta, p[..., 2], _radius(rho, radius, eps)], dim=-1)


def from_cylindrical(coords: Tensor, *, axis=None, origin=None, reference=None, radius: str = "linear") -> Tensor:
    """Inverse of :func:`cylindrical` (same options): ``(..., 3)`` -> points ``(..., 3)``."""
    theta, h, rho = coords.unbind(-1)
    rho = torch.exp(rho) if radius == "log" else rho
    local = torch.stack([rho * torch.cos(theta), rho * torch.sin(theta), h], dim=-1)
    frame = axis_frame(axis if axis is not None else (0.0, 0.0, 1.0), reference, dtype=coords.dtype).to(coords.device)
    return local @ frame + _vec(origin, coords, (0.0, 0.0, 0.0))


def spherical(points: Tensor, *, axis=None, origin=None, reference=None, radius: Optional[str] = "log",
              eps: float = 1e-6) -> Tensor:
    """``(..., 3)`` points -> ``(azimuth, polar, log r)`` ``(..., 3)`` (``radius="linear"``: ``r``; ``None``: drop it,
    ``(..., 2)``).

    ``azimuth`` in ``(-pi, pi]`` about ``axis``, ``polar`` in ``[0, pi]`` from the axis, ``r`` the distance from
    ``origin``. Rotations about the axis shift the azimuth; scaling about the origin shifts ``log r``.
    """
    p = _local(points, axis, origin, reference)  # (..., 3)
    rho = torch.hypot(p[..., 0], p[..., 1])
    az = torch.atan2(p[..., 1], p[..., 0])
    polar = torch.atan2(rho, p[..., 2])
    out = [az, polar]
    if radius is not None:
        out.append(_radius(p.norm(dim=-1), radius, eps))
    return torch.stack(out, dim=-1)


def from_spherical(coords: Tensor, *, axis=None, origin=None, reference=None, radius: str = "log") -> Tensor:
    """Inverse of :func:`spherical` with a radius (``(..., 3)`` -> points ``(..., 3)``)."""
    az, polar, r = coords.unbind(-1)
    r = torch.exp(r) if radius == "log" else r
    local = torch.stack([r * torch.sin(polar) * torch.cos(az), r * torch.sin(polar) * torch.sin(az),
                         r * torch.cos(polar)], dim=-1)
    frame = axis_frame(axis if axis is not None else (0.0, 0.0, 1.0), reference, dtype=coords.dtype).to(coords.device)
    return local @ frame + _vec(origin, coords, (0.0, 0.0, 0.0))


def rotate_about_axis(points: Tensor, angle: float | Tensor, *, axis=None, origin=None) -> Tensor:
    """Rotate ``(..., 3)`` points by ``angle`` (radians, right-handed) about ``axis`` through ``origin``."""
    w = _vec(axis, points, (0.0, 0.0, 1.0))
    w = w / w.norm()
    o = _vec(origin, points, (0.0, 0.0, 0.0))
    angle = torch.as_tensor(angle, dtype=points.dtype, device=points.device)
    k = torch.zeros(3, 3, dtype=points.dtype, device=points.device)  # cross-product matrix of w
    k[0, 1], k[0, 2], k[1, 0], k[1, 2], k[2, 0], k[2, 1] = -w[2], w[1], w[2], -w[0], -w[1], w[0]
    rot = torch.eye(3, dtype=points.dtype, device=points.device) + torch.sin(angle) * k \
        + (1 - torch.cos(angle)) * (k @ k)  # Rodrigues
    return (points - o) @ rot.T + o


# ---------------------------------------------------------------------------------------------- periodic axes
def integer_frequencies(head_dim: int, coord_dim: int, periodic: Sequence[int] = (0,), *, num_heads: int = 1,
                        base: float = 100.0, max_harmonic: int = 8, seed: Optional[int] = None) -> Tensor:
    """RoPE-Mixed initial frequencies ``(num_heads, c, d/2)`` whose rows on the ``periodic`` axes are integers.

    The RoPE-Mixed initialisation (magnitudes from 1 down to ``1 / base``, random directions) with the periodic
    rows scaled by ``max_harmonic`` and rounded: integer harmonics in ``[-max_harmonic, max_harmonic]`` (pairs that
    round to 0 do not see that axis). Pass as ``freqs=`` to ``create_pe("mixed" | "cayley", ...)`` (with
    ``per_head=True``, ``num_heads`` must match). Then ``R(r + 2 pi e_k) = R(r)`` for each periodic axis ``k``.
    """
    for k in periodic:
        if not 0 <= k < coord_dim:
            raise ValueError(f"periodic axis {k} out of range for coord_dim={coord_dim}")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    freqs = mixed_frequencies(head_dim, coord_dim, num_heads, base, generator=gen)  # (Hp, c, d/2)
    for k in periodic:
        freqs[:, k] = torch.round(freqs[:, k] * max_harmonic)
    return freqs


def freeze_periodic_(pe: PositionEncoding, axes: Sequence[int] = (0,)) -> PositionEncoding:
    """Keep the frequencies of ``pe`` on ``axes`` fixed in training (gradient hook zeroing those rows).

    For encodings with a learnable frequency table ``freq_param`` ``(Hp, c, d/2)`` (``mixed``, ``cayley``); the
    rows must already be integers (:func:`integer_frequencies`). The hook is not saved with the module: call this
    again after rebuilding a model. Encoding parameters are excluded from weight decay (``no_weight_decay``), so
    with zero gradients Adam/AdamW leave the rows unchanged. Returns ``pe``.

    Raises:
        TypeError: ``pe`` has no ``freq_param``.
        ValueError: a frozen row is not integer-valued.
    """
    param = getattr(pe, "freq_param", None)
    if not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"{type(pe).__name__} has no learnable frequency table freq_param (use mixed or cayley)")
    axes = list(axes)
    rows = param.detach()[:, axes]
    if not torch.equal(rows, torch.round(rows)):
        raise ValueError("the frequencies on the periodic axes must be integers: build the encoding with "
                         "freqs=integer_frequencies(...)")
    mask = torch.ones_like(param)
    mask[:, axes] = 0

    def hook(grad: Tensor) -> Tensor:
        return grad * mask.to(grad.device, grad.dtype)

    param.register_hook(hook)
    return pe


def periodicity_error(pe: PositionEncoding, axis: int = 0, period: float = 2 * math.pi, *, num_points: int = 32,
                      seed: int = 0) -> float:
    """``max |R(r + period e_axis) x - R(r) x| / max |x|`` over random ``r`` and ``x`` (float64): 0 (round-off)
    when the encoding is periodic along ``axis``."""
    gen = torch.Generator().manual_seed(seed)
    enc = _float64_copy(pe)
    x = torch.randn(1, pe.num_heads, num_points, pe.head_dim, generator=gen, dtype=torch.float64)
    r = torch.randn(num_points, pe.coord_dim, generator=gen, dtype=torch.float64) * 3
    shifted = r.clone()
    shifted[:, axis] += period
    with torch.no_grad():
        err = (enc.rotate(x, shifted) - enc.rotate(x, r)).abs().max()
    return float(err / x.abs().max())


def _float64_copy(pe: PositionEncoding) -> PositionEncoding:
    return copy.deepcopy(pe).double().cpu()
