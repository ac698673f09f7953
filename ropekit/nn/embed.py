"""Patch and tubelet embeddings, and absolute position embeddings (APE).

Shape legend: ``B`` batch, ``C`` input channels, ``T, H, W`` frames / height / width in pixels, ``p`` patch
size, ``tt`` tubelet length in frames, ``g = (gh, gw)`` or ``(gt, gh, gw)`` the token grid, ``M = prod(g)``
tokens, ``D`` width.

Inputs whose size is not a multiple of the patch size are cropped at the bottom/right (the strided
convolution ignores the remainder); the grid is always read from the input at forward time.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PatchEmbed", "TubeletEmbed", "LearnedPosEmbed", "SinCosPosEmbed", "sincos_pos_embed"]


class PatchEmbed(nn.Module):
    """Non-overlapping ``p x p`` patches of a ``(B, C, H, W)`` image, linearly embedded (a strided Conv2d)."""

    def __init__(self, patch_size: int, in_chans: int, dim: int) -> None:
        super().__init__()
        self.patch_size = int(patch_size)
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=self.patch_size, stride=self.patch_size)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tuple[int, int]]:
        """``(B, C, H, W) -> ((B, M, D), (gh, gw))``."""
        if x.dim() != 4:
            raise ValueError(f"expected images (B, C, H, W), got shape {tuple(x.shape)}")
        if x.shape[-1] < self.patch_size or x.shape[-2] < self.patch_size:
            raise ValueError(f"image {tuple(x.shape[-2:])} is smaller than the patch size {self.patch_size}")
        y = self.proj(x)  # (B, D, gh, gw)
        grid = (y.shape[-2], y.shape[-1])
        # contiguous: a transposed view would carry its (B, D, M) memory layout into every residual add of every
        # block (elementwise ops keep their first input's layout), making each add a strided, uncoalesced kernel
        # and each LayerNorm copy its input first -- ~18% of a ViT-B training step on a GPU in eager mode
        return y.flatten(2).transpose(1, 2).contiguous(), grid  # (B, M, D)


class TubeletEmbed(nn.Module):
    """Non-overlapping ``tt x p x p`` tubelets of a ``(B, C, T, H, W)`` clip, linearly embedded (a strided Conv3d)."""

    def __init__(self, tubelet_size: int, patch_size: int, in_chans: int, dim: int) -> None:
        super().__init__()
        self.tubelet_size = int(tubelet_size)
        self.patch_size = int(patch_size)
        k = (self.tubelet_size, self.patch_size, self.patch_size)
        self.proj = nn.Conv3d(in_chans, dim, kernel_size=k, stride=k)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tuple[int, int, int]]:
        """``(B, C, T, H, W) -> ((B, M, D), (gt, gh, gw))``."""
        if x.dim() != 5:
            raise ValueError(f"expected clips (B, C, T, H, W), got shape {tuple(x.shape)}")
        if x.shape[2] < self.tubelet_size or min(x.shape[-2:]) < self.patch_size:
            raise ValueError(f"clip {tuple(x.shape[2:])} is smaller than the tubelet "
                             f"({self.tubelet_size}, {self.patch_size}, {self.patch_size})")
        y = self.proj(x)  # (B, D, gt, gh, gw)
        grid = tuple(y.shape[2:])
        return y.flatten(2).transpose(1, 2).contiguous(), grid  # (B, M, D), contiguous as in PatchEmbed


class LearnedPosEmbed(nn.Module):
    """A learned table ``(1, D, *grid)`` added to the patch embeddings; resized (bilinear for images,
    trilinear for video, ``align_corners=False``) when the input grid differs from the training grid."""

    def __init__(self, dim: int, grid: Sequence[int]) -> None:
        super().__init__()
        self.grid = tuple(int(g) for g in grid)
        self.table = nn.Parameter(torch.zeros(1, dim, *self.grid))
        nn.init.trunc_normal_(self.table, std=0.02)

    def forward(self, grid: Sequence[int]) -> Tensor:
        """``grid -> (1, M, D)``."""
        table = self.table
        if tuple(grid) != self.grid:
            mode = "bilinear" if len(self.grid) == 2 else "trilinear"
            table = F.interpolate(table, size=tuple(grid), mode=mode, align_corners=False)  # (1, D, *grid)
        return table.flatten(2).transpose(1, 2)  # (1, M, D)


def sincos_pos_embed(coords: Tensor, dim: int, temperature: float = 10000.0) -> Tensor:
    """Fixed sinusoidal embedding of ``(M, c)`` coordinates: ``(M, D)``.

    Each axis gets ``2 * (D // (2c))`` channels, half sines and half cosines with frequencies
    ``temperature ** (-i / (D // (2c)))`` (MAE's 2-D sincos for ``c = 2``); leftover channels are zero.
    """
    m, c = coords.shape
    per = dim // (2 * c)
    if per == 0:
        raise ValueError(f"width {dim} is too small for a sincos embedding of {c} axes")
    omega = temperature ** (-torch.arange(per, dtype=torch.float32, device=coords.device) / per)  # (per,)
    ang = coords.float()[:, :, None] * omega  # (M, c, per)
    emb = torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1).reshape(m, 2 * c * per)  # (M, 2c*per)
    if emb.shape[1] < dim:
        emb = F.pad(emb, (0, dim - emb.shape[1]))
    return emb


class SinCosPosEmbed(nn.Module):
    """Fixed sinusoidal absolute position embedding of the integer patch indices (no parameters, any grid)."""

    def __init__(self, dim: int, temperature: float = 10000.0) -> None:
        super().__init__()
        self.dim = dim
        self.temperature = temperature

    def forward(self, grid: Sequence[int], device=None) -> Tensor:
        """``grid -> (1, M, D)``."""
        axes = [torch.arange(int(g), dtype=torch.float32, device=device) for g in grid]
        coords = torch.stack([a.reshape(-1) for a in torch.meshgrid(*axes, indexing="ij")], dim=-1)  # (M, c)
        return sincos_pos_embed(coords, self.dim, self.temperature).unsqueeze(0)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, temperature={self.temperature}"

