"""ViTD depth lifting: each patch's third coordinate from the mean *valid* depth under it.

Shape legend: ``B`` batch, ``H, W`` pixels, ``p`` patch size, ``(gh, gw)`` patch grid, ``M = gh * gw``.

A depth pixel is valid when it is finite and ``> 0`` (sensors write 0 or NaN where they have no return).
Invalid pixels are masked out of the mean -- a NaN never reaches the model. A patch without any valid pixel
takes the mean of its image's valid patches (or 0 when the whole image is invalid).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["valid_depth_mask", "patch_mean_depth", "DepthLift"]


def valid_depth_mask(depth: Tensor) -> Tensor:
    """``True`` where ``depth`` is finite and positive (same shape as ``depth``)."""
    return torch.isfinite(depth) & (depth > 0)


def patch_mean_depth(depth: Tensor, patch_size: int) -> Tensor:
    """Mean valid depth per patch.

    Args:
        depth: ``(B, H, W)`` metric depth, 0 / NaN / inf marking invalid pixels.
        patch_size: ``p``; the bottom/right remainder is cropped like the patch embedding does.

    Returns:
        ``(B, M)`` finite means, row-major over the ``(gh, gw)`` grid.
    """
    valid = valid_depth_mask(depth)
    d = torch.where(valid, depth, torch.zeros((), dtype=depth.dtype, device=depth.device)).unsqueeze(1)  # (B, 1, H, W)
    v = valid.to(depth.dtype).unsqueeze(1)
    total = F.avg_pool2d(d, patch_size, stride=patch_size).flatten(1)  # (B, M): sum / p^2
    count = F.avg_pool2d(v, patch_size, stride=patch_size).flatten(1)  # (B, M): valid fraction
    has = count > 0
    mean = total / count.clamp_min(1e-12)  # (B, M), meaningless where ~has
    n_valid = has.sum(dim=1, keepdim=True)  # (B, 1)
    fallback = torch.where(has, mean, torch.zeros_like(mean)).sum(dim=1, keepdim=True) / n_valid.clamp_min(1)  # (B, 1)
    return torch.where(has, mean, fallback.expand_as(mean))


class DepthLift(nn.Module):
    """``z = scale * mean_valid_depth + bias``: the learnable third coordinate of a ViTD patch.

    Args:
        scale_init: initial ``scale`` (coordinate units per metre). Non-zero (e.g. 1) to train from scratch;
            ``0`` when fine-tuning a 2-D model, so the first forward pass equals the 2-D model's.
    """

    def __init__(self, scale_init: float = 1.0) -> None:
        super().__init__()
        self.scale_init = float(scale_init)
        self.scale = nn.Parameter(torch.tensor(self.scale_init))
        self.bias = nn.Parameter(torch.zeros(()))

    def reset_parameters(self) -> None:
        """``scale = scale_init``, ``bias = 0``."""
        with torch.no_grad():
            self.scale.fill_(self.scale_init)
            self.bias.zero_()

    def forward(self, depth: Tensor, patch_size: int) -> Tensor:
        """``(B, H, W) -> (B, M)`` z coordinates."""
        return self.scale * patch_mean_depth(depth, patch_size) + self.bias

    def no_weight_decay(self) -> set[str]:
        return {"scale", "bias"}
