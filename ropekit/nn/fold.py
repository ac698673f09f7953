"""Folding a model for inference: the basis of every commuting encoding merged into the query/key projections of
its :class:`~ropekit.nn.Attention` layers, the encodings replaced by fixed-frequency RoPE.

The mathematics (each encoding's RoPE form, :class:`~ropekit.encodings.fold.FoldedRoPE`, :func:`fold_pe`) is
:mod:`ropekit.encodings.fold`; this module only walks a model.
"""

from __future__ import annotations

import copy
from typing import Tuple, Union

import torch
from torch import Tensor, nn

from ..encodings.base import PositionEncoding
from ..encodings.fold import FoldedRoPE, fold_pe, is_foldable, to_rope
from ..encodings.rope import FrequencyRoPE
from .attention import Attention

__all__ = ["fold"]


def _is_plain_rope(pe: PositionEncoding) -> bool:
    """RoPE already (axial, mixed, liere-commute, none, folded): ``P = I`` and no post-rotation."""
    if isinstance(pe, FoldedRoPE):
        return True
    if not isinstance(pe, FrequencyRoPE) or pe.post_rotation_matrix() is not None:
        return False
    p, _ = pe.to_rope()
    return bool(torch.equal(p, torch.eye(pe.head_dim, dtype=p.dtype, device=p.device).expand_as(p)))


def _fold_into_qkv(qkv: nn.Linear, p: Tensor, num_heads: int, head_dim: int) -> None:
    """Replace the q and k rows of a fused ``(3 D, D_in)`` projection by ``P_h W_h`` (and the biases by ``P_h b_h``)."""
    dim = num_heads * head_dim
    p64 = p.to(torch.float64)  # (H, d, d)
    with torch.no_grad():
        w = qkv.weight
        for part in (0, 1):  # q rows [0, D), k rows [D, 2D)
            rows = slice(part * dim, (part + 1) * dim)
            wh = w[rows].to(torch.float64).view(num_heads, head_dim, -1)  # (H, d, D_in)
            w[rows] = (p64 @ wh).reshape(dim, -1).to(w.dtype)
            if qkv.bias is not None:
                bh = qkv.bias[rows].to(torch.float64).view(num_heads, head_dim, 1)
                qkv.bias[rows] = (p64 @ bh).reshape(dim).to(qkv.bias.dtype)


def fold(obj: Union[nn.Module, PositionEncoding], *, inplace: bool = False,
         strict: bool = True) -> Union[nn.Module, Tuple[FoldedRoPE, Tensor]]:
    """Fold the learned basis of every commuting encoding into the query/key projections, for inference.

    Args:
        obj: a model holding ``ropekit.nn.Attention`` layers (e.g. a ``VisionTransformer``), or one encoding.
        inplace: modify ``obj`` instead of a deep copy (models only).
        strict: raise on an encoding that cannot be folded (non-commuting, tensor-product) or on an encoding
            held by a layer other than ``ropekit.nn.Attention``; with ``strict=False`` those are left unchanged.

    Returns:
        For a model: the folded model (logits equal the original's up to float rounding; eval mode is not
        changed). Encodings with ``P = I`` (axial, mixed, liere-commute, already folded) are kept as they are;
        an encoding shared by several layers becomes one shared :class:`FoldedRoPE`.
        For an encoding: ``(FoldedRoPE, P)`` as :func:`fold_pe`.

    Raises:
        ValueError: see ``strict``.
    """
    if isinstance(obj, PositionEncoding):
        return fold_pe(obj)
    if not isinstance(obj, nn.Module):
        raise ValueError(f"fold needs an nn.Module or a PositionEncoding, got {type(obj).__name__}")
    model = obj if inplace else copy.deepcopy(obj)
    done: dict = {}
    layers = [m for m in model.modules() if isinstance(getattr(m, "pe", None), PositionEncoding)]
    for m in layers:
        pe = m.pe
        if _is_plain_rope(pe):  # already RoPE (P = I): nothing to fold
            continue
        if not isinstance(m, Attention):
            if strict:
                raise ValueError(f"cannot fold the encoding of a {type(m).__name__}: only ropekit.nn.Attention "
                                 f"(softmax attention with a fused qkv projection) is supported")
            continue
        if id(pe) not in done:
            if not is_foldable(pe):
                if strict:
                    to_rope(pe)  # raises with the reason
                continue
            done[id(pe)] = fold_pe(pe)
        folded, p = done[id(pe)]
        _fold_into_qkv(m.qkv, p.to(m.qkv.weight.device), m.num_heads, m.head_dim)
        m.pe = folded
    return model
