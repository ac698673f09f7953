"""Functional core of the rotary encodings: pure functions on tensors, no modules, no state.

Shape legend used throughout ``ropekit.encodings``:

* ``B`` batch, ``H`` heads, ``M`` tokens that carry a coordinate, ``d`` head dimension (even),
  ``P = d / 2`` rotation planes ("pairs"), ``c`` coordinate dimension;
* ``Hp`` heads that own parameters: 1 when an encoding is shared by all heads, ``H`` when per head;
* ``nb = d / b`` blocks of size ``b`` for block-diagonal encodings.

Pairs are *interleaved*: pair ``n`` is the two coordinates ``(2n, 2n + 1)`` of a head vector, and
``rotate_pairs`` turns it by the angle ``theta_n`` counter-clockwise::

    [y_2n  ]   [cos t  -sin t] [x_2n  ]
    [y_2n+1] = [sin t   cos t] [x_2n+1]

This is the layout of the original RoFormer and of every 2x2 block-diagonal generator, so that
"block j" and "pair j" are the same thing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "rope_angles",
    "rotate_pairs",
    "pair_generators",
    "axial_frequencies",
    "mixed_frequencies",
    "skew",
    "cayley_transform",
    "scaled_block_exp_apply",
    "scaled_block_exp_reference",
]


def rope_angles(coords: Tensor, freqs: Tensor) -> Tensor:
    """Angles ``theta_n(r) = sum_k r_k * freqs[k, n]`` of every rotation plane.

    Args:
        coords: ``(M, c)`` shared by the batch, or ``(B, M, c)`` per example.
        freqs: ``(Hp, c, P)``.

    Returns:
        ``(Hp, M, P)`` for shared coordinates, ``(B, Hp, M, P)`` per example; dtype of ``coords``.
    """
    if coords.dim() == 2:
        return torch.einsum("mc,hcp->hmp", coords, freqs)  # (Hp, M, P)
    return torch.einsum("bmc,hcp->bhmp", coords, freqs)  # (B, Hp, M, P)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each interleaved pair ``(x_2n, x_2n+1)`` of ``x`` by the angle whose cos/sin are given.

    Args:
        x: ``(..., d)``.
        cos, sin: ``(..., d / 2)``, broadcastable against ``x``'s leading dimensions.

    Returns:
        ``(..., d)``, a new tensor (``x`` is not modified).
    """
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)  # (..., P) each
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def pair_generators(freqs: Tensor) -> Tensor:
    """Dense generators of the pairwise rotation ``RoPE(r) = expm(sum_k r_k J_k)``.

    Args:
        freqs: ``(Hp, c, P)``.

    Returns:
        ``(Hp, c, 2P, 2P)`` skew-symmetric, block diagonal: block ``n`` of ``J_k`` is
        ``freqs[k, n] * [[0, -1], [1, 0]]``.
    """
    hp, c, p = freqs.shape
    gen = freqs.new_zeros(hp, c, p, 2, p, 2)
    idx = torch.arange(p, device=freqs.device)
    gen[:, :, idx, 1, idx, 0] = freqs
    gen[:, :, idx, 0, idx, 1] = -freqs
    return gen.reshape(hp, c, 2 * p, 2 * p)


def axial_frequencies(head_dim: int, coord_dim: int, base: float = 10000.0) -> Tensor:
    """Axial RoPE frequencies: pairs split evenly and contiguously across the axes.

    Axis ``k`` owns pairs ``[k * p, (k + 1) * p)`` with ``p = (d / 2) // c``; pair ``n`` of an axis turns
    by ``r_k * base ** (-2 n / d_k)`` with ``d_k = 2 p``. Leftover pairs (when ``d / 2`` is not divisible
    by ``c``) get frequency 0: they are not rotated.

    Returns:
        ``(c, d / 2)`` float32 frequency matrix.
    """
    pairs = head_dim // 2
    per_axis = pairs // coord_dim
    if per_axis == 0:
        raise ValueError(
            f"axial RoPE needs at least one rotation plane per axis: head_dim={head_dim} gives "
            f"{pairs} planes for coord_dim={coord_dim}; use head_dim >= {2 * coord_dim}"
        )
    omega = base ** (-2.0 * torch.arange(per_axis, dtype=torch.float64) / (2 * per_axis))
    freqs = torch.zeros(coord_dim, pairs, dtype=torch.float64)
    for k in range(coord_dim):
        freqs[k, k * per_axis:(k + 1) * per_axis] = omega
    return freqs.float()


