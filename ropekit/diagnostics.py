"""Exactness and robustness diagnostics of a position encoding: commutativity, mixing, relative-operator error.

All functions take a ``PositionEncoding`` module. Notation: generators ``L_k`` (``pe.generators()``,
``(H, c, d, d)``), the generator part ``R_STR(r) = expm(sum_k r_k L_k)``, the optional post-rotation
``P_sp`` (``pe.post_rotation_matrix()``, i.e. ``R(0)``) with ``R_sp(r) = pe.matrix(r)`` (``R_STR(r) P_sp`` for relaxed
STRING; for Cayley ``RoPE(r) P = P R_STR(r)``, whose left ``P`` cancels in attention), and the active
subspace: the first ``pe.active_dim`` coordinates (all of them except for relaxed STRING).
Every quantity is computed in float64 (for round-off that does not hide small violations).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from .encodings.base import PositionEncoding
from .encodings.string import dense_expm_rotations

__all__ = ["commutator_error", "mixing_norm", "relative_operator_error", "invariant_residual", "sample_l1_ball"]


def _generators64(pe: PositionEncoding) -> Tensor:
    with torch.no_grad():
        return pe.generators().detach().to(torch.float64)


@torch.no_grad()
def commutator_error(pe: PositionEncoding) -> dict[str, float]:
    """``max_{a,b} ||[L_a, L_b]||_F`` over generator pairs and heads.

    Returns:
        ``{"abs": max ||[L_a, L_b]||_F, "rel": max ||[L_a, L_b]||_F / (||L_a||_F ||L_b||_F)}``; both 0 for ``c = 1``.
    """
    gen = _generators64(pe)  # (H, c, d, d)
    c = gen.shape[1]
    worst_abs, worst_rel = 0.0, 0.0
    for a in range(c):
        for b in range(a + 1, c):
            la, lb = gen[:, a], gen[:, b]
            comm = torch.linalg.matrix_norm(la @ lb - lb @ la)  # (H,)
            denom = torch.linalg.matrix_norm(la) * torch.linalg.matrix_norm(lb)
            worst_abs = max(worst_abs, float(comm.max()))
            rel = torch.where(denom > 0, comm / denom.clamp_min(1e-300), torch.zeros_like(comm))
            worst_rel = max(worst_rel, float(rel.max()))
    return {"abs": worst_abs, "rel": worst_rel}


@torch.no_grad()
def mixing_norm(pe: PositionEncoding) -> float:
    """Frobenius norm of the blocks of ``P_sp`` that map the active subspace into the null one and back.

    Zero when there is no post-rotation, or when ``P_sp = I_active (+) Q_null`` (largest over heads).
    """
    p = pe.post_rotation_matrix()
    a = pe.active_dim
    if p is None or a >= pe.head_dim:
        return 0.0
    p = p.detach().to(torch.float64)
    off = torch.sqrt(torch.linalg.matrix_norm(p[:, a:, :a]) ** 2 + torch.linalg.matrix_norm(p[:, :a, a:]) ** 2)
    return float(off.max())


@torch.no_grad()
def relative_operator_error(pe: PositionEncoding, r: Tensor, s: Tensor) -> float:
    """Mean over pairs and heads of ``||R_STR(r)^T R_STR(s) - R_STR(s - r)||_F / ||R_STR(s - r)||_F``.

    Args:
        pe: the encoding (its generator part is used, not the post-rotation).
        r, s: ``(n, c)`` paired coordinates.

    Round-off for commuting generators; grows like ``C eps ||r||_1 ||s||_1`` otherwise (BCH).
    """
    if r.shape != s.shape or r.dim() != 2 or r.shape[1] != pe.coord_dim:
        raise ValueError(f"r and s must both have shape (n, {pe.coord_dim}), got {tuple(r.shape)} and {tuple(s.shape)}")
    gen = _generators64(pe)
    r, s = r.to(torch.float64), s.to(torch.float64)
    rr, rs, rd = (dense_expm_rotations(x, gen) for x in (r, s, s - r))  # (H, n, d, d)
    err = torch.linalg.matrix_norm(rr.transpose(-1, -2) @ rs - rd) / torch.linalg.matrix_norm(rd)
    return float(err.mean())


def sample_l1_ball(n: int, dim: int, radius: float, generator: torch.Generator | None = None) -> Tensor:
    """``n`` points uniform in the l1 ball of the given radius in ``R^dim``: ``(n, dim)`` float64."""
    e = -torch.log(torch.rand(n, dim + 1, generator=generator, dtype=torch.float64))  # Dirichlet(1, ..., 1)
    w = (e / e.sum(-1, keepdim=True))[:, :dim]
    signs = torch.randint(0, 2, (n, dim), generator=generator).to(torch.float64) * 2 - 1
    return radius * w * signs


@torch.no_grad()
def invariant_residual(pe: PositionEncoding, rho: float = 1.0, num_deltas: int = 16, num_r: int = 32,
                       delta_std: float = 1.0, generator: torch.Generator | None = None) -> float:
    """``IR = E_Delta[ max_{||r||_1 <= rho} ||Pi R_sp(r)^T R_sp(r + Delta) Pi - Pi R_STR(Delta) Pi||_F ]``.

    ``Pi`` projects on the active subspace. The expectation is estimated with ``num_deltas`` offsets drawn
    from ``N(0, delta_std^2 I)``, the maximum over ``num_r`` points uniform in the l1 ball (and ``r = 0``).
    Zero in the exact configuration; averaged over heads.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    c, a = pe.coord_dim, pe.active_dim
    gen = _generators64(pe)
    pe64 = copy.deepcopy(pe).double()  # R_sp(r) exactly as the encoding applies it, in float64
    pe64.set_conventions(pairs="interleaved")  # the convention of generators()
    deltas = torch.randn(num_deltas, c, generator=generator, dtype=torch.float64) * delta_std
    rs = torch.cat([torch.zeros(1, c, dtype=torch.float64), sample_l1_ball(num_r, c, rho, generator)])
    total = 0.0
    for delta in deltas:
        lhs = (pe64.matrix(rs).transpose(-1, -2) @ pe64.matrix(rs + delta))[..., :a, :a]  # (H, R, a, a)
        rhs = dense_expm_rotations(delta[None], gen)[..., :a, :a]  # (H, 1, a, a)
        res = torch.linalg.matrix_norm(lhs - rhs)  # (H, R)
        total += float(res.max(dim=-1).values.mean())
    return total / num_deltas
