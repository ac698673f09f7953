"""Cayley's hand-written backward (``skew.cayley_from_free``) in float32 against float64 on the same parameters,
compared with plain autograd through ``torch.linalg.solve``: no worse at any ``|S|_F``.

For large ``S`` the rotation ``P = (I - S)(I + S)^-1`` is near ``-I``; a backward written through
``(I + S)^-1 = (I + P) / 2`` cancels there (at main: 2e-4 from float64 at ``|S|_F = 1e3`` for 8x8, where autograd
through the solve gives 1.7e-4; 1e-3 against 6e-4 at 1e4). The backward through the LU factors of ``I + S`` keeps
a solve's error. The bound asserted: the worst relative gradient error over seeds and batch is at most that of
autograd through the solve plus ``8 eps_32`` (the rounding of the gradient itself).
"""

from __future__ import annotations

import pytest
import torch

from ropekit.encodings.ops.skew import cayley_from_free, free_to_skew, num_free

pytestmark = pytest.mark.numerics


def _gradient(fn, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    v = v.clone().requires_grad_()
    (grad,) = torch.autograd.grad(fn(v), v, g.to(v.dtype))
    return grad.double()


@pytest.mark.parametrize("n", [8, 64])
@pytest.mark.parametrize("norm", [1e-3, 1.0, 1e2, 1e3, 1e4])
def test_cayley_fp32_gradient_no_worse_than_autograd_through_the_solve(n, norm):
    eps = torch.finfo(torch.float32).eps
    worst_custom = worst_autograd = 0.0
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        v = torch.randn(4, num_free(n), dtype=torch.float64, generator=gen)
        v = (v / free_to_skew(v, n).flatten(-2).norm(dim=-1, keepdim=True) * norm).float()  # |S|_F = norm
        g = torch.randn(4, n, n, dtype=torch.float64, generator=gen)
        ref = _gradient(lambda t: cayley_from_free(t, n), v.double(), g)  # float64, the same parameters
        eye = torch.eye(n)

        def through_solve(t):
            s = free_to_skew(t, n)
            return torch.linalg.solve(eye + s, eye - s)

        den = ref.norm(dim=-1)
        custom = (_gradient(lambda t: cayley_from_free(t, n), v, g) - ref).norm(dim=-1) / den
        autograd = (_gradient(through_solve, v, g) - ref).norm(dim=-1) / den
        worst_custom, worst_autograd = max(worst_custom, float(custom.max())), max(worst_autograd, float(autograd.max()))
    assert worst_custom <= worst_autograd + 8 * eps, (worst_custom, worst_autograd)