def mixed_frequencies(
    head_dim: int, coord_dim: int, num_heads: int, base: float = 100.0, generator: torch.Generator | None = None
) -> Tensor:
    """RoPE-Mixed initial frequencies (Heo et al. 2024), generalised to any coordinate dimension.

    Pairs are split into ``c`` contiguous groups. Within a group the magnitudes decay as in RoPE with
    maximum wavelength ``base`` (``|w_m| = base ** (-m / g)``, ``g`` the group size); every group points
    along one axis of a random orthonormal frame drawn per head. For ``c = 2`` the frame is a random
    angle ``a`` and the second group is offset by ``pi / 2`` (the authors' initialisation).

    Returns:
        ``(num_heads, c, d / 2)`` float32.
    """
    pairs = head_dim // 2
    group = math.ceil(pairs / coord_dim)
    m = torch.arange(pairs, dtype=torch.float64) % group
    mag = base ** (-m / group)  # (P,)
    owner = torch.arange(pairs) // group  # (P,) which frame axis each pair follows
    freqs = torch.empty(num_heads, coord_dim, pairs, dtype=torch.float64)
    for h in range(num_heads):
        if coord_dim == 2:
            a = float(torch.rand((), generator=generator, dtype=torch.float64)) * 2 * math.pi
            frame = torch.tensor([[math.cos(a), math.cos(a + math.pi / 2)],
                                  [math.sin(a), math.sin(a + math.pi / 2)]], dtype=torch.float64)
        else:
            g = torch.randn(coord_dim, coord_dim, generator=generator, dtype=torch.float64)
            frame, _ = torch.linalg.qr(g)  # (c, c) orthonormal columns
        freqs[h] = frame[:, owner] * mag  # (c, P)
    return freqs.float()


def skew(a: Tensor) -> Tensor:
    """``A - A^T`` over the last two dimensions."""
    return a - a.transpose(-1, -2)


def cayley_transform(s: Tensor) -> Tensor:
    """Orthogonal ``P = (I - S)(I + S)^-1`` for skew ``S`` of shape ``(..., d, d)``.

    Computed with one factorised linear solve (``torch.linalg.solve_ex``), never an explicit inverse;
    ``(I - S)`` and ``(I + S)^-1`` commute, so ``P = solve(I + S, I - S)``. ``I + S`` is always
    invertible for skew ``S`` (its eigenvalues are ``1 + i mu``).
    """
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device)
    p, _ = torch.linalg.solve_ex(eye + s, eye - s)
    return p


class _ScaledBlockExp(torch.autograd.Function):
    """``y_t = expm(s_t K) x_t`` for a fixed skew ``K`` per block and a scalar ``s_t`` per token.

    One Hermitian eigendecomposition per block serves every token (``K = U diag(i mu) U^H``); the
    backward pass uses the exact Frechet derivative of the exponential of a normal matrix, written
    with divided differences in ``sinc`` form so it stays finite when eigenvalues coincide (e.g. at
    ``K = 0``) -- no ``eigh`` backward, whose ``1 / (mu_i - mu_j)`` terms blow up there.
    """

    @staticmethod
    def forward(ctx, x: Tensor, s: Tensor, k: Tensor) -> Tensor:
        # x: (B, H, M, nb, b); s: (B|1, Hp, M, nb); k: (Hp, nb, b, b)
        mu, u = _skew_eigh(k)  # (Hp, nb, b), (Hp, nb, b, b) complex
        y = _expm_apply(x, s, mu, u)
        ctx.save_for_backward(x, s, k, mu, u, y)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        x, s, k, mu, u, y = ctx.saved_tensors
        gx = gs = gk = None
        if ctx.needs_input_grad[0]:
            gx = _expm_apply(g, -s, mu, u)  # R^T g = expm(-s K) g
        if ctx.needs_input_grad[1]:
            ky = torch.einsum("hnab,...hmnb->...hmna", k, y)  # K y: (B, H, M, nb, b)
            gs = _sum_to(torch.einsum("...a,...a->...", g, ky), s.shape)  # (.., Hp, M, nb)
        if ctx.needs_input_grad[2]:
            uc = u.conj()
            p = torch.einsum("hnai,...hmna->...hmni", uc, g.to(u.dtype))  # U^H g
            q = torch.einsum("hnai,...hmna->...hmni", uc, x.to(u.dtype))  # U^H x
            # Sum p q^H over the batch first when the coordinates (hence s) are shared.
            pq = torch.einsum("...hmni,...hmnj->...hmnij", p, q.conj())  # (B, H, M, nb, b, b)
            if s.shape[0] == 1:
                pq = pq.sum(0, keepdim=True)
            if k.shape[0] == 1 and pq.shape[-5] != 1:
                pq = pq.sum(-5, keepdim=True)
            # s * Phi_ij with Phi the divided difference of exp at i s mu: s e^{i s m} sinc(s delta / 2)
            st = s.unsqueeze(-1).unsqueeze(-1)  # (.., Hp, M, nb, 1, 1)
            mean = 0.5 * (mu.unsqueeze(-1) + mu.unsqueeze(-2))  # (Hp, nb, b, b)
            diff = mu.unsqueeze(-1) - mu.unsqueeze(-2)
            mean = mean.unsqueeze(-4)  # (Hp, 1, nb, b, b) for broadcasting over M
            diff = diff.unsqueeze(-4)
            phase = (st * torch.sinc(st * diff / (2 * math.pi))) * _cis(-st * mean)  # conj(s Phi)
            m = (phase * pq).sum(dim=(-4,))  # sum over tokens: (B|1, Hp, nb, b, b)
            if m.dim() == 5:
                m = m.sum(0)
            gk = torch.einsum("hnai,hnij,hnbj->hnab", u, m, uc).real.to(k.dtype)
        return gx, gs, gk


