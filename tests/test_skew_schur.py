"""The real Schur form of skew matrices (``skew.skew_real_schur``: closed form for 4x4 blocks, block Jacobi sweeps
for 6x6 and 8x8 ones, eigendecompositions beyond) against the definition, on random, tied, zero and graded
spectra.

The float64 bound used below: ``Q`` is a product of a few dozen orthogonal factors, each formed and applied with an
error of a few ``eps`` per entry, so ``|Q^T Q - I|_F`` and ``|Q D Q^T - K|_F / |K|_F`` are ``c b eps`` with ``c`` a
small constant; the issue's figure, ``1e-14`` (about ``45 eps``; ``b <= 8``), is asserted for every 6x6 and 8x8
block. In float32 the basis is formed in float64 and rounded once: ``c sqrt(b) eps_32``.
"""

from __future__ import annotations

import pytest
import torch

from ropekit.encodings.ops.skew import skew_real_schur

pytestmark = pytest.mark.numerics

J = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)


def _rebuild(q: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """``Q blockdiag_n(mu_n J) Q^T`` for a batch ``(..., b, b)``, ``(..., b/2)``."""
    h = mu.shape[-1]
    d = torch.zeros(*mu.shape[:-1], h, 2, h, 2, dtype=q.dtype)
    idx = torch.arange(h)
    d[..., idx, :, idx, :] = mu.movedim(-1, 0)[..., None, None] * J
    return q @ d.reshape(q.shape) @ q.transpose(-1, -2)


def _planted(mus, seed=0):
    """A skew matrix with the plane frequencies ``mus`` in a random orthogonal basis."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(2 * len(mus), 2 * len(mus), dtype=torch.float64, generator=g))
    return q @ torch.block_diag(*[m * J for m in mus]) @ q.T


def _check(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, mu = skew_real_schur(k)
    b = k.shape[-1]
    tol = 4e-15 if b <= 8 else 1e-13  # the eigensolver path's real pairs are orthogonal to ~1e-13
    scale = float(k.abs().max().clamp_min(1.0))
    assert float((q.transpose(-1, -2) @ q - torch.eye(b, dtype=q.dtype)).abs().max()) < tol * b
    assert float((_rebuild(q, mu) - k).abs().max()) < tol * b * scale
    assert bool((mu >= 0).all()) and bool((mu.diff(dim=-1) >= 0).all())
    return q, mu


@pytest.mark.parametrize("b", [2, 4, 6, 8, 10, 16, 32, 64])
def test_random_blocks(b):
    n = 200 if b <= 8 else 5  # the fixed Jacobi sweeps on many draws
    k = torch.randn(n, b, b, dtype=torch.float64, generator=torch.Generator().manual_seed(b))
    k = k - k.mT
    _, mu = _check(k)
    # the frequencies are those of an eigensolver (the magnitudes of -iK's eigenvalues)
    ref = torch.linalg.eigvalsh(-1j * k.to(torch.complex128))[..., b // 2:]
    assert torch.allclose(mu, ref, rtol=0, atol=1e-13 * b)


@pytest.mark.parametrize("mus", [[1, 1, 1, 1], [1, 1, 0.3, 0.3], [0, 0, 0, 0], [1, 1 + 1e-12, 0.5, 0.5 + 1e-9],
                                 [1, 0.3, 4e-9, 0], [1, 1e-16, 0, 0], [2, 1e-8, 1e-8, 1e-8], [5, 0, 0, 5]],
                         ids=str)
def test_ties_zeros_and_graded_spectra(mus):
    """Coinciding, vanishing and 1e-8 / 1e-16 times slower planes keep their frequencies to the round-off of the
    largest entry, and every basis is orthogonal."""
    k = _planted(mus)
    _, mu = _check(k)
    assert torch.allclose(mu, torch.tensor(sorted(mus), dtype=torch.float64), rtol=1e-6, atol=1e-15)


def test_four_by_four_closed_form_edge_cases():
    """4x4 blocks: purely self-dual (tied frequencies), purely anti-self-dual (one still plane), one entry, zero."""
    e = torch.zeros(4, 4, dtype=torch.float64)
    cases = []
    for a, c in (([1.0, 0.0, 0.0], [0.0, 0.0, 0.0]), ([0.0, 0.0, 0.0], [0.3, -0.4, 0.0]), (None, None)):
        k = e.clone()
        if a is not None:  # self-dual part a, anti-self-dual part c (entries 01, 02, 03, 12, 13, 23)
            k[0, 1], k[2, 3] = a[0] + c[0], a[0] - c[0]
            k[0, 2], k[1, 3] = a[1] + c[1], c[1] - a[1]
            k[0, 3], k[1, 2] = a[2] + c[2], a[2] - c[2]
        cases.append(k - k.T)
    one = e.clone()
    one[2, 1] = -1e-3
    cases.append(one - one.T)
    _, mu = _check(torch.stack(cases))
    assert torch.allclose(mu[0], torch.tensor([1.0, 1.0], dtype=torch.float64), rtol=1e-15, atol=0)  # |a| twice
    assert torch.allclose(mu[1], torch.tensor([0.5, 0.5], dtype=torch.float64), rtol=1e-15, atol=0)  # |c| twice
    assert torch.equal(mu[2], torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(mu[3], torch.tensor([0.0, 1e-3], dtype=torch.float64), rtol=1e-14, atol=0)


@pytest.mark.parametrize("b", [6, 8])
def test_clustered_and_graded_spectra_converge(b):
    """Many planted spectra for the fixed Jacobi sweeps: clustered near zero, ties, frequencies spread over 12
    decades."""
    g = torch.Generator().manual_seed(b)
    n = 300
    q, _ = torch.linalg.qr(torch.randn(n, b, b, dtype=torch.float64, generator=g))
    mus = torch.rand(n, b // 2, dtype=torch.float64, generator=g) ** 4
    mus[:100] = torch.round(mus[:100] * 3 + 0.2) / 3
    mus[100:200] = 10.0 ** (-12 * torch.rand(100, b // 2, dtype=torch.float64, generator=g))
    h = b // 2
    d = torch.zeros(n, h, 2, h, 2, dtype=torch.float64)
    d[:, torch.arange(h), :, torch.arange(h), :] = mus.T[..., None, None] * J
    k = q @ d.reshape(n, b, b) @ q.mT
    _, mu = _check(k)
    assert torch.allclose(mu, mus.sort(-1).values, rtol=1e-10, atol=1e-14)


def test_dtypes_and_bad_sizes():
    k = torch.randn(2, 3, 8, 8)
    k = k - k.mT
    q, mu = skew_real_schur(k)
    assert q.dtype == mu.dtype == torch.float32 and q.shape == (2, 3, 8, 8) and mu.shape == (2, 3, 4)
    with pytest.raises(ValueError, match="even size"):
        skew_real_schur(torch.zeros(5, 5))


def _relative_errors(k: torch.Tensor, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Per matrix of ``k`` ``(n, b, b)`` (float64), the Schur form of ``k`` cast to ``dtype``: the relative
    reconstruction error ``|Q D Q^T - K|_F / |K|_F`` (formed on matrices rescaled by their largest entry, so that
    neither 1e-150 nor 1e150 under- or overflows; absolute for ``K = 0``) and ``|Q^T Q - I|_F``, in float64."""
    kd = k.to(dtype)
    q, mu = skew_real_schur(kd)
    q, mu, kd = q.double(), mu.double(), kd.double()
    scale = kd.abs().amax(dim=(-2, -1)).clamp_min(torch.finfo(torch.float64).tiny)  # (n,)
    ks = kd / scale[:, None, None]
    rec = (_rebuild(q, mu / scale[:, None]) - ks).flatten(-2).norm(dim=-1) / ks.flatten(-2).norm(dim=-1).clamp_min(1)
    orth = (q.mT @ q - torch.eye(k.shape[-1], dtype=torch.float64)).flatten(-2).norm(dim=-1)
    return rec, orth


def _adversarial_spectra(h: int, n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Named families of ``(n, h)`` plane frequencies: exact ties of every multiplicity, near ties 1e-14 to 1e-2
    apart, clusters near zero, zero and rank-deficient blocks, graded spectra (12 decades), rounded (ties by chance)
    and random ones."""
    base = torch.rand(n, h, dtype=torch.float64, generator=g)
    out = {}
    for mult in range(2, h + 1):
        tied = base.clone()
        tied[:, :mult] = tied[:, :1]
        out[f"tie{mult}"] = tied
        for gap in (1e-14, 1e-12, 1e-10, 1e-8, 1e-6, 1e-4, 1e-2):
            out[f"near{mult}-{gap:g}"] = tied.clone().index_add_(
                1, torch.arange(mult), gap * torch.randn(n, mult, dtype=torch.float64, generator=g))
        two = base.clone()
        two[:, :mult], two[:, mult:] = 1.0, 0.25  # two exact clusters (one of h - mult planes)
        out[f"clusters{mult}"] = two
    for zeros in range(1, h + 1):
        z = base.clone()
        z[:, :zeros] = 0.0
        out[f"zero{zeros}"] = z  # rank b - 2 zeros; zero{h} is K = 0
    out["near-zero"] = torch.cat((base[:, :-1] * 1e-8, base[:, -1:]), dim=-1)
    out["graded"] = 10.0 ** (-12 * torch.rand(n, h, dtype=torch.float64, generator=g))
    out["rounded"] = torch.round(base * 3 + 0.2) / 3
    out["fourth-power"] = base ** 4
    return out


def _in_random_bases(mus: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``(n, 2h, 2h)`` skew matrices with the plane frequencies ``mus`` ``(n, h)``, each in its own random basis."""
    n, h = mus.shape
    q, _ = torch.linalg.qr(torch.randn(n, 2 * h, 2 * h, dtype=torch.float64, generator=g))
    d = torch.zeros(n, h, 2, h, 2, dtype=torch.float64)
    d[:, torch.arange(h), :, torch.arange(h), :] = mus.T[..., None, None] * J
    return q @ d.reshape(n, 2 * h, 2 * h) @ q.mT


@pytest.mark.parametrize("b", [6, 8])
def test_jacobi_path_reaches_round_off_on_every_spectrum(b):
    """Every adversarial family, each in many random bases (6 seeds x 40 draws), in float64 and float32: round-off
    in reconstruction and orthogonality, frequencies ascending. At main, three equal planes and one other (8x8)
    reconstructed to 4e-10, rounded spectra to 1e-11: the fixed sweeps converge only linearly at exact ties."""
    h = b // 2
    for seed in range(6):
        g = torch.Generator().manual_seed(100 * b + seed)
        fams = _adversarial_spectra(h, 40, g)
        names = [name for name, m in fams.items() for _ in range(m.shape[0])]
        k = _in_random_bases(torch.cat(list(fams.values())), g)  # one batch: every family, every draw
        for dtype, tol in ((torch.float64, 1e-14), (torch.float32, 4 * b ** 0.5 * torch.finfo(torch.float32).eps)):
            err = torch.maximum(*_relative_errors(k, dtype))
            bad = {names[i]: f"{float(err[i]):.1e}" for i in (~(err <= tol)).nonzero().flatten().tolist()}
            assert not bad, (seed, dtype, bad)


@pytest.mark.parametrize("b", [6, 8])
@pytest.mark.parametrize("norm", [1e-150, 1e-30, 1e30, 1e150])
def test_tiny_and_huge_norms(b, norm):
    """Spectra with ties, zeros and graded planes scaled by 1e-150 to 1e150 keep round-off relative to their
    largest entry, and their frequencies scale with them. At main 1e-150 gave a relative error of 1 (a fixed
    1e-150 in the closed 4x4 form outweighed the matrix) and ties at 1e-30 4e-10."""
    g = torch.Generator().manual_seed(b)
    mus = torch.cat([m for m in _adversarial_spectra(b // 2, 20, g).values()])
    k = _in_random_bases(mus, g)
    rec, orth = _relative_errors(k * norm)
    assert float(rec.max()) <= 1e-14 and float(orth.max()) <= 1e-14
    _, mu = skew_real_schur(k * norm)
    _, mu1 = skew_real_schur(k)
    assert torch.allclose(mu / norm, mu1, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("b", [10, 12, 16])
def test_eigensolver_path_is_orthogonal_at_nearly_still_planes(b):
    """Blocks larger than 8x8 (the eigensolver path): planes ``(0, 1e-8, 2e-8, 1, 2) * 1e4`` (and ties, zeros,
    graded spectra) in many random bases give an orthogonal ``Q`` and ``K`` back to round-off. At main the first
    gave ``|Q^T Q - I| = 2e-8``."""
    h = b // 2
    g = torch.Generator().manual_seed(b)
    special = torch.tensor([0.0, 1e-8, 2e-8, 1.0, 2.0] + [1.5] * (h - 5), dtype=torch.float64) * 1e4
    fams = [special.expand(30, h)]
    fams += [m[:10] for m in _adversarial_spectra(h, 10, g).values() if not m.isnan().any()]
    k = _in_random_bases(torch.cat(fams), g)
    rec, orth = _relative_errors(k)
    tol = 1e-14 * b / 8  # the same c b eps as the 8x8 bound
    assert float(orth.max()) <= tol and float(rec.max()) <= tol, (float(orth.max()), float(rec.max()))
    rec32, orth32 = _relative_errors(k, torch.float32)
    assert float(rec32.max()) <= 4 * b ** 0.5 * torch.finfo(torch.float32).eps
    assert float(orth32.max()) <= 4 * b ** 0.5 * torch.finfo(torch.float32).eps
