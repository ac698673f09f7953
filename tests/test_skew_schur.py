"""The real Schur form of skew matrices (``skew.skew_real_schur``: closed form for 4x4 blocks, block Jacobi sweeps
for 6x6 and 8x8 ones, eigendecompositions beyond) against the definition, on random, tied, zero and graded
spectra."""

from __future__ import annotations

import pytest
import torch

from ropekit.encodings.skew import skew_real_schur

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