def _skew_eigh(k: Tensor) -> tuple[Tensor, Tensor]:
    """Eigen-decomposition of skew ``K = U diag(i mu) U^H`` via the Hermitian ``-i K`` (in float64)."""
    herm = (-1j) * k.to(torch.complex128)
    mu, u = torch.linalg.eigh(herm)
    cdtype = torch.complex128 if k.dtype == torch.float64 else torch.complex64
    return mu.to(k.dtype), u.to(cdtype)


def _expm_apply(x: Tensor, s: Tensor, mu: Tensor, u: Tensor) -> Tensor:
    """``Re(U diag(exp(i s mu)) U^H x)`` per token and block. Shapes as in ``_ScaledBlockExp``."""
    c = torch.einsum("hnai,...hmna->...hmni", u.conj(), x.to(u.dtype))  # U^H x: (B, H, M, nb, b)
    c = c * _cis(s.unsqueeze(-1) * mu.unsqueeze(-3))  # (.., Hp, M, nb, b)
    return torch.einsum("hnai,...hmni->...hmna", u, c).real.to(x.dtype)


def _cis(angle: Tensor) -> Tensor:
    """``exp(i * angle)`` as a complex tensor."""
    return torch.complex(torch.cos(angle), torch.sin(angle))


def _sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``t`` over broadcast dimensions so that it has ``shape`` (the inverse of broadcasting)."""
    while t.dim() > len(shape):
        t = t.sum(0)
    for i, n in enumerate(shape):
        if n == 1 and t.shape[i] != 1:
            t = t.sum(i, keepdim=True)
    return t


def scaled_block_exp_apply(x: Tensor, s: Tensor, k: Tensor) -> Tensor:
    """Apply ``expm(s_{t,j} K_j)`` to block ``j`` of every token ``t`` of ``x`` (ComRoPE's operator).

    Args:
        x: ``(B, H, M, d)``.
        s: ``(Hp, M, nb)`` shared by the batch or ``(B, Hp, M, nb)`` per example: the scalar multiplying
            each block's generator.
        k: ``(Hp, nb, b, b)`` skew-symmetric block generators; ``Hp`` is 1 or ``H``.

    Returns:
        ``(B, H, M, d)``; differentiable in ``x``, ``s`` and ``k`` (finite at ``k = 0``).
    """
    hp, nb, b, _ = k.shape
    xb = x.unflatten(-1, (nb, b))  # (B, H, M, nb, b)
    if s.dim() == 3:
        s = s.unsqueeze(0)  # (1, Hp, M, nb)
    return _ScaledBlockExp.apply(xb, s, k).flatten(-2)


def scaled_block_exp_reference(s: Tensor, k: Tensor) -> Tensor:
    """Dense reference ``blockdiag_j expm(s_j K_j)`` with one ``torch.linalg.matrix_exp`` per token and block.

    Args:
        s: ``(..., Hp, M, nb)``; k: ``(Hp, nb, b, b)``.

    Returns:
        ``(..., Hp, M, d, d)``.
    """
    blocks = torch.linalg.matrix_exp(s.unsqueeze(-1).unsqueeze(-1) * k.unsqueeze(-4))  # (.., Hp, M, nb, b, b)
    return _block_diag(blocks)


def _block_diag(blocks: Tensor) -> Tensor:
    """``(..., nb, b, b)`` -> ``(..., nb * b, nb * b)`` block-diagonal matrices."""
    *lead, nb, b, _ = blocks.shape
    out = blocks.new_zeros(*lead, nb, b, nb, b)
    idx = torch.arange(nb, device=blocks.device)
    out[..., idx, :, idx, :] = blocks.movedim(-3, 0)
    return out.reshape(*lead, nb * b, nb * b)
