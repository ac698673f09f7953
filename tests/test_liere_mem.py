"""Per-example LieRE keeps only its rotations for the backward pass (the eigenbases are recomputed there), with
gradients equal to keeping them (to round-off); the shared-grid path keeps them, bit for bit as before."""

from __future__ import annotations

import pytest
import torch

from ropekit import create_pe
from ropekit.bench.measure import saved_memory_mb
from ropekit.encodings.ops.expm import linear_skew_expm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recompute_equals_keeping_the_eigenbases(dtype):
    torch.manual_seed(0)
    pe = create_pe("liere", head_dim=16, coord_dim=3, num_heads=2, per_head=True)  # Hp = 2: several heads
    gen = pe.block_generators().detach().to(dtype).requires_grad_()
    coords = torch.rand(2 * 9, 3, dtype=dtype) * 13
    coords[0] = 0  # G = 0: one eigenvalue of multiplicity n (the divided differences at equal eigenvalues)
    coords[1] = coords[2] * 2  # the same generator direction at twice the scale
    coords.requires_grad_()
    w = torch.randn(18, 2, 1, 16, 16, dtype=dtype)
    outs, grads = [], []
    for recompute in (False, True):
        for budget in (256 * 5, 1 << 30):  # several chunks (5 tokens each) and one
            r = linear_skew_expm(coords, gen, budget, recompute=recompute)
            outs.append(r.detach())
            grads.append(torch.autograd.grad((r * w).sum(), (coords, gen)))
    for o in outs[1:]:
        assert torch.equal(o, outs[0]) or (o - outs[0]).abs().max() < 1e-13  # chunking: same up to round-off
    assert torch.equal(outs[2], outs[0]) and torch.equal(outs[3], outs[1])  # the forward pass is the same
    close = 1e-6 if dtype == torch.float32 else 1e-12  # kept complex64 eigenbasis vs recomputed complex128 one
    for a, b in ((grads[2], grads[0]), (grads[3], grads[1]), (grads[2], grads[3])):
        assert all((x - y).abs().max() <= close * y.abs().max() for x, y in zip(a, b))
    # and right: against a float64 matrix_exp per token
    with torch.enable_grad():
        c64, g64 = coords.detach().double().requires_grad_(), gen.detach().double().requires_grad_()
        ref = torch.linalg.matrix_exp(torch.einsum("tc,hcnij->thnij", c64, g64))
        gref = torch.autograd.grad((ref * w.double()).sum(), (c64, g64))
    tol = 1e-5 if dtype == torch.float32 else 1e-9
    assert (outs[2].double() - ref).abs().max() < tol
    for x, y in zip(grads[2], gref):
        assert (x.double() - y).abs().max() <= tol * y.abs().max()


def test_recompute_second_derivatives_stay_exact():
    torch.manual_seed(1)
    pe = create_pe("liere", head_dim=4, coord_dim=2, num_heads=1, init_scale=1.0)
    gen = pe.block_generators().detach().double().requires_grad_()
    coords = torch.rand(3, 2, dtype=torch.float64)
    w = torch.randn(3, 1, 1, 4, 4, dtype=torch.float64)

    def hvp(fn):
        g, = torch.autograd.grad((fn(coords, gen) * w).sum(), gen, create_graph=True)
        return torch.autograd.grad(g.square().sum(), gen)[0]

    ref = hvp(lambda c, g: torch.linalg.matrix_exp(torch.einsum("tc,hcnij->thnij", c, g)))
    got = hvp(lambda c, g: linear_skew_expm(c, g, recompute=True))
    assert (got - ref).abs().max() <= 1e-10 * ref.abs().max()


def _saved_bytes(pe, q, k, coords):
    return saved_memory_mb(lambda: pe(q, k, coords), [q, k, coords, *pe.parameters()]) * 2 ** 20


def test_per_example_liere_saves_only_its_rotations():
    torch.manual_seed(2)
    b, h, m, d = 2, 4, 9, 16
    pe = create_pe("liere", head_dim=d, coord_dim=3, num_heads=h)
    q, k = torch.randn(b, h, m, d, requires_grad=True), torch.randn(b, h, m, d, requires_grad=True)
    rot_bytes = b * m * d * d * 4  # one float32 d x d rotation per example and token (generators shared by heads)
    per_example = torch.rand(b, m, 3) * 13
    gen_bytes = 3 * d * d * 4  # the skew generators formed from the parameters (kept to recompute)
    assert _saved_bytes(pe, q, k, per_example) <= rot_bytes + gen_bytes  # no eigenbasis (8 bytes per entry) kept
    # the shared grid keeps its eigenbases (fast backward; M exponentials only): unchanged
    assert _saved_bytes(pe, q, k, per_example[0]) >= 2 * m * d * d * 4


def test_grid_path_unchanged_and_per_example_path_agrees():
    """The shared grid still goes through the default chunks with kept eigenbases (bit for bit), and the same
    coordinates given per example (recomputed eigenbases, small chunks) give the same values and gradients."""
    from ropekit.encodings.ops.blocks import block_apply

    torch.manual_seed(3)
    h, m, d = 2, 30, 16
    pe = create_pe("liere", head_dim=d, coord_dim=3, num_heads=h, block_size=8)
    coords = torch.rand(m, 3) * 13
    x = torch.randn(1, h, m, d)
    results = []
    for mode in ("grid", "manual", "per-example"):
        xi = x.clone().requires_grad_()
        if mode == "manual":  # what the grid path did before per-example recomputation existed
            rot = linear_skew_expm(coords, pe.block_generators())  # (M, Hp, nb, b, b)
            y = block_apply(rot.unsqueeze(0).transpose(1, 2).contiguous(), xi)
        else:
            y = pe.apply_one(xi, pe.prepare(coords if mode == "grid" else coords[None]))
        w = torch.randn_like(y, generator=torch.Generator().manual_seed(4))
        grads = torch.autograd.grad((y * w).sum(), (xi, pe.generator_params))
        results.append((y.detach(), *grads))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    for a, b in zip(results[0], results[2]):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
