"""Tensor-product STRING (``name="tensor"``): ``z -> vec(phi(r) (x) z)``, widening q and k by ``2m``.

``phi(r) = m^(-1/2) [cos(w_i^T r), sin(w_i^T r)]_{i=1..m}`` with learnable ``w_i``; then
``<vec(phi(r) (x) q), vec(phi(s) (x) k)> = (q^T k) * (1/m) sum_i cos(w_i^T (s - r))``: translation invariant
but not a rotation. Values are not widened; attention must use the scale ``1 / sqrt(head_dim)``.
Prefix tokens are encoded as if at the coordinate origin (``phi(0)``, unit norm), so prefix-prefix
logits are exactly ``q^T k``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .ops.angles import wide_angles
from .base import PositionEncoding
from .ops.frequencies import mixed_frequencies
from .registry import register_pe

__all__ = ["TensorSTRING"]


@register_pe("tensor", label="⊗-STRING", paper_sharing="layer")
class TensorSTRING(PositionEncoding):
    is_rotation = False

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, num_features: int = 2,
                 base: float = 100.0, per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        if num_features < 1:
            raise ValueError(f"tensor: num_features must be >= 1, got {num_features}")
        self.num_features, self.base = num_features, base
        self.feature_freqs = nn.Parameter(torch.empty(self.param_heads, num_features, coord_dim))  # (Hp, m, c)
        self._init_weights()

    def _init_weights(self) -> None:
        """Feature frequencies drawn as RoPE-Mixed's (``m`` of them per parameter head)."""
        if not self.feature_freqs.is_meta:
            w = mixed_frequencies(2 * self.num_features, self.coord_dim, self.param_heads, self.base)  # (Hp, c, m)
            with torch.no_grad():
                self.feature_freqs.copy_(w.transpose(1, 2))

    @property
    def out_dim(self) -> int:
        return 2 * self.num_features * self.head_dim

    def features(self, coords: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``phi(r)``: ``(Hp, M, 2m)`` for shared coords, ``(B, Hp, M, 2m)`` per example, in ``dtype`` (default:
        ``coords``' floating dtype; float32 for integer coordinates).

        The angles ``w_i^T r`` are every encoding's (``angles.wide_angles``: elementwise products in float64, never a
        TF32-rounded einsum) and are rounded after cos/sin.
        """
        ang = wide_angles(coords, self.feature_freqs.transpose(1, 2))  # (.., Hp, M, m)
        if dtype is None:
            dtype = coords.dtype if coords.is_floating_point() else torch.float32
        phi = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1).to(dtype)
        return phi / math.sqrt(self.num_features)

    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> Tensor:
        phi = self.features(coords, dtype)  # (coords in their own precision, phi in the compute dtype)
        return phi.unsqueeze(0) if phi.dim() == 3 else phi  # (B|1, Hp, M, 2m)

    def _transform(self, x: Tensor, phi: Tensor) -> Tensor:
        return (phi.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)  # (B, H, M, 2m*d), index i*d + j

    def _transform_prefix(self, x: Tensor) -> Tensor:
        phi0 = torch.cat([x.new_ones(self.num_features), x.new_zeros(self.num_features)]) / math.sqrt(self.num_features)
        return (phi0[:, None] * x.unsqueeze(-2)).flatten(-2)
