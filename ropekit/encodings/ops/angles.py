"""Angles ``theta = r . freqs``, their cos/sin tables, and the rotation of pairs by them: the reference every
rotation path (the PyTorch paths of :mod:`ropekit.encodings.ops.rotation` and the fused kernels of
:mod:`ropekit.kernels`) is built from or checked against.

Shape legend: ``B`` batch, ``Hp`` heads that own parameters (1 or ``H``), ``M`` tokens that carry a coordinate,
``c`` coordinate dimension, ``d`` head dimension, ``P = d / 2`` rotation planes; pairs are interleaved
(``(2n, 2n + 1)``, see :mod:`ropekit.encodings.ops.rotation`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["frequency_angles", "wide_angles", "angle_table", "rope_cos_sin", "wide_dtype", "rotate_pairs_real"]


def frequency_angles(coords: Tensor, freqs: Tensor) -> Tensor:
    """Angles ``theta_n(r) = sum_k r_k * freqs[k, n]`` by elementwise products and sums.

    Never a matrix product: on a GPU with TF32 enabled (``torch.backends.cuda.matmul.allow_tf32``) a matmul or
    einsum would round the coordinates and frequencies to 10 mantissa bits, an angle error of ~1e-3 relative.
    The ``c`` products are accumulated in the dtype of the inputs (callers pass float32 or float64).

    Args:
        coords: ``(M, c)`` shared by the batch, or ``(B, M, c)`` per example.
        freqs: ``(Hp, c, P)``.

    Returns:
        ``(Hp, M, P)`` for shared coordinates, ``(B, Hp, M, P)`` per example.
    """
    theta = None
    for j in range(freqs.shape[-2]):
        # (..., 1, M, 1) * (Hp, 1, P) -> (..., Hp, M, P)
        term = coords[..., j].unsqueeze(-2).unsqueeze(-1) * freqs[:, j].unsqueeze(-2)
        theta = term if theta is None else theta + term
    return theta


def wide_angles(coords: Tensor, freqs: Tensor) -> Tensor:
    """The angles ``theta = r . freqs`` every encoding rotates by: ``frequency_angles`` in float64 (float32 on
    devices without float64, MPS), autocast disabled.

    A float32 angle of ``4096 * 2 pi`` already carries an error of ~1e-3 rad (its ulp); formed in float64 the
    angle, and the cos/sin taken from it, stay exact to float32 round-off at any coordinate scale.

    Args:
        coords: ``(M, c)`` shared by the batch, or ``(B, M, c)`` per example, any real dtype.
        freqs: ``(Hp, c, P)``, any real dtype (parameters, or frequencies derived from them in float64).

    Returns:
        ``(Hp, M, P)`` for shared coordinates, ``(B, Hp, M, P)`` per example, in the wide dtype; differentiable
        in ``coords`` and ``freqs``.
    """
    wide = wide_dtype(coords.device)
    with torch.autocast(device_type=coords.device.type, enabled=False):
        return frequency_angles(coords if coords.dtype == wide else coords.to(wide),
                                freqs if freqs.dtype == wide else freqs.to(wide))


def angle_table(coords: Tensor, freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(theta, cos, sin)``, each ``(1 | B, Hp, M, P)``: the angles of ``wide_angles`` (differentiable) and their
    cos/sin in ``dtype`` (constants), for ``rotation.rotate_angles``."""
    theta = wide_angles(coords, freqs)
    if theta.dim() == 3:
        theta = theta.unsqueeze(0)  # (1, Hp, M, P): shared by the batch
    with torch.no_grad():
        return theta, torch.cos(theta).to(dtype), torch.sin(theta).to(dtype)


def rope_cos_sin(coords: Tensor, freqs: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin tables of the angles ``theta = r . freqs``, accurate to float32 round-off at any coordinate.

    The angles come from ``wide_angles`` (float64), are reduced by ``cos``/``sin`` in float64, then rounded to
    ``dtype``. The tables are small (one row per coordinate, not per head and example), so the cost is
    negligible.

    Args:
        coords: ``(M, c)`` shared by the batch, or ``(B, M, c)`` per example.
        freqs: ``(Hp, c, P)``.
        dtype: table dtype; ``None``: float64 if an input is float64, else float32.

    Returns:
        ``(cos, sin)``, each ``(1, Hp, M, P)`` for shared coordinates or ``(B, Hp, M, P)`` per example;
        differentiable in ``coords`` and ``freqs``.
    """
    if dtype is None:
        dtype = torch.float64 if torch.float64 in (coords.dtype, freqs.dtype) else torch.float32
    theta = wide_angles(coords, freqs)
    if theta.dim() == 3:
        theta = theta.unsqueeze(0)  # (1, Hp, M, P): shared by the batch
    return torch.cos(theta).to(dtype), torch.sin(theta).to(dtype)


def wide_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype angles, derived frequencies and fixed tables are formed in on ``device``: float64, or float32 on
    devices without float64 (MPS)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def rotate_pairs_real(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Reference form of ``rotate_pairs`` in real arithmetic (any dtype; used under ``torch.compile``)."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)  # (..., P) each
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
