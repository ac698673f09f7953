"""Angles and generator sums that do not depend on TF32, checked on the CPU with an emulated TF32 product.

On a GPU with TF32 matmuls enabled, every float32 matmul / einsum rounds its inputs to a 10-bit mantissa, so
angles ``r . w`` formed by a product are off by ~1e-3 relative at grid coordinates. Here ``torch.einsum``,
``torch.matmul``, ``torch.bmm`` and ``@`` are replaced by versions that round float32 inputs the way TF32 does
(nearest, 10 explicit mantissa bits; gradients pass straight through), and the float32 results are compared with
float64 ones (which the emulation leaves alone). The tensor-product STRING's features and ComRoPE-LD's block
scales were einsums and are now elementwise; the tests fail with the einsum forms.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from ropekit import create_pe
from ropekit.encodings.string import dense_expm_rotations

B, H, D, G = 2, 2, 24, 14
TOL = 1e-5


def _tf32(t):
    """float32 ``t`` rounded to TF32 (nearest); other dtypes and non-tensors unchanged; straight-through grad."""
    if not isinstance(t, Tensor) or t.dtype != torch.float32:
        return t
    bits = t.detach().contiguous().view(torch.int32)
    r = ((bits + 0x1000) & -8192).view(torch.float32)
    return t + (r - t).detach()


@pytest.fixture
def emulated_tf32(monkeypatch):
    einsum, matmul, bmm, tmatmul = torch.einsum, torch.matmul, torch.bmm, torch.Tensor.__matmul__

    def fake_einsum(eq, *ops):
        ops = tuple(ops[0]) if len(ops) == 1 and isinstance(ops[0], (list, tuple)) else ops
        return einsum(eq, *(_tf32(o) for o in ops))

    monkeypatch.setattr(torch, "einsum", fake_einsum)
    monkeypatch.setattr(torch, "matmul", lambda a, b, **kw: matmul(_tf32(a), _tf32(b), **kw))
    monkeypatch.setattr(torch, "bmm", lambda a, b, **kw: bmm(_tf32(a), _tf32(b), **kw))
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: tmatmul(_tf32(a), _tf32(b)))


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _coords(c: int, per_example: bool) -> Tensor:
    """A 14 x 14 grid of patch indices, plus a random depth in [0, 13] per example for ``c = 3``."""
    ys, xs = torch.meshgrid(torch.arange(G, dtype=torch.float64), torch.arange(G, dtype=torch.float64), indexing="ij")
    grid = torch.stack((ys, xs), -1).reshape(G * G, 2)
    if not per_example:
        return grid
    depth = torch.rand(B, G * G, c - 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * (G - 1)
    return torch.cat((grid.expand(B, -1, -1), depth), -1)


def test_emulation_rounds_like_tf32(emulated_tf32):
    """The emulated product is ~1e-3 off where the inputs are not TF32-exact (else the tests below prove nothing)."""
    coords = _coords(2, False).float()
    w = torch.rand(2, 8, generator=torch.Generator().manual_seed(0)) * 3
    plain = torch.einsum("mc,cp->mp", coords, w)
    assert _rel(plain, coords.double() @ w.double()) > 1e-4


@pytest.mark.parametrize("per_example", [False, True], ids=["grid2d", "rgbd3d"])
def test_tensor_string_fp32_matches_float64(emulated_tf32, per_example):
    """Whole forward and backward: no product touches the angles or the widened q and k."""
    c = 3 if per_example else 2
    torch.manual_seed(0)
    pe = create_pe("tensor", head_dim=D, coord_dim=c, num_heads=H)
    coords = _coords(c, per_example)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 1 + G * G, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, 1 + G * G, D, generator=gen, dtype=torch.float64)
    w = torch.randn(B, H, 1 + G * G, pe.out_dim, generator=gen, dtype=torch.float64)
    outs = []
    for dt in (torch.float64, torch.float32):
        mod = copy.deepcopy(pe).to(dt)
        qq, kk = (t.to(dt).detach().clone().requires_grad_() for t in (q, k))
        qe, ke = mod(qq, kk, coords.to(dt), num_prefix_tokens=1)
        ((qe * w.to(dt)).sum() + (ke * w.to(dt).flip(-2)).sum()).backward()
        outs.append([qe, ke, qq.grad, kk.grad, mod.feature_freqs.grad])
    errs = [_rel(a, b) for a, b in zip(outs[1], outs[0])]
    assert max(errs) <= TOL, errs


@pytest.mark.parametrize("per_example", [False, True], ids=["grid2d", "rgbd3d"])
def test_comrope_ld_block_scales_fp32_match_float64(emulated_tf32, per_example):
    """``s_j(r) = sum_k r_k lambda_kj`` and its gradients (axis weights, coordinates) at float32 round-off."""
    c = 3 if per_example else 2
    torch.manual_seed(0)
    pe = create_pe("comrope-ld", head_dim=D, coord_dim=c, num_heads=H, block_size=4, init="normal")
    coords = _coords(c, per_example)
    outs = []
    for dt in (torch.float64, torch.float32):
        mod = copy.deepcopy(pe).to(dt)
        r = coords.to(dt).detach().clone().requires_grad_()
        s = mod.block_scales(r)
        g = torch.randn(s.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dt)
        (s * g).sum().backward()
        outs.append([s, r.grad, mod.axis_weights.grad])
    errs = [_rel(a, b) for a, b in zip(outs[1], outs[0])]
    assert max(errs) <= 1e-6, errs


def test_comrope_ld_forward_with_tf32_einsum(monkeypatch):
    """The whole ComRoPE-LD forward and backward with einsum in TF32 (the product its scales used): float32
    within 1e-5 of float64."""
    einsum = torch.einsum
    monkeypatch.setattr(torch, "einsum", lambda eq, *ops: einsum(eq, *(_tf32(o) for o in ops)))
    torch.manual_seed(0)
    pe = create_pe("comrope-ld", head_dim=D, coord_dim=3, num_heads=H, block_size=4, init="normal")
    with torch.no_grad():
        pe.block_params.mul_(1.0 / G)  # the authors' init, scaled for integer grid coordinates
    coords = _coords(3, True)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 1 + G * G, D, generator=gen, dtype=torch.float64)
    w = torch.randn(B, H, 1 + G * G, D, generator=gen, dtype=torch.float64)
    outs = []
    for dt in (torch.float64, torch.float32):
        mod = copy.deepcopy(pe).to(dt)
        qq = q.to(dt).detach().clone().requires_grad_()
        qe, ke = mod(qq, qq, coords.to(dt), num_prefix_tokens=1)
        ((qe * w.to(dt)).sum() + (ke * w.to(dt).flip(-2)).sum()).backward()
        outs.append([qe, qq.grad, mod.axis_weights.grad, mod.block_params.grad])
    errs = [_rel(a, b) for a, b in zip(outs[1], outs[0])]
    assert max(errs) <= TOL, errs


def test_string_generators_and_dense_reference(emulated_tf32):
    """General STRING's generators ``Q L_k Q^T`` and the dense reference's sum ``sum_k r_k L_k``."""
    torch.manual_seed(0)
    pe = create_pe("string", head_dim=8, coord_dim=2, num_heads=1)
    gen32 = pe.generators()
    gen64 = copy.deepcopy(pe).double().generators()
    assert gen32.dtype == torch.float32 and _rel(gen32, gen64) <= 1e-6
    coords = _coords(2, False)[:20]
    rot32 = dense_expm_rotations(coords.float(), gen64.float())
    rot64 = dense_expm_rotations(coords, gen64)
    assert _rel(rot32, rot64) <= 1e-5
