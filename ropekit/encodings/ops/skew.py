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
           "cayley_from_free", "skew_real_schur", "real_schur"]


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


def cayley_from_free(v: Tensor, n: int, band: int | None = None) -> Tensor:
    """``cayley_transform(free_to_skew(v, n, band))`` -- ``(..., F)`` free entries to ``(..., n, n)`` rotations --
    in four operations forward and seven backward, whatever the batch.

    Forward: ``A = I + S`` from one gather of ``v`` into an ``n x n`` table times a constant sign table (``+1`` above
    the diagonal, ``-1`` below, ``0`` on it and outside the band) added to ``I``, then ``P = A^-1 A^T`` (``I - S =
    A^T``) from one LU factorisation of ``A`` (``lu_factor_ex``, no error check: ``A`` is never singular), whose
    factors are kept. Backward, without a second factorisation: ``dL/dS = -2 A^-T G A^-T`` (``G = dL/dP``) from two
    triangular solves with those factors, projected onto the free entries (``dL/dS[i, j] - dL/dS[j, i]``). Not
    through ``A^-1 = (I + P) / 2``: for large ``S`` ``P`` is near ``-I`` and ``I + P`` cancels (in float32 at
    ``|S|_F = 1e4`` a gradient error of ~1e-3, against ~1e-4 through the solve); the factors keep the error of a
    solve, no worse than autograd through ``torch.linalg.solve`` at any ``|S|``. Differentiable again (under
    ``create_graph`` the factors are formed again from ``v``, on its graph).
    """
    table = _cayley_tables(n, band, v.device, v.dtype)
    if v.shape[-1] != table[3].shape[0]:
        raise ValueError(f"expected {table[3].shape[0]} free entries for n={n}, band={band}, got {v.shape[-1]}")
    return _CayleyFree.apply(v, table)


class _CayleyFree(torch.autograd.Function):
    """``P = (I - S)(I + S)^-1`` from the free entries of ``S`` (:func:`cayley_from_free`); ``table`` from
    ``_cayley_tables``."""

    @staticmethod
    def forward(ctx, v: Tensor, table: tuple) -> Tensor:
        eye, gather, sign, rows, cols = table
        a = torch.addcmul(eye, v[..., gather], sign)  # I + S, (..., n, n)
        lu, pivots, _ = torch.linalg.lu_factor_ex(a)  # no error check: I + S is never singular, and none syncs
        p = torch.linalg.lu_solve(lu, pivots, a.mT)  # (I + S)^-1 (I - S)
        ctx.save_for_backward(v, lu, pivots)
        ctx.table = table
        return p

    @staticmethod
    def backward(ctx, g: Tensor):
        v, lu, pivots = ctx.saved_tensors
        eye, gather, sign, rows, cols = ctx.table
        if torch.is_grad_enabled():  # a second derivative: the factors again, on v's graph (double backward)
            lu, pivots, _ = torch.linalg.lu_factor_ex(torch.addcmul(eye, v[..., gather], sign))
        z = torch.linalg.lu_solve(lu, pivots, g, adjoint=True)  # A^-T G
        y = torch.linalg.lu_solve(lu, pivots, z.mT).mT  # A^-T G A^-T = -dL/dS / 2
        return 2.0 * (y.mT - y)[..., rows, cols], None  # dL/dS[i, j] - dL/dS[j, i] at the free entries


_CAYLEY_TABLES: dict = {}


