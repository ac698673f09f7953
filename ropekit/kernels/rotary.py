"""The fused frequency rotation as a differentiable function (a ``torch.autograd.Function`` over Triton kernels).

Shape legend: ``B`` batch, ``Hq`` / ``Hk`` query / key heads (``Hk`` divides ``Hq``: grouped-query attention),
``Nq`` / ``Nk`` tokens (the first ``num_prefix_tokens`` of each carry no coordinate, e.g. a class token),
``Mq = Nq - prefix`` / ``Mk = Nk - prefix`` tokens with coordinates, ``c`` coordinate dimension, ``d`` head
dimension, ``P = d / 2`` rotation planes.

Plane ``p`` of a head vector is the pair of dimensions ``(2p, 2p + 1)`` (``pairs="interleaved"``) or
``(p, p + d / 2)`` (``pairs="half"``); it turns counter-clockwise by ``theta_p(r) = sum_j r_j * freqs[j, p]``.
Angles are formed in fp64 registers from the coordinates and frequencies (float64 ones used as they are) and
reduced modulo 2 pi before cos/sin and the rotation in fp32 (fp64 when q or k is fp64) -- no angle or cos/sin
table is written to memory, and no matrix product is involved, so the angles do not depend on the TF32 setting
and stay exact to fp32 rounding at any coordinate scale. Inputs and outputs keep their dtype (bf16, fp16, fp32 or fp64).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..encodings.ops.validation import check_finite, check_real

__all__ = ["available", "compile_supported", "fused_rotary", "unavailable_reason", "as_rows", "as_heads"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MODULE = "ropekit.kernels._rotary_triton"


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _triton_import_error() -> Optional[str]:
    """None when Triton imports, else why it does not (one line)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        if getattr(e, "name", None) == "triton" and "halted" not in str(e):
            return "Triton is not installed (pip install triton)"
        return f"importing Triton failed ({type(e).__name__}: {' '.join(str(e).split())})"
    except Exception as e:  # noqa: BLE001 -- a broken install raising something else at import
        return f"importing Triton failed ({type(e).__name__}: {' '.join(str(e).split())})"
    return None


