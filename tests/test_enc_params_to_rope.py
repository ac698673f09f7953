"""``to_rope()`` stays differentiable: training through ``P^T RoPE(s - r) P`` gives the encoding's own gradients."""

from __future__ import annotations

import pytest
import torch

from ropekit import create_pe
from ropekit.encodings.functional import rotate_pairs


def _folded_rotate(pe, x: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """``RoPE_freqs(r) P x`` from ``to_rope()``: equals ``R(r) x`` up to a left rotation shared by all tokens."""
    p, freqs = pe.to_rope()  # (H, d, d), (H, c, d/2)
    y = torch.einsum("hij,bhmj->bhmi", p, x)
    theta = torch.einsum("mc,hcp->hmp", coords, freqs)
    return rotate_pairs(y, torch.cos(theta), torch.sin(theta))


@pytest.mark.parametrize("name,opts", [("cayley", {}), ("cayley", {"band": 2}), ("comrope-ap", {"block_size": 4}),
                                       ("comrope-ld", {"block_size": 4}), ("string", {})], ids=str)
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
