"""The naive reference forms that ``ropekit bench`` compares the fast paths against.

They share the parameters of the fast module they wrap, so outputs and gradients can be compared exactly.

* :class:`NaiveLieRE` -- LieRE as its published code computes it: one ``torch.linalg.matrix_exp`` per example,
  head, token (and block), the rotations applied with an einsum.
* :class:`DenseComRoPE` -- ComRoPE as its published code computes it: one matrix exponential per example, head,
  token and block, scattered into a dense ``d x d`` matrix per (example, head, token) and applied as a
  matrix-vector product.

Shape legend: ``B`` batch, ``H`` heads, ``M`` tokens, ``d`` head dimension, ``nb`` blocks of size ``b``,
``c`` coordinate dimension.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor, nn

from ..encodings import ComRoPEAP, ComRoPELD, LieRE
from ..encodings.ops.blocks import block_diag

__all__ = ["NaiveLieRE", "DenseComRoPE"]


def _per_example(coords: Tensor, batch: int) -> Tensor:
    """``(M, c)`` or ``(B, M, c)`` -> ``(B, M, c)`` (the naive forms never share work across the batch)."""
    return coords.expand(batch, *coords.shape) if coords.dim() == 2 else coords


class NaiveLieRE(nn.Module):
    """One ``matrix_exp`` per (example, head, token, block); wraps a :class:`~ropekit.encodings.LieRE`."""

    def __init__(self, pe: LieRE) -> None:
        super().__init__()
        self.pe = pe

    def forward(self, q: Tensor, k: Tensor, coords: Tensor) -> Tuple[Tensor, Tensor]:
        b, h, m, d = q.shape
        gen = self.pe.block_generators()  # (Hp, c, nb, bs, bs)
        bs = gen.shape[-1]
        g = torch.einsum("bmc,hcnij->bhmnij", _per_example(coords, b).to(gen.dtype), gen)  # (B, Hp, M, nb, bs, bs)
        g = g.expand(b, h, *g.shape[2:]).contiguous()  # one generator per example and head
        rot = torch.linalg.matrix_exp(g)  # (B, H, M, nb, bs, bs)

        def apply(x: Tensor) -> Tensor:
            return torch.einsum("bhmnij,bhmnj->bhmni", rot, x.unflatten(-1, (-1, bs))).flatten(-2)

        return apply(q), apply(k)


class DenseComRoPE(nn.Module):
    """Per-token dense ``d x d`` ComRoPE; wraps a :class:`~ropekit.encodings.ComRoPEAP` or ``ComRoPELD``."""

    def __init__(self, pe) -> None:
        super().__init__()
        if not isinstance(pe, (ComRoPEAP, ComRoPELD)):
            raise ValueError(f"DenseComRoPE wraps comrope-ap or comrope-ld, got {type(pe).__name__}")
        self.pe = pe

    def forward(self, q: Tensor, k: Tensor, coords: Tensor) -> Tuple[Tensor, Tensor]:
        b, h, m, d = q.shape
        kb = self.pe.block_generators()  # (Hp, nb, bs, bs)
        s = self.pe.block_scales(_per_example(coords, b).to(kb.dtype))  # (B, Hp', M, nb)
        s = s.expand(b, h, *s.shape[2:])  # (B, H, M, nb): one per example and head
        blocks = torch.linalg.matrix_exp(s.unsqueeze(-1).unsqueeze(-1) * kb.unsqueeze(1))  # (B, H, M, nb, bs, bs)
        dense = block_diag(blocks)  # (B, H, M, d, d)
        return torch.einsum("bhmij,bhmj->bhmi", dense, q), torch.einsum("bhmij,bhmj->bhmi", dense, k)
