"""Attention masks for packed sequences (several images in one sequence) and the attention call that takes them.

A packed row holds the tokens of several images; ``segment_ids`` ``(B, N)`` gives each token's image (``-1``:
padding). Attention is block diagonal: token ``i`` attends to token ``j`` iff ``seg[i] == seg[j]`` (padding tokens
attend to each other only, so no row of the mask is empty and no softmax sees only ``-inf``). Three ways to run it:

* SDPA with a boolean mask ``(B, 1, N, N)`` (:func:`segment_mask`) -- any device, every PyTorch backend;
* FlexAttention with a document mask (:func:`flex_segment_mask`) -- ``create_block_mask`` evaluates the mask
  function on the device, with no ``.item()``/host synchronisation; fused under ``torch.compile``;
* flash-attn's varlen kernel with ``cu_seqlens`` (:func:`cu_seqlens`), where flash-attn is installed (CUDA).

Shape legend: ``B`` rows, ``N`` tokens per row, ``H`` heads, ``d`` head dimension.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["segment_mask", "flex_segment_mask", "cu_seqlens", "is_block_mask", "masked_attention"]


def _check_segments(segment_ids: Tensor) -> None:
    if segment_ids.dim() != 2 or segment_ids.dtype.is_floating_point or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids must be an integer tensor (B, N), got {segment_ids.dtype} "
                         f"{tuple(segment_ids.shape)}")


def segment_mask(segment_ids: Tensor) -> Tensor:
    """Block-diagonal boolean mask ``(B, 1, N, N)`` (``True``: attend) for SDPA, from ``segment_ids`` ``(B, N)``."""
    _check_segments(segment_ids)
    return (segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)).unsqueeze(1)


def flex_segment_mask(segment_ids: Tensor, block_size: int = 128) -> Any:
    """A FlexAttention ``BlockMask`` for the document mask of ``segment_ids`` ``(B, N)``, built on their device
    without host synchronisation (the mask function is evaluated by ``create_block_mask`` as tensor operations)."""
    _check_segments(segment_ids)
    from torch.nn.attention.flex_attention import create_block_mask

    seg = segment_ids

    def same_segment(b, h, q_idx, kv_idx):
        return seg[b, q_idx] == seg[b, kv_idx]

    b, n = seg.shape
    return create_block_mask(same_segment, b, None, n, n, device=seg.device, BLOCK_SIZE=block_size)


def cu_seqlens(lengths: Tensor) -> Tensor:
    """Cumulative sequence lengths ``(S + 1,)`` int32 (flash-attn varlen) from ``S`` segment lengths:
    ``[0, l_0, l_0 + l_1, ...]``."""
    if lengths.dim() != 1 or lengths.dtype.is_floating_point:
        raise ValueError(f"lengths must be a 1-D integer tensor, got {lengths.dtype} {tuple(lengths.shape)}")
    return F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def is_block_mask(mask: Any) -> bool:
    """Whether ``mask`` is a FlexAttention ``BlockMask``."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - PyTorch without FlexAttention
        return False
    return isinstance(mask, BlockMask)


_FLEX = None


def _flex():
    global _FLEX
    if _FLEX is None:
        import warnings

        from torch.nn.attention.flex_attention import flex_attention

        def run(q, k, v, block_mask, scale):
            with warnings.catch_warnings():  # eager: PyTorch's unfused reference, exact, warns once per process
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                return flex_attention(q, k, v, block_mask=block_mask, scale=scale)

        _FLEX = run
    return _FLEX


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Union[Tensor, Any], dropout_p: float = 0.0,
                     scale: Optional[float] = None) -> Tensor:
    """Attention ``(B, H, N, d)`` under ``mask``: a boolean (or additive float) tensor broadcastable to
    ``(B, H, N, N)`` through ``F.scaled_dot_product_attention``, or a FlexAttention ``BlockMask`` through
    ``flex_attention`` (no dropout there: ``ValueError`` with ``dropout_p > 0``). ``q`` and ``k`` may be wider
    than ``v`` (the tensor-product encoding): FlexAttention then runs on ``v`` zero-padded to their width."""
    if is_block_mask(mask):
        if dropout_p:
            raise ValueError("FlexAttention runs without attention dropout: set attn_drop_rate=0 or use an SDPA mask")
        dv = v.shape[-1]
        if q.shape[-1] != dv:  # flex needs one head dimension: pad v, cut the output
            v = F.pad(v, (0, q.shape[-1] - dv))
        return _flex()(q, k, v, mask, scale)[..., :dv]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