def _cayley_tables(n: int, band: int | None, device: torch.device, dtype: torch.dtype) -> tuple:
    """Constants of :func:`cayley_from_free` (``_cached``): ``I``; the ``(n, n)`` gather index (free entry ``k`` at
    ``(i, j)`` and ``(j, i)``, ``0`` elsewhere) and its signs (``+1``, ``-1``, ``0``); the free entries' rows and
    columns ``(F,)``."""
    def build() -> tuple:
        iu = upper_indices(n, band, device)
        k = torch.arange(iu.shape[1], device=device)
        gather = torch.zeros(n, n, dtype=torch.long, device=device)
        sign = torch.zeros(n, n, dtype=dtype, device=device)
        gather[iu[0], iu[1]] = k
        gather[iu[1], iu[0]] = k
        sign[iu[0], iu[1]] = 1.0
        sign[iu[1], iu[0]] = -1.0
        eye = torch.eye(n, dtype=dtype, device=device)
        return eye, gather, sign, iu[0], iu[1]

    return _cached(_CAYLEY_TABLES, (n, band, str(device), dtype), build)


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
    eigenspaces of the product of the two structures). ``b = 6, 8``: block Jacobi sweeps, each pair of 2x2
    diagonal blocks brought to block-diagonal form by that closed form, the pairs of a round disjoint and done
    together (``_jacobi_sweeps``), then three Newton steps (``_refine``, whose docstring gives the argument)
    that take what the sweeps leave to round-off, exact ties of any multiplicity and zero frequencies included.
    ``K`` is first divided by a power of two near its largest entry (``_rescaled``: exact), so tiny and huge norms
    behave as norm one. Blocks larger than ``8 x 8`` (one-axis LieRE's whole head, ComRoPE with ``b > 8``)
    take Hermitian eigendecompositions instead (``_skew_real_schur_eigh``), which do make the host wait. Every
    rotation is orthogonal to round-off, and the frequencies are read off the converged blocks: a plane ``1e-8``
    (or ``1e-16``) times slower than the fastest keeps its frequency to the round-off of ``K``'s largest entries
    (an angle error ~1e-12 rad at coordinates of 1e4), a still plane (``K = 0`` included) gets a valid plane and
    ``mu = 0``.
    """
    b = k.shape[-1]
    if b % 2:
        raise ValueError(f"skew_real_schur needs an even size, got {b}")
    if b > _JACOBI_MAX:
        return _skew_real_schur_eigh(k)
    a, exponent = _rescaled(k.detach().to(torch.float64))
    eye = torch.eye(b, dtype=a.dtype, device=a.device)
    q = eye.expand(a.shape)
    if b >= 4:
        rounds = _jacobi_rounds(b, a.device)
        m = a
        for _ in range(_jacobi_sweeps(b) if b > 4 else 1):  # 4 x 4: the closed form once
            for rows, cols, put_rows, put_cols in rounds:  # each round: disjoint pairs of 2x2 blocks
                g = eye.expand(a.shape).clone()
                g[..., put_rows, put_cols] = _schur4(m[..., rows, cols])  # block diagonal after a permutation
                m = g.transpose(-1, -2) @ m @ g
                q = q @ g
        if b > 4:
            q = _refine(a, q)
    return _ordered_planes(a, q, exponent, k.dtype)


def _rescaled(kd: Tensor) -> tuple[Tensor, Tensor]:
    """``kd`` ``(..., b, b)`` divided by the power of two nearest above its largest entry (exactly: only exponents
    change), and that exponent ``(...)``: the solvers then work on entries of magnitude ``<= 1`` whatever the norm
    (``1e-150`` and ``1e150`` alike); a zero matrix keeps its scale."""
    _, exponent = torch.frexp(kd.abs().amax(dim=(-2, -1)))
    return torch.ldexp(kd, -exponent[..., None, None]), exponent


def _ordered_planes(a: Tensor, q: Tensor, exponent: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(Q, mu)`` of ``skew_real_schur`` from an orthogonal basis ``q`` that block-diagonalises the rescaled
    ``a`` (``_rescaled``): the frequencies read off the blocks of ``q^T a q``, made non-negative (a plane turning
    backwards has its second column flipped), sorted ascending, scaled back by ``2^exponent``, cast to ``dtype``."""
    m = q.transpose(-1, -2) @ a @ q
    f = (m[..., 1::2, 0::2].diagonal(dim1=-2, dim2=-1) - m[..., 0::2, 1::2].diagonal(dim1=-2, dim2=-1)) * 0.5
    mu, order = f.abs().sort(dim=-1)  # (..., b/2) ascending
    sign = torch.where(f < 0, -1.0, 1.0).to(a.dtype)  # a plane turning backwards: flip its second column
    flip = torch.stack((torch.ones_like(sign), sign), dim=-1).flatten(-2)  # (..., b)
    q = q * flip.unsqueeze(-2)
    cols = torch.stack((2 * order, 2 * order + 1), dim=-1).flatten(-2)  # (..., b): the planes in mu's order
    q = torch.gather(q, -1, cols.unsqueeze(-2).expand(q.shape))
    return q.to(dtype), torch.ldexp(mu, exponent.unsqueeze(-1)).to(dtype)


def _refine(a: Tensor, q: Tensor, steps: int = 3, gap: float = 2.0 ** -20) -> Tensor:
    """Newton steps that finish a block diagonalisation: ``q`` ``(..., b, b)`` orthogonal with ``M = q^T a q = D + E``
    (``D`` the diagonal ``2 x 2`` blocks ``f_n J``, ``E`` the couplings; ``a`` rescaled, entries ``<= 1``) becomes
    ``q exp(Omega)`` (its Taylor polynomial of degree 2, then one Newton-Schulz step back to orthonormal), with the
    skew ``Omega`` that solves ``E + D Omega - Omega D = 0`` to first order. Per coupling block ``E_nm``, its part
    commuting with ``J`` is divided by ``f_n - f_m`` and its anti-commuting part by ``f_n + f_m``, where that
    divisor exceeds ``gap``; a part whose divisor does not is left as it is.

    Why this reaches round-off on any hardware (no count tuned to one machine's rounding):

    * a part that is divided shrinks from ``e`` to ``O(e^2 / divisor)`` per step (Newton's method converges
      quadratically), so from the ``e <= 1e-8`` that the sweeps leave at worst (exact ties, on which they converge
      only linearly: 6 sweeps 5e-9, 12 sweeps 3e-12) three steps give ``1e-10``, ``1e-14``, round-off even at a
      divisor as small as ``gap``;
    * a part that is left is one that does not need resolving: within a group of planes with equal frequencies
      ``f`` (an exact tie), ``K`` on their invariant subspace is ``f C`` with ``C`` an orthogonal complex structure;
      in a basis close to block diagonal, ``C^2 = -I`` makes the couplings of planes with equal diagonal blocks
      anti-commute with ``J`` up to ``O(e^2)`` (their divisor is ``2 f``: resolved), those of planes with opposite
      ones commute (divisor ``2 f`` again), and the part left is of second order. Any orthonormal basis of a tied
      invariant subspace is a valid answer, so nothing is chosen there. Planes still together (``f = 0``) have
      both divisors small and couplings of second order for the same reason. Nearly tied planes (``|f_n - f_m|``
      below ``gap``) are resolved exactly pair by pair by the sweeps' closed form (``_schur4``, exact for any
      gap); they converge quadratically there, their commuting couplings bounded by the frequencies' spread.

    Orthonormality: the degree-2 polynomial ``S`` has ``S^T S = I + Omega^4 / 4``; with ``|Omega| <= 1e-2`` (a
    coupling of ``1e-8`` over a divisor of ``gap``) that is ``1e-8``, and the Newton-Schulz step squares it to
    round-off (its defect ``d`` becomes ``3 d^2 / 4``).

    Batched products only (a float64 linear solve here copied between host and device on an H200, torch 2.11, which broke graph capture): no
    value read back to the host, no shape that depends on the data."""
    b = a.shape[-1]
    h = b // 2
    eye = torch.eye(b, dtype=a.dtype, device=a.device)
    jm = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=a.dtype, device=a.device)
    off = ~torch.eye(h, dtype=torch.bool, device=a.device)
    for _ in range(steps):
        m = q.transpose(-1, -2) @ a @ q
        blk = m.unflatten(-1, (h, 2)).unflatten(-3, (h, 2)).transpose(-3, -2)  # (..., n, m, 2, 2)
        f = (blk[..., 1, 0] - blk[..., 0, 1]).diagonal(dim1=-2, dim2=-1) * 0.5  # (..., h): the J coefficients
        c0 = (blk[..., 0, 0] + blk[..., 1, 1]) * 0.5  # the commuting part c0 I + c1 J of each block
        c1 = (blk[..., 1, 0] - blk[..., 0, 1]) * 0.5
        commuting = c0[..., None, None] * eye[:2, :2] + c1[..., None, None] * jm
        diff = f.unsqueeze(-1) - f.unsqueeze(-2)  # (..., n, m): f_n - f_m
        summ = f.unsqueeze(-1) + f.unsqueeze(-2)
        inv_d = torch.where(off & (diff.abs() > gap), 1.0 / torch.where(diff == 0, 1.0, diff), 0.0)
        inv_s = torch.where(off & (summ.abs() > gap), 1.0 / torch.where(summ == 0, 1.0, summ), 0.0)
        omega = jm @ (commuting * inv_d[..., None, None] + (blk - commuting) * inv_s[..., None, None])
        omega = omega.transpose(-3, -2).reshape(m.shape)  # (..., b, b), skew up to rounding
        omega = (omega - omega.transpose(-1, -2)) * 0.5  # Omega, exactly skew
        q = q @ (eye + omega + 0.5 * (omega @ omega))  # exp(Omega) to second order: (S^T S = I + Omega^4 / 4)
        q = q @ (1.5 * eye - 0.5 * (q.transpose(-1, -2) @ q))  # a Newton-Schulz step: orthonormal to round-off
    return q


