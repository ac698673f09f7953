"""Matrix exponentials of skew-symmetric matrices that stay orthogonal and differentiate twice.

* :func:`linear_skew_expm` -- ``expm(G(r))``, ``G(r) = sum_k r_k L_k``, for every token, with large norms
  (LieRE's generators at its authors' initialisation reach ``||G|| ~ 10^3`` at image-grid coordinates). On the
  CPU it is computed in float64 from one Hermitian eigendecomposition per matrix, ``-iG = U diag(lam) U^H``,
  ``expm(G) = Re(U diag(exp(i lam)) U^H)``: unitary ``U`` gives an orthogonal result to float64 round-off
  whatever the norm, where a float32 scaling-and-squaring loses orthogonality (``||R^T R - I|| ~ 1e-3``). The
  cost does not grow with the norm (no squarings), the generator sum is formed and exponentiated in chunks
  (bounded workspace, never stored), and the backward pass reuses the eigenbasis (kept from the forward pass, or
  -- with ``recompute=True``, for many tokens -- recomputed chunk by chunk, so that only the output is kept
  for the backward pass): the exact Frechet adjoint
  ``U ((U^H gE U) * Phi) U^H`` with ``Phi`` the divided differences of ``exp``, written as
  ``exp(-i (lam_i + lam_j) / 2) sinc((lam_i - lam_j) / 2)`` (finite for equal eigenvalues). On a GPU, whose
  solvers batch eigendecompositions only for small matrices, it is a float64 ``matrix_exp``, chunk by chunk.
  Used by LieRE and relaxed STRING (ComRoPE's block exponentials and the per-block products are
  ``blocks.scaled_block_exp_matrices`` and ``blocks.block_apply``).

Second derivatives: the backward pass is hand-written for speed. When a gradient graph is requested
(``create_graph=True``, e.g. for a gradient penalty or Hessian-vector products) it computes the same gradient
with differentiable operations (a ``torch.linalg.matrix_exp`` reference per matrix), so second derivatives are
exact, at the reference's cost. Under ``torch.compile`` (which traces first-order training) it uses a
traceable float64 ``matrix_exp``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .validation import check_deferred_coords

__all__ = ["linear_skew_expm", "DEFAULT_BUDGET"]

DEFAULT_BUDGET = 1 << 21  # matrix entries per chunk: ~64 MiB of complex128 workspace per array


def _sinc(x: Tensor) -> Tensor:
    """``sin(x) / x`` with the value 1 at 0 (accurate for tiny ``x``)."""
    safe = torch.where(x == 0, torch.ones_like(x), x)
    return torch.where(x == 0, torch.ones_like(x), torch.sin(safe) / safe)


def _combine(r: Tensor, gen: Tensor) -> Tensor:
    """``sum_k r[t, k] gen[:, k]`` by elementwise products (no matmul: exact in float64 on every device).

    ``r`` ``(t, c)``, ``gen`` ``(Hp, c, nb, n, n)`` -> ``(t, Hp, nb, n, n)``.
    """
    g = r[:, 0, None, None, None, None] * gen[:, 0]
    for k in range(1, r.shape[1]):
        g = g + r[:, k, None, None, None, None] * gen[:, k]
    return g


def _exp_from_eig(u: Tensor, lam: Tensor) -> Tensor:
    """``Re(U diag(exp(i lam)) U^H)``: ``(..., n, n)`` complex, ``(..., n)`` -> ``(..., n, n)`` real."""
    return torch.matmul(u * torch.polar(torch.ones_like(lam), lam).unsqueeze(-2), u.mH).real


def _frechet_adjoint(u: Tensor, lam: Tensor, ge: Tensor) -> Tensor:
    """Gradient of ``expm`` at ``G = U diag(i lam) U^H`` against the output gradient ``ge`` (all ``(..., n, n)``).

    ``grad_G = L_exp(G^T)[ge]``; ``G^T = U diag(-i lam) U^H``, whose divided differences of ``exp`` are
    ``exp(-i (lam_i + lam_j) / 2) sinc((lam_i - lam_j) / 2)``.
    """
    half_sum = (lam.unsqueeze(-1) + lam.unsqueeze(-2)) * 0.5
    half_diff = (lam.unsqueeze(-1) - lam.unsqueeze(-2)) * 0.5
    phi = torch.polar(_sinc(half_diff), -half_sum)  # (..., n, n)
    inner = u.mH @ ge.to(u.dtype) @ u
    return (u @ (inner * phi) @ u.mH).real


def _frechet_adjoint_lean(u: Tensor, lam: Tensor, ge: Tensor) -> Tensor:
    """:func:`_frechet_adjoint` with about a third fewer operations (equal to round-off; used where the eigenbasis is
    recomputed, whose rounding is free to differ from the kept-eigenbasis path).

    The phase factor of ``Phi`` is the outer product of ``e = exp(-i lam / 2)``, folded into the eigenbasis
    (``diag(e) (U^H gE U) diag(e) = (U diag(conj e))^H gE (U diag(e))``) instead of an ``n x n`` complex array, and the
    products with the real ``gE`` and the real part of the last product are real matrix products.
    ``u`` ``(..., n, n)`` complex128, ``lam`` ``(..., n)``, ``ge`` ``(..., n, n)`` float64 -> ``(..., n, n)`` float64.
    """
    e = torch.polar(torch.ones_like(lam), -0.5 * lam)  # (..., n)
    s = _sinc((lam.unsqueeze(-1) - lam.unsqueeze(-2)) * 0.5)  # (..., n, n) real part of Phi without its phase
    ge_u = ge @ torch.view_as_real(u * e.unsqueeze(-2)).flatten(-2)  # (..., n, 2n): gE U diag(e), real product
    inner = (u * e.conj().unsqueeze(-2)).mH @ torch.view_as_complex(ge_u.unflatten(-1, (-1, 2)))
    d = u @ (inner * s)
    return torch.view_as_real(d).flatten(-2) @ torch.view_as_real(u).flatten(-2).mT  # Re(d U^H)


def _eigen(r64: Tensor, l64: Tensor) -> tuple[Tensor, Tensor]:
    """``(U, lam)`` with ``-i G = U diag(lam) U^H``, ``G = sum_k r_k L_k`` formed in float64.

    ``r64`` ``(t, c)``, ``l64`` ``(Hp, c, nb, n, n)`` float64 -> ``(t, Hp, nb, n, n)`` complex128, ``(t, Hp, nb, n)``.
    """
    try:
        lam, u = torch.linalg.eigh((-1j) * _combine(r64, l64).to(torch.complex128))
    except torch.linalg.LinAlgError:
        check_deferred_coords(r64.device)  # NaN coordinates that a deferred check counted: that error instead
        raise
    return u, lam


def _chunk_tokens(per_token: int, budget: int) -> int:
    return max(1, budget // max(per_token, 1))


class _LinearSkewExpm(torch.autograd.Function):
    """``expm(sum_k r_k L_k)`` per token, fused: the generator sum is formed chunk by chunk in float64 and never
    stored. The backward pass either reuses the eigenbases kept from the forward pass (``recompute=False``) or keeps
    only the inputs and redoes the eigendecompositions chunk by chunk (``recompute=True``: the activation memory is
    the output alone, for one more eigendecomposition per token, and a leaner form of the same adjoint: the gradients
    agree to round-off)."""

    @staticmethod
    def forward(ctx, coords: Tensor, gen: Tensor, budget: int, recompute: bool, dtype: torch.dtype) -> Tensor:
        t, c = coords.shape
        hp, _, nb, n, _ = gen.shape
        r64, l64 = coords.detach().to(torch.float64), gen.detach().to(torch.float64)
        keep = torch.complex128 if dtype == torch.float64 else torch.complex64
        out = gen.new_empty(t, hp, nb, n, n, dtype=dtype)
        us, lams = [], []
        step = _chunk_tokens(hp * nb * n * n, budget)
        for i in range(0, t, step):
            u, lam = _eigen(r64[i:i + step], l64)
            out[i:i + step] = _exp_from_eig(u, lam).to(out.dtype)
            if not recompute:
                us.append(u.to(keep))
                lams.append(lam)
        if recompute:  # keep only the inputs: the backward pass redoes the eigendecompositions chunk by chunk
            ctx.save_for_backward(coords, gen)
        else:
            ctx.save_for_backward(coords, gen, torch.cat(us), torch.cat(lams))
        ctx.step, ctx.recompute = step, recompute
        return out

    @staticmethod
    def backward(ctx, ge: Tensor):
        coords, gen = ctx.saved_tensors[:2]
        if torch.is_grad_enabled():  # a gradient graph is requested: differentiable reference
            with torch.enable_grad():
                ref = torch.linalg.matrix_exp(_combine(coords, gen))
                want = [x for x, need in zip((coords, gen), ctx.needs_input_grad[:2]) if need]
                grads = iter(torch.autograd.grad(ref, want, ge.to(ref.dtype), create_graph=True))
            return tuple(next(grads) if need else None for need in ctx.needs_input_grad[:2]) + (None, None, None)
        r64, l64 = coords.to(torch.float64), gen.to(torch.float64)
        g_r = torch.zeros_like(r64) if ctx.needs_input_grad[0] else None
        g_l = torch.zeros_like(l64) if ctx.needs_input_grad[1] else None
        step = ctx.step
        for i in range(0, coords.shape[0], step):
            if ctx.recompute:  # the same eigenbasis as the forward pass, in full precision
                u, lam = _eigen(r64[i:i + step], l64)
                gg = _frechet_adjoint_lean(u, lam, ge[i:i + step].to(torch.float64))
            else:
                u, lam = ctx.saved_tensors[2][i:i + step].to(torch.complex128), ctx.saved_tensors[3][i:i + step]
                gg = _frechet_adjoint(u, lam, ge[i:i + step].to(torch.float64))  # (t', Hp, nb, n, n): dL/dG per token
            del u
            if g_r is not None:  # dG/dr_k = L_k
                g_r[i:i + step] = torch.einsum("thnij,hknij->tk", gg, l64)  # float64: no reduced-precision GEMM
            if g_l is not None:  # dG/dL_k = r_k
                g_l += torch.einsum("tk,thnij->hknij", r64[i:i + step], gg)
        return (None if g_r is None else g_r.to(coords.dtype), None if g_l is None else g_l.to(gen.dtype), None, None,
                None)


def linear_skew_expm(coords: Tensor, generators: Tensor, budget: int = DEFAULT_BUDGET, *,
                     recompute: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    """``expm(sum_k r_k L_k)`` for every token: orthogonal to float64 round-off whatever the norm.

    Args:
        coords: ``(T, c)`` real (flatten the batch of coordinates into ``T``).
        generators: ``(Hp, c, nb, n, n)`` skew-symmetric blocks (``L^T = -L``; not checked), float32/64.
        budget: matrix entries per chunk (bounds the float64 / complex128 workspace: ~``32 * budget`` bytes).
        recompute: on the CPU, keep nothing but the inputs for the backward pass and redo the eigendecompositions
            there, chunk by chunk, instead of keeping one complex eigenbasis per token (twice the output's bytes in
            float32). The gradients agree to round-off; the backward pass costs one more eigendecomposition per
            token. Worth it when there are many tokens (per-example coordinates); ignored elsewhere.
        dtype: dtype of the result (default: ``generators``'): float64 generators with a float32 result keep
            generator sums that float32 would round (``r * ulp(L)`` at coordinate ``r``) at float32's memory cost.

    Returns:
        ``(T, Hp, nb, n, n)`` in ``dtype``; differentiable in both inputs (first and second order).

    Raises:
        ValueError: on shapes that do not fit.
    """
    if coords.dim() != 2 or generators.dim() != 5 or generators.shape[1] != coords.shape[1] \
            or generators.shape[-1] != generators.shape[-2]:
        raise ValueError(f"linear_skew_expm needs coords (T, c) and generators (Hp, c, nb, n, n), got "
                         f"{tuple(coords.shape)} and {tuple(generators.shape)}")
    dtype = generators.dtype if dtype is None else dtype
    if coords.shape[0] == 0:
        return generators.new_zeros(0, *generators.shape[:1], *generators.shape[2:], dtype=dtype)
    if torch.compiler.is_compiling():  # traceable form: one float64 matrix_exp per token (orthogonal, unchunked)
        return _expm64(coords, generators).to(dtype)
    if coords.device.type != "cpu":
        # GPU solvers batch small eigendecompositions only up to n = 32 (larger ones run one by one), while the
        # float64 matrix_exp is batched: use it there, chunk by chunk (bounded workspace)
        hp, _, nb, n, _ = generators.shape
        step = _chunk_tokens(hp * nb * n * n, budget)
        return torch.cat([_expm64(part, generators).to(dtype) for part in coords.split(step)])
    return _LinearSkewExpm.apply(coords, generators, int(budget), bool(recompute), dtype)


def _expm64(coords: Tensor, generators: Tensor) -> Tensor:
    """``expm(sum_k r_k L_k)`` by float64 ``torch.linalg.matrix_exp`` (differentiable to any order)."""
    g = _combine(coords.to(torch.float64), generators.to(torch.float64))  # (T, Hp, nb, n, n)
    return torch.linalg.matrix_exp(g).to(generators.dtype)
