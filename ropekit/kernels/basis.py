"""The fused basis change and frequency rotation, ``RoPE(theta) P x``, as a differentiable function.

Shape legend: ``B`` batch, ``H`` heads, ``N`` tokens of which the first ``num_prefix_tokens`` carry no coordinate,
``M`` tokens with a coordinate, ``c`` coordinate dimension, ``d`` head dimension, ``Hp`` heads owning a basis (1 or
``H``), ``Hf`` heads owning frequencies (1 or ``H``).

Used where a commuting STRING (Cayley; with ``transpose_back``, Circulant) is applied to every token -- an
encoding called on its own, in a user's attention, where the basis cannot be folded into a projection weight:
the two-step form writes ``P x`` to memory and reads it back (forward and backward), this kernel never does.
Products with ``P`` accumulate in fp32 at fp32 accuracy (``input_precision="tf32x3"`` on a GPU: three TF32
products, independent of the TF32 setting), angles as in :func:`ropekit.kernels.fused_rotary`. Planes are
interleaved pairs ``(2p, 2p + 1)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..encodings.ops.angles import rotate_pairs_real, rope_cos_sin
from ..encodings.ops.products import basis_change
from ..encodings.ops.validation import check_finite, check_real
from .rotary import as_heads, as_rows, available
from .rotary import load_kernels as _rotary_kernels

__all__ = ["basis_rotary_supported", "fused_basis_rotary"]

_MODULE = "ropekit.kernels._basis_triton"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Tokens per tile: the forward's program size, the backward's step through an (example, head).
BLOCK_N = 32


def load_kernels():
    """The kernel module in the mode ``TRITON_INTERPRET`` asks for now, after the rotation kernels' module whose jit
    helpers it calls (so both are in the same mode)."""
    _rotary_kernels()
    return _rotary_kernels(_MODULE)


def basis_rotary_supported(x: Tensor, basis: Tensor, coords: Tensor, freqs: Tensor) -> bool:
    """Whether :func:`fused_basis_rotary` handles these arguments on their device (else use the two-step form):
    the kernel is available there, ``d`` is a power of two from 32 to 128, at most 4 coordinate dimensions, fp32 /
    fp16 / bf16 tokens, and no float64 basis (float64 coordinates and frequencies are fine: the angles are formed
    in float64)."""
    d = x.shape[-1]
    return (x.dim() == 4 and 32 <= d <= 128 and d & (d - 1) == 0 and x.dtype in _DTYPES
            and freqs.shape[-2] <= 4 and basis.dtype != torch.float64 and available(x.device))


def _two_step(x: Tensor, p: Tensor, coords: Tensor, freqs: Tensor, prefix: int, post: bool = False) -> Tensor:
    """``RoPE(theta) P x`` (``post``: then ``P^T``) in differentiable PyTorch operations, prefix tokens unchanged:
    the map the backward pass differentiates under ``create_graph``. Computed in float32 as the kernel is (angles
    in float64 by elementwise products, products with ``P`` float32-accurate under TF32), output in ``x``'s dtype.

    Shapes as :func:`fused_basis_rotary`'s arguments: ``x`` ``(B, H, N, d)``, ``p`` ``(Hp, d, d)``, ``coords``
    ``(M, c)`` / ``(B, M, c)``, ``freqs`` ``(c, d / 2)`` / ``(Hf, c, d / 2)``.
    """
    pf = p.to(torch.float32)
    y = basis_change(x[:, :, prefix:].to(torch.float32), pf)  # (B, H, M, d)
    cos, sin = rope_cos_sin(coords, freqs if freqs.dim() == 3 else freqs.unsqueeze(0), torch.float32)
    out = rotate_pairs_real(y, cos, sin)  # cos, sin: (1 | B, Hf, M, d/2)
    if post:
        out = basis_change(out, pf.transpose(-1, -2))  # P^T per head
    return torch.cat([x[:, :, :prefix], out.to(x.dtype)], dim=2)


def _precision(x: Tensor) -> str:
    return "ieee" if x.device.type == "cpu" else "tf32x3"


class _FusedBasisRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, basis: Tensor, coords: Tensor, freqs: Tensor, prefix: int, post: bool) -> Tensor:
        mod = load_kernels()
        bsz, h, n, d = x.shape
        p = basis.detach().to(torch.float32).contiguous()  # (Hp, d, d)
        r = as_rows(coords, torch.float64)  # (Bc, M, c): the angles are formed in fp64 (see reduced_angles)
        w = as_heads(freqs.detach(), torch.float64)  # (Hf, c, d/2)
        y = torch.empty_like(x)
        tiles = -(-n // BLOCK_N)
        if bsz * h * tiles:
            mod.basis_rotary_fwd[(bsz * h * tiles,)](
                x, *x.stride(), y, *y.stride(), p, p.stride(0) if p.shape[0] > 1 else 0, p.stride(1), p.stride(2),
                r, r.stride(0) if r.shape[0] > 1 else 0, w, w.stride(0) if w.shape[0] > 1 else 0, h, n, prefix, tiles,
                C=w.shape[1], D=d, D2=d // 2, BLOCK_N=BLOCK_N, PRECISION=_precision(x), POST=post, num_warps=4)
        ctx.save_for_backward(x, p, r, w, basis, coords, freqs)  # the inputs themselves: for a recorded backward
        ctx.prefix, ctx.post = prefix, post
        ctx.meta = (basis.shape, basis.dtype, coords.shape, coords.dtype, freqs.shape, freqs.dtype)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        if torch.is_grad_enabled():  # a gradient graph is requested: differentiate the same map in torch operations
            x, basis, coords, freqs = (ctx.saved_tensors[i] for i in (0, 4, 5, 6))
            inputs = (x, basis, coords, freqs)
            want = [t for t, n in zip(inputs, ctx.needs_input_grad[:4]) if n]
            with torch.enable_grad():
                ref = _two_step(*inputs, ctx.prefix, ctx.post)
                grads = iter(torch.autograd.grad(ref, want, g, create_graph=True))
            return tuple(next(grads) if n else None for n in ctx.needs_input_grad[:4]) + (None, None)
        mod = load_kernels()
        x, p, r, w = ctx.saved_tensors[:4]
        p_shape, p_dtype, r_shape, r_dtype, w_shape, w_dtype = ctx.meta
        need_x, need_p, need_r, need_w = ctx.needs_input_grad[:4]
        bsz, h, n, d = x.shape
        m = n - ctx.prefix
        c = w.shape[1]
        dev = x.device
        gx = torch.empty_like(x) if need_x else x.new_empty(1)
        gp = torch.empty(bsz * h, d, d, device=dev, dtype=torch.float32) if need_p else x.new_empty(1)
        fpart = torch.empty(bsz * h, c, d // 2, device=dev, dtype=torch.float32) if need_w else x.new_empty(1)
        cpart = torch.empty(bsz * h, m, c, device=dev, dtype=torch.float32) if need_r else x.new_empty(1)
        gx_strides = gx.stride() if need_x else (0, 0, 0, 0)
        if bsz * h and n:
            mod.basis_rotary_bwd[(bsz * h,)](
                g, *g.stride(), x, *x.stride(), gx, *gx_strides,
                p, p.stride(0) if p.shape[0] > 1 else 0, p.stride(1), p.stride(2),
                r, r.stride(0) if r.shape[0] > 1 else 0, w, w.stride(0) if w.shape[0] > 1 else 0,
                gp, fpart, cpart, h, n, ctx.prefix,
                C=c, BLOCK_C=max(1, 1 << (c - 1).bit_length()), D=d, D2=d // 2, BLOCK_N=BLOCK_N,
                PRECISION=_precision(x), POST=ctx.post, NEED_X=need_x, NEED_P=need_p, NEED_FREQ=need_w,
                NEED_COORD=need_r, num_warps=4)
        else:  # nothing to encode: every gradient is zero
            for t in (gp, fpart, cpart):
                t.zero_()
        g_p = g_r = g_w = None
        if need_p:  # (B, H, d, d) partials: sum the examples, and the heads when they share P
            g_p = gp.view(bsz, h, d, d).sum(0)
            g_p = (g_p.sum(0, keepdim=True) if p.shape[0] == 1 else g_p).reshape(p_shape).to(p_dtype)
        if need_w:
            g_w = fpart.view(bsz, h, c, d // 2).sum(0)
            g_w = (g_w.sum(0, keepdim=True) if w.shape[0] == 1 else g_w).reshape(w_shape).to(w_dtype)
        if need_r:
            g_r = cpart.view(bsz, h, m, c).sum(1)  # (B, M, c)
            g_r = (g_r.sum(0, keepdim=True) if r.shape[0] == 1 else g_r).reshape(r_shape).to(r_dtype)
        return (gx if need_x else None), g_p, g_r, g_w, None, None


def fused_basis_rotary(x: Tensor, basis: Tensor, coords: Tensor, freqs: Tensor, *, num_prefix_tokens: int = 0,
                       transpose_back: bool = False, validate: bool = True) -> Tensor:
    """``RoPE(coords . freqs) P x`` (or ``P^T RoPE(coords . freqs) P x``) for every token in one pass;
    differentiable in all four arguments.

    Args:
        x: ``(B, H, N, d)`` float32 / float16 / bfloat16, any strides; ``d`` a power of two in [32, 128].
        basis: ``P``, ``(Hp, d, d)`` with ``Hp`` 1 (shared by the heads) or ``H``.
        coords: ``(M, c)`` shared by the batch or ``(B, M, c)`` per example, ``M = N - num_prefix_tokens``,
            ``c <= 4``.
        freqs: ``(c, d / 2)`` or ``(1, c, d / 2)`` shared by the heads, or ``(H, c, d / 2)`` per head.
        num_prefix_tokens: leading tokens without a coordinate, passed through unchanged (not even ``P``).
        transpose_back: multiply by ``P^T`` after the rotation, back to the input's basis (the symmetric form
            ``R(r) = P^T RoPE(r) P`` of Circulant-STRING and ComRoPE); default the Cayley form ``RoPE(r) P``.
        validate: check ``coords`` for NaN and infinity, as :func:`ropekit.kernels.fused_rotary` does; ``False``
            for callers that checked them already.

    Returns:
        ``(B, H, N, d)`` in ``x``'s dtype and layout: plane ``p`` (dimensions ``2p, 2p + 1``) of ``P x`` turned by
        ``theta_p = sum_j coords_j freqs[j, p]`` (then ``P^T`` with ``transpose_back``). Computed in fp32, the
        angles in fp64.

    Raises:
        ValueError: inconsistent shapes, arguments :func:`basis_rotary_supported` rejects, or (``validate``) NaN /
            infinite coordinates on the CPU.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be (B, H, N, d), got shape {tuple(x.shape)}")
    bsz, h, n, d = x.shape
    m = n - num_prefix_tokens
    if not 0 <= num_prefix_tokens <= n:
        raise ValueError(f"num_prefix_tokens must be in [0, {n}], got {num_prefix_tokens}")
    if basis.dim() != 3 or basis.shape[1:] != (d, d) or basis.shape[0] not in (1, h):
        raise ValueError(f"basis must be (1 or {h}, {d}, {d}), got shape {tuple(basis.shape)}")
    if freqs.dim() not in (2, 3) or freqs.shape[-1] != d // 2 or (freqs.dim() == 3 and freqs.shape[0] not in (1, h)):
        raise ValueError(f"freqs must be (c, {d // 2}) or ({h}, c, {d // 2}), got shape {tuple(freqs.shape)}")
    check_real(coords)  # (the dtype only: also with validate=False)
    if coords.dim() not in (2, 3) or coords.shape[-2] != m or coords.shape[-1] != freqs.shape[-2] or (
            coords.dim() == 3 and coords.shape[0] != bsz):
        raise ValueError(f"coords must be ({m}, {freqs.shape[-2]}) or ({bsz}, {m}, {freqs.shape[-2]}), "
                         f"got shape {tuple(coords.shape)}")
    if not basis_rotary_supported(x, basis, coords, freqs):
        raise ValueError(f"the fused basis rotation does not handle d={d}, c={freqs.shape[-2]}, {x.dtype} on "
                         f"{x.device} (see basis_rotary_supported)")
    if validate:
        check_finite(coords)
    return _FusedBasisRotary.apply(x, basis, coords, freqs, int(num_prefix_tokens), bool(transpose_back))

