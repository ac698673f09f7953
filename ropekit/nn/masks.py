"""Attention masks for packed sequences (several images in one sequence) and the attention call that takes them.

A packed row holds the tokens of several images; ``segment_ids`` ``(B, N)`` gives each token's image (``-1``:
padding). Attention is block diagonal: token ``i`` attends to token ``j`` iff ``seg[i] == seg[j]`` (padding tokens
attend to each other only, so no row of the mask is empty and no softmax sees only ``-inf``). Three ways to run it:

* SDPA with a boolean mask ``(B, 1, N, N)`` (:func:`segment_mask`) -- any device, every PyTorch backend;
* FlexAttention with a document mask (:func:`flex_segment_mask`) -- ``create_block_mask`` evaluates the mask
  function on the device, with no ``.item()``/host synchronisation; fused under ``torch.compile``;
* FlashAttention's varlen kernel (:func:`varlen_segments`, :class:`VarlenSegments`): the rows' tokens gathered into
  one sequence per segment, ``cu_seqlens`` marking where each begins, and only the blocks of each segment computed.
  It runs on CUDA in float16 / bfloat16 through PyTorch's ``torch.nn.attention.varlen.varlen_attn`` or, where that
  is missing, flash-attn's ``flash_attn_varlen_func`` (:func:`varlen_function`). Built on the device without host
  synchronisation: the gather order is a stable sort of ``(row, segment)``, the starts a ``searchsorted`` in it, and
  the kernel's ``max_seqlen`` (a host integer) is bounded by the row length ``N`` known from the shape instead of
  read back as the longest segment (which would need a ``.item()``); the bound only sizes the kernel's launch grid
  (blocks past a segment's end return at once), so results are the same. Encodings are applied to q and k before
  attention, so the kernel sees rotated q / k and needs no rotary support of its own.

Shape legend: ``B`` rows, ``N`` tokens per row, ``H`` heads, ``d`` head dimension, ``S`` segments (image slots) per
row.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["segment_mask", "flex_segment_mask", "cu_seqlens", "is_block_mask", "masked_attention", "VarlenSegments",
           "varlen_segments", "VarlenKernel", "varlen_function", "varlen_usable", "varlen_attention", "VARLEN_DTYPES",
           "NO_VARLEN"]

#: The dtypes FlashAttention's varlen kernel takes.
VARLEN_DTYPES = (torch.float16, torch.bfloat16)


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


class VarlenSegments(NamedTuple):
    """The segments of packed rows laid out for a varlen attention kernel (:func:`varlen_segments`).

    Attributes:
        order: ``(B N,)`` int64, the flat token positions (``row * N + token``) sorted by ``(row, segment)``, stable:
            gathering the flattened tokens by it puts every segment's tokens next to each other, in their order.
        inverse: ``(B N,)`` int64, the permutation back (``inverse[order] = arange``).
        cu_seqlens: ``(B (S + 1) + 1,)`` int32, where each sequence starts in the gathered layout: per row its ``S``
            segments, then its padding (segment ``-1``) as one more sequence; empty ones have length 0.
        max_seqlen: a bound on the longest sequence (the row length ``N`` unless given exactly).
        segment_ids: ``(B, N)``, the segments laid out.
        mode: ``"varlen"`` (the kernel, else an error) or ``"auto"`` (the kernel where :func:`varlen_usable`, else
            SDPA with :attr:`fallback_mask`).
        fallback_mask: ``(B, 1, N, N)`` bool, :func:`segment_mask` of ``segment_ids`` for the SDPA fallback of
            ``mode="auto"``, built once for every layer (``None`` in ``mode="varlen"``).
    """

    order: Tensor
    inverse: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    segment_ids: Tensor
    mode: str = "varlen"
    fallback_mask: Optional[Tensor] = None


def varlen_segments(segment_ids: Tensor, num_segments: int, *, max_seqlen: Optional[int] = None,
                    mode: str = "varlen") -> VarlenSegments:
    """:class:`VarlenSegments` of ``segment_ids`` ``(B, N)`` (values ``-1 .. num_segments - 1``), on their device,
    without a host synchronisation.

    Args:
        segment_ids: each token's segment, ``-1`` for padding (the padding of a row attends to itself, as in
            :func:`segment_mask`).
        num_segments: ``S``, segments per row (the slots of a packed batch; a Python int, from a shape).
        max_seqlen: the longest segment when the caller knows it on the host (the data loader does); default the
            row length ``N``, a bound that needs no synchronisation.
        mode: ``"varlen"`` or ``"auto"`` (see :class:`VarlenSegments`).
    """
    _check_segments(segment_ids)
    if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
        raise ValueError(f"num_segments must be a positive int, got {num_segments!r}")
    if mode not in ("varlen", "auto"):
        raise ValueError(f"mode must be 'varlen' or 'auto', got {mode!r}")
    b, n = segment_ids.shape
    seg = segment_ids.long()
    slot = torch.where(seg >= 0, seg, torch.full_like(seg, num_segments))  # padding: the row's last sequence
    rows = torch.arange(b, device=seg.device).unsqueeze(1)  # (B, 1)
    key = (rows * (num_segments + 1) + slot).flatten()  # (B N,) the sequence of each token
    ordered, order = torch.sort(key, stable=True)  # (B N,) each
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(b * n, device=seg.device))
    # sequence g starts after the tokens of the sequences before it: a search in the sorted keys (no bincount, whose
    # size would need a sync; deterministic, unlike an atomic index_add)
    starts = torch.arange(b * (num_segments + 1) + 1, device=seg.device)  # (B (S + 1) + 1,)
    cu = torch.searchsorted(ordered, starts).to(torch.int32)
    bound = n if max_seqlen is None else int(max_seqlen)
    fallback = segment_mask(segment_ids) if mode == "auto" else None
    return VarlenSegments(order, inverse, cu, bound, segment_ids, mode, fallback)


class VarlenKernel(NamedTuple):
    """A varlen attention function and where it runs.

    Attributes:
        name: what it is (``"torch.nn.attention.varlen.varlen_attn"``, ``"flash_attn.flash_attn_varlen_func"``).
        fn: ``fn(q, k, v, cu_seqlens, max_seqlen, scale, dropout_p) -> out`` on ``(T, H, d)`` tensors, every sequence
            attending within itself.
        device_types: the devices it runs on. dtypes: the dtypes it takes. dropout: whether it applies attention
            dropout. max_head_dim: the widest q / k head it takes (a multiple of 8; FlashAttention 2: 256).
    """

    name: str
    fn: Callable[..., Tensor]
    device_types: Tuple[str, ...] = ("cuda",)
    dtypes: Tuple[torch.dtype, ...] = VARLEN_DTYPES
    dropout: bool = False
    max_head_dim: int = 256


def varlen_function() -> Optional[VarlenKernel]:
    """The varlen attention kernel this installation has: PyTorch's ``torch.nn.attention.varlen.varlen_attn``
    (FlashAttention 2 inside PyTorch; no dropout; a version without its ``scale`` argument gets q pre-scaled), else
    flash-attn's ``flash_attn_varlen_func``; ``None`` when neither is there. Both run on CUDA in float16 /
    bfloat16. Looked up once, when this module is imported (so that ``torch.compile`` reads a constant)."""
    return _VARLEN


def _find_varlen() -> Optional[VarlenKernel]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:
        has_scale = "scale" in inspect.signature(varlen_attn).parameters

        def torch_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: Optional[float],
                         dropout_p: float) -> Tensor:
            if has_scale:
                return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale)
            if scale is not None:  # its scale is 1 / sqrt(d): fold the ratio into q
                q = q * (scale * math.sqrt(q.shape[-1]))
            return varlen_attn(q, k, v, cu, cu, max_len, max_len)

        return VarlenKernel("torch.nn.attention.varlen.varlen_attn", torch_varlen)
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - missing, or built for another PyTorch / CUDA (ImportError, OSError, ...)
        return None

    def flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: Optional[float],
                     dropout_p: float) -> Tensor:
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, dropout_p=dropout_p, softmax_scale=scale)

    return VarlenKernel("flash_attn.flash_attn_varlen_func", flash_varlen, dropout=True)


_VARLEN = _find_varlen()

#: The one-line error of ``attention="varlen"`` where no varlen kernel is installed.
NO_VARLEN = ("attention='varlen' needs torch.nn.attention.varlen.varlen_attn (recent PyTorch) or flash-attn's "
             "flash_attn_varlen_func; neither is installed (use attention='sdpa')")


def varlen_usable(q: Tensor, dropout_p: float = 0.0) -> bool:
    """Whether the installed varlen kernel (:func:`varlen_function`) takes ``q`` ``(..., d')``: its device and dtype
    (CUDA, float16 / bfloat16; under autocast the autocast dtype, which q / k / v are then cast to, as SDPA does),
    ``d'`` a multiple of 8 up to its widest head, and dropout only where it has dropout."""
    kernel = varlen_function()
    return (kernel is not None and q.device.type in kernel.device_types and _dtype_in(q) in kernel.dtypes
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= kernel.max_head_dim and (not dropout_p or kernel.dropout))


def _dtype_in(q: Tensor) -> torch.dtype:
    """The dtype attention runs in: the autocast dtype where autocast is on for ``q``'s device, else ``q``'s."""
    dev = q.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, segments: VarlenSegments, *, dropout_p: float = 0.0,
                     scale: Optional[float] = None) -> Tensor:
    """Attention of each segment within itself through the varlen kernel: ``q``, ``k`` ``(B, H, N, d')``, ``v``
    ``(B, H, N, d)`` -> ``(B, H, N, d)``, as ``F.scaled_dot_product_attention`` with :func:`segment_mask` gives it.

    Raises:
        ValueError: no varlen kernel installed, or ``q`` on a device, in a dtype or with dropout it does not take;
            one line.
    """
    kernel = varlen_function()
    if kernel is None:
        raise ValueError(NO_VARLEN)
    if not varlen_usable(q, dropout_p):
        raise ValueError(f"varlen attention ({kernel.name}) runs on {'/'.join(kernel.device_types)} in "
                         f"{' or '.join(str(t).replace('torch.', '') for t in kernel.dtypes)}"
                         f"{'' if kernel.dropout else ' without dropout'}, heads of a multiple of 8 up to "
                         f"{kernel.max_head_dim}; got {q.device.type} {str(_dtype_in(q)).replace('torch.', '')}, "
                         f"head {q.shape[-1]}{f', dropout {dropout_p}' if dropout_p else ''} "
                         "(use autocast, or attention='auto' / 'sdpa')")
    dt = _dtype_in(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)  # (autocast: as SDPA casts them)
    b, h, n, dq = q.shape
    dv = v.shape[-1]
    if dv != dq:  # one head dimension for the kernel: pad v, cut the output (as for FlexAttention)
        v = F.pad(v, (0, dq - dv))

    def flat(x: Tensor) -> Tensor:  # (B, H, N, d) -> (B N, H, d), gathered segment by segment
        return x.transpose(1, 2).reshape(b * n, h, x.shape[-1]).index_select(0, segments.order)

    out = kernel.fn(flat(q), flat(k), flat(v), segments.cu_seqlens, segments.max_seqlen, scale,
                    dropout_p)  # (B N, H, d')
    return out.index_select(0, segments.inverse).view(b, n, h, dq).transpose(1, 2)[..., :dv]  # (B, H, N, d)


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
    ``(B, H, N, N)`` through ``F.scaled_dot_product_attention``, a FlexAttention ``BlockMask`` through
    ``flex_attention`` (no dropout there: ``ValueError`` with ``dropout_p > 0``), or :class:`VarlenSegments` through
    the varlen kernel (``mode="auto"``: SDPA with the block-diagonal mask where the kernel cannot run, see
    :func:`varlen_usable`). ``q`` and ``k`` may be wider than ``v`` (the tensor-product encoding): FlexAttention and
    the varlen kernel then run on ``v`` zero-padded to their width."""
    if isinstance(mask, VarlenSegments):
        if mask.mode == "auto" and not varlen_usable(q, dropout_p):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.fallback_mask,
                                                  dropout_p=dropout_p, scale=scale)
        return varlen_attention(q, k, v, mask, dropout_p=dropout_p, scale=scale)
    if is_block_mask(mask):
        if dropout_p:
            raise ValueError("FlexAttention runs without attention dropout: set attn_drop_rate=0 or use an SDPA mask")
        dv = v.shape[-1]
        if q.shape[-1] != dv:  # flex needs one head dimension: pad v, cut the output
            v = F.pad(v, (0, q.shape[-1] - dv))
        return _flex()(q, k, v, mask, scale)[..., :dv]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