def _skew_real_schur_eigh(k: Tensor, rtol: float = 1e-8) -> tuple[Tensor, Tensor]:
    """``skew_real_schur`` for blocks larger than ``8 x 8``, from Hermitian eigendecompositions (``rtol``: eigenvalues
    ``mu <= rtol * max(mu)`` count as small and are resolved again on their own scale).

    From a Hermitian eigendecomposition of ``-iK`` (backward stable whatever the eigenvalue gaps): an
    eigenvector ``u`` of ``mu > 0`` gives the real orthonormal pair ``sqrt(2) (Im u, Re u)`` -- also when several
    ``mu`` coincide. For ``mu`` near zero that pairing fails (``u`` and its conjugate, the eigenvector of
    ``-mu``, mix), so the small eigenvalues are resolved again on their own scale: ``K`` restricted to the
    complement of the well-separated planes (an exactly block-structured matrix in an orthonormal basis of that
    complement) is rescaled to norm one and decomposed the same way -- its planes keep their frequencies exactly
    (``mu`` from ``1e-8`` of the largest down to ``1e-16`` of it, which would otherwise be dropped: an angle error
    of ``mu * s``, ~1e-4 rad at coordinates of 1e4). What is left below that scale is the null space, given a
    real orthonormal basis of its own; its planes turn by 0 (``K = 0`` gives a valid ``Q``). Four small
    eigendecompositions in all, batched over the leading dimensions, on ``K`` rescaled by a power of two
    (``_rescaled``); the basis is then made orthonormal (two Newton-Schulz steps) and finished by ``_refine``,
    which brings the reconstruction back to round-off after that correction.
    """
    b = k.shape[-1]
    kd, exponent = _rescaled(k.detach().to(torch.float64))
    eye = torch.eye(b, dtype=kd.dtype, device=kd.device)
    pairs, mu, good = _schur_pairs(kd, rtol)  # the well-separated planes
    kept = pairs * good.repeat_interleave(2, dim=-1).unsqueeze(-2).to(pairs.dtype)
    # an orthonormal basis W whose last 2r columns span the complement of the kept planes (projector eigenvalue 1)
    lam, w = torch.linalg.eigh(eye - kept @ kept.transpose(-1, -2))
    inner = (lam > 0.5).to(kd.dtype)  # (..., b): the complement's coordinates in W
    kn = (w.transpose(-1, -2) @ kd @ w) * inner.unsqueeze(-1) * inner.unsqueeze(-2)  # exactly zero elsewhere
    scale = kn.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(kd.dtype).tiny)
    pairs2, mu2, good2 = _schur_pairs(kn / scale, rtol)  # the small planes, on their own scale
    # below the round-off of K's own entries a plane is still: its pair is noise, and so is its turn
    good2 = good2 & (mu2 * scale.squeeze(-1) > 64 * torch.finfo(kd.dtype).eps * mu.amax(dim=-1, keepdim=True))
    small = w @ (pairs2 * good2.repeat_interleave(2, dim=-1).unsqueeze(-2).to(pairs2.dtype))
    # slot order: null planes, small planes, then the separated ones (each ascending); the separated planes hold
    # the last g slots, the small ones the g2 slots before them
    h = b // 2
    g, g2 = good.sum(-1, keepdim=True), good2.sum(-1, keepdim=True)  # (..., 1)
    slot = torch.arange(h, device=kd.device)
    src2 = (slot + g).clamp(max=h - 1)  # small plane at slot n comes from pass 2's slot n + g
    is_small = (slot >= h - g - g2) & (slot < h - g)  # (..., h)
    small = torch.gather(small.unflatten(-1, (h, 2)), -2, src2.unsqueeze(-2).unsqueeze(-1).expand(
        *small.shape[:-1], h, 2)).flatten(-2)
    mu_small = torch.gather(mu2 * scale.squeeze(-1), -1, src2)
    small_cols = is_small.repeat_interleave(2, dim=-1).unsqueeze(-2)
    q = torch.where(small_cols, small, kept)
    mu = torch.where(good, mu, torch.where(is_small, mu_small, torch.zeros_like(mu)))
    # the null space: the last 2 r0 eigenvectors of the projector onto the complement of every plane found
    found = q * (good | is_small).repeat_interleave(2, dim=-1).unsqueeze(-2).to(q.dtype)
    _, null_vecs = torch.linalg.eigh(eye - found @ found.transpose(-1, -2))
    r2 = 2 * (~(good | is_small)).sum(dim=-1, keepdim=True)  # (..., 1)
    idx = (torch.arange(b, device=kd.device) + b - r2).clamp(max=b - 1)  # (..., b): column c <- b - 2r + c
    null_cols = torch.gather(null_vecs, -1, idx.unsqueeze(-2).expand(null_vecs.shape))
    q = torch.where((good | is_small).repeat_interleave(2, dim=-1).unsqueeze(-2), q, null_cols)
    # the columns of the three passes are orthogonal only to the eigensolvers' accuracy on nearly still planes
    # (1e-8 between a plane 1e-8 times slower and the null space): made orthonormal, then finished as the sweeps are
    for _ in range(2):  # Newton-Schulz towards the nearest orthogonal matrix, quadratic: 1e-8 -> 1e-16 -> round-off
        q = q @ (1.5 * eye - 0.5 * (q.transpose(-1, -2) @ q))
    return _ordered_planes(kd, _refine(kd, q), exponent, k.dtype)


