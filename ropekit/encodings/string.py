"""General STRING, the dense reference form: ``R(r) = expm(sum_k r_k L_k)``.

Commuting generators ``L_k = Q D_k Q^T`` with a learnable orthogonal ``Q = expm(A - A^T)`` and
``D_k`` 2x2-block skew (RoPE-Mixed generators). The forward pass is one ``torch.linalg.matrix_exp``
per token (per parameter head, once for the batch when coordinates are shared): it is the slow,
obviously-correct form the fast variants are tested against, not a model component.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import PositionEncoding
from .functional import mixed_frequencies, pair_generators, skew

__all__ = ["GeneralSTRING", "dense_expm_rotations"]


def dense_expm_rotations(coords: Tensor, generators: Tensor) -> Tensor:
    """``expm(sum_k r_k L_k)`` per token.

    Args:
        coords: ``(M, c)`` or ``(B, M, c)``; generators: ``(Hp, c, n, n)``.

    Returns:
        ``(Hp, M, n, n)`` or ``(B, Hp, M, n, n)``.
    """
    if coords.dim() == 2:
        g = torch.einsum("mc,hcij->hmij", coords, generators)
    else:
        g = torch.einsum("bmc,hcij->bhmij", coords, generators)
    return torch.linalg.matrix_exp(g.contiguous())


class GeneralSTRING(PositionEncoding):
    name = "string"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, base: float = 100.0,
                 basis_scale: float = 0.5, per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        self.freq_param = nn.Parameter(mixed_frequencies(head_dim, coord_dim, self.param_heads, base))
        self.basis_params = nn.Parameter(torch.randn(self.param_heads, head_dim, head_dim) * basis_scale / head_dim ** 0.5)

    def basis(self) -> Tensor:
        """Orthogonal ``Q``: ``(Hp, d, d)``."""
        return torch.linalg.matrix_exp(skew(self.basis_params))

    def _generators(self, dtype: torch.dtype | None = None) -> Tensor:
        q = self.basis()
        gen = q.unsqueeze(1) @ pair_generators(self.freq_param) @ q.transpose(-1, -2).unsqueeze(1)
        return gen if dtype is None else gen.to(dtype)  # (Hp, c, d, d)

    def generators(self) -> Tensor:
        return self._generators().expand(self.num_heads, -1, -1, -1)

    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> Tensor:
        r = dense_expm_rotations(coords, self._generators(dtype))
        return r.unsqueeze(0) if r.dim() == 4 else r  # (B|1, Hp, M, d, d)

    def _transform(self, x: Tensor, rot: Tensor) -> Tensor:
        return torch.einsum("bhmij,bhmj->bhmi", rot, x)
