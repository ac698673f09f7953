"""Block-diagonal operators: a ``b x b`` matrix applied to every block of every token, the exponentials
``expm(s K_j)`` of skew block generators with their exact Frechet derivative, and the rotation of q and k in a
block eigenbasis -- the per-token work of ComRoPE, LieRE and relaxed STRING.

Shape legend: ``B`` batch, ``H`` heads, ``Hp`` heads that own parameters (1 or ``H``), ``N`` tokens, ``M`` tokens
that carry a coordinate, ``c`` coordinate dimension, ``d = nb * b`` head dimension in ``nb`` blocks of size ``b``;
a leading ``Bs`` / ``Be`` is 1 for what the batch shares, ``B`` per example.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .angles import rotate_pairs_real, wide_dtype, wide_angles
from .products import precise_matmul
from .rotation import complex_pairs, fused_kernel, slice_loops, apply_frequency_rope
from .skew import skew_real_schur

__all__ = ["block_apply", "scaled_block_exp_matrices", "scaled_block_exp_apply", "scaled_block_exp_reference",
           "rotate_in_block_eigenbasis", "share_block_gradients", "batch_block_gradients", "block_diag"]


def block_apply(e: Tensor, x: Tensor) -> Tensor:
    """Apply a ``b x b`` matrix to every block of every token: ``y[.., j, :] = e[.., j, :, :] @ x[.., j, :]``.

    Args:
        e: ``(Be, He, M, nb, b, b)`` with ``Be`` 1 (shared by the batch: an image grid) or ``B``, and ``He`` 1
            (shared by the heads) or ``H`` -- one matrix per distinct (coordinate, parameter head, block).
        x: ``(B, H, M, nb * b)``.

    Returns:
        ``(B, H, M, nb * b)``, differentiable in ``e`` and ``x``.

    The matrices are never expanded over the batch or heads they are shared by: the shared dimensions become
    the columns of one batched matrix product per (coordinate, block), and the backward pass sums the outer
    products ``g x^T`` over them with one batched product per coordinate (``_BlockApply``); under
    ``create_graph`` the backward is written with differentiable ops, so second derivatives are exact.
    """
    return _BlockApply.apply(e, x)


def _block_matvec(e: Tensor, x: Tensor) -> Tensor:
    """Forward of ``block_apply`` (no autograd). Shapes as in ``block_apply``."""
    bsz, h, m, d = x.shape
    be, he, _, nb, b, _ = e.shape
    hr = h // he
    xv = x.reshape(bsz, he, hr, m, nb, b)  # (B, He, Hr, M, nb, b)
    if be == 1:
        cols = xv.permute(1, 3, 4, 5, 0, 2).reshape(he, m, nb, b, bsz * hr)  # (He, M, nb, b, B*Hr)
        y = precise_matmul(e[0], cols)  # (He, M, nb, b, B*Hr)
        y = y.view(he, m, nb, b, bsz, hr).permute(4, 0, 5, 1, 2, 3)  # (B, He, Hr, M, nb, b)
    else:
        cols = xv.permute(0, 1, 3, 4, 5, 2)  # (B, He, M, nb, b, Hr)
        y = precise_matmul(e, cols).permute(0, 1, 5, 2, 3, 4)  # (B, He, Hr, M, nb, b)
    return y.reshape(bsz, h, m, d)


def _block_outer_sum(g: Tensor, x: Tensor, eshape: Sequence[int]) -> Tensor:
    """``sum g_j x_j^T`` per block over the dimensions a ``block_apply`` matrix of shape ``eshape`` is shared by.

    Computed as one ``(d x R) @ (R x d)`` product per coordinate (``R`` the shared batch x head columns), whose
    diagonal ``b x b`` blocks are kept: on CPU this beats a batched product of ``b x b`` outer products.
    """
    bsz, h, m, d = x.shape
    be, he, _, nb, b, _ = eshape
    hr = h // he
    if be == bsz and hr == 1:  # nothing is shared: plain per-token outer products
        return g.reshape(bsz, h, m, nb, b, 1) * x.reshape(bsz, h, m, nb, 1, b)
    gv, xv = g.reshape(bsz, he, hr, m, d), x.reshape(bsz, he, hr, m, d)
    if be == 1:
        gm = gv.permute(1, 3, 4, 0, 2).reshape(he, m, d, bsz * hr)  # (He, M, d, R)
        xm = xv.permute(1, 3, 0, 2, 4).reshape(he, m, bsz * hr, d)  # (He, M, R, d)
        full = precise_matmul(gm, xm).unsqueeze(0)  # (1, He, M, d, d)
    elif he == 1 and not slice_loops(x):  # per-example coordinates, shared by heads: one batched product
        gb = g.reshape(bsz, h, m * nb, b).permute(0, 2, 3, 1)  # (B, M*nb, b, H)
        xb = x.reshape(bsz, h, m * nb, b).permute(0, 2, 1, 3)  # (B, M*nb, H, b)
        return precise_matmul(gb, xb).view(bsz, 1, m, nb, b, b)
    elif he == 1:  # the same on the CPU, one strided batched product per example (cheaper there)
        # (no ``out=``: it would break double backward, where these products are recorded by autograd)
        per_example = []
        for i in range(bsz):
            gi = g[i].reshape(h, m * nb, b).permute(1, 2, 0)  # (M*nb, b, H)
            xi = x[i].reshape(h, m * nb, b).permute(1, 0, 2)  # (M*nb, H, b)
            per_example.append(precise_matmul(gi, xi))
        return torch.stack(per_example).view(bsz, 1, m, nb, b, b)
    else:
        gm = gv.permute(0, 1, 3, 4, 2).contiguous()  # (B, He, M, d, Hr)
        xm = xv.permute(0, 1, 3, 2, 4).contiguous()  # (B, He, M, Hr, d)
        full = precise_matmul(gm, xm)  # (B, He, M, d, d)
    if nb == 1:
        return full.unsqueeze(-3)  # (Be, He, M, 1, d, d)
    blocks = full.view(be, he, m, nb, b, nb, b).diagonal(dim1=3, dim2=5)  # (Be, He, M, b, b, nb)
    return blocks.permute(0, 1, 2, 5, 3, 4)  # (Be, He, M, nb, b, b)


class _BlockApply(torch.autograd.Function):
    """``block_apply`` with a backward that keeps the shared matrices un-expanded (see ``block_apply``)."""

    @staticmethod
    def forward(ctx, e: Tensor, x: Tensor) -> Tensor:
        ctx.save_for_backward(e, x)
        return _block_matvec(e, x)

    @staticmethod
    def backward(ctx, g: Tensor):
        e, x = ctx.saved_tensors
        ge = gx = None
        if not torch.is_grad_enabled():  # first order: batched products, shared matrices never expanded
            if ctx.needs_input_grad[1]:
                gx = _block_matvec(e.transpose(-1, -2), g)  # R^T g
            if ctx.needs_input_grad[0]:
                ge = _block_outer_sum(g, x, e.shape)
            return ge, gx
        # a gradient graph is requested (create_graph): the same gradients from differentiable ops
        if ctx.needs_input_grad[1]:
            gx = _BlockApply.apply(e.transpose(-1, -2), g)  # R^T g, itself twice differentiable
        if ctx.needs_input_grad[0]:
            bsz, h, m, _ = x.shape
            be, he, _, nb, b, _ = e.shape
            gv = g.reshape(bsz, he, h // he, m, nb, b)
            xv = x.reshape(bsz, he, h // he, m, nb, b)
            ge = torch.einsum("bhrmni,bhrmnj->bhmnij", gv, xv)  # (B, He, M, nb, b, b): per-token outer products
            if be == 1:
                ge = ge.sum(0, keepdim=True)
        return ge, gx


def _plane_basis(q: Tensor) -> Tensor:
    """``(A_n, B_n)`` with ``Q RoPE(theta) Q^T = sum_n cos(theta_n) A_n + sin(theta_n) B_n``.

    ``A_n = q0 q0^T + q1 q1^T`` (projector on plane ``n``), ``B_n = q1 q0^T - q0 q1^T`` (its generator), from the
    column pair ``(q0, q1) = (Q[:, 2n], Q[:, 2n+1])``. Args: ``q`` ``(..., b, b)``. Returns ``(..., b, b * b)``:
    rows ``0 .. b/2 - 1`` the ``A_n``, rows ``b/2 .. b - 1`` the ``B_n``, each flattened.
    """
    q0, q1 = q.unflatten(-1, (-1, 2)).unbind(-1)  # (..., b, h): plane n's two columns
    a = q0.transpose(-1, -2).unsqueeze(-1) * q0.transpose(-1, -2).unsqueeze(-2)  # (..., h, b, b)
    a = a + q1.transpose(-1, -2).unsqueeze(-1) * q1.transpose(-1, -2).unsqueeze(-2)
    g = q1.transpose(-1, -2).unsqueeze(-1) * q0.transpose(-1, -2).unsqueeze(-2)
    g = g - g.transpose(-1, -2)
    return torch.cat((a, g), dim=-3).flatten(-2)  # (..., 2h, b*b)


class _ScaledBlockExpm(torch.autograd.Function):
    """``E = expm(s K)`` for a fixed skew ``K`` per block and a scalar ``s`` per (coordinate, block).

    Forward: one real block-diagonalisation per block (``skew_real_schur``) serves every coordinate:
    ``expm(s K) = Q RoPE(s mu) Q^T = sum_n cos(s mu_n) A_n + sin(s mu_n) B_n`` -- one small matrix product
    per block for all coordinates (``_plane_basis``). The angles ``s mu_n`` are formed in float64 from ``s`` (pass
    it in float64 where it is itself a sum of products) and the float64 eigenvalues, so the exponentials stay exact
    to ``K``'s dtype at any coordinate scale.

    Backward: the exact Frechet derivative of the exponential, in the real basis ``Q``. ``G^ = Q^T gE Q`` (one
    product with ``Q (x) Q`` per block); every 2x2 block ``(n, m)`` of ``G^`` splits into a part commuting with
    the plane rotations, ``a I + b J``, and an anti-commuting one, ``c Z + e W``; integrating
    ``expm(-(1 - t) s D) G^ expm(-t s D)`` over ``t`` multiplies them by ``s sinc(s (mu_n - mu_m) / 2)`` and
    ``s sinc(s (mu_n + mu_m) / 2)`` phase factors -- finite and exact also when eigenvalues coincide
    (``K = 0``, zero initialisation), where an eigendecomposition backward would divide by zero. Under
    ``create_graph`` the backward differentiates a dense ``matrix_exp`` reference instead, so second
    derivatives are exact too.
    """

    @staticmethod
    def forward(ctx, s: Tensor, k: Tensor) -> Tensor:
        # s: (Bs, Hp, M, nb); k: (Hp, nb, b, b)
        bs, hp, m, nb = s.shape
        b = k.shape[-1]
        wide = wide_dtype(k.device)
        q, mu_wide = skew_real_schur(k.to(wide))  # (Hp, nb, b, b), (Hp, nb, h)
        q = q.to(k.dtype)
        st = s.permute(1, 3, 0, 2).reshape(hp, nb, bs * m, 1)  # (Hp, nb, T, 1), T = Bs * M coordinates
        theta = st.to(wide) * mu_wide.unsqueeze(-2)  # (Hp, nb, T, h): float64, exact at any coordinate scale
        cs = torch.cat((torch.cos(theta), torch.sin(theta)), dim=-1).to(k.dtype)  # (Hp, nb, T, 2h)
        e = precise_matmul(cs, _plane_basis(q))  # (Hp, nb, T, b*b)
        # the backward's phase factors are angles too: float64 scalars and frequencies
        ctx.save_for_backward(s, k, st.to(wide), q, mu_wide)
        ctx.shape = (bs, hp, m, nb)
        return e.view(hp, nb, bs, m, b, b).permute(2, 0, 3, 1, 4, 5).contiguous()  # (Bs, Hp, M, nb, b, b)

    @staticmethod
    def backward(ctx, ge: Tensor):
        s, k, st, q, mu = ctx.saved_tensors
        if torch.is_grad_enabled():  # a gradient graph is requested: differentiate a dense reference instead
            with torch.enable_grad():
                ref = _dense_block_exp(s, k)
                want = [t for t, n in zip((s, k), ctx.needs_input_grad[:2]) if n]
                grads = iter(torch.autograd.grad(ref, want, ge, create_graph=True))
            return tuple(next(grads) if n else None for n in ctx.needs_input_grad[:2])
        bs, hp, m, nb = ctx.shape
        b = q.shape[-1]
        kron = (q.unsqueeze(-1).unsqueeze(-3) * q.unsqueeze(-2).unsqueeze(-4)).reshape(hp, nb, b * b, b * b)
        ge = ge.permute(1, 3, 0, 2, 4, 5).reshape(hp, nb, bs * m, b * b)  # (Hp, nb, T, b*b)
        gh = precise_matmul(ge, kron).view(hp, nb, bs * m, b, b)  # Q^T gE Q
        gst, mt = _frechet_block_grads(gh, st, mu, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        gs = None if gst is None else gst.view(hp, nb, bs, m).permute(2, 0, 3, 1).to(s.dtype)  # (Bs, Hp, M, nb)
        if mt is not None:
            qw = q.to(mt.dtype)
            mt = precise_matmul(precise_matmul(qw, mt), qw.transpose(-1, -2)).to(k.dtype)
        return gs, mt


def _frechet_block_grads(gh: Tensor, st: Tensor, mu: Tensor, need_s: bool, need_k: bool
                         ) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of ``E_t = Q expm(s_t D) Q^T`` (``D = blockdiag_n(mu_n J)``) with respect to ``s`` and to ``D``,
    from the gradient of the ``E_t`` written in the basis ``Q``: the exact Frechet derivative of the exponential.

    Args:
        gh: ``(Hp, nb, T, b, b)``: ``Q^T gE_t Q`` for every coordinate ``t`` (for ``y = E x``:
            ``sum (Q^T g)(Q^T x)^T`` over the tokens at ``t``).
        st: ``(Hp, nb, T, 1)`` the scalars ``s_t``; mu: ``(Hp, nb, b/2)`` the plane frequencies.
        need_s, need_k: which gradients to form.

    Returns:
        ``(gs, gd)``: ``gs`` ``(Hp, nb, T)`` and ``gd`` ``(Hp, nb, b, b)``, the gradient with respect to a
        perturbation of the generator in the basis (``Q gd Q^T`` is the one of ``K``); ``None`` where not asked.
        Computed in ``st``'s dtype.

    Every 2x2 block ``(n, m)`` of ``gh`` splits into a part commuting with the plane rotations, ``a I + b J``, and
    an anti-commuting one, ``c Z + e W``; integrating ``expm(-(1 - t) s D) gh expm(-t s D)`` over ``t`` multiplies
    them by ``s sinc(s (mu_n - mu_m) / 2)`` and ``s sinc(s (mu_n + mu_m) / 2)`` phase factors -- finite and exact
    also where frequencies coincide or vanish, where an eigenvector derivative would divide by zero.
    """
    hp, nb, t, b, _ = gh.shape
    h = b // 2
    gh = gh.to(st.dtype).view(hp, nb, t, h, 2, h, 2)  # 2x2 blocks (n, m)
    # (Hp, nb, 2, 2, T, h*h): every later op runs on contiguous (T, h*h) planes, no small broadcast dims
    gh = gh.permute(0, 1, 4, 6, 2, 3, 5).reshape(hp, nb, 2, 2, t, h * h)
    g00, g01, g10, g11 = gh[:, :, 0, 0], gh[:, :, 0, 1], gh[:, :, 1, 0], gh[:, :, 1, 1]  # (Hp, nb, T, h*h)
    ca, cb = (g00 + g11) * 0.5, (g10 - g01) * 0.5  # commuting part a I + b J of block (n, m)
    mu = mu.to(st.dtype)
    gst = gd = None
    if need_s:
        half = st * mu.unsqueeze(-2) * 0.5  # alpha_n = s mu_n / 2: (Hp, nb, T, h)
        ch, sh = torch.cos(half), torch.sin(half)
        diag = torch.arange(h, device=gh.device) * (h + 1)  # (n, n) in the flattened h*h
        ca_d, sa_d = ch * ch - sh * sh, 2.0 * sh * ch  # cos, sin of s mu_n
        da, db = ca[..., diag], cb[..., diag]  # (Hp, nb, T, h)
        # <G^_nn, mu_n J Rot(s mu_n)> = 2 mu_n Im((a + ib) exp(-i s mu_n))
        gst = 2.0 * (mu.unsqueeze(-2) * (db * ca_d - da * sa_d)).sum(-1)  # (Hp, nb, T)
    if need_k:
        aa, ae = (g00 - g11) * 0.5, (g01 + g10) * 0.5  # anti-commuting part c Z + e W
        hd = (mu.unsqueeze(-1) - mu.unsqueeze(-2)).flatten(-2).unsqueeze(-2) * 0.5  # (Hp, nb, 1, h*h)
        hs = (mu.unsqueeze(-1) + mu.unsqueeze(-2)).flatten(-2).unsqueeze(-2) * 0.5  # (mu_n -+ mu_m) / 2
        x1, x2 = st * hd, st * hs  # (Hp, nb, T, h*h)
        c1, s1, c2, s2 = torch.cos(x1), torch.sin(x1), torch.cos(x2), torch.sin(x2)
        # s sinc(s (mu_n -+ mu_m) / 2) = sin(x) / ((mu_n -+ mu_m) / 2), and s where the difference is 0:
        # exact for tiny differences too (sin is accurate relative to its argument), no Taylor branch
        u1 = torch.where(hd == 0, st, s1 / torch.where(hd == 0, torch.ones_like(hd), hd))
        u2 = torch.where(hs == 0, st, s2 / torch.where(hs == 0, torch.ones_like(hs), hs))
        # commuting part times w_c = u1 exp(-i x2); anti-commuting part times conj(w_a) = u2 exp(-i x1)
        zcr = (u1 * (ca * c2 + cb * s2)).sum(2)  # (Hp, nb, h*h)
        zci = (u1 * (cb * c2 - ca * s2)).sum(2)
        zar = (u2 * (aa * c1 + ae * s1)).sum(2)
        zai = (u2 * (ae * c1 - aa * s1)).sum(2)
        gd = torch.stack((zcr + zar, zai - zci, zci + zai, zcr - zar), dim=-1)  # (Hp, nb, h*h, 4): 2x2 blocks
        gd = gd.view(hp, nb, h, h, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(hp, nb, b, b)
    return gst, gd


def scaled_block_exp_matrices(s: Tensor, k: Tensor) -> Tensor:
    """``expm(s_{t,j} K_j)`` for every coordinate ``t`` and block ``j`` (the ``b x b`` blocks only).

    Args:
        s: ``(Hp, M, nb)`` shared by the batch or ``(B, Hp, M, nb)`` per example, float32 or float64 (the angles
            ``s mu`` are formed in float64 either way).
        k: ``(Hp, nb, b, b)`` skew-symmetric block generators, ``b`` even.

    Returns:
        ``(1 | B, Hp, M, nb, b, b)`` in ``k``'s dtype; differentiable in ``s`` and ``k`` (finite at ``k = 0``).
    """
    if s.dim() == 3:
        s = s.unsqueeze(0)  # (1, Hp, M, nb)
    hp = max(s.shape[1], k.shape[0])
    s = s.expand(s.shape[0], hp, *s.shape[2:])
    k = k.expand(hp, *k.shape[1:])
    if k.shape[-1] % 2:
        return _dense_block_exp(s, k).to(k.dtype)
    return _ScaledBlockExpm.apply(s, k)


def scaled_block_exp_apply(x: Tensor, s: Tensor, k: Tensor) -> Tensor:
    """Apply ``expm(s_{t,j} K_j)`` to block ``j`` of every token ``t`` of ``x`` (ComRoPE's operator).

    Args:
        x: ``(B, H, M, d)``.
        s: ``(Hp, M, nb)`` shared by the batch or ``(B, Hp, M, nb)`` per example: the scalar multiplying
            each block's generator.
        k: ``(Hp, nb, b, b)`` skew-symmetric block generators; ``Hp`` is 1 or ``H``.

    Returns:
        ``(B, H, M, d)``; differentiable in ``x``, ``s`` and ``k`` (finite at ``k = 0``).

    The block exponentials are built once per distinct (coordinate, parameter head, block) -- for an image
    grid shared by the batch that is ``M * nb`` small matrices, never one per example and head -- from one
    real block-diagonalisation per block (``scaled_block_exp_matrices``), then applied with ``block_apply``.
    """
    return block_apply(scaled_block_exp_matrices(s, k), x)


def _rotate_by_table(x: Tensor, cos: Tensor, sin: Tensor, num_prefix_tokens: int, inverse: bool = False) -> Tensor:
    """``x`` ``(..., N, d)`` turned pair by pair by the angles of a table (``cos``, ``sin`` ``(..., M, d/2)``; by
    their negatives with ``inverse``) after its prefix tokens, math in the table's dtype, output in ``x``'s: the
    plain product, for use inside an autograd Function (no graph, no nested Function)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        xr = x[..., num_prefix_tokens:, :] if num_prefix_tokens else x
        xr = xr if xr.dtype == cos.dtype else xr.to(cos.dtype)
        sin = -sin if inverse else sin
        if torch.compiler.is_compiling():  # no complex tensor reaches the compiler (rotation.rotate_pairs)
            y = rotate_pairs_real(xr, cos, sin)
        else:
            y = torch.view_as_real(complex_pairs(xr) * torch.complex(cos, sin)).flatten(-2)  # (..., M, d)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return torch.cat((x[..., :num_prefix_tokens, :], y), dim=-2) if num_prefix_tokens else y


class _BlockEigenRotation(torch.autograd.Function):
    """q and k, stacked ``(2, B, H, N, d)``, rotated by ``Q_j^T expm(s_j K_j) Q_j`` block by block after their
    prefix tokens, computed as RoPE in the basis ``Q`` (see ``rotate_in_block_eigenbasis``); outputs ``(q, k)``."""

    @staticmethod
    def forward(ctx, qk: Tensor, s: Tensor, gens: Tensor, basis: Tensor, mu: Tensor, coords: Tensor,
                freqs: Tensor, num_prefix_tokens: int, backend: str, collector: Tensor | None = None,
                table: tuple | None = None) -> tuple[Tensor, Tensor]:
        # qk: (2, B, H, N, d); s: (Bs, Hp, M, nb) wide; gens, basis: (Hp, nb, b, b); mu: (Hp, nb, h) wide;
        # coords: (M, c) | (B, M, c); freqs: (Hp, c, d/2) wide, = axis weights x mu, or None with a table; see
        # share_block_gradients (its gradient is this rotation's Q^T gE Q, mapped to s and K there, once);
        # table: (theta, cos, sin) of coords and freqs already formed (rotation.angle_tables), or None
        f = None if freqs is None else freqs[0] if freqs.shape[0] == 1 else freqs
        if f is None:  # (then the PyTorch rotation runs: see rotate_in_block_eigenbasis)
            qo, ko = _rotate_by_table(qk, table[1], table[2], num_prefix_tokens).unbind(0)
        else:
            qo, ko = apply_frequency_rope(qk[0], qk[1], coords, f, num_prefix_tokens=num_prefix_tokens,
                                          backend=backend)
        ctx.save_for_backward(qk, s, gens, basis, mu, coords, f)
        ctx.num_prefix_tokens, ctx.backend, ctx.table = num_prefix_tokens, backend, table
        ctx.collector = None if collector is None else collector.dtype
        return qo, ko

    @staticmethod
    def backward(ctx, gq: Tensor, gk: Tensor):
        qk, s, gens, basis, mu, coords, f = ctx.saved_tensors
        p0 = ctx.num_prefix_tokens
        need_x, need_s, need_g = ctx.needs_input_grad[:3]
        g = torch.stack((gq, gk))  # (2, B, H, N, d)
        if torch.is_grad_enabled():  # a gradient graph is requested: differentiate the dense exponential instead
            with torch.enable_grad():
                inputs = [t for t, n in zip((qk, s, gens), (need_x, need_s, need_g)) if n]
                outs = [_block_eigen_reference(x, s, gens, basis, p0) for x in qk.unbind(0)]
                grads = iter(torch.autograd.grad(outs, inputs, [gq, gk], create_graph=True, allow_unused=True))
            return tuple(next(grads) if n else None for n in (need_x, need_s, need_g)) + (None,) * 8
        g_x = g_s = g_gens = g_collector = None
        collect = ctx.collector is not None and ctx.needs_input_grad[9]
        if collect:  # the shared node maps the sum of every rotation's outer products to s and K, once
            need_s = need_g = False
        if need_x:  # the transposed rotation: the same angles negated
            table = ctx.table
            if f is None:
                g_x = _rotate_by_table(g, table[1], table[2], p0, inverse=True)
            else:
                g_x = torch.stack(apply_frequency_rope(gq, gk, coords, -f, num_prefix_tokens=p0,
                                                       backend=ctx.backend, validate=False))
        if need_s or need_g or collect:
            bs, hp, m, nb = s.shape
            b = basis.shape[-1]
            heads = qk.shape[2]
            with torch.autocast(device_type=qk.device.type, enabled=False):
                dt = torch.float64 if qk.dtype == torch.float64 else torch.float32
                # (Hp, nb, M | (B, M), ., .) batches of outer products summed over q and k, the batch and the heads
                # sharing the parameters (shared coordinates) or over q, k and the heads only (per example): one bmm
                # (the sizes spelled out, no -1: with no rotated token, M = 0, the shape is still determined)
                order, batch, rows = (((2, 5, 4, 0, 1, 3, 6), hp * nb * m, 2 * qk.shape[1] * (heads // hp))
                                      if bs == 1 else ((2, 5, 1, 4, 0, 3, 6), hp * nb * bs * m, 2 * (heads // hp)))
                xv, gv = ((t[..., p0:, :] if p0 else t) for t in (qk, g))  # (2, B, H, M, d)
                xv, gv = ((t if t.dtype == dt else t.to(dt)).unflatten(2, (hp, heads // hp)).unflatten(-1, (nb, b))
                          .permute(order).reshape(batch, rows, b) for t in (xv, gv))  # (batch, 2 B r | 2 r, b)
                gh = torch.bmm(gv.transpose(1, 2), xv).view(hp, nb, bs * m, b, b)
                if collect:
                    g_collector = gh if gh.dtype == ctx.collector else gh.to(ctx.collector)
                else:
                    g_s, g_gens = _block_grads(gh, s, gens, basis, mu, need_s, need_g)
        return g_x, g_s, g_gens, None, None, None, None, None, None, g_collector, None


def _block_grads(gh: Tensor, s: Tensor, gens: Tensor, basis: Tensor, mu: Tensor, need_s: bool, need_g: bool
                 ) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of ``s`` ``(Bs, Hp, M, nb)`` and of the generators ``(Hp, nb, b, b)`` from ``gh`` ``(Hp, nb,
    Bs * M, b, b)``, the sum of ``Q^T gE_t Q`` over the tokens at each coordinate ``t`` (``_frechet_block_grads``,
    computed in ``s``'s wide dtype -- the angles ``s mu`` stay exact at large coordinates -- then back from the
    basis ``Q``)."""
    bs, hp, m, nb = s.shape
    with torch.autocast(device_type=gh.device.type, enabled=False):
        st = s.permute(1, 3, 0, 2).reshape(hp, nb, bs * m, 1)  # (Hp, nb, T, 1), T = Bs * M
        gst, gd = _frechet_block_grads(gh, st, mu, need_s, need_g)
        g_s = g_gens = None
        if need_s:
            g_s = gst.view(hp, nb, bs, m).permute(2, 0, 3, 1).to(s.dtype)  # (Bs, Hp, M, nb)
        if need_g:
            qw = basis.to(gd.dtype)
            g_gens = precise_matmul(precise_matmul(qw, gd), qw.transpose(-1, -2)).to(gens.dtype)
    return g_s, g_gens


class _BlockGradientCollector(torch.autograd.Function):
    """A zero tensor the shape of ``Q^T gE Q`` ``(Hp, nb, T, b, b)`` that every rotation sharing one block form takes
    as an input: autograd sums their gradients (each layer's outer products) into it, and its backward maps the
    sum to ``s`` and ``K`` once -- the Frechet map is linear in them, so this equals mapping each layer's and
    adding (see ``share_block_gradients``)."""

    @staticmethod
    def forward(ctx, s: Tensor, gens: Tensor, basis: Tensor, mu: Tensor, dtype: torch.dtype) -> Tensor:
        bs, hp, m, nb = s.shape
        b = basis.shape[-1]
        ctx.save_for_backward(s, gens, basis, mu)
        return torch.zeros(hp, nb, bs * m, b, b, dtype=dtype, device=s.device)

    @staticmethod
    def backward(ctx, gh: Tensor):
        s, gens, basis, mu = ctx.saved_tensors
        gh = gh if gh.dtype == s.dtype else gh.to(s.dtype)  # one cast for every layer's outer products
        g_s, g_gens = _block_grads(gh, s, gens, basis, mu, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return g_s, g_gens, None, None, None


def share_block_gradients(form, coords: Tensor):
    """A block encoding's :class:`~ropekit.encodings.ops.forms.RoPEForm` prepared for several rotations on the same
    coordinates (the layers of a model sharing one encoding): the scalars ``s_j(r)`` formed once, and one node
    that gathers every rotation's gradient and maps the sum to ``K`` and ``s`` once, instead of one Frechet map per
    layer. First derivatives only: under ``create_graph`` each rotation differentiates its dense reference as
    before.

    Args:
        form: a form with ``eigen`` set (else it is returned as it is).
        coords: ``(M, c)`` or ``(B, M, c)``, the coordinates every rotation using the result will get.

    The gathered gradients are summed in float64 (float32 on devices without it): a small tensor, ``Hp nb T b^2``.
    """
    e = form.eigen
    if e is None:
        return form
    s = wide_angles(coords, e.axis_weights)  # (Hp, M, nb) or (B, Hp, M, nb)
    s = s.unsqueeze(0) if s.dim() == 3 else s  # (Bs, Hp, M, nb)
    if not (torch.is_grad_enabled() and (s.requires_grad or e.generators.requires_grad)):
        return form._replace(eigen=e._replace(scales=s))
    collector = _BlockGradientCollector.apply(s, e.generators, e.schur.detach(), e.mu.detach(),
                                              wide_dtype(s.device))
    return form._replace(eigen=e._replace(scales=s, collector=collector))


def batch_block_gradients(forms: Sequence, coords: Tensor, stacked: Sequence = ()) -> list:
    """Several block encodings' :class:`~ropekit.encodings.ops.forms.RoPEForm` (the per-layer encodings of one model)
    prepared for their rotations on the same coordinates: every form keeps its own generators and axis weights,
    but the scalars ``s_j(r)`` of all forms of one configuration are formed in one product, and one node gathers
    all their rotations' gradients and maps them to each form's ``K`` and ``s`` in one batched Frechet map (the
    forms stacked along the parameter-head dimension), instead of one map per layer. The map acts on each
    ``(layer, head, block)`` separately, so values and gradients are those of mapping each form alone. First
    derivatives only: under ``create_graph`` each rotation differentiates its dense reference as before.

    Args:
        forms: forms of any encodings; those with ``eigen`` set whose generators and axis weights have one shape,
            dtype and device are batched together (a configuration met once gets :func:`share_block_gradients`),
            every other form is returned as it is.
        coords: ``(M, c)`` or ``(B, M, c)``, the coordinates every rotation using the results will get.
        stacked: ``(indices, eigen)`` pairs whose ``eigen`` holds the forms' ``BlockEigenForm`` tensors stacked,
            ``(L, ...)`` (a stacked form's, ``fold.rope_forms_stacked``): those forms are batched with the stacked
            tensors as they are, not concatenated again from their slices.

    Returns:
        The forms, in the order given.
    """
    out = list(forms)
    done = set()
    for idx, e in stacked:
        _batch_eigen_group(out, forms, list(idx), e, coords)
        done.update(idx)
    groups: dict = {}
    for i, form in enumerate(forms):
        e = form.eigen
        if e is not None and i not in done:
            key = (tuple(e.generators.shape), e.generators.dtype, e.generators.device, tuple(e.axis_weights.shape),
                   e.axis_weights.dtype, e.mu.dtype)
            groups.setdefault(key, []).append(i)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = share_block_gradients(forms[idx[0]], coords)
            continue
        es = [forms[i].eigen for i in idx]
        e = es[0]._replace(**{f: torch.stack([getattr(x, f) for x in es])
                              for f in ("generators", "axis_weights", "schur", "mu")})
        _batch_eigen_group(out, forms, idx, e, coords)
    return out


def _batch_eigen_group(out: list, forms: Sequence, idx: list, e, coords: Tensor) -> None:
    """:func:`batch_block_gradients` for the forms ``idx``, their eigen tensors stacked in ``e`` ``(L, Hp, ...)``."""
    n, hp = e.generators.shape[:2]
    s = wide_angles(coords, e.axis_weights.flatten(0, 1))  # (L Hp, M, nb) or (B, L Hp, M, nb)
    s = s.unsqueeze(0) if s.dim() == 3 else s  # (Bs, L Hp, M, nb): layer l's heads at l Hp .. (l + 1) Hp - 1
    scales = s.unflatten(1, (n, hp)).unbind(1)  # L x (Bs, Hp, M, nb)
    collectors: Sequence = [None] * n
    if torch.is_grad_enabled() and (s.requires_grad or e.generators.requires_grad):
        collector = _BlockGradientCollector.apply(
            s, e.generators.flatten(0, 1), e.schur.detach().flatten(0, 1), e.mu.detach().flatten(0, 1),
            torch.promote_types(e.generators.dtype, torch.float32))  # (L Hp, nb, T, b, b): each layer its own
        collectors = collector.unflatten(0, (n, hp)).unbind(0)  # slice, nothing summed: the rotations' dtype
    for i, sc, col in zip(idx, scales, collectors):
        out[i] = forms[i]._replace(eigen=forms[i].eigen._replace(scales=sc, collector=col))


def _block_eigen_reference(x: Tensor, s: Tensor, gens: Tensor, basis: Tensor, num_prefix_tokens: int) -> Tensor:
    """Dense form of one output of ``_BlockEigenRotation``: ``Q^T expm(s K) Q`` by ``torch.linalg.matrix_exp``,
    differentiable in ``x``, ``s`` and ``K`` (``Q`` a constant), computed in ``s``'s dtype."""
    bsz, heads, n, d = x.shape
    hp, nb, b = gens.shape[0], gens.shape[1], gens.shape[-1]
    m = n - num_prefix_tokens
    e = _dense_block_exp(s, gens.to(s.dtype))  # (Bs, Hp, M, nb, b, b)
    qw = basis.to(s.dtype).unsqueeze(1)  # (Hp, 1, nb, b, b)
    e = qw.transpose(-1, -2) @ e @ qw
    xv = x[:, :, num_prefix_tokens:].to(s.dtype).reshape(bsz, hp, heads // hp, m, nb, b)
    y = (e.unsqueeze(2) @ xv.unsqueeze(-1)).squeeze(-1).reshape(bsz, heads, m, d).to(x.dtype)
    return torch.cat((x[:, :, :num_prefix_tokens], y), dim=2) if num_prefix_tokens else y


def rotate_in_block_eigenbasis(q: Tensor, k: Tensor | None, coords: Tensor, axis_weights: Tensor, gens: Tensor,
                               basis: Tensor, mu: Tensor, num_prefix_tokens: int = 0, backend: str = "auto",
                               scales: Tensor | None = None, collector: Tensor | None = None,
                               table: tuple | None = None) -> tuple[Tensor, Tensor]:
    """Rotate q and k, already written in the eigenbasis of a block-diagonal generator, by ``expm(s_j K_j)`` in
    block ``j``: ``y = Q_j^T expm(s_j(r) K_j) Q_j x``, ``s_j(r) = sum_k r_k axis_weights[k, j]`` -- the per-token
    work of a folded ComRoPE (and one-axis LieRE).

    With ``K_j = Q_j blockdiag_n(mu_{j,n} J) Q_j^T`` (``skew_real_schur``) the value is plain RoPE by the angles
    ``s_j(r) mu_{j,n}`` (``apply_frequency_rope``: the fused kernel where it runs). The gradients are those of
    the exponential itself, not of the eigendecomposition: with respect to ``K`` the exact Frechet derivative
    (``_frechet_block_grads``), so they are exact and finite also where frequencies coincide or vanish (where an
    eigenbasis has no derivative); ``Q`` and ``mu`` are constants. Under ``create_graph`` the backward
    differentiates the dense ``matrix_exp`` form, so second derivatives are exact too.

    Args:
        q, k: ``(B, H, N, d)`` in the basis (``Q_j x`` per block), any float dtype; the first
            ``num_prefix_tokens`` pass unrotated. ``k=None``: ``q`` is q and k stacked, ``(2, B, H, N, d)`` (the
            leading slices of an attention layer's fused projection: rotated and differentiated as one tensor).
        coords: ``(M, c)`` shared by the batch or ``(B, M, c)`` per example, ``M = N - num_prefix_tokens``.
        axis_weights: ``(Hp, c, nb)``, differentiable.
        gens: ``(Hp, nb, b, b)`` the skew blocks ``K``, differentiable; ``Hp`` is 1 or ``H``.
        basis, mu: ``(Hp, nb, b, b)`` and ``(Hp, nb, b/2)`` from ``skew_real_schur(K)`` (constants; float64 for
            exact angles at large coordinates).
        backend: the path of the rotation, as ``apply_frequency_rope``.
        scales, collector: from ``share_block_gradients`` for these ``coords`` (``BlockEigenForm``): the scalars
            ``s_j(r)`` already formed, and the node that maps the gradients of every rotation sharing them at once.
        table: the angle table ``(theta, cos, sin)`` of ``coords`` and the frequencies ``axis_weights x mu``
            already formed (``rotation.angle_tables``: a model forms those of all its layers together), used for the
            value and for the transposed rotation of the backward pass where the PyTorch rotation runs.

    Returns:
        ``(q, k)`` of the same shapes and dtypes (float32 math, float64 for float64 tokens).
    """
    wide = mu.dtype
    s = wide_angles(coords, axis_weights) if scales is None else scales  # (Hp, M, nb) or (B, Hp, M, nb)
    s = s.unsqueeze(0) if s.dim() == 3 else s  # (Bs, Hp, M, nb)
    mu = mu.detach()
    freqs = None  # the table's, where it is used
    if table is None or fused_kernel(q.device, backend=backend) is not None:
        freqs = (axis_weights.detach().to(wide).unsqueeze(-1) * mu.unsqueeze(1)).flatten(-2)  # (Hp, c, d/2)
        table = None
    qk = q if k is None else torch.stack((q, k))  # (2, B, H, N, d)
    return _BlockEigenRotation.apply(qk, s, gens, basis.detach(), mu, coords.detach(), freqs, num_prefix_tokens,
                                     backend, collector, table)


def _dense_block_exp(s: Tensor, k: Tensor) -> Tensor:
    """``expm(s_{t,j} K_j)`` by ``torch.linalg.matrix_exp``, one per scalar and block: the dense reference of the
    block exponentials, differentiable to any order.

    Args:
        s: ``(..., Hp, M, nb)``; k: ``(Hp, nb, b, b)``.

    Returns:
        ``(..., Hp, M, nb, b, b)``.
    """
    return torch.linalg.matrix_exp(s.unsqueeze(-1).unsqueeze(-1) * k.unsqueeze(-4))


def scaled_block_exp_reference(s: Tensor, k: Tensor) -> Tensor:
    """Dense reference ``blockdiag_j expm(s_j K_j)`` with one ``torch.linalg.matrix_exp`` per token and block.

    Args:
        s: ``(..., Hp, M, nb)``; k: ``(Hp, nb, b, b)``.

    Returns:
        ``(..., Hp, M, d, d)``.
    """
    return block_diag(_dense_block_exp(s, k))  # (.., Hp, M, d, d)


def block_diag(blocks: Tensor) -> Tensor:
    """``(..., nb, b, b)`` -> ``(..., nb * b, nb * b)`` block-diagonal matrices."""
    *lead, nb, b, _ = blocks.shape
    out = blocks.new_zeros(*lead, nb, b, nb, b)
    idx = torch.arange(nb, device=blocks.device)
    out[..., idx, :, idx, :] = blocks.movedim(-3, 0)
    return out.reshape(*lead, nb * b, nb * b)