def unavailable_reason(device: Any) -> Optional[str]:
    """Why :func:`fused_rotary` cannot run on ``device`` (one line), or None when it can.

    It runs on a CUDA device when CUDA is available and Triton imports; on the CPU only when ``TRITON_INTERPRET=1``
    is set (Triton's interpreter, slow: meant for tests); on no other device.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
    elif dev.type == "cpu":
        if not _interpret_requested():
            return "on the CPU the Triton kernels run only in Triton's interpreter (TRITON_INTERPRET=1)"
    else:
        return f"the Triton kernels run on CUDA devices (the CPU only under TRITON_INTERPRET=1), not on {dev.type}"
    return _triton_import_error()


def available(device: Any) -> bool:
    """Whether :func:`fused_rotary` can run on ``device`` (see :func:`unavailable_reason`)."""
    return unavailable_reason(device) is None


def load_kernels(name: str = _MODULE):
    """The kernel module ``name``, (re)imported so that its compile-or-interpret mode matches ``TRITON_INTERPRET``
    now."""
    mod = sys.modules.get(name)
    if mod is None:
        return importlib.import_module(name)
    if mod.INTERPRET != _interpret_requested():
        return importlib.reload(mod)
    return mod


def _check_coords(coords: Tensor, name: str, batch: int, tokens: int, prefix: int) -> None:
    check_real(coords, name)  # (the dtype only: also with validate=False)
    if coords.dim() not in (2, 3):
        raise ValueError(f"{name} must be (M, c) or (B, M, c), got shape {tuple(coords.shape)}")
    if coords.dim() == 3 and coords.shape[0] != batch:
        raise ValueError(f"{name} has batch {coords.shape[0]} but the tensor has batch {batch}")
    if coords.shape[-2] != tokens - prefix:
        raise ValueError(f"{name} has {coords.shape[-2]} tokens but the tensor has {tokens} tokens with "
                         f"{prefix} prefix tokens (expected {tokens - prefix})")


def _validate(q: Tensor, k: Optional[Tensor], coords: Tensor, freqs: Tensor, k_coords: Optional[Tensor],
              prefix: int, pairs: str) -> None:
    if pairs not in ("interleaved", "half"):
        raise ValueError(f"pairs must be 'interleaved' or 'half', got {pairs!r}")
    if q.dim() != 4:
        raise ValueError(f"q must be (B, H, N, d), got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float32, float16, bfloat16 or float64, got {q.dtype}")
    b, hq, nq, d = q.shape
    if d % 2:
        raise ValueError(f"head dimension must be even, got {d}")
    if prefix < 0 or prefix > nq:
        raise ValueError(f"num_prefix_tokens must be in [0, {nq}], got {prefix}")
    if freqs.dim() not in (2, 3) or freqs.shape[-1] != d // 2:
        raise ValueError(f"freqs must be (c, {d // 2}) or (H, c, {d // 2}), got shape {tuple(freqs.shape)}")
    c = freqs.shape[-2]
    hf = freqs.shape[0] if freqs.dim() == 3 else 1
    if hf not in (1, hq):
        raise ValueError(f"freqs has {hf} heads but q has {hq}")
    _check_coords(coords, "coords", b, nq, prefix)
    if coords.shape[-1] != c:
        raise ValueError(f"coords have {coords.shape[-1]} dimensions but freqs have {c}")
    for t, name in ((coords, "coords"), (freqs, "freqs")):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if k is None:
        if k_coords is not None:
            raise ValueError("k_coords given without k")
        return
    if k.dim() != 4 or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be (B={b}, Hk, Nk, d={d}), got shape {tuple(k.shape)}")
    if k.dtype not in _DTYPES:
        raise ValueError(f"k must be float32, float16, bfloat16 or float64, got {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}")
    hk, nk = k.shape[1], k.shape[2]
    if hq % hk:
        raise ValueError(f"key heads ({hk}) must divide query heads ({hq})")
    if hf != 1 and hk != hq:
        raise ValueError(f"per-head freqs need as many key heads as query heads (got {hk} and {hq}); "
                         "grouped keys need shared freqs")
    if k_coords is None:
        if nk != nq:
            raise ValueError(f"k has {nk} tokens but q has {nq}; pass k_coords for keys of another length")
    else:
        _check_coords(k_coords, "k_coords", b, nk, prefix)
        if k_coords.shape[-1] != c:
            raise ValueError(f"k_coords have {k_coords.shape[-1]} dimensions but freqs have {c}")
        if k_coords.device != q.device:
            raise ValueError(f"k_coords is on {k_coords.device} but q is on {q.device}")


def _blocks(d: int) -> Tuple[int, int]:
    block_p = _next_pow2(d // 2)
    block_n = max(1, min(64, 4096 // block_p))
    return block_n, block_p


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: (example, head) copies that one program rotates with the same cos/sin (fewer programs, less sin/cos work).
CHUNK = 8


def _geometry(x: Tensor, r: Tensor, w: Tensor, block_n: int) -> Tuple[int, ...]:
    """How one tensor's programs are laid out: ``(keys_b, keys_h, reuse_h, reuse, chunk, n_chunks, programs)``.

    An angle key is an (example, head) pair with its own angles: ``keys_b`` = B for per-example coordinates (else 1),
    ``keys_h`` = H for per-head frequencies (else 1); ``reuse`` copies share each key, ``reuse_h`` of them along the
    heads; programs = keys x token tiles x chunks of ``chunk`` copies.
    """
    b, h, n, _ = x.shape
    keys_b = b if r.shape[0] > 1 else 1
    keys_h = h if w.shape[0] > 1 else 1
    reuse_h = h // keys_h
    reuse = (b // keys_b) * reuse_h
    chunk = min(CHUNK, reuse)
    n_chunks = _cdiv(reuse, chunk)
    return keys_b, keys_h, reuse_h, reuse, chunk, n_chunks, keys_b * keys_h * _cdiv(n, block_n) * n_chunks


def _launch(x_q: Tensor, y_q: Tensor, o_q: Tensor, r_q: Tensor, x_k: Optional[Tensor], y_k: Optional[Tensor],
            o_k: Optional[Tensor], r_k: Optional[Tensor], w: Tensor, prefix: int, half: bool, sign: float,
            need_freq: bool, need_coord: bool) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """One launch over q's and k's programs. ``r_*``: contiguous (Bc, M, c) and ``w``: contiguous (Hf, c, P), both
    in fp64 (the kernel forms its angles in fp64 whatever the compute dtype).

    Returns the reduced angle-gradient products when asked for, else None: the frequency gradient ``(Hf, c, P)``,
    and the coordinate gradients of q's and of k's tokens ``(Bc, N, c)`` (prefix rows included, summed over heads).
    """
    mod = load_kernels()
    dev = x_q.device
    d = x_q.shape[3]
    p = d // 2
    c = w.shape[1]
    block_n, block_p = _blocks(d)
    gq = _geometry(x_q, r_q, w, block_n)
    separate_k = x_k is not None
    if x_k is None:
        x_k, y_k, o_k, r_k, gk = x_q, y_q, o_q, r_q, gq[:-1] + (0,)
    else:
        gk = _geometry(x_k, r_k, w, block_n)
    q_programs, k_programs = gq[-1], gk[-1]
    acc = _compute_dtype(x_q, x_k)  # float32, or float64 for float64 inputs
    fpart = torch.empty((q_programs + k_programs, c, p) if need_freq else (1,), device=dev, dtype=acc)

    def cpart(x: Tensor, g: Tuple[int, ...], used: bool) -> Tensor:
        keys = g[0] * g[1]
        return torch.empty((keys * g[5], x.shape[2], c) if (need_coord and used) else (1,), device=dev,
                           dtype=acc)

    cq, ck = cpart(x_q, gq, True), cpart(x_k, gk, k_programs > 0)
    srq = r_q.stride(0) if r_q.shape[0] > 1 else 0  # batch stride 0: coordinates shared by the batch
    srk = r_k.stride(0) if r_k.shape[0] > 1 else 0
    if q_programs + k_programs == 0:  # no token (N = 0): nothing to launch; the gradients are zeros
        g_w = torch.zeros((gq[1], c, p), device=dev, dtype=acc) if need_freq else None
        g_rq = torch.zeros((gq[0], 0, c), device=dev, dtype=acc) if need_coord else None
        g_rk = torch.zeros((gk[0], 0, c), device=dev, dtype=acc) if need_coord and separate_k else None
        return g_w, g_rq, g_rk
    mod.rotary_kernel[(q_programs + k_programs,)](
        x_q, *x_q.stride(), y_q, *y_q.stride(), o_q, *o_q.stride(), r_q, srq, x_q.shape[2], *gq[1:6],
        x_k, *x_k.stride(), y_k, *y_k.stride(), o_k, *o_k.stride(), r_k, srk, x_k.shape[2], *gk[1:6],
        w, w.stride(0) if w.shape[0] > 1 else 0, fpart, cq, ck,
        q_programs, prefix, p, sign,
        C=c, BLOCK_N=block_n, BLOCK_P=block_p, HALF=half, NEED_FREQ=need_freq, NEED_COORD=need_coord,
        REDUCE=acc == torch.float32,  # fp32: the fp64 angles reduced mod 2 pi before rounding (fp64: used as they are)
        num_warps=4)
    g_w = g_rq = g_rk = None
    if need_freq:  # program order (key_b, key_h, tile, chunk): sum all but key_h
        g_w = (fpart[:q_programs].view(gq[0], gq[1], -1, c, p).sum((0, 2)) if q_programs else
               torch.zeros((gq[1], c, p), device=dev, dtype=acc))  # (q without a token)
        if k_programs:
            g_w = g_w + fpart[q_programs:].view(gk[0], gk[1], -1, c, p).sum((0, 2))
    if need_coord:  # (key_b, key_h x chunks, N, c): sum over heads and chunks
        g_rq = (cq.view(gq[0], -1, x_q.shape[2], c).sum(1) if q_programs else
                torch.zeros((gq[0], 0, c), device=dev, dtype=acc))
        if k_programs:
            g_rk = ck.view(gk[0], -1, x_k.shape[2], c).sum(1)
        elif separate_k:  # k without a token
            g_rk = torch.zeros((gk[0], 0, c), device=dev, dtype=acc)
    return g_w, g_rq, g_rk


def _compute_dtype(*xs: Optional[Tensor]) -> torch.dtype:
    """float64 when an input is float64, else float32 (the dtype of cos/sin and the rotation)."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def as_rows(coords: Tensor, dtype: torch.dtype) -> Tensor:
    """Coordinates as contiguous ``(Bc, M, c)`` in ``dtype`` (``Bc = 1`` when shared by the batch)."""
    r = coords.detach().to(dtype)
    return (r.unsqueeze(0) if r.dim() == 2 else r).contiguous()


