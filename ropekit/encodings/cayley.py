"""Cayley-STRING: ``R(r) = RoPE-Mixed(r) . P`` with a learnable orthogonal ``P = (I - S)(I + S)^-1``.

``S = A - A^T`` (optionally restricted to a band ``|i - j| <= band``); ``A`` starts at zero, so the encoding
starts as RoPE-Mixed. ``P`` comes from one factorised solve per forward (``solve_ex``), shared by q, k and
every token, and is applied as a matrix product. The commuting generators it implies are
``L_k = P^T J_k P`` (``J_k`` the RoPE-Mixed generators): ``R(r) = P expm(sum_k r_k L_k)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .functional import basis_change, cayley_transform, rotate_pairs, skew
from .rope import MixedRoPE

__all__ = ["CayleySTRING"]


class CayleySTRING(MixedRoPE):
    name = "cayley"
    post_rotation = True

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, base: float = 100.0,
                 per_head: bool = False, band: int | None = None, freqs: Tensor | None = None) -> None:
        super().__init__(head_dim, coord_dim, num_heads, base=base, per_head=per_head, freqs=freqs)
        self.cayley_params = nn.Parameter(torch.zeros(self.param_heads, head_dim, head_dim))
        self.band = band
        if band is not None:
            if not 1 <= band < head_dim:
                raise ValueError(f"cayley band must be in [1, {head_dim - 1}], got {band}")
            i = torch.arange(head_dim)
            mask = ((i[None, :] - i[:, None]) > 0) & ((i[None, :] - i[:, None]) <= band)
            self.register_buffer("band_mask", mask.float(), persistent=False)

    def skew_matrix(self) -> Tensor:
        """``S`` of shape ``(Hp, d, d)``."""
        a = self.cayley_params
        if self.band is not None:
            a = a * self.band_mask
        return skew(a)

    def post_rotation_matrix(self) -> Tensor:
        return cayley_transform(self.skew_matrix()).expand(self.num_heads, -1, -1)

    def _prepare(self, coords: Tensor, dtype: torch.dtype):
        cos, sin = super()._prepare(coords, dtype)
        p = cayley_transform(self.skew_matrix().to(dtype))  # (Hp, d, d)
        return cos, sin, p

    def _transform(self, x: Tensor, state) -> Tensor:
        cos, sin, p = state
        x = basis_change(x, p)  # P x per token, one GEMM: (B, H, M, d)
        return rotate_pairs(x, cos, sin)

    def generators(self) -> Tensor:
        p = self.post_rotation_matrix()  # (H, d, d)
        j = super().generators()  # (H, c, d, d)
        return p.transpose(-1, -2).unsqueeze(1) @ j @ p.unsqueeze(1)

    def to_rope(self) -> tuple[Tensor, Tensor]:
        """``(P, freqs)`` with ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P``: the Cayley rotation and the mixed
        frequencies (``R(r) = RoPE(r) P`` exactly). ``(H, d, d)``, ``(H, c, d/2)``, detached."""
        with torch.no_grad():
            p = cayley_transform(self.skew_matrix().double()).to(self.cayley_params.dtype)
        return p.expand(self.num_heads, -1, -1), self.freqs.detach().expand(self.num_heads, -1, -1)
