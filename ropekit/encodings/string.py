"""General STRING: ``R(r) = expm(sum_k r_k L_k)`` with commuting generators ``L_k = Q D_k Q^T``.

``Q = expm(A - A^T)`` is a learnable rotation and ``D_k`` are 2x2-block skew (RoPE-Mixed generators), so the
exponential is diagonal in the basis ``Q``: ``R(r) = Q RoPE(r) Q^T``. The forward pass applies exactly that
(``Q^T x``, a pairwise rotation, ``Q``): ``O(d^2)`` per token, no per-token matrix exponential and no per-token
``d x d`` matrix, for coordinates shared by the batch or per example alike; only ``Q`` is a (float64)
``matrix_exp``, once per forward. ``generators()`` gives the dense ``L_k``, whose per-token ``matrix_exp`` is
the reference the fast encodings are tested against (``dense_expm_rotations``).

``num_effective_parameters()`` counts ``A``'s free entries once (only ``A - A^T`` acts).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops.angles import angle_table
from .base import PositionEncoding
from .ops.forms import RoPEForm, half_pairs_basis
from .ops.frequencies import mixed_frequencies, pair_generators
from .ops.products import basis_change
from .registry import register_pe
from .ops.rotation import rotate_angles
from .ops.skew import skew

__all__ = ["GeneralSTRING", "dense_expm_rotations"]


def dense_expm_rotations(coords: Tensor, generators: Tensor) -> Tensor:
    """``expm(sum_k r_k L_k)`` per token (the dense reference).

    Args:
        coords: ``(M, c)`` or ``(B, M, c)``; generators: ``(Hp, c, n, n)``.

    Returns:
        ``(Hp, M, n, n)`` or ``(B, Hp, M, n, n)``.
    """
    # sum_k r_k L_k by elementwise products (a matmul / einsum would run in TF32 on a GPU that enables it)
    r = coords.unsqueeze(-3)  # (.., 1, M, c): broadcast over the parameter heads
    g = r[..., 0, None, None] * generators[:, 0, None]
    for k in range(1, coords.shape[-1]):
        g = g + r[..., k, None, None] * generators[:, k, None]
    return torch.linalg.matrix_exp(g.contiguous())


@register_pe("string", label="STRING (general)", paper_sharing="layer")
class GeneralSTRING(PositionEncoding):
    rope_kind = "string"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, base: float = 100.0,
                 basis_scale: float = 0.5, per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        self.base, self.basis_scale = base, basis_scale
        self.freq_param = nn.Parameter(torch.empty(self.param_heads, coord_dim, head_dim // 2))
        self.basis_params = nn.Parameter(torch.empty(self.param_heads, head_dim, head_dim))
        self._init_weights()

    def _init_weights(self) -> None:
        """Frequencies as RoPE-Mixed; ``A`` normal with standard deviation ``basis_scale / sqrt(d)``."""
        if self.freq_param.is_meta:
            return
        d, hp = self.head_dim, self.param_heads
        with torch.no_grad():
            self.freq_param.copy_(mixed_frequencies(d, self.coord_dim, hp, self.base))
            self.basis_params.copy_(torch.randn(hp, d, d) * self.basis_scale / d ** 0.5)

    def basis(self, dtype: torch.dtype | None = None) -> Tensor:
        """Orthogonal ``Q``: ``(Hp, d, d)``, exponentiated in float64 (orthogonal to round-off)."""
        a = self.basis_params
        q = torch.linalg.matrix_exp(skew(a.to(torch.float64)))
        return q.to(a.dtype if dtype is None else dtype)

    def _generators(self, dtype: torch.dtype | None = None) -> Tensor:
        # the products in float64: a float32 matmul would run in TF32 on a GPU that enables it
        q = self.basis(torch.float64)
        gen = q.unsqueeze(1) @ pair_generators(self.freq_param.double()) @ q.transpose(-1, -2).unsqueeze(1)
        return gen.to(self.freq_param.dtype if dtype is None else dtype)  # (Hp, c, d, d)

    def generators(self) -> Tensor:
        return self._generators().expand(self.num_heads, -1, -1, -1)

    def _prepare(self, coords: Tensor, dtype: torch.dtype):
        q = self.basis(dtype)  # (Hp, d, d)
        return q, angle_table(coords, self.freq_param, dtype)  # float64 angles, cos/sin: (1 | B, Hp, M, P) each

    def _transform(self, x: Tensor, state) -> Tensor:
        q, table = state
        y = basis_change(x, q.transpose(-1, -2))  # Q^T x: (B, H, M, d)
        return basis_change(rotate_angles(y, *table), q)  # Q RoPE(r) Q^T x

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """``L_k = Q D_k Q^T``: in the basis ``P = Q^T`` the frequencies are the parameters themselves."""
        hp = self.param_heads
        return RoPEForm(half_pairs_basis(self, self.basis().transpose(-1, -2)[:hp]), self.freq_param[:hp], None)

    def num_effective_parameters(self) -> int:
        """Frequencies plus the free entries of ``A - A^T``."""
        d = self.head_dim
        return self.freq_param.numel() + self.param_heads * d * (d - 1) // 2