def as_heads(freqs: Tensor, dtype: torch.dtype) -> Tensor:
    """Frequencies as contiguous ``(Hf, c, P)`` in ``dtype`` (``Hf = 1`` when shared by the heads); differentiable."""
    w = freqs.to(dtype)
    return (w.unsqueeze(0) if w.dim() == 2 else w).contiguous()


class _FusedRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Optional[Tensor], coords: Tensor, freqs: Tensor, k_coords: Optional[Tensor],
                prefix: int, half: bool):
        r_q = as_rows(coords, torch.float64)  # angles in fp64 whatever the compute dtype (see reduced_angles)
        r_k = r_q if k_coords is None else as_rows(k_coords, torch.float64)
        w = as_heads(freqs.detach(), torch.float64)  # (Hf, c, P)
        q_out = torch.empty_like(q)  # keeps q's layout when it is a dense (permuted) view
        k_out = None if k is None else torch.empty_like(k)
        _launch(q, q_out, q, r_q, k, k_out, k, r_k, w, prefix, half, 1.0, False, False)
        need_theta = ctx.needs_input_grad[2] or ctx.needs_input_grad[3] or (
            k_coords is not None and ctx.needs_input_grad[4])
        ctx.prefix, ctx.half, ctx.has_k, ctx.has_k_coords = prefix, half, k is not None, k_coords is not None
        ctx.coords_meta = (coords.shape, coords.dtype)
        ctx.k_coords_meta = None if k_coords is None else (k_coords.shape, k_coords.dtype)
        ctx.freqs_meta = (freqs.shape, freqs.dtype)
        ctx.need_theta = need_theta
        saved = [r_q, r_k, w, coords, freqs, k_coords]  # the inputs themselves: for a recorded backward
        if need_theta:
            saved += [q_out] + ([k_out] if k is not None else [])
        ctx.save_for_backward(*saved)
        if k_out is None:
            return q_out
        return q_out, k_out

    @staticmethod
    def backward(ctx, *grads):
        g_q = grads[0]
        g_k = grads[1] if ctx.has_k else None
        saved = ctx.saved_tensors
        r_q, r_k, w = saved[:3]
        o_q = saved[6] if ctx.need_theta else None
        o_k = saved[7] if (ctx.need_theta and ctx.has_k) else None
        if torch.is_grad_enabled():
            return _recorded_backward(ctx, g_q, g_k, o_q, o_k, *saved[3:6])
        need_freq = ctx.needs_input_grad[3]
        need_coord = ctx.needs_input_grad[2] or (ctx.has_k_coords and ctx.needs_input_grad[4])
        # gradients of unused outputs arrive as zeros (autograd materialises them), so g_q / g_k are tensors
        gq_in = torch.empty_like(g_q)  # follows the layout the gradient arrives in
        gk_in = None if g_k is None else torch.empty_like(g_k)
        g_w, g_rq, g_rk = _launch(g_q, gq_in, o_q if o_q is not None else g_q, r_q,
                                  g_k, gk_in, o_k if o_k is not None else g_k, r_k, w, ctx.prefix, ctx.half, -1.0,
                                  need_freq, need_coord)
        g_freqs = g_coords = g_kc = None
        if need_freq:
            shape, dtype = ctx.freqs_meta
            g_freqs = g_w.reshape(shape).to(dtype)
        if need_coord:
            prefix = ctx.prefix
            g_rq = g_rq[:, prefix:]  # (Bc, Mq, c)
            if ctx.has_k and not ctx.has_k_coords:
                g_rq = g_rq + g_rk[:, prefix:]
            if ctx.needs_input_grad[2]:
                shape, dtype = ctx.coords_meta
                g_coords = g_rq.reshape(shape).to(dtype)
            if ctx.has_k_coords and ctx.needs_input_grad[4]:
                shape, dtype = ctx.k_coords_meta
                g_kc = g_rk[:, prefix:].reshape(shape).to(dtype)
        return (gq_in if ctx.needs_input_grad[0] else None, gk_in if ctx.has_k and ctx.needs_input_grad[1] else None,
                g_coords, g_freqs, g_kc, None, None)


