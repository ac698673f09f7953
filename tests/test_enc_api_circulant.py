"""Circulant-STRING in real arithmetic: dense reference, second derivatives, torch.compile, differentiable RoPE form."""

import pytest
import scipy.linalg
import torch

from ropekit.encodings import create_pe
from ropekit.encodings.circulant import real_dft_basis


def _dense_reference(cols, coords):
    """``expm(sum_k r_k L_k)``, ``L_k`` block-circulant minus its transpose, built with scipy: ``(M, d, d)``."""
    c, nb, b = cols.shape
    gens = []
    for k in range(c):
        blocks = []
        for j in range(nb):
            cm = torch.from_numpy(scipy.linalg.circulant(cols[k, j].numpy()))
            blocks.append(cm - cm.T)
        gens.append(torch.block_diag(*blocks))
    gen = torch.stack(gens)  # (c, d, d)
    return torch.linalg.matrix_exp(torch.einsum("mc,cij->mij", coords, gen))


@pytest.mark.parametrize("block_size", [3, 5, 4, 8])
def test_real_basis_matches_dense_expm(block_size):
    torch.manual_seed(0)
    d = 2 * block_size if block_size % 2 else 16
    pe = create_pe("circulant", head_dim=d, coord_dim=2, block_size=block_size).double()
    with torch.no_grad():
        pe.circ_params.normal_()
    coords = torch.randn(4, 2, dtype=torch.float64) * 3
    want = _dense_reference(pe.circ_params.detach()[0], coords)
    torch.testing.assert_close(pe.matrix(coords)[0], want, rtol=0, atol=1e-11)
    q, s = real_dft_basis(block_size)
    torch.testing.assert_close(q @ q.T, torch.eye(block_size, dtype=torch.float64), rtol=0, atol=1e-14)
    # the mode frequencies are 2 Im(rfft(c)) (independent check with the FFT)
    lam = 2 * torch.fft.rfft(pe.circ_params.detach(), dim=-1).imag[..., 1:1 + (block_size - 1) // 2]
    torch.testing.assert_close(pe.mode_frequencies(), lam, rtol=0, atol=1e-12)


def test_second_derivatives():
    torch.manual_seed(0)
    pe = create_pe("circulant", head_dim=8, coord_dim=2, block_size=4).double()
    x = torch.randn(1, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    coords = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    params = pe.circ_params.detach().clone().requires_grad_(True)

    def fn(x_, c_, p_):
        return torch.func.functional_call(pe, {"circ_params": p_}, (x_, x_, c_))[0]

    assert torch.autograd.gradgradcheck(fn, (x, coords, params))


def test_to_rope_is_exact_and_differentiable():
    torch.manual_seed(0)
    pe = create_pe("circulant", head_dim=12, coord_dim=2, num_heads=2, block_size=6).double()
    with torch.no_grad():
        pe.circ_params.normal_()
    p, freqs = pe.to_rope()
    coords = torch.randn(3, 2, dtype=torch.float64)
    theta = torch.einsum("mc,hcn->hmn", coords, freqs.detach())
    rope = torch.zeros(2, 3, 12, 12, dtype=torch.float64)
    idx = torch.arange(6)
    rope[..., 2 * idx, 2 * idx] = theta.cos()
    rope[..., 2 * idx + 1, 2 * idx + 1] = theta.cos()
    rope[..., 2 * idx, 2 * idx + 1] = -theta.sin()
    rope[..., 2 * idx + 1, 2 * idx] = theta.sin()
    want = p.detach().transpose(-1, -2).unsqueeze(1) @ rope @ p.detach().unsqueeze(1)
    torch.testing.assert_close(pe.matrix(coords), want, rtol=0, atol=1e-11)
    freqs.sum().backward()
    assert pe.circ_params.grad is not None and pe.circ_params.grad.abs().sum() > 0


def test_buffers_rebuilt_exactly_on_dtype_change():
    pe = create_pe("circulant", head_dim=16, coord_dim=2, block_size=16).double()
    q = pe.dft_basis
    assert q.dtype == torch.float64
    torch.testing.assert_close(q @ q.T, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-14)
    assert "dft_basis" not in pe.state_dict()


def test_torch_compile_inductor_matches_eager():
    torch.manual_seed(0)
    pe = create_pe("circulant", head_dim=8, coord_dim=2, num_heads=2, block_size=8)
    q = torch.randn(2, 2, 5, 8, requires_grad=True)
    k = torch.randn(2, 2, 5, 8, requires_grad=True)
    coords = torch.randn(4, 2)

    def step(mod):
        qe, ke = mod(q, k, coords, num_prefix_tokens=1)
        loss = (qe * ke).sum()
        grads = torch.autograd.grad(loss, [q, k, pe.circ_params])
        return qe.detach(), grads

    eager_out, eager_grads = step(pe)
    compiled = torch.compile(pe, backend="inductor", fullgraph=True)
    comp_out, comp_grads = step(compiled)
    torch.testing.assert_close(comp_out, eager_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(comp_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