def _schur_pairs(kd: Tensor, rtol: float) -> tuple[Tensor, Tensor, Tensor]:
    """The planes of ``kd`` ``(..., b, b)`` (float64 skew) from one eigendecomposition of ``-iK``: ``(pairs, mu,
    good)`` -- ``(..., b, b)`` columns ``sqrt(2) (Im u, Re u)`` per non-negative eigenvalue (ascending),
    ``(..., b/2)`` those eigenvalues, and ``(..., b/2)`` whether each exceeds ``rtol`` times the largest (only
    those columns are trustworthy)."""
    half = kd.shape[-1] // 2
    mu_all, u = torch.linalg.eigh((-1j) * kd.to(torch.complex128))  # ascending, -mu_max .. mu_max
    mu, u = mu_all[..., half:], u[..., :, half:]  # (..., h), (..., b, h): the non-negative half
    pairs = torch.stack((u.imag, u.real), dim=-1).flatten(-2) * math.sqrt(2.0)  # (..., b, b)
    good = mu > rtol * mu.abs().amax(dim=-1, keepdim=True)  # (..., h); the small ones come first
    return pairs, mu, good


#: The largest block the Jacobi sweeps take. Larger blocks use the eigensolver path (``_skew_real_schur_eigh``),
#: which synchronises: the closed-form pair rotations are not chosen nearest to the identity, so with more than
#: four planes per block, clustered spectra converge only linearly (``10 x 10``: 10 sweeps to round-off,
#: ``12 x 12``: 14, against 4 and 5 for ``6 x 6`` and ``8 x 8``).
_JACOBI_MAX = 8


