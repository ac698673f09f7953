"""Triton kernels of the fused basis change and frequency rotation (imported lazily by :mod:`ropekit.kernels.basis`).

Shape legend: ``B`` batch, ``H`` heads, ``N`` tokens, the first ``prefix`` of them without a coordinate (passed
through unchanged), ``M = N - prefix`` tokens with a coordinate, ``c`` coordinate dimension, ``D``
head dimension (a power of two, at least 32), ``D2 = D / 2`` rotation planes, ``Hp`` heads owning a basis (1 or
``H``), ``Hf`` heads owning frequencies (1 or ``H``).

A commuting STRING (Cayley, and any encoding written as RoPE in a learnt orthogonal basis ``P``) rotates a head
vector ``x`` as ``RoPE(theta) P x``. Applied to a whole tensor in two steps, ``P x`` is written to memory and read
back; here one program loads a tile of ``BLOCK_N`` tokens of one (example, head), forms the two halves of every
plane with two small matrix products against the even and odd rows of ``P`` (``y0 = x P[0::2]^T``, ``y1 = x
P[1::2]^T``, fp32 accumulation), rotates them by the angles ``theta[n, p] = sum_j r[n, j] w[j, p]`` (formed in
fp64 from fp64 coordinates and frequencies and reduced modulo 2 pi before rounding, as in
:mod:`ropekit.kernels._rotary_triton`, so angles are exact to fp32 rounding and do not depend on the TF32 setting)
and writes the result once: the memory traffic of plain RoPE.

Backward, one program per (example, head) walking its token tiles, with ``g`` the output gradient::

    h0 = g0 cos + g1 sin,  h1 = -g0 sin + g1 cos          (the gradient of y = P x, rotated back)
    gx = h0 P[0::2] + h1 P[1::2]                          (the input gradient)
    gP[0::2] += h0^T x,  gP[1::2] += h1^T x               (per-(example, head) partial sums of the basis gradient)
    g_theta = o0 g1 - o1 g0,  o = RoPE(theta) y recomputed from x  (the angle gradient, as in the rotation kernel)

With ``POST`` the kernels compute the symmetric form ``P^T RoPE(theta) P x`` instead: the rotated halves go back
through ``P^T`` in the forward pass; in the backward pass ``g`` is first brought into the rotated basis (``P g``)
and the basis gradient gains the term ``o^T g`` of the outer product.

The angle gradient is reduced to per-program partial sums for the frequencies and the coordinates; the caller
sums the partials over examples and heads in one deterministic torch reduction (no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._rotary_triton import INTERPRET, reduced_angles, sum_combine  # noqa: F401  (INTERPRET: see rotary.py)


@triton.jit
def _load_tile(base, sd, nmask, D: tl.constexpr):
    """A ``(BLOCK_N, D)`` tile of rows (``base``: row pointers ``(BLOCK_N, 1)``) as fp32."""
    dims = tl.arange(0, D)
    return tl.load(base + dims[None, :] * sd, mask=nmask[:, None], other=0.0).to(tl.float32)


@triton.jit
def _basis_halves(p_base, sr, sc, D: tl.constexpr, D2: tl.constexpr):
    """The even and odd rows of ``P`` transposed, ``P[0::2]^T`` and ``P[1::2]^T``: ``(D, D2)`` each, fp32."""
    cols = tl.arange(0, D)
    planes = tl.arange(0, D2)
    pe = tl.load(p_base + (2 * planes)[None, :] * sr + cols[:, None] * sc).to(tl.float32)
    po = tl.load(p_base + (2 * planes + 1)[None, :] * sr + cols[:, None] * sc).to(tl.float32)
    return pe, po


@triton.jit
def _angles(r_ptr, srb, w_ptr, swh, bc, hf, m, nmask, D2: tl.constexpr, C: tl.constexpr):
    """cos and sin ``(BLOCK_N, D2)`` of the tile's angles (zero angle outside the tile)."""
    p = tl.arange(0, D2)
    r_row = r_ptr + bc * srb + m.to(tl.int64) * C
    w_row = w_ptr + hf * swh
    theta = reduced_angles(r_row, nmask, w_row, p, p < D2, D2, C)
    return tl.cos(theta), tl.sin(theta)


@triton.jit
def basis_rotary_fwd(x_ptr, sxb, sxh, sxn, sxd, y_ptr, syb, syh, syn, syd, p_ptr, sph, spr, spc,
                     r_ptr, srb, w_ptr, swh, H, N, prefix, tiles,
                     C: tl.constexpr, D: tl.constexpr, D2: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr, POST: tl.constexpr):
    """``y = RoPE(theta) P x`` (``POST``: ``P^T RoPE(theta) P x``) for one token tile of one (example, head)."""
    pid = tl.program_id(0)
    tile = pid % tiles
    bh = pid // tiles
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hp = tl.where(sph != 0, h, 0)  # stride 0: one basis for every head
    hf = tl.where(swh != 0, h, 0)  # stride 0: frequencies shared by the heads
    bc = tl.where(srb != 0, b, 0)  # stride 0: coordinates shared by the batch
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    n64 = n.to(tl.int64)
    rows = nmask & (n >= prefix)  # tokens with a coordinate; the prefix tokens pass through unchanged

    x = _load_tile(x_ptr + b * sxb + h * sxh + n64[:, None] * sxn, sxd, nmask, D)  # (BN, D)
    pe, po = _basis_halves(p_ptr + hp * sph, spr, spc, D, D2)
    y0 = tl.dot(x, pe, input_precision=PRECISION)  # (BN, D2)
    y1 = tl.dot(x, po, input_precision=PRECISION)
    cos, sin = _angles(r_ptr, srb, w_ptr, swh, bc, hf, n - prefix, rows, D2, C)
    o0 = y0 * cos - y1 * sin
    o1 = y0 * sin + y1 * cos
    if POST:  # back to the input basis: P^T o = o0 P[0::2] + o1 P[1::2]
        rot = tl.dot(o0, tl.trans(pe), input_precision=PRECISION) + tl.dot(o1, tl.trans(po), input_precision=PRECISION)
    else:
        rot = tl.reshape(tl.join(o0, o1), (BLOCK_N, D))
    out = tl.where(rows[:, None], rot, x).to(y_ptr.dtype.element_ty)
    dims = tl.arange(0, D)
    tl.store(y_ptr + b * syb + h * syh + n64[:, None] * syn + dims[None, :] * syd, out, mask=nmask[:, None])


@triton.jit
def basis_rotary_bwd(g_ptr, sgb, sgh, sgn, sgd, x_ptr, sxb, sxh, sxn, sxd, gx_ptr, sob, soh, son, sod,
                     p_ptr, sph, spr, spc, r_ptr, srb, w_ptr, swh, gp_ptr, fpart_ptr, cpart_ptr, H, N, prefix,
                     C: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr, D2: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr, POST: tl.constexpr, NEED_X: tl.constexpr, NEED_P: tl.constexpr,
                     NEED_FREQ: tl.constexpr, NEED_COORD: tl.constexpr):
    """Gradients of one (example, head) over all its tokens; see the module doc. Writes ``gx`` (when ``NEED_X``),
    this program's ``(D, D)`` basis-gradient partial (rows in ``P``'s order), its ``(C, D2)`` frequency partial
    and its ``(M, C)`` coordinate partial."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hp = tl.where(sph != 0, h, 0)  # stride 0: one basis for every head
    hf = tl.where(swh != 0, h, 0)  # stride 0: frequencies shared by the heads
    bc = tl.where(srb != 0, b, 0)  # stride 0: coordinates shared by the batch
    pe, po = _basis_halves(p_ptr + hp * sph, spr, spc, D, D2)
    dims = tl.arange(0, D)
    planes = tl.arange(0, D2)
    gpe = tl.full((D2, D), 0.0, tl.float32)
    gpo = tl.full((D2, D), 0.0, tl.float32)
    cdims = tl.arange(0, BLOCK_C)
    f_acc = tl.full((BLOCK_C, D2), 0.0, tl.float32)
    M = N - prefix
    for start in range(0, N, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < N
        n64 = n.to(tl.int64)
        rows = nmask & (n >= prefix)  # tokens with a coordinate (prefix tokens: identity)
        m64 = (n - prefix).to(tl.int64)
        g = _load_tile(g_ptr + b * sgb + h * sgh + n64[:, None] * sgn, sgd, nmask, D)
        if POST:  # the gradient of the rotated o (out = P^T o): P g, split into the planes' halves
            g0 = tl.dot(g, pe, input_precision=PRECISION)
            g1 = tl.dot(g, po, input_precision=PRECISION)
        else:
            g0, g1 = tl.split(tl.reshape(g, (BLOCK_N, D2, 2)))
        cos, sin = _angles(r_ptr, srb, w_ptr, swh, bc, hf, n - prefix, rows, D2, C)
        h0 = tl.where(rows[:, None], g0 * cos + g1 * sin, 0.0)
        h1 = tl.where(rows[:, None], g1 * cos - g0 * sin, 0.0)
        if NEED_X:
            gx = tl.dot(h0, tl.trans(pe), input_precision=PRECISION) + tl.dot(h1, tl.trans(po),
                                                                              input_precision=PRECISION)
            gx = tl.where(rows[:, None], gx, g)
            tl.store(gx_ptr + b * sob + h * soh + n64[:, None] * son + dims[None, :] * sod,
                     gx.to(gx_ptr.dtype.element_ty), mask=nmask[:, None])
        if NEED_P or NEED_FREQ or NEED_COORD:
            x = _load_tile(x_ptr + b * sxb + h * sxh + n64[:, None] * sxn, sxd, nmask, D)
            if NEED_P:
                gpe += tl.dot(tl.trans(h0), x, input_precision=PRECISION)
                gpo += tl.dot(tl.trans(h1), x, input_precision=PRECISION)
            if NEED_FREQ or NEED_COORD or (POST and NEED_P):
                y0 = tl.dot(x, pe, input_precision=PRECISION)
                y1 = tl.dot(x, po, input_precision=PRECISION)
                o0 = tl.where(rows[:, None], y0 * cos - y1 * sin, 0.0)
                o1 = tl.where(rows[:, None], y0 * sin + y1 * cos, 0.0)
                if POST and NEED_P:  # out = P^T o: gP[0::2] += o0^T g, gP[1::2] += o1^T g
                    gpe += tl.dot(tl.trans(o0), g, input_precision=PRECISION)
                    gpo += tl.dot(tl.trans(o1), g, input_precision=PRECISION)
                gth = o0 * g1 - o1 * g0  # (BN, D2): the angle gradient, zero for prefix rows
                r_rows = r_ptr + bc * srb + m64[:, None] * C + cdims[None, :]
                if NEED_FREQ:
                    r = tl.load(r_rows, mask=rows[:, None] & (cdims < C)[None, :], other=0.0).to(tl.float32)
                    f_acc += tl.reduce(r[:, :, None] * gth[:, None, :], 0, sum_combine)  # (BC, D2)
                if NEED_COORD:
                    c_row = cpart_ptr + (bh.to(tl.int64) * M + m64) * C  # (B H, M, C) partials
                    for j in tl.static_range(C):
                        w = tl.load(w_ptr + hf * swh + j * D2 + planes).to(tl.float32)
                        tl.store(c_row + j, tl.reduce(gth * w[None, :], 1, sum_combine), mask=rows)
    if NEED_P:
        gp_base = gp_ptr + bh.to(tl.int64) * (D * D)
        tl.store(gp_base + (2 * planes)[:, None] * D + dims[None, :], gpe)
        tl.store(gp_base + (2 * planes + 1)[:, None] * D + dims[None, :], gpo)
    if NEED_FREQ:
        f_base = fpart_ptr + bh.to(tl.int64) * (C * D2)
        tl.store(f_base + cdims[:, None] * D2 + planes[None, :], f_acc, mask=(cdims < C)[:, None])
