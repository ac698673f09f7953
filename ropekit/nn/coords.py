"""Token coordinates: patch-grid centres, position jitter, centroids.

Shape legend: ``B`` batch, ``M`` tokens with a coordinate, ``c`` coordinate dimension, ``g_i`` the patch grid
along axis ``i`` (``(gh, gw)`` for images, ``(gt, gh, gw)`` for video).

Coordinates are computed from the *actual* grid of the input at forward time, so any image size works.
Axis order follows the tensor layout: ``(y, x)`` for images, ``(y, x, z)`` for RGB-D patches, ``(t, y, x)``
for video tubelets. Two conventions:

* ``"grid"`` -- integer patch indices ``0, 1, ..., g_i - 1`` (one unit = one patch);
* ``"normalized"`` -- patch centres divided by the input extent, ``(i + 0.5) / g_i`` in ``[0, 1]``
  (a resolution change then moves tokens closer together instead of further apart).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["COORD_MODES", "grid_coords", "patch_units", "jitter_coords", "centroid"]

COORD_MODES = ("grid", "normalized")


def grid_coords(grid: Sequence[int], mode: str = "grid", *, device=None, dtype=torch.float32) -> Tensor:
    """Coordinates of the patch centres of a grid, in row-major token order.

    Args:
        grid: ``(g_0, ..., g_{c-1})`` patches per axis.
        mode: ``"grid"`` (integer indices) or ``"normalized"`` (centres in ``[0, 1]``).

    Returns:
        ``(M, c)`` with ``M = prod(grid)``; token ``m`` is the patch at ``unravel_index(m, grid)``.
    """
    if mode not in COORD_MODES:
        raise ValueError(f"coordinate mode must be one of {COORD_MODES}, got {mode!r}")
    axes = []
    for g in grid:
        g = g if isinstance(g, torch.SymInt) else int(g)  # a symbolic size stays symbolic (export at any size)
        a = torch.arange(g, device=device, dtype=dtype)
        axes.append(a if mode == "grid" else (a + 0.5) / g)
    mesh = torch.meshgrid(*axes, indexing="ij")  # c tensors of shape grid
    return torch.stack([m.reshape(-1) for m in mesh], dim=-1)  # (M, c)


def patch_units(grid: Sequence[int], mode: str = "grid") -> list[float]:
    """Size of one patch along each axis in coordinate units (1 for ``"grid"``, ``1 / g_i`` normalised)."""
    return [1.0 if mode == "grid" else 1.0 / int(g) for g in grid]


def jitter_coords(coords: Tensor, batch: int, sigma: float, unit: Sequence[float]) -> Tensor:
    """Position jitter (training augmentation): each coordinate drawn from ``N(centre, (sigma * unit)^2)``,
    truncated to the patch (``|noise| <= unit / 2``), independently per example, token and axis.

    Args:
        coords: ``(M, c)`` shared centres or ``(B, M, c)`` per example.
        batch: ``B``.
        sigma: standard deviation in patches (``0`` returns ``coords`` unchanged).
        unit: ``c`` patch sizes in coordinate units; axes with unit ``0`` are not jittered.

    Returns:
        ``(B, M, c)`` (or ``coords`` itself when ``sigma == 0``). Uses the global torch RNG.
    """
    if sigma <= 0:
        return coords
    m, c = coords.shape[-2:]
    noise = torch.empty(batch, m, c, device=coords.device, dtype=coords.dtype)
    # truncated standard normal in units of sigma, cut at +-0.5 patch
    torch.nn.init.trunc_normal_(noise, mean=0.0, std=1.0, a=-0.5 / sigma, b=0.5 / sigma)
    scale = torch.tensor([sigma * float(u) for u in unit], device=coords.device, dtype=coords.dtype)
    return coords + noise * scale  # (B, M, c)


def centroid(coords: Tensor) -> Tensor:
    """Mean coordinate of the tokens: ``(M, c) -> (1, c)``, ``(B, M, c) -> (B, 1, c)``."""
    return coords.mean(dim=-2, keepdim=True)
