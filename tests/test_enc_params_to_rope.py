"""``to_rope()`` stays differentiable: training through ``P^T RoPE(s - r) P`` gives the encoding's own gradients."""

from __future__ import annotations

import pytest
import torch

from ropekit import create_pe
from ropekit.encodings.ops.rotation import rotate_pairs


def _folded_rotate(pe, x: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """``RoPE_freqs(r) P x`` from ``to_rope()``: equals ``R(r) x`` up to a left rotation shared by all tokens."""
    p, freqs = pe.to_rope()  # (H, d, d), (H, c, d/2)
    y = torch.einsum("hij,bhmj->bhmi", p, x)
    theta = torch.einsum("mc,hcp->hmp", coords, freqs)
    return rotate_pairs(y, torch.cos(theta), torch.sin(theta))


@pytest.mark.parametrize("name,opts", [("cayley", {}), ("cayley", {"band": 2}), ("comrope-ap", {"block_size": 4}),
                                       ("comrope-ld", {"block_size": 4}), ("string", {}),
                                       ("liere", {"block_size": 2}), ("relaxed", {"exact": True})], ids=str)
def test_logit_gradients_through_to_rope_equal_direct(name, opts):
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=8, coord_dim=2, num_heads=2, **opts).double()
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    q, k = torch.randn(2, 2, 6, 8, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64)
    coords = torch.randn(6, 2, dtype=torch.float64) * 2
    w = torch.randn(2, 2, 6, 6, dtype=torch.float64)

    def loss(fn):
        pe.zero_grad()
        qe, ke = fn(q), fn(k)
        out = ((qe @ ke.transpose(-1, -2)) * w).sum()
        out.backward()
        return float(out.detach()), {n: p.grad.clone() for n, p in pe.named_parameters()}

    direct, g_direct = loss(lambda x: pe.rotate(x, coords))
    folded, g_folded = loss(lambda x: _folded_rotate(pe, x, coords))
    assert abs(direct - folded) < 1e-9 * max(1.0, abs(direct))
    for n in g_direct:
        assert torch.allclose(g_folded[n], g_direct[n], atol=1e-8), n


def test_liere_one_axis_to_rope_differentiable():
    torch.manual_seed(3)
    pe = create_pe("liere", head_dim=8, coord_dim=1, num_heads=1, block_size=4, init_scale=1.0).double()
    x = torch.randn(2, 1, 5, 8, dtype=torch.float64)
    coords = torch.randn(5, 1, dtype=torch.float64)
    w = torch.randn(2, 1, 5, 5, dtype=torch.float64)
    grads = []
    for fn in (lambda t: pe.rotate(t, coords), lambda t: _folded_rotate(pe, t, coords)):
        pe.zero_grad()
        y = fn(x)
        ((y @ y.transpose(-1, -2)) * w).sum().backward()
        grads.append(pe.generator_params.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-8)


def test_non_commuting_to_rope_raises():
    for name, opts in (("liere", {"block_size": 4}), ("relaxed", {})):
        pe = create_pe(name, head_dim=8, coord_dim=2, **opts)
        with pytest.raises(ValueError, match="does not commute"):
            pe.to_rope()
