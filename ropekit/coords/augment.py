"""Coordinate augmentation in training, as DINOv3 and timm's NaFlexViT do for their RoPE ViTs: a random global
shift, a per-axis scale jitter and a global rescale of every token's coordinates.

For one image with coordinates ``r`` ``(M, c)`` the augmented coordinates are

    r' = ((r + t) * j) * g

with ``t`` ``(c,)`` uniform in ``[-shift, shift]`` per axis, ``j`` ``(c,)`` log-uniform in ``[1 / jitter, jitter]``
per axis and ``g`` one log-uniform number in ``[1 / rescale, rescale]`` (DINOv3's order: shift, then jitter, then
rescale). With a commuting encoding the shift changes no logit (offsets only); the scales change every offset, so
the model sees each image at many effective resolutions.

Shape legend: ``B`` images, ``M`` tokens, ``c`` coordinate dimension.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["CoordAugmentDraws", "draw_coord_augmentation", "apply_coord_augmentation", "augment_coords",
           "check_coord_augment", "augment_leading_axes"]


class CoordAugmentDraws(NamedTuple):
    """One draw per image: ``shift`` ``(B, c)``, ``jitter`` ``(B, c)`` and ``rescale`` ``(B, 1)``."""

    shift: Tensor
    jitter: Tensor
    rescale: Tensor


def _check(name: str, value: float, low: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < low:
        raise ValueError(f"coordinate augmentation {name} must be finite and >= {low}, got {value}")
    return value


def draw_coord_augmentation(batch: int, coord_dim: int, *, shift: float = 0.0, jitter: float = 1.0,
                            rescale: float = 1.0, generator: Optional[torch.Generator] = None,
                            dtype: torch.dtype = torch.float32, device=None) -> CoordAugmentDraws:
    """Draw ``B`` augmentations (CPU random numbers from ``generator``, or the global generator).

    Args:
        batch, coord_dim: ``B`` and ``c``.
        shift: half-width of the uniform shift (coordinate units, ``>= 0``; 0: none).
        jitter: per-axis scale bound (``>= 1``; 1: none).
        rescale: global scale bound (``>= 1``; 1: none).

    Returns:
        :class:`CoordAugmentDraws`.
    """
    shift, jitter, rescale = _check("shift", shift, 0.0), _check("jitter", jitter, 1.0), _check("rescale", rescale, 1.0)
    u = torch.rand(batch, 2 * coord_dim + 1, generator=generator, dtype=torch.float64)  # (B, 2c + 1)
    t = (2 * u[:, :coord_dim] - 1) * shift
    j = torch.exp((2 * u[:, coord_dim:2 * coord_dim] - 1) * math.log(jitter))
    g = torch.exp((2 * u[:, 2 * coord_dim:] - 1) * math.log(rescale))
    return CoordAugmentDraws(*(x.to(dtype=dtype, device=device) for x in (t, j, g)))


def apply_coord_augmentation(coords: Tensor, draws: CoordAugmentDraws, segment: Optional[Tensor] = None) -> Tensor:
    """``((r + t) * j) * g`` per image.

    Args:
        coords: ``(B, M, c)`` (one image per row), or ``(N, c)`` / ``(B, N, c)`` tokens of packed images with
            ``segment`` giving each token's image index into the draws (``-1``: padding, left as it is).
        draws: from :func:`draw_coord_augmentation`.
        segment: ``(N,)`` / ``(B, N)`` integer image index per token, or ``None``.

    Returns:
        Coordinates of ``coords``' shape and dtype.
    """
    t, j, g = (x.to(device=coords.device, dtype=coords.dtype) for x in draws)
    if segment is None:
        if coords.dim() != 3 or coords.shape[0] != t.shape[0] or coords.shape[-1] != t.shape[-1]:
            raise ValueError(f"coords must be ({t.shape[0]}, M, {t.shape[-1]}) for {t.shape[0]} draws, "
                             f"got {tuple(coords.shape)}")
        return (coords + t[:, None]) * j[:, None] * g[:, None]
    if segment.shape != coords.shape[:-1]:
        raise ValueError(f"segment {tuple(segment.shape)} must match coords {tuple(coords.shape[:-1])}")
    idx = segment.clamp(min=0).long()
    out = (coords + t[idx]) * j[idx] * g[idx]
    return torch.where((segment >= 0).unsqueeze(-1), out, coords)


def augment_coords(coords: Tensor, *, shift: float = 0.0, jitter: float = 1.0, rescale: float = 1.0,
                   generator: Optional[torch.Generator] = None) -> Tensor:
    """Augment ``(B, M, c)`` coordinates, one draw per image (see the module docstring)."""
    if coords.dim() != 3:
        raise ValueError(f"coords must be (B, M, c), got {tuple(coords.shape)}")
    draws = draw_coord_augmentation(coords.shape[0], coords.shape[-1], shift=shift, jitter=jitter, rescale=rescale,
                                    generator=generator)
    return apply_coord_augmentation(coords, draws)


def check_coord_augment(settings: Sequence[float]) -> Tuple[float, float, float]:
    """``(shift, jitter, rescale)`` checked (``shift >= 0``, ``jitter >= 1``, ``rescale >= 1``, all finite);
    ``ValueError`` otherwise. ``(0, 1, 1)`` is no augmentation."""
    values = tuple(settings)
    if len(values) != 3:
        raise ValueError(f"coord_augment is (shift, jitter, rescale), got {values!r}")
    return (_check("shift", values[0], 0.0), _check("jitter", values[1], 1.0), _check("rescale", values[2], 1.0))


def augment_leading_axes(coords: Tensor, settings: Sequence[float], num_images: int, *, axes: int,
                         image: Optional[Tensor] = None) -> Tensor:
    """The model's training-time augmentation: the first ``axes`` coordinate axes of each image shifted, jittered
    and rescaled with one draw per image (from the global torch CPU generator, so a checkpoint's RNG state makes a
    resumed run draw the same numbers); the other axes (an RGB-D depth coordinate) are left as they are.

    Args:
        coords: ``(M, c)`` (one grid for all images, expanded), ``(B, M, c)`` one image per row, or ``(B, N, c)``
            packed tokens with ``image``.
        settings: ``(shift, jitter, rescale)`` (:func:`check_coord_augment`).
        num_images: ``B``, or the packed batch's ``I``.
        axes: how many leading axes to augment (``<= c``).
        image: ``(B, N)`` each packed token's image (``-1``: padding, unchanged), or ``None``.

    Returns:
        ``(B, M, c)`` / ``(B, N, c)`` coordinates in ``coords``' dtype.
    """
    shift, jitter, rescale = check_coord_augment(settings)
    c = coords.shape[-1]
    if not 0 < axes <= c:
        raise ValueError(f"axes must be in 1..{c}, got {axes}")
    if image is None and coords.dim() == 2:
        coords = coords.expand(num_images, -1, -1)  # (B, M, c)
    draws = draw_coord_augmentation(num_images, axes, shift=shift, jitter=jitter, rescale=rescale,
                                    dtype=coords.dtype, device=coords.device)
    moved = apply_coord_augmentation(coords[..., :axes], draws, image)
    return torch.cat([moved, coords[..., axes:]], dim=-1) if axes < c else moved
