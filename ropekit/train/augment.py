"""Augmentations shared by the training tasks (image classification, robot policies)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["random_shift"]


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
