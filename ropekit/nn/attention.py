"""Multi-head self-attention that receives its position encoding from the model builder.

Shape legend: ``B`` batch, ``N`` tokens (``P0`` prefix tokens first, then ``M = N - P0`` tokens with
coordinates), ``D`` width, ``H`` heads, ``d = D / H`` head dimension, ``d'`` the encoded q/k width
(``pe.out_dim``; ``d`` for every rotation, ``2m * d`` for the tensor-product encoding), ``c`` coordinate
dimension.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from ..encodings import PositionEncoding

__all__ = ["Attention"]


class Attention(nn.Module):
    """Self-attention with any ``PositionEncoding`` applied to queries and keys.

    The layer never inspects which encoding it has: it calls ``pe(q, k, coords, num_prefix_tokens)`` and
    ``F.scaled_dot_product_attention`` with the scale ``1 / sqrt(head_dim)`` fixed explicitly (the
    tensor-product encoding widens q and k but keeps the logit ``q^T k * phi^T phi``, so SDPA's default
    ``1 / sqrt(out_dim)`` would be wrong).

    Args:
        dim: ``D``.
        num_heads: ``H`` (must divide ``D``).
        pe: the encoding (``head_dim = D / H``, ``num_heads = H``), or ``None`` for no rotary encoding.
            A module shared by several layers is simply passed to each of them.
        qkv_bias: bias of the fused q/k/v projection.
        attn_drop, proj_drop: dropout on the attention weights and on the output.
    """

    def __init__(self, dim: int, num_heads: int, pe: Optional[PositionEncoding] = None, *, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        if pe is not None and (pe.head_dim != self.head_dim or pe.num_heads != num_heads):
            raise ValueError(f"the position encoding was built for head_dim={pe.head_dim}, num_heads={pe.num_heads}; "
                             f"this attention has head_dim={self.head_dim}, num_heads={num_heads}")
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.pe = pe
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, coords: Optional[Tensor] = None, num_prefix_tokens: int = 0) -> Tensor:
        """Args:
            x: ``(B, N, D)``.
            coords: ``(M, c)`` shared by the batch or ``(B, M, c)`` per example; ignored without an encoding.
            num_prefix_tokens: ``P0`` leading tokens that the encoding leaves unrotated.

        Returns:
            ``(B, N, D)``.
        """
        b, n, dim = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
        q, k, v = qkv.unbind(0)  # (B, H, N, d) each
        if self.pe is not None:
            if coords is None:
                raise ValueError("this attention layer has a position encoding: pass coords")
            q, k = self.pe(q, k, coords, num_prefix_tokens)  # (B, H, N, d') each
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0,
                                             scale=self.scale)  # (B, H, N, d)
        out = out.transpose(1, 2).reshape(b, n, dim)  # (B, N, D)
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}"