def _jacobi_sweeps(b: int) -> int:
    """Block Jacobi sweeps for ``b x b`` blocks (``b <= 8``) before the Newton finish (``_refine``): enough to bring
    the couplings into its quadratic range (``<= 1e-8`` of the norm at worst, at exact ties; random, clustered
    and graded spectra reach round-off in 4 sweeps for ``6 x 6`` and 5 for ``8 x 8``). Round-off itself comes from
    the finish, whose convergence does not depend on how the hardware sums."""
    return 6


#: (size, device) -> the Jacobi rounds' indices, constants built once (see ``_cached``)
_JACOBI_ROUNDS: dict = {}


def _jacobi_rounds(b: int, device: torch.device) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The rounds of one block Jacobi sweep over the ``h = b / 2`` diagonal 2x2 blocks, by the round-robin
    ("circle") schedule: every pair of blocks once per sweep, each round a set of disjoint pairs.

    Per round, with ``idx`` ``(pairs, 4)`` the indices ``(2i, 2i + 1, 2j, 2j + 1)`` of each pair ``(i, j)``:
    ``rows`` / ``cols`` (``(pairs, 4, 1)`` / ``(pairs, 1, 4)``) select the ``4 x 4`` submatrices, and
    ``put_rows`` / ``put_cols`` (``(pairs, 1, 4, 1)`` / ``(pairs, 2, 1, 2)``) place a ``(pairs, 2, 4, 2)`` table
    ``X[p, s, r, t]`` (column ``2 s + t``, row ``r`` of pair ``p``'s ``4 x 4`` rotation) into the ``b x b`` one.
    """
    def build() -> list:
        h = b // 2
        players = list(range(h + h % 2))  # a bye for odd h: its partner rests that round
        n, rounds = len(players), []
        for _ in range(n - 1):
            pairs = [sorted((players[i], players[n - 1 - i])) for i in range(n // 2)]
            idx = torch.tensor([[2 * i, 2 * i + 1, 2 * j, 2 * j + 1] for i, j in pairs if j < h], device=device)
            rounds.append((idx[:, :, None], idx[:, None, :], idx[:, None, :, None], idx.view(-1, 2, 1, 2)))
            players = [players[0], players[-1]] + players[1:-1]
        return rounds

    return _cached(_JACOBI_ROUNDS, (b, str(device)), build)


_SCHUR4_TABLES: dict = {}


def _schur4_tables(device: torch.device, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """Constants of ``_schur4`` on ``device`` (built once, ``_cached``: no host-to-device copy per call, which a
    CUDA graph could not hold):

    * ``parts`` ``(16, 6)``: a flattened ``4 x 4`` skew ``A`` times it gives its self-dual part
      ``((a01 + a23), (a02 - a13), (a03 + a12)) / 2`` and its anti-self-dual part (the signs of ``a23``,
      ``a13``, ``a12`` flipped);
    * ``structures`` ``(2, 3, 16)``: a unit 3-vector times ``structures[0]`` (``[1]``) is the flattened unit
      self-dual (anti-self-dual) complex structure, the 't Hooft symbols;
    * ``first`` ``(3,)``: ``1e-150`` times the first unit vector, added so that a vanishing part still gets a
      structure (and its square does not underflow);
    * ``half_eye`` ``(4, 4)`` and ``half_signs`` ``(2, 1, 1)``: ``(I -+ M) / 2 = half_eye + half_signs * M``.
    """
    def build() -> tuple[Tensor, ...]:
        parts = torch.zeros(16, 6, dtype=torch.float64)
        for col, (x, y, sign) in enumerate([(1, 11, 1), (2, 7, -1), (3, 6, 1), (1, 11, -1), (2, 7, 1), (3, 6, -1)]):
            parts[x, col], parts[y, col] = 0.5, 0.5 * sign
        which = [[0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 0, 1], [3, 2, 1, 0]]  # which of (0, u1, u2, u3) sits at (r, c)
        signs = [[[0, 1, 1, 1], [-1, 0, 1, -1], [-1, -1, 0, 1], [-1, 1, -1, 0]],
                 [[0, 1, 1, 1], [-1, 0, -1, 1], [-1, 1, 0, -1], [-1, -1, 1, 0]]]
        structures = torch.zeros(2, 3, 16, dtype=torch.float64)
        for kind in range(2):
            for r in range(4):
                for c in range(4):
                    if which[r][c]:
                        structures[kind, which[r][c] - 1, 4 * r + c] = signs[kind][r][c]
        first = torch.tensor([1e-150, 0.0, 0.0], dtype=torch.float64)
        half_signs = torch.tensor([-0.5, 0.5], dtype=torch.float64).view(2, 1, 1)
        return tuple(t.to(device=device, dtype=dtype)
                     for t in (parts, structures, first, 0.5 * torch.eye(4, dtype=torch.float64), half_signs))

    return _cached(_SCHUR4_TABLES, (str(device), dtype), build)


def _schur4(a: Tensor) -> Tensor:
    """The plane table ``X`` ``(..., 2, 4, 2)`` of ``Q`` ``(..., 4, 4)`` orthogonal with ``Q^T A Q =
    blockdiag(mu_1 J, mu_2 J)`` for skew ``A`` ``(..., 4, 4)`` (float64), in closed form: ``X[..., s, :, t]`` is
    column ``2 s + t`` of ``Q``.

    ``A = alpha J_+ + gamma J_-`` with ``J_+`` / ``J_-`` the unit complex structures of its self-dual and
    anti-self-dual parts (they commute; a part that vanishes gets a fixed structure). ``M = J_+ J_-`` is a
    symmetric involution: on its ``-1`` eigenspace ``J_- = J_+`` and ``A = (alpha + gamma) J_+``, on its ``+1``
    eigenspace ``J_- = -J_+`` and ``A = (alpha - gamma) J_+``. Each plane: the largest column of the projector
    ``(I -+ M) / 2`` (its largest diagonal entry), normalised, ``v``, and ``J v`` with ``J`` the structure of the
    larger part (``J_+`` where ``alpha >= gamma``: then both planes turn forwards). A structure enters ``A``
    times its part's norm, so the rounding it carries from a small part does not reach the form: exact to
    ``A``'s round-off, nearly tied frequencies included.
    """
    parts_of, structures, first, half_eye, half_signs = _schur4_tables(a.device, a.dtype)
    u = (a.flatten(-2) @ parts_of).unflatten(-1, (2, 3)) + first  # (..., 2, 3): self-dual, anti-self-dual
    norm = u.norm(dim=-1, keepdim=True)  # (..., 2, 1): alpha, gamma
    j = ((u / norm).unsqueeze(-2) @ structures).unflatten(-1, (4, 4)).squeeze(-3)  # (..., 2, 4, 4): J_+, J_-
    proj = torch.addcmul(half_eye, half_signs, (j[..., 0, :, :] @ j[..., 1, :, :]).unsqueeze(-3))  # (..., 2, 4, 4)
    best = proj.diagonal(dim1=-2, dim2=-1).argmax(-1)  # (..., 2): a column's squared norm is its diagonal entry
    v = torch.gather(proj, -1, best[..., None, None].expand(*proj.shape[:-1], 1))  # (..., 2, 4, 1)
    v = v / v.norm(dim=-2, keepdim=True)
    larger = norm.argmax(-2, keepdim=True).unsqueeze(-1).expand(*j.shape[:-3], 1, 4, 4)
    return torch.cat((v, torch.gather(j, -3, larger) @ v), dim=-1)  # (..., 2, 4, 2)


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
        h = mu.shape[-1]
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
