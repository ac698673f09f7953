"""Augmentations shared by the training tasks (image classification, robot policies)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["random_shift", "random_resize"]


def random_shift(x: Tensor, max_shift: int) -> Tensor:
    """Translate each example by up to ``max_shift`` pixels along H and W, filling with zeros.

    ``x``: ``(B, C, H, W)`` or ``(B, C, T, H, W)`` (every frame of a clip moves together; a zero-filled depth
    pixel is invalid, as it should be). Draws from the global torch RNG.
    """
    if max_shift <= 0:
        return x
    s = int(max_shift)
    h, w = x.shape[-2:]
    padded = F.pad(x, (s, s, s, s))  # (..., H + 2s, W + 2s)
    offsets = torch.randint(0, 2 * s + 1, (x.shape[0], 2)).tolist()
    return torch.stack([padded[i, ..., dy:dy + h, dx:dx + w] for i, (dy, dx) in enumerate(offsets)])


def random_resize(x: Tensor, sizes: Sequence[int]) -> Tensor:
    """Scale augmentation: resize the whole batch to one square size drawn uniformly from ``sizes``.

    ``x``: ``(B, C, H, W)`` images; returns ``(B, C, s, s)`` (bilinear, antialiased when shrinking; ``x`` itself
    when ``s`` equals its size). One size per call, so a batch keeps one token grid; with a fixed patch size the
    model sees grids of ``s / patch`` tokens per side. Draws one number from the global torch RNG (nothing when
    ``sizes`` is empty).

    Raises:
        ValueError: for clips or RGB-D input (resizing depth would blend valid and invalid pixels).
    """
    if not sizes:
        return x
    if x.dim() != 4:
        raise ValueError(f"augment_sizes resizes (B, C, H, W) images, got a {x.dim()}-D batch")
    s = int(sizes[int(torch.randint(0, len(sizes), (1,)))])
    if (s, s) == tuple(x.shape[-2:]):
        return x
    shrink = s < min(x.shape[-2:])
    return F.interpolate(x, size=(s, s), mode="bilinear", align_corners=False, antialias=shrink)
