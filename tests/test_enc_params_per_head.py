"""Every registered encoding built per head (H >= 2), against an independent float64 reference.

The reference for a rotation is the dense ``torch.linalg.matrix_exp(sum_k r_k L_k[h]) @ P[h]`` of each head's
generators (``P`` the post-rotation, identity where there is none), applied with an explicit einsum; prefix
tokens must pass through unchanged. The tensor-product encoding is checked against its closed-form logit
kernel. Shared ``(M, c)`` and per-example ``(B, M, c)`` coordinates, forward and backward.
"""

from __future__ import annotations

import pytest
import torch

from ropekit import create_pe, list_pes

H, D, C, B, M, P0 = 2, 8, 2, 2, 5, 1
OPTS = {  # small configurations that still exercise each encoding's structure; everything else as created
    "axial": {"learnable_freqs": True},
    "circulant": {"block_size": 4},
    "liere": {"block_size": 4},
    "comrope-ap": {"block_size": 4},
    "comrope-ld": {"block_size": 4},
}


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=D, coord_dim=C, num_heads=H, per_head=True, **OPTS.get(name, {}))
    with torch.no_grad():  # make the heads' parameters differ (some inits are identical across heads)
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return pe.double()


def _reference(pe, coords: torch.Tensor) -> torch.Tensor:
    """Dense float64 ``R`` per head and token: ``(H, M, d, d)`` or ``(B, H, M, d, d)``."""
    gen = pe.generators().detach().double()  # (H, c, d, d)
    post = pe.post_rotation_matrix()
    post = torch.eye(D, dtype=torch.float64).expand(H, D, D) if post is None else post.detach()
    g = torch.einsum("...mc,hcij->...hmij", coords, gen).contiguous()  # (B?, H, M, d, d)
    post = post.unsqueeze(1)  # (H, 1, d, d)
    if pe.name == "cayley":  # Cayley's generators are P^T J_k P: R(r) = P expm(sum_k r_k L_k)
        return post @ torch.linalg.matrix_exp(g)
    return torch.linalg.matrix_exp(g) @ post  # R(r) = R_STR(r) P


@pytest.mark.parametrize("name", list_pes())
@pytest.mark.parametrize("per_example", [False, True], ids=["shared", "per_example"])
def test_per_head_against_dense_reference(name, per_example):
    pe = _build(name)
    assert pe.num_heads == H
    q = torch.randn(B, H, M + P0, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, H, M + P0, D, dtype=torch.float64, requires_grad=True)
    coords = torch.rand(B, M, C, dtype=torch.float64) * 6 if per_example else torch.rand(M, C, dtype=torch.float64) * 6
    qe, ke = pe(q, k, coords, num_prefix_tokens=P0)

    if pe.is_rotation:
        r = _reference(pe, coords)
        r = r if per_example else r.unsqueeze(0)  # (B | 1, H, M, d, d)
        for x, xe in ((q, qe), (k, ke)):
            assert torch.equal(xe[:, :, :P0], x[:, :, :P0]), "prefix tokens must not be rotated"
            want = torch.einsum("bhmij,bhmj->bhmi", r.expand(B, -1, -1, -1, -1), x[:, :, P0:])
            assert torch.allclose(xe[:, :, P0:], want, atol=1e-9), (name, (xe[:, :, P0:] - want).abs().max())
        orth = r.transpose(-1, -2) @ r - torch.eye(D, dtype=torch.float64)
        assert orth.abs().max() < 1e-9
        if name not in ("none",) and any(p.requires_grad for p in pe.parameters()):
            assert (r[:, 0] - r[:, 1]).abs().max() > 1e-6, "per-head parameters must give per-head rotations"
        if pe.commuting:  # relative: R(r)^T R(s) = R(0)^T R(s - r), per head
            c2 = coords.flip(-2)
            r2 = _reference(pe, c2)
            r2 = r2 if per_example else r2.unsqueeze(0)
            rd = _reference(pe, c2 - coords)
            rd = rd if per_example else rd.unsqueeze(0)
            r0 = _reference(pe, torch.zeros(1, C, dtype=torch.float64))  # (H, 1, d, d)
            lhs = r.transpose(-1, -2) @ r2
            assert torch.allclose(lhs, r0.transpose(-1, -2) @ rd, atol=1e-9)
    else:  # tensor product: logits = (q^T k) * mean_i cos(w_i . (r_j - r_i)) per head
        logits = qe @ ke.transpose(-1, -2)  # (B, H, N, N)
        w = pe.feature_freqs.detach()  # (H, m, c)
        cb = coords if per_example else coords.expand(B, M, C)
        delta = cb[:, None, :, None, :] - cb[:, None, None, :, :]  # (B, 1, M, M, c): r_j - r_i
        kern = torch.cos(torch.einsum("bxijc,hfc->bhijf", delta, w)).mean(-1)  # (B, H, M, M)
        plain = (q @ k.transpose(-1, -2))[:, :, P0:, P0:]
        assert torch.allclose(logits[:, :, P0:, P0:], plain * kern, atol=1e-9)

    (qe.square().sum() + (qe * ke).sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    for pname, p in pe.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname
