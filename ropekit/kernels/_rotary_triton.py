"""Triton kernels of the fused frequency rotation (imported lazily by :mod:`ropekit.kernels`).

Shape legend: ``B`` batch, ``H`` heads of the tensor being rotated, ``N`` tokens (prefix tokens first), ``M = N -
prefix`` tokens that carry a coordinate, ``c`` coordinate dimension, ``d`` head dimension, ``P = d / 2`` planes.

One program rotates a tile of ``BLOCK_N`` tokens of q or of k for a few (example, head) copies whose angles are the
same (the angles depend on the example only through per-example coordinates, on the head only through per-head
frequencies), so cos and sin are computed once for all of them. The programs of q come first in the launch grid,
those of k after them: both tensors are rotated by one launch. In registers, in fp32::

    theta[n, p] = sum_j coords[b, n - prefix, j] * freqs[h, j, p]       (0 for prefix tokens: identity)
    y0 = x0 cos(theta) - x1 sin(theta),   y1 = x0 sin(theta) + x1 cos(theta)

where ``(x0, x1)`` is plane ``p``: the dimensions ``(2p, 2p + 1)`` (interleaved pairs) or ``(p, p + P)`` (half
split). The angle is formed in fp64 from fp64 coordinates and frequencies (an fp32 sum is off by ~1e-3 rad at
``|theta| ~ 10^4``, coordinates in the thousands, and frequencies derived in float64 from parameters would be
rounded), reduced modulo 2 pi in fp64 and only then rounded to the fp32 compute dtype (``reduced_angles``): cos
and sin get the float64 angle to fp32 rounding, in ``[-pi, pi]``. Per (token, plane) and program that is ``c``
fp64 multiply-adds, one fp64 multiply, a floor and one more multiply-add, shared by the program's copies. The
backward pass is the same rotation by ``-theta`` applied to the output gradient, and, when the frequencies or
coordinates need a gradient, the angle gradient of every (token, plane)::

    g_theta = g0 * dy0/dtheta + g1 * dy1/dtheta = y0 * g1 - y1 * g0     (dy0/dtheta = -y1, dy1/dtheta = y0)

computed from the saved forward output ``y`` and the incoming gradient ``g``. It is summed over the program's
copies and reduced in the kernel to per-program partial sums --
``sum_n g_theta[n, p] * coords[n, j]`` for the frequencies and ``sum_p g_theta[n, p] * freqs[h, j, p]`` for the
coordinates -- which the caller sums over programs in one small deterministic reduction (no atomics).

Whether the kernels are compiled for a GPU or run by Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors)
is decided by Triton when this module is imported; ``INTERPRET`` records it.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# Triton's own library functions (``tl.sum``, ``tl.zeros``, ``tl.cdiv``) are jit functions whose compile-or-interpret
# mode was fixed when Triton was imported; the kernels below call only builtins (``tl.reduce`` with the library's sum
# combiner, which the interpreter recognises) so that they also run when TRITON_INTERPRET is set after that.
sum_combine = tl.standard._sum_combine  # triton.language.standard keeps it private


@triton.jit
def _load_pairs(base, stride, nmask, p, pmask, P, acc, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
                HALF: tl.constexpr):
    """The two halves ``(x0, x1)`` ``(BLOCK_N, BLOCK_P)`` in the compute dtype of ``acc`` of every plane of a tile
    of rows (``base``: row pointers ``(BLOCK_N, 1)``). Interleaved pairs are read as whole contiguous rows and split
    in registers, so the loads stay coalesced and vectorised; half-split pairs are two contiguous loads."""
    mask = nmask[:, None] & pmask[None, :]
    if HALF:
        x0 = tl.load(base + p[None, :] * stride, mask=mask, other=0.0).to(acc.dtype)
        x1 = tl.load(base + (p + P)[None, :] * stride, mask=mask, other=0.0).to(acc.dtype)
    else:
        dims = tl.arange(0, 2 * BLOCK_P)
        x = tl.load(base + dims[None, :] * stride, mask=nmask[:, None] & (dims < 2 * P)[None, :], other=0.0)
        x0, x1 = tl.split(tl.reshape(x.to(acc.dtype), (BLOCK_N, BLOCK_P, 2)))
    return x0, x1


@triton.jit
def _store_pairs(base, stride, y0, y1, nmask, p, pmask, P, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
                 HALF: tl.constexpr):
    """Write the plane halves ``y0``, ``y1`` back in the layout :func:`_load_pairs` reads."""
    mask = nmask[:, None] & pmask[None, :]
    if HALF:
        tl.store(base + p[None, :] * stride, y0, mask=mask)
        tl.store(base + (p + P)[None, :] * stride, y1, mask=mask)
    else:
        dims = tl.arange(0, 2 * BLOCK_P)
        y = tl.reshape(tl.join(y0, y1), (BLOCK_N, 2 * BLOCK_P))
        tl.store(base + dims[None, :] * stride, y, mask=nmask[:, None] & (dims < 2 * P)[None, :])


@triton.jit
def reduced_angles(r_row, rmask, w_row, p, pmask, P, C: tl.constexpr):
    """Angles ``sum_j r_j w_jp`` ``(BN, BP)`` formed in fp64 from the fp64 coordinates and frequencies, reduced
    modulo 2 pi in fp64 (``theta - round(theta / 2 pi) 2 pi``, exact to ~1e-12 rad at ``|theta| ~ 10^4``) and only
    then rounded to fp32, in ``[-pi, pi]``: within fp32 rounding of the float64 angle whatever the coordinate scale,
    where an fp32 sum is off by up to ~1e-3 rad at ``|theta| ~ 10^4``, and frequencies derived in float64 from
    parameters are used unrounded."""
    theta = _angles64(r_row, rmask, w_row, p, pmask, P, C)
    k = tl.floor(theta * 0.15915494309189535 + 0.5)
    return (theta - k * 6.283185307179586).to(tl.float32)


@triton.jit
def _angles64(r_row, rmask, w_row, p, pmask, P, C: tl.constexpr):
    """fp64 angles ``sum_j r_j w_jp`` ``(BN, BP)`` from the fp64 coordinate rows and frequency rows."""
    r = tl.load(r_row, mask=rmask, other=0.0)
    w = tl.load(w_row + p, mask=pmask, other=0.0)
    theta = r[:, None] * w[None, :]
    for j in tl.static_range(1, C):
        r = tl.load(r_row + j, mask=rmask, other=0.0)
        w = tl.load(w_row + j * P + p, mask=pmask, other=0.0)
        theta += r[:, None] * w[None, :]
    return theta


@triton.jit
def _rotate_tile(x_ptr, sxb, sxh, sxn, sxd,
                 y_ptr, syb, syh, syn, syd,
                 o_ptr, sob, soh, son, sod,
                 r_ptr, srb, w_ptr, swh,
                 fpart_ptr, cpart_ptr,
                 t, N, keys_h, reuse_h, reuse, chunk_size, n_chunks, prefix, P, sign,
                 C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, HALF: tl.constexpr,
                 NEED_FREQ: tl.constexpr, NEED_COORD: tl.constexpr, REDUCE: tl.constexpr):
    """Rotate one token tile of ``chunk_size`` (example, head) copies that share their angles; see the module doc.

    The angles depend on the example only through per-example coordinates and on the head only through per-head
    frequencies. An *angle key* ``(bk, hk)`` names one distinct angle table (``keys_h`` = heads with their own
    frequencies, 1 when shared); the ``reuse`` copies sharing a key are ``(b, h) = (bk + s // reuse_h, hk + s %
    reuse_h)`` for ``s < reuse``. The local program index ``t`` enumerates (key, token tile, chunk of copies); cos
    and sin are computed once per program and reused for its copies.
    """
    tiles = (N + BLOCK_N - 1) // BLOCK_N
    chunk = t % n_chunks
    rest = t // n_chunks
    tile = rest % tiles
    key = rest // tiles
    bk = key // keys_h
    hk = key % keys_h

    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) token index
    p = tl.arange(0, BLOCK_P)  # (BP,) plane index
    nmask = n < N
    pmask = p < P
    m = n - prefix  # coordinate row; < 0 for prefix tokens
    rmask = nmask & (m >= 0)
    # coords (Bc, M, C) and freqs (Hf, C, P) are contiguous fp64: the angles are formed in fp64 (see the module doc)
    r_row = r_ptr + bk.to(tl.int64) * srb + m.to(tl.int64) * C
    w_row = w_ptr + hk.to(tl.int64) * swh

    if REDUCE:  # fp32 compute dtype: the fp64 angle reduced modulo 2 pi, then rounded
        theta = reduced_angles(r_row, rmask, w_row, p, pmask, P, C)
    else:  # fp64 compute dtype
        theta = _angles64(r_row, rmask, w_row, p, pmask, P, C)  # (BN, BP)
    cos = tl.cos(theta)
    sin = tl.sin(theta) * sign

    n64 = n.to(tl.int64)
    g_acc = theta * 0.0  # angle gradient summed over the copies
    for i in range(chunk_size):
        s = chunk * chunk_size + i
        live = nmask & (s < reuse)
        b = (bk + s // reuse_h).to(tl.int64)
        h = (hk + s % reuse_h).to(tl.int64)
        x_base = x_ptr + b * sxb + h * sxh + n64[:, None] * sxn
        y_base = y_ptr + b * syb + h * syh + n64[:, None] * syn
        x0, x1 = _load_pairs(x_base, sxd, live, p, pmask, P, theta, BLOCK_N, BLOCK_P, HALF)
        y0 = x0 * cos - x1 * sin
        y1 = x0 * sin + x1 * cos
        _store_pairs(y_base, syd, y0.to(y_ptr.dtype.element_ty), y1.to(y_ptr.dtype.element_ty), live, p, pmask, P,
                     BLOCK_N, BLOCK_P, HALF)
        if NEED_FREQ or NEED_COORD:
            # x is the output gradient here and o the saved forward output: g_theta = o0 * g1 - o1 * g0
            o_base = o_ptr + b * sob + h * soh + n64[:, None] * son
            o0, o1 = _load_pairs(o_base, sod, live, p, pmask, P, theta, BLOCK_N, BLOCK_P, HALF)
            g_acc += o0 * x1 - o1 * x0  # (BN, BP); zero outside the tile and for dead copies

    if NEED_FREQ:
        f_row = fpart_ptr + t.to(tl.int64) * (C * P)  # (programs, C, P) partial sums, program order
        for j in tl.static_range(C):
            r = tl.load(r_row + j, mask=rmask, other=0.0).to(g_acc.dtype)
            tl.store(f_row + j * P + p, tl.reduce(g_acc * r[:, None], 0, sum_combine), mask=pmask)
    if NEED_COORD:
        c_row = cpart_ptr + ((key * n_chunks + chunk).to(tl.int64) * N + n64) * C  # (keys, chunks, N, C) partials
        for j in tl.static_range(C):
            w = tl.load(w_row + j * P + p, mask=pmask, other=0.0).to(g_acc.dtype)
            tl.store(c_row + j, tl.reduce(g_acc * w[None, :], 1, sum_combine), mask=nmask)


@triton.jit
def rotary_kernel(q_ptr, sqb, sqh, sqn, sqd, qy_ptr, sqyb, sqyh, sqyn, sqyd, qo_ptr, sqob, sqoh, sqon, sqod,
                  rq_ptr, srqb, Nq, keys_hq, reuse_hq, reuse_q, chunk_q, n_chunks_q,
                  k_ptr, skb, skh, skn, skd, ky_ptr, skyb, skyh, skyn, skyd, ko_ptr, skob, skoh, skon, skod,
                  rk_ptr, srkb, Nk, keys_hk, reuse_hk, reuse_k, chunk_k, n_chunks_k,
                  w_ptr, swh, fpart_ptr, cqpart_ptr, ckpart_ptr,
                  q_programs, prefix, P, sign,
                  C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, HALF: tl.constexpr,
                  NEED_FREQ: tl.constexpr, NEED_COORD: tl.constexpr, REDUCE: tl.constexpr):
    """q's programs are ``[0, q_programs)``, k's the rest: one launch for both tensors.

    Forward: ``x = q / k``, ``y`` the rotated outputs, ``sign = 1``. Backward: ``x`` the output gradients, ``y`` the
    input gradients, ``o`` the saved forward outputs, ``sign = -1`` (the inverse rotation).
    """
    pid = tl.program_id(0)
    if pid < q_programs:
        _rotate_tile(q_ptr, sqb, sqh, sqn, sqd, qy_ptr, sqyb, sqyh, sqyn, sqyd, qo_ptr, sqob, sqoh, sqon, sqod,
                     rq_ptr, srqb, w_ptr, swh, fpart_ptr, cqpart_ptr,
                     pid, Nq, keys_hq, reuse_hq, reuse_q, chunk_q, n_chunks_q, prefix, P, sign,
                     C, BLOCK_N, BLOCK_P, HALF, NEED_FREQ, NEED_COORD, REDUCE)
    else:
        _rotate_tile(k_ptr, skb, skh, skn, skd, ky_ptr, skyb, skyh, skyn, skyd, ko_ptr, skob, skoh, skon, skod,
                     rk_ptr, srkb, w_ptr, swh, fpart_ptr + q_programs * C * P, ckpart_ptr,
                     pid - q_programs, Nk, keys_hk, reuse_hk, reuse_k, chunk_k, n_chunks_k, prefix, P, sign,
                     C, BLOCK_N, BLOCK_P, HALF, NEED_FREQ, NEED_COORD, REDUCE)