def _angle_gradient(g: Tensor, o: Tensor, prefix: int, half: bool, dtype: torch.dtype) -> Tensor:
    """``dL/dtheta = o0 g1 - o1 g0`` of every coordinate token and plane, ``(B, H, M, P)`` in ``dtype``, from the
    output gradient ``g`` and the output ``o`` ``(B, H, N, d)``; differentiable."""
    g, o = g[:, :, prefix:].to(dtype), o[:, :, prefix:].to(dtype)
    if half:
        (g0, g1), (o0, o1) = g.chunk(2, dim=-1), o.chunk(2, dim=-1)
    else:
        g0, g1, o0, o1 = g[..., 0::2], g[..., 1::2], o[..., 0::2], o[..., 1::2]
    return o0 * g1 - o1 * g0


def _coords_gradient(g_theta: Tensor, freqs: Tensor, coords: Tensor) -> Tensor:
    """``sum_{h, p} freqs[h, j, p] g_theta[b, h, m, p]`` in ``coords``' shape ``(M, c)`` / ``(B, M, c)``, by
    elementwise products and sums (no TF32-rounded matmul); ``g_theta`` ``(B, H, M, P)``, ``freqs``
    ``(Hf, c, P)``."""
    g = (freqs.unsqueeze(0).unsqueeze(2) * g_theta.unsqueeze(-2)).sum((1, -1))  # (B, M, c)
    return (g if coords.dim() == 3 else g.sum(0)).to(coords.dtype)


