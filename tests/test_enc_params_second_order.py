"""Second derivatives of the encodings with hand-written backward passes: exact (gradgradcheck, float64)."""

from __future__ import annotations

import pytest
import torch

from ropekit import create_pe

CASES = {
    "comrope-ap": {"block_size": 4},
    "comrope-ld": {"block_size": 4},
    "liere": {"block_size": 4, "init_scale": 1.0},
    "cayley": {},
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("per_example", [False, True], ids=["shared", "per_example"])
def test_gradgradcheck_parameters_and_input(name, per_example):
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=8, coord_dim=2, num_heads=1, **CASES[name]).double()
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    names = [n for n, _ in pe.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in pe.named_parameters()]
    x = torch.randn(2, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    shape = (2, 3, 2) if per_example else (3, 2)
    coords = torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    def f(x_, c_, *ps):
        return torch.func.functional_call(pe, dict(zip(names, ps)), (x_, x_, c_))[0]

    assert torch.autograd.gradgradcheck(f, (x, coords, *params), fast_mode=True)


def test_comrope_hessian_vector_product_not_silently_zero():
    """A gradient penalty on ComRoPE's parameters must reach them (it silently did not before)."""
    torch.manual_seed(1)
    pe = create_pe("comrope-ld", head_dim=8, coord_dim=2, num_heads=1, block_size=4).double()
    x = torch.randn(2, 1, 5, 8, dtype=torch.float64)
    coords = torch.randn(5, 2, dtype=torch.float64)
    y = pe.rotate(x, coords)
    (g,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), pe.block_params, create_graph=True)
    g.square().sum().backward()
    assert pe.block_params.grad is not None and pe.block_params.grad.abs().sum() > 0
