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


def _kv_basis(p: Tensor, num_heads: int, num_kv_heads: int) -> Tensor:
    """The basis of each key head of grouped-query attention: ``(Hk or 1, d, d)`` from the query heads' ``(H or 1,
    d, d)``, which must agree within each group (ValueError otherwise: a per-head basis is not absorbed by a key
    projection that the heads of a group share)."""
    if p.shape[0] == 1 or num_kv_heads == num_heads:
        return p
    groups = p.unflatten(0, (num_kv_heads, num_heads // num_kv_heads))  # (Hk, H / Hk, d, d)
    if not bool((groups == groups[:, :1]).all()):
        raise ValueError(f"cannot fold a per-head basis into grouped-query attention (num_heads={num_heads}, "
                         f"num_kv_heads={num_kv_heads}): each query head would need its own key projection P_h W_k; "
                         f"keep the model unfolded or share the encoding across heads")
    return groups[:, 0]


def _fold_into_qkv(qkv: nn.Linear, p: Tensor, num_heads: int, head_dim: int, num_kv_heads: int) -> None:
    """Replace the q and k rows of a fused ``(D + 2 Hk d, D_in)`` projection by ``P_h W_h`` (and the biases by
    ``P_h b_h``): ``H`` query heads with ``p`` (``(H or 1, d, d)``), then ``Hk`` key heads with
    :func:`_kv_basis`."""
    bases = (p.to(torch.float64), _kv_basis(p, num_heads, num_kv_heads).to(torch.float64))
    with torch.no_grad():
        w = qkv.weight
        start = 0
        for heads, p64 in zip((num_heads, num_kv_heads), bases):  # q rows, then k rows
            rows = slice(start, start + heads * head_dim)
            start += heads * head_dim
            wh = w[rows].to(torch.float64).view(heads, head_dim, -1)  # (heads, d, D_in)
            w[rows] = (p64 @ wh).reshape(heads * head_dim, -1).to(w.dtype)
            if qkv.bias is not None:
                bh = qkv.bias[rows].to(torch.float64).view(heads, head_dim, 1)
                qkv.bias[rows] = (p64 @ bh).reshape(heads * head_dim).to(qkv.bias.dtype)


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
        ValueError: see ``strict``; and always for a grouped-query layer (``num_kv_heads < num_heads``) whose
            encoding has a basis per head: it is not absorbed by the shared key projection
            (:mod:`ropekit.nn.attention`), so no folded model computes the same function.
    """
    if isinstance(obj, PositionEncoding):
        return fold_pe(obj)
    if not isinstance(obj, nn.Module):
        raise ValueError(f"fold needs an nn.Module or a PositionEncoding, got {type(obj).__name__}")
    model = obj if inplace else copy.deepcopy(obj)
    done: dict = {}
    todo = []
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
        _kv_basis(p, m.num_heads, m.num_kv_heads)  # every layer checked before any is changed
        todo.append((m, folded, p))
    for m, folded, p in todo:
        _fold_into_qkv(m.qkv, p.to(m.qkv.weight.device), m.num_heads, m.head_dim, m.num_kv_heads)
        m.pe = folded
    return model