def _freqs_gradient(g_theta: Tensor, coords: Tensor, freqs: Tensor) -> Tensor:
    """``sum_{b, m} coords[b, m, j] g_theta[b, h, m, p]`` in ``freqs``' shape (summed over the heads when they
    share the frequencies), by elementwise products and sums; ``g_theta`` ``(B, H, M, P)``."""
    r = coords if coords.dim() == 3 else coords.unsqueeze(0)  # (Bc, M, c)
    g = (r.to(g_theta.dtype).unsqueeze(1).unsqueeze(-1) * g_theta.unsqueeze(-2)).sum((0, 2))  # (H, c, P)
    shared = freqs.dim() == 2 or freqs.shape[0] == 1
    return (g.sum(0, keepdim=True) if shared else g).reshape(freqs.shape).to(freqs.dtype)


def _recorded_backward(ctx, g_q: Tensor, g_k: Optional[Tensor], o_q: Optional[Tensor], o_k: Optional[Tensor],
                       coords: Tensor, freqs: Tensor, k_coords: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """:meth:`_FusedRotary.backward` in operations that autograd records (``create_graph``), so that second
    derivatives are exact: the input gradients are the same rotation by the negated angles (this kernel again), and
    the angle gradient ``o0 g1 - o1 g0`` is reduced onto the frequencies and coordinates with elementwise operations
    on the saved outputs (which carry their own graph back to the inputs)."""
    prefix, half, acc = ctx.prefix, ctx.half, _compute_dtype(g_q, g_k)
    need_q, need_k, need_r, need_w, need_kr = ctx.needs_input_grad[:5]
    gq_in = gk_in = g_coords = g_freqs = g_kc = None
    if need_q or (ctx.has_k and need_k):
        out = _FusedRotary.apply(g_q, g_k, coords, -freqs, k_coords, prefix, half)
        gq_in, gk_in = (out, None) if g_k is None else out
    if need_r or need_w or (ctx.has_k_coords and need_kr):
        w = freqs.to(acc)
        w = w if w.dim() == 3 else w.unsqueeze(0)  # (Hf, c, P)
        th_q = _angle_gradient(g_q, o_q, prefix, half, acc)
        th_k = None if g_k is None else _angle_gradient(g_k, o_k, prefix, half, acc)
        if need_w:
            g_freqs = _freqs_gradient(th_q, coords, freqs)
            if th_k is not None:
                g_freqs = g_freqs + _freqs_gradient(th_k, coords if k_coords is None else k_coords, freqs)
        if need_r:
            g_coords = _coords_gradient(th_q, w, coords)
            if th_k is not None and k_coords is None:
                g_coords = g_coords + _coords_gradient(th_k, w, coords)
        if ctx.has_k_coords and need_kr:
            g_kc = _coords_gradient(th_k, w, k_coords)
    return (gq_in if need_q else None, gk_in if ctx.has_k and need_k else None, g_coords, g_freqs, g_kc, None, None)


# ----------------------------------------------------------------------------- the same kernel inside torch.compile
# Dynamo cannot trace a Triton launch wrapped in an autograd.Function, so under torch.compile the rotation is
# exposed as two PyTorch custom operators (forward; backward), opaque to Inductor: the compiled graph keeps the
# fused kernel instead of falling back to the PyTorch path (which Inductor fuses far less well: ViT-B steps 1.2-1.8x
# the absolute-embedding model on an H100). They cover the case attention needs -- q and k together, coordinates
# shared by q and k and without a gradient, fp32/bf16/fp16 -- see :func:`compile_supported`.

@torch.library.custom_op("ropekit::rotary_qk", mutates_args=())
def _rotary_qk(q: Tensor, k: Tensor, r: Tensor, w: Tensor, prefix: int, half: bool) -> Tuple[Tensor, Tensor]:
    """``(q_out, k_out)``: q and k rotated by ``r . w`` (``r``: contiguous fp64 ``(Bc, M, c)``; ``w``: contiguous
    fp64 ``(Hf, c, P)``), in the inputs' dtypes and layouts."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _launch(q, q_out, q, r, k, k_out, k, r, w, prefix, half, 1.0, False, False)
    return q_out, k_out


@_rotary_qk.register_fake
def _rotary_qk_fake(q: Tensor, k: Tensor, r: Tensor, w: Tensor, prefix: int, half: bool) -> Tuple[Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("ropekit::rotary_qk_backward", mutates_args=())
def _rotary_qk_backward(g_q: Tensor, g_k: Tensor, o_q: Tensor, o_k: Tensor, r: Tensor, w: Tensor, prefix: int,
                        half: bool, need_freq: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(g_q_in, g_k_in, g_w)``: the inverse rotation of the output gradients and, with ``need_freq``, the
    frequency gradient ``(Hf, c, P)`` from the saved outputs ``o_q``, ``o_k`` (zeros without)."""
    gq_in, gk_in = torch.empty_like(g_q), torch.empty_like(g_k)
    g_w, _, _ = _launch(g_q, gq_in, o_q, r, g_k, gk_in, o_k, r, w, prefix, half, -1.0, need_freq, False)
    return gq_in, gk_in, (g_w.to(w.dtype) if need_freq else torch.zeros_like(w))


@_rotary_qk_backward.register_fake
def _rotary_qk_backward_fake(g_q: Tensor, g_k: Tensor, o_q: Tensor, o_k: Tensor, r: Tensor, w: Tensor,
                             prefix: int, half: bool, need_freq: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(g_q), torch.empty_like(g_k), torch.empty_like(w)


def _rotary_qk_setup(ctx, inputs, output) -> None:
    q, k, r, w, prefix, half = inputs
    ctx.prefix, ctx.half, ctx.need_freq = prefix, half, w.requires_grad
    ctx.save_for_backward(r, w, *(output if w.requires_grad else ()))  # outputs: the angles' gradient needs them


def _rotary_qk_grad(ctx, g_q: Tensor, g_k: Tensor):
    r, w, *outs = ctx.saved_tensors
    o_q, o_k = outs if outs else (g_q, g_k)
    gq_in, gk_in, g_w = _rotary_qk_backward(g_q, g_k, o_q, o_k, r, w, ctx.prefix, ctx.half, ctx.need_freq)
    return gq_in, gk_in, None, (g_w if ctx.need_freq else None), None, None


_rotary_qk.register_autograd(_rotary_qk_grad, setup_context=_rotary_qk_setup)


def compile_supported(q: Tensor, k: Optional[Tensor], coords: Tensor, freqs: Tensor,
                      k_coords: Optional[Tensor]) -> bool:
    """Whether :func:`fused_rotary` can run inside ``torch.compile`` for these arguments (else the caller takes
    its PyTorch path): q and k together, keys on the queries' coordinates, no coordinate gradient, no float64 q or
    k (float64 coordinates and frequencies are fine: the kernel forms its angles in float64)."""
    return (k is not None and k_coords is None and not coords.requires_grad
            and torch.float64 not in (q.dtype, k.dtype))


def _compiled_rotary(q: Tensor, k: Tensor, coords: Tensor, freqs: Tensor, prefix: int,
                     half: bool) -> Tuple[Tensor, Tensor]:
    return _rotary_qk(q, k, as_rows(coords, torch.float64), as_heads(freqs, torch.float64), prefix, half)


def fused_rotary(q: Tensor, k: Optional[Tensor], coords: Tensor, freqs: Tensor, *, k_coords: Optional[Tensor] = None,
                 num_prefix_tokens: int = 0, pairs: str = "interleaved",
                 validate: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """Rotate ``q`` and ``k`` by the angles ``coords . freqs`` in one fused launch; differentiable in all four.

    Args:
        q: ``(B, Hq, Nq, d)`` float32 / float16 / bfloat16 (float64 too: then computed in float64), any strides
            (e.g. a transposed ``(B, N, H, d)`` view).
        k: ``(B, Hk, Nk, d)`` (any of those dtypes) with ``Hk`` dividing ``Hq`` (grouped keys need shared freqs), or
            None.
        coords: ``(Mq, c)`` shared by the batch or ``(B, Mq, c)`` per example, ``Mq = Nq - num_prefix_tokens``.
        freqs: ``(c, d / 2)`` shared by the heads or ``(H, c, d / 2)`` per head.
        k_coords: the keys' coordinates ``(Mk, c)`` / ``(B, Mk, c)`` when they differ from the queries'
            (``Mk = Nk - num_prefix_tokens``); default: ``coords`` (then ``Nk`` must equal ``Nq``).
        num_prefix_tokens: leading tokens of q and k that carry no coordinate; passed through unchanged.
        pairs: ``"interleaved"`` (planes ``(2p, 2p + 1)``) or ``"half"`` (planes ``(p, p + d / 2)``).
        validate: check ``coords`` and ``k_coords`` for NaN and infinity (``ropekit.encodings.check_coords``'s
            finiteness check: on a GPU counted on the device, without a host synchronisation, and reported by
            ``ropekit.encodings.check_deferred_coords()``); ``False`` for callers that checked them already.

    Returns:
        ``(q_out, k_out)`` in the inputs' dtypes and layouts (``k_out`` is None when ``k`` is None). Angles are
        formed in fp64, cos/sin and the rotation in fp32 (fp64 when q or k is fp64); gradients reach ``q``, ``k``,
        ``freqs``, ``coords`` and ``k_coords``.
        When ``freqs`` or coordinates need a gradient the outputs are saved for the backward pass (attention
        keeps them anyway), so they must not be modified in place.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices, when the device cannot run the kernel (a CPU
            tensor without ``TRITON_INTERPRET=1``), or (``validate``) NaN / infinite coordinates on the CPU.
    """
    _validate(q, k, coords, freqs, k_coords, num_prefix_tokens, pairs)
    if validate:
        check_finite(coords)
        if k_coords is not None:
            check_finite(k_coords, "k_coords")
    if torch.compiler.is_compiling():
        if not compile_supported(q, k, coords, freqs, k_coords):
            raise ValueError("inside torch.compile the fused rotation needs q and k together on shared coordinates "
                             "without a coordinate gradient, in fp32/bf16/fp16 (see compile_supported)")
        return _compiled_rotary(q, k, coords, freqs, int(num_prefix_tokens), pairs == "half")
    reason = unavailable_reason(q.device)
    if reason is not None:
        raise ValueError(f"the fused rotation kernel cannot run on {q.device}: {reason}")
    out = _FusedRotary.apply(q, k, coords, freqs, k_coords, int(num_prefix_tokens), pairs == "half")
    if k is None:
        return out, None
    return out
