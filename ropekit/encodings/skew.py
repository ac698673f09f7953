"""Skew-symmetric matrices: stored by their free entries, formed as ``A - A^T``, mapped to rotations by the Cayley
transform, and decomposed into rotation planes by the real Schur form (a plain and a differentiable one).

A skew ``n x n`` matrix has ``n (n - 1) / 2`` free entries, its strict upper triangle. Storing a full matrix
``A`` and using ``A - A^T`` doubles every free entry's parameter count and its step under Adam (each free
entry is the difference of two parameters that both move by ~lr); Cayley-STRING and ComRoPE therefore store
the free entries (in ``torch.triu_indices(n, n, 1)`` order, optionally restricted to a band).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["upper_indices", "num_free", "free_to_skew", "skew_to_free", "full_to_free", "skew", "cayley_transform",
           "skew_real_schur", "real_schur"]


def upper_indices(n: int, band: int | None = None, device: torch.device | str | None = None) -> Tensor:
    """``(2, F)`` row and column indices of the free entries ``i < j`` (``j - i <= band`` when a band is given)."""
    iu = torch.triu_indices(n, n, 1, device=device)
    if band is not None:
        iu = iu[:, (iu[1] - iu[0]) <= band]
    return iu


def num_free(n: int, band: int | None = None) -> int:
    """Number of free entries of an ``n x n`` skew matrix (within ``band`` of the diagonal if given)."""
    if band is None:
        return n * (n - 1) // 2
    b = min(band, n - 1)
    return b * n - b * (b + 1) // 2


def free_to_skew(v: Tensor, n: int, band: int | None = None) -> Tensor:
    """Skew matrices from free entries: ``(..., F)`` -> ``(..., n, n)`` with ``S[i, j] = v``, ``S[j, i] = -v``.

    Differentiable (any order) in ``v``.
    """
    upper, lower = _flat_skew_indices(n, band, v.device)
    if v.shape[-1] != upper.shape[0]:
        raise ValueError(f"expected {upper.shape[0]} free entries for n={n}, band={band}, got {v.shape[-1]}")
    flat = v.new_zeros(*v.shape[:-1], n * n)
    flat[..., upper] = v
    flat[..., lower] = -v
    return flat.unflatten(-1, (n, n))


_FLAT_INDICES: dict = {}


def _flat_skew_indices(n: int, band: int | None, device: torch.device) -> tuple[Tensor, Tensor]:
    """Flat positions ``i n + j`` and ``j n + i`` of the free entries: constants, built once per (size, band,
    device) and kept (``_cached``), so a forward pass does not rebuild them (with a band the selection would also
    read a mask back to the host)."""
    def build() -> tuple[Tensor, Tensor]:
        iu = upper_indices(n, band, device)
        return iu[0] * n + iu[1], iu[1] * n + iu[0]

    return _cached(_FLAT_INDICES, (n, band, str(device)), build)


def skew_to_free(s: Tensor, band: int | None = None) -> Tensor:
    """Free entries ``(..., F)`` of skew matrices ``(..., n, n)`` (the strict upper triangle)."""
    iu = upper_indices(s.shape[-1], band, s.device)
    return s[..., iu[0], iu[1]]


def full_to_free(a: Tensor) -> Tensor:
    """Free entries ``(..., F)`` of ``S = A - A^T`` from full matrices ``A`` ``(..., n, n)``: ``A[i, j] - A[j, i]``."""
    iu = upper_indices(a.shape[-1], None, a.device)
    return a[..., iu[0], iu[1]] - a[..., iu[1], iu[0]]


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


# ----------------------------------------------------------------------------- real Schur form
def skew_real_schur(k: Tensor) -> tuple[Tensor, Tensor]:
    """Real block-diagonal form of skew matrices: ``K = Q blockdiag_n(mu_n J) Q^T``, ``J = [[0, -1], [1, 0]]``.

    Args:
        k: ``(..., b, b)`` skew-symmetric, ``b`` even.

    Returns:
        ``(Q, mu)``: ``Q`` ``(..., b, b)`` orthogonal, its columns ``(2n, 2n + 1)`` spanning rotation plane ``n``,
        and ``mu`` ``(..., b / 2)`` >= 0 ascending (the planes that do not turn first), in ``k``'s dtype;
        computed in float64, not differentiable.

    Written in closed form and fixed batched products only -- no eigensolver, no value read back to the host, no
    shape that depends on the data -- so that it can run inside a CUDA graph and never makes the host wait for
    the device. ``b = 2``: ``Q = I`` (a column flipped where the block turns backwards). ``b = 4``: one closed
    form (``_schur4``: the self-dual and anti-self-dual parts of ``K`` are commuting complex structures times
    ``alpha`` and ``gamma``, the frequencies are ``alpha + gamma`` and ``|alpha - gamma|``, the planes the
    eigenspaces of the product of the two structures). Larger ``b``: block Jacobi sweeps, each pair of 2x2
    diagonal blocks brought to block-diagonal form by that closed form, the pairs of a round disjoint and done
    together (``_jacobi_sweeps``: a fixed number, converged to round-off with a margin for every ``b`` the tests
    try, ties and zero frequencies included). Every rotation is orthogonal to round-off, and the frequencies are
    read off the converged blocks: a plane ``1e-8`` (or ``1e-16``) times slower than the fastest keeps its
    frequency to the round-off of ``K``'s largest entries (an angle error ~1e-12 rad at coordinates of 1e4), a
    still plane (``K = 0`` included) gets a valid plane and ``mu = 0``.
    """
    b = k.shape[-1]
    if b % 2:
        raise ValueError(f"skew_real_schur needs an even size, got {b}")
    a = k.detach().to(torch.float64)
    eye = torch.eye(b, dtype=a.dtype, device=a.device)
    q = eye.expand(a.shape).clone() if b > 2 else None
    if b == 4:
        q = _schur4(a)
        a = q.transpose(-1, -2) @ a @ q
    elif b > 4:
        for _ in range(_jacobi_sweeps(b)):
            for idx, rows, cols in _jacobi_rounds(b, a.device):  # each round: disjoint pairs of 2x2 blocks
                q4 = _schur4(a[..., rows, cols])  # (..., pairs, 4, 4)
                g = eye.expand(a.shape).clone()
                g[..., rows, cols] = q4  # the round's rotation, block diagonal after a permutation
                a = g.transpose(-1, -2) @ a @ g
                q = q @ g
    m = (a[..., 1::2, 0::2].diagonal(dim1=-2, dim2=-1) - a[..., 0::2, 1::2].diagonal(dim1=-2, dim2=-1)) * 0.5
    mu, order = m.abs().sort(dim=-1)  # (..., b/2) ascending
    sign = torch.where(m < 0, -1.0, 1.0).to(a.dtype)  # a plane turning backwards: flip its second column
    flip = torch.stack((torch.ones_like(sign), sign), dim=-1).flatten(-2)  # (..., b)
    q = (eye if q is None else q) * flip.unsqueeze(-2)
    cols = torch.stack((2 * order, 2 * order + 1), dim=-1).flatten(-2)  # (..., b): the planes in mu's order
    q = torch.gather(q, -1, cols.unsqueeze(-2).expand(a.shape))
    return q.to(k.dtype), mu.to(k.dtype)


def _jacobi_sweeps(b: int) -> int:
    """Block Jacobi sweeps for ``b x b`` blocks: convergence is quadratic once the off-diagonal blocks are small;
    random ``8 x 8`` blocks reach round-off in 4 sweeps, ``16 x 16`` in 7, ``64 x 64`` in 12 (measured on random
    and tied spectra, tests/test_skew_schur.py): two sweeps of margin."""
    return 2 + math.ceil(2 * math.log2(b)) if b > 8 else 6


#: (size, device) -> the Jacobi rounds' indices, constants built once (see ``_cached``)
_JACOBI_ROUNDS: dict = {}


def _jacobi_rounds(b: int, device: torch.device) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The rounds of one block Jacobi sweep over the ``h = b / 2`` diagonal 2x2 blocks, by the round-robin
    ("circle") schedule: every pair of blocks once per sweep, each round a set of disjoint pairs. Per round
    ``(idx, rows, cols)``: ``idx`` ``(pairs, 4)`` the indices ``(2i, 2i + 1, 2j, 2j + 1)`` of each pair ``(i, j)``,
    ``rows`` / ``cols`` the ``(pairs, 4, 1)`` / ``(pairs, 1, 4)`` views that select the ``4 x 4`` submatrices."""
    def build() -> list:
        h = b // 2
        players = list(range(h + h % 2))  # a bye for odd h: its partner rests that round
        n, rounds = len(players), []
        for _ in range(n - 1):
            pairs = [sorted((players[i], players[n - 1 - i])) for i in range(n // 2)]
            idx = torch.tensor([[2 * i, 2 * i + 1, 2 * j, 2 * j + 1] for i, j in pairs if j < h], device=device)
            rounds.append((idx, idx[:, :, None], idx[:, None, :]))
            players = [players[0], players[-1]] + players[1:-1]
        return rounds

    return _cached(_JACOBI_ROUNDS, (b, str(device)), build)


_SCHUR4_TABLES: dict = {}


def _schur4_tables(device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Constants of ``_schur4`` on ``device`` (built once, ``_cached``: no host-to-device copy per call, which a
    CUDA graph could not hold): which of ``(0, u1, u2, u3)`` sits at each entry of a complex structure
    ``(16,)``, the signs of the self-dual and anti-self-dual structures (the 't Hooft symbols) ``(2, 4, 4)``, the
    fallback unit vector ``(3,)`` and the projector signs ``(2, 1, 1)``."""
    def build() -> tuple[Tensor, Tensor, Tensor, Tensor]:
        which = torch.tensor([0, 1, 2, 3, 1, 0, 3, 2, 2, 3, 0, 1, 3, 2, 1, 0], device=device)
        signs = torch.tensor([[[0, 1, 1, 1], [-1, 0, 1, -1], [-1, -1, 0, 1], [-1, 1, -1, 0]],
                              [[0, 1, 1, 1], [-1, 0, -1, 1], [-1, 1, 0, -1], [-1, -1, 1, 0]]],
                             dtype=dtype, device=device)
        return (which, signs, torch.tensor([1.0, 0.0, 0.0], dtype=dtype, device=device),
                torch.tensor([-1.0, 1.0], dtype=dtype, device=device).view(2, 1, 1))

    return _cached(_SCHUR4_TABLES, (str(device), dtype), build)


def _schur4(a: Tensor) -> Tensor:
    """``Q`` ``(..., 4, 4)`` orthogonal with ``Q^T A Q = blockdiag(mu_1 J, mu_2 J)`` for skew ``A`` ``(..., 4, 4)``
    (float64), in closed form.

    ``A = alpha J_+ + gamma J_-`` with ``J_+`` / ``J_-`` the unit complex structures of its self-dual and
    anti-self-dual parts (they commute; a part that vanishes gets a fixed structure). ``M = J_+ J_-`` is a
    symmetric involution: on its ``-1`` eigenspace ``J_- = J_+`` and ``A = (alpha + gamma) J_+``, on its ``+1``
    eigenspace ``J_- = -J_+`` and ``A = (alpha - gamma) J_+``. Each plane: the largest column of the projector
    ``(I -+ M) / 2`` normalised, ``v``, and ``+-J_+ v``. Where ``alpha`` is much smaller than ``gamma`` (nearly tied
    frequencies), ``J_+`` carries the rounding of ``A`` divided by ``alpha``, but enters ``A`` only times ``alpha``:
    the form stays exact to ``A``'s round-off.
    """
    a01, a02, a03 = a[..., 0, 1], a[..., 0, 2], a[..., 0, 3]
    a12, a13, a23 = a[..., 1, 2], a[..., 1, 3], a[..., 2, 3]
    parts = torch.stack((torch.stack((a01 + a23, a02 - a13, a03 + a12), dim=-1),
                         torch.stack((a01 - a23, a02 + a13, a03 - a12), dim=-1)), dim=-2) * 0.5  # (..., 2, 3)
    norm = parts.norm(dim=-1, keepdim=True)  # (..., 2, 1): alpha, gamma
    which, signs, first, pm = _schur4_tables(a.device, a.dtype)
    tiny = torch.finfo(a.dtype).tiny
    unit = torch.where(norm > tiny, parts / norm.clamp_min(tiny), first)  # (..., 2, 3)
    # the unit self-dual (j[..., 0]) and anti-self-dual (j[..., 1]) structures: entry (r, c) is +-u[which]
    j = torch.cat((torch.zeros_like(unit[..., :1]), unit), dim=-1)[..., which].unflatten(-1, (4, 4)) * signs
    m = j[..., 0, :, :] @ j[..., 1, :, :]  # symmetric involution
    eye = torch.eye(4, dtype=a.dtype, device=a.device)
    proj = (eye + pm * m.unsqueeze(-3)) * 0.5  # (..., 2, 4, 4): (I - M) / 2, (I + M) / 2
    best = proj.square().sum(-2).argmax(-1)  # (..., 2): the largest column of each projector
    v = torch.gather(proj, -1, best[..., None, None].expand(*proj.shape[:-1], 1))  # (..., 2, 4, 1)
    v = v / v.norm(dim=-2, keepdim=True)
    w = j[..., :1, :, :] @ v  # J_+ v: (..., 2, 4, 1)
    turn = torch.where(norm[..., 0, :] >= norm[..., 1, :], 1.0, -1.0).to(a.dtype)  # (..., 1): sign of alpha - gamma
    w = w * torch.cat((torch.ones_like(turn), turn), dim=-1)[..., None, None]
    return torch.cat((v, w), dim=-1).transpose(-3, -2).flatten(-2)  # columns v_1, w_1, v_2, w_2


def _cached(store: dict, key: tuple, build):
    """A constant built once per key and kept (index tables, fixed bases), so that a forward pass does not rebuild
    it. Inside ``torch.compile`` a missing entry is built in the graph and not stored: a dictionary filled while
    Dynamo traces fails its guard at the next call and compiles the model a second time. Built outside inference
    mode so that autograd may save it."""
    if key in store:
        return store[key]
    if torch.compiler.is_compiling():
        return build()
    with torch.inference_mode(False):
        return store.setdefault(key, build())


class _RealSchur(torch.autograd.Function):
    """``(Q, mu)`` of ``skew_real_schur`` with the first-order perturbation backward.

    With ``K = Q D Q^T``, ``D = blockdiag_n(mu_n J)``, a skew perturbation ``dK`` gives ``dM = Q^T dK Q``,
    ``dmu_n = `` the ``J`` coefficient of the diagonal block ``dM_nn``, and ``dQ = Q Omega`` with the skew
    ``Omega`` solving ``dM = dD + Omega D - D Omega``: per off-diagonal 2x2 block, the part commuting with
    ``J`` is divided by ``mu_m - mu_n`` and the anti-commuting part by ``mu_m + mu_n``. Where a divisor is
    zero (repeated or zero eigenvalues) the eigenbasis is not unique; that component is set to zero. The
    backward is the adjoint of this linear map.
    """

    @staticmethod
    def forward(ctx, k: Tensor) -> tuple[Tensor, Tensor]:
        q, mu = skew_real_schur(k)
        ctx.save_for_backward(q, mu)
        return q, mu

    @staticmethod
    def backward(ctx, gq: Tensor | None, gmu: Tensor | None):
        q, mu = ctx.saved_tensors
        b, h = q.shape[-1], mu.shape[-1]
        jm = q.new_tensor([[0.0, -1.0], [1.0, 0.0]])
        gm = q.new_zeros(*q.shape[:-2], h, 2, h, 2)  # gradient on M = Q^T K Q, in 2x2 blocks (n, m)
        if gq is not None:
            x = (q.transpose(-1, -2) @ gq).view(*q.shape[:-2], h, 2, h, 2).transpose(-3, -2)  # (.., n, m, 2, 2)
            jx = jm @ x
            c0 = (jx[..., 0, 0] + jx[..., 1, 1]) * 0.5  # commuting part c0 I + c1 J
            c1 = (jx[..., 1, 0] - jx[..., 0, 1]) * 0.5
            pc = c0[..., None, None] * torch.eye(2, dtype=q.dtype, device=q.device) + c1[..., None, None] * jm
            pa = jx - pc
            diff = mu.unsqueeze(-2) - mu.unsqueeze(-1)  # (.., n, m): mu_m - mu_n
            summ = mu.unsqueeze(-2) + mu.unsqueeze(-1)
            tol = 1e-12 * mu.abs().amax(dim=-1, keepdim=True).unsqueeze(-1).clamp_min(1e-300)
            inv_d = torch.where(diff.abs() > tol, 1.0 / torch.where(diff == 0, torch.ones_like(diff), diff),
                                torch.zeros_like(diff))
            inv_s = torch.where(summ.abs() > tol, 1.0 / torch.where(summ == 0, torch.ones_like(summ), summ),
                                torch.zeros_like(summ))
            off = ~torch.eye(h, dtype=torch.bool, device=q.device)
            blk = pc * inv_d[..., None, None] - pa * inv_s[..., None, None]
            blk = blk * off[..., None, None].to(blk.dtype)
            gm = gm + blk.transpose(-3, -2)
        if gmu is not None:  # mu_n = (M_nn[1, 0] - M_nn[0, 1]) / 2
            idx = torch.arange(h, device=q.device)
            gm[..., idx, :, idx, :] = gm[..., idx, :, idx, :] + (gmu.movedim(-1, 0)[..., None, None] * jm / 2)
        gk = q @ gm.reshape(*q.shape) @ q.transpose(-1, -2)
        return (gk - gk.transpose(-1, -2)) * 0.5  # K is skew: only the skew part of the gradient acts


def real_schur(k: Tensor) -> tuple[Tensor, Tensor]:
    """``K = Q blockdiag_n(mu_n J) Q^T`` for skew ``K`` ``(..., b, b)``, differentiable in ``K``.

    Returns ``skew_real_schur``'s ``(Q, mu)``. Gradients are exact where the ``mu`` are distinct and
    non-zero (and pairwise sums non-zero); at repeated or zero eigenvalues the basis is not unique and the
    components along that freedom get zero gradient.
    """
    return _RealSchur.apply(k)
