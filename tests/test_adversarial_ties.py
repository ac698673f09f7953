"""Coinciding and nearly coinciding frequencies, first and second derivatives, on every execution path.

The folded training path (``ropekit.nn.Attention(fold=True)``, the ViT's default) writes a commuting encoding as
RoPE in a basis. For ComRoPE (and one-axis LieRE) that basis is the eigenbasis of each skew block, which has no
derivative where two frequencies of a block coincide -- at ``K = 0``, and wherever training moves the parameters
through a tie. Every test here compares a path with an independent float64 reference: attention written out
densely, each token rotated by ``torch.linalg.matrix_exp`` of its generator (whose own backward is the exact
Frechet derivative), softmax by hand.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ropekit
from ropekit.encodings.ops.skew import full_to_free
from ropekit.nn import Attention, VisionTransformer, vit_config

J = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)


def _dense_attention(att: Attention, x: torch.Tensor, coords: torch.Tensor, p0: int) -> torch.Tensor:
    """``att(x, coords, p0)`` in float64 from the encoding's generators: ``R(r) = expm(sum_k r_k L_k)`` per token
    (Cayley-STRING: ``P expm(...)``, relaxed STRING: ``expm(...) P_sp``), prefix tokens unrotated, softmax attention
    written out."""
    pe = att.pe
    b, n, dim = x.shape
    h, d = att.num_heads, att.head_dim
    qkv = (x @ att.qkv.weight.T + att.qkv.bias).reshape(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # (B, H, N, d)
    gen = torch.einsum("mc,hcij->hmij", coords, pe.generators())  # (H, M, d, d)
    rot = torch.linalg.matrix_exp(gen.contiguous())
    post = pe.post_rotation_matrix()
    if post is not None and pe.name == "relaxed":  # relaxed STRING: R(r) = R_STR(r) P_sp
        rot = rot @ post.unsqueeze(1)
    elif post is not None:  # Cayley-STRING: R(r) = P R_STR(r)
        rot = post.unsqueeze(1) @ rot

    def encode(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t[:, :, :p0], torch.einsum("hmij,bhmj->bhmi", rot, t[:, :, p0:])), dim=2)

    q, k = encode(q), encode(k)
    attn = torch.softmax(q @ k.transpose(-1, -2) * att.scale, dim=-1)
    out = (attn @ v).transpose(1, 2).reshape(b, n, dim)
    return att.proj(out)


def _set_blocks(pe, gaps: list, scale: float = 0.5, seed: int = 0) -> None:
    """Give every skew block the frequencies ``scale * (1, 1 + gap_1, 1 + gap_2, ...)`` (a tie at gap 0; ``None``:
    a zero frequency; planes left over get distinct ones) in a random orthogonal basis."""
    g = torch.Generator().manual_seed(seed)
    b = pe.block_size
    mus = [scale * (0.0 if gap is None else 1.0 + gap) for gap in [0.0] + gaps][: b // 2]
    mus += [scale * (3.0 + i) for i in range(b // 2 - len(mus))]
    d = torch.block_diag(*[mu * J for mu in mus])
    blocks = []
    for _ in range(pe.block_params.shape[0] * pe.block_params.shape[1]):
        q, _ = torch.linalg.qr(torch.randn(b, b, dtype=torch.float64, generator=g))
        blocks.append(q @ d @ q.T)
    k = torch.stack(blocks).view(*pe.block_params.shape[:2], b, b)
    with torch.no_grad():
        pe.block_params.copy_(full_to_free(torch.triu(k, 1)).to(pe.block_params.dtype))


def _grads(m, x, coords, p0, forward=None):
    forward = forward or (lambda: m(x, coords, p0))
    out = forward()
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
    names = [n for n, p in m.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in m.named_parameters()] + [x])
    return out.detach(), dict(zip(names + ["x"], grads))


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


BLOCK_CASES = [("comrope-ld", {"block_size": 4}), ("comrope-ap", {"block_size": 4}),
               ("comrope-ld", {"block_size": 8, "per_head": True})]
GAPS = {"tie": [0.0], "gap1e-6": [1e-6], "gap1e-5": [1e-5], "tie+zero": [0.0, None, None],
        "triple": [0.0, 0.0, 1.0]}


@pytest.mark.parametrize("name,opts", BLOCK_CASES, ids=str)
@pytest.mark.parametrize("gaps", list(GAPS), ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_folded_comrope_gradients_at_coinciding_frequencies(name, opts, gaps, dtype):
    """The folded path's values and gradients (encoding, projections, input) equal the dense float64 reference
    where the frequencies of a block coincide or nearly do (at main: relative error 0.2-0.9)."""
    torch.manual_seed(0)
    pe = ropekit.create_pe(name, head_dim=8 * (2 if opts["block_size"] == 8 else 1), coord_dim=2, num_heads=2,
                           **opts).to(dtype)
    _set_blocks(pe, GAPS[gaps])
    dim = 2 * pe.head_dim
    att = Attention(dim, 2, pe, fold=True).to(dtype)
    assert att.folds
    ref = copy.deepcopy(att).double()
    x = torch.randn(2, 6, dim, dtype=dtype, requires_grad=True)
    coords = torch.randn(5, 2, dtype=dtype) * 3
    out, g = _grads(att, x, coords, 1)
    xr = x.detach().double().requires_grad_()
    want, g_ref = _grads(ref, xr, coords.double(), 1, lambda: _dense_attention(ref, xr, coords.double(), 1))
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    assert _rel(out, want) < tol
    for n in g_ref:
        assert _rel(g[n], g_ref[n]) < tol, n


def test_folded_one_axis_liere_gradients_at_a_tie():
    """One-coordinate LieRE with blocks of 4 folds through the same eigenbasis: exact at a tie too."""
    torch.manual_seed(1)
    pe = ropekit.create_pe("liere", head_dim=8, coord_dim=1, num_heads=2, block_size=4).double()
    b = 4
    q, _ = torch.linalg.qr(torch.randn(b, b, dtype=torch.float64))
    k = q @ torch.block_diag(0.7 * J, 0.7 * J) @ q.T
    with torch.no_grad():  # LieRE's parameters: A with L = triu(A, 1) - triu(A, 1)^T
        a = pe.generator_params
        a.zero_()
        a[..., :, :] = torch.triu(k, 1).expand_as(a)
    att = Attention(16, 2, pe, fold=True).double()
    assert att.folds
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    coords = torch.randn(5, 1, dtype=torch.float64) * 2
    out, g = _grads(att, x, coords, 0)
    want, g_ref = _grads(att, x, coords, 0, lambda: _dense_attention(att, x, coords, 0))
    assert _rel(out, want) < 1e-10
    for n in g_ref:
        assert _rel(g[n], g_ref[n]) < 1e-10, n


@pytest.mark.parametrize("name", ["comrope-ld", "comrope-ap"])
def test_vit_with_zero_initialised_comrope_folds_exactly(name):
    """``init="zero"`` (every block at ``K = 0``, all frequencies tied at zero) no longer needs the per-token path:
    the ViT folds it and its gradients equal the unfolded model's (at main it was kept unfolded)."""
    torch.manual_seed(0)
    cfg = vit_config("tiny", num_classes=3, in_chans=1, image_size=(8, 8), patch_size=4, depth=2, embed_dim=32,
                     num_heads=2, pe=name, pe_options={"init": "zero", "block_size": 4})
    model = VisionTransformer(cfg).double()
    assert all(blk.attn.folds for blk in model.blocks)
    ref = copy.deepcopy(model)
    for blk in ref.blocks:
        blk.attn.fold = False
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    grads = []
    for m in (model, ref):
        out = m(x)
        grads.append(torch.autograd.grad((out * torch.arange(out.numel()).view_as(out)).sum(), list(m.parameters())))
    for a, b in zip(*grads):
        assert _rel(a, b) < 1e-10 or float(b.norm()) == float(a.norm()) == 0.0


def _hvp(m, x, coords, p0, forward):
    """Hessian-vector product of a scalar loss with respect to the encoding's and the projection's parameters."""
    params = list(m.pe.parameters()) + [m.qkv.weight]
    out = forward()
    loss = (out.square() * torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype, device=out.device).view_as(out)).sum()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    g = torch.Generator().manual_seed(7)
    vs = [torch.randn(p.shape, dtype=torch.float64, generator=g).to(p) for p in params]  # same draws in any dtype
    return torch.autograd.grad(sum((gi * v).sum() for gi, v in zip(grads, vs)), params)


ROTATIONS = [("axial", {"learnable_freqs": True}), ("mixed", {}), ("cayley", {}), ("circulant", {"block_size": 4}),
             ("string", {}), ("liere", {}), ("liere", {"block_size": 4}), ("liere-commute", {}),
             ("comrope-ld", {"block_size": 4}), ("comrope-ap", {"block_size": 4}), ("relaxed", {}),
             ("relaxed", {"exact": True}), ("none", {})]


def _paths() -> list:
    """``(name, opts, fold)``: every rotation unfolded, and folded where it commutes (the others have no folded
    path: ``nn.Attention`` takes the unfolded one for them, covered by ``fold=False``)."""
    from ropekit.fold import foldable_kind

    out = []
    for name, opts in ROTATIONS:
        pe = ropekit.create_pe(name, head_dim=8, coord_dim=2, num_heads=2, **opts)
        folds = [True, False] if foldable_kind(pe) is not None else [False]
        out += [pytest.param(name, opts, f, id=f"{'folded' if f else 'unfolded'}-{name}-{opts}") for f in folds]
    return out


PATHS = _paths()


def test_every_rotation_is_covered():
    """Every registered encoding but the tensor product (not a rotation: no dense ``R(r)`` to compare with)."""
    assert {n for n, _ in ROTATIONS} == set(ropekit.list_pes()) - {"tensor"}


def _tied_layer(name: str, opts: dict, fold: bool) -> tuple:
    """A float64 layer with parameters off their init (ComRoPE: tied frequencies in every block) and coordinates
    that include the origin twice -- where every token generator is zero, so all its eigenvalues coincide."""
    torch.manual_seed(0)
    pe = ropekit.create_pe(name, head_dim=8, coord_dim=2, num_heads=2, **opts).double()
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.3 * torch.randn_like(p))
    if name.startswith("comrope"):
        _set_blocks(pe, [0.0])
    att = Attention(16, 2, pe, fold=fold).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    coords = torch.cat((torch.zeros(2, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64) * 2))
    return att, x, coords


@pytest.mark.parametrize("name,opts,fold", PATHS)
def test_attention_first_derivatives(name, opts, fold):
    """Every rotation on both attention paths: values and gradients (encoding, projections, input) equal the
    dense reference's, at the origin and at ties."""
    att, x, coords = _tied_layer(name, opts, fold)
    assert att.folds == fold
    x.requires_grad_()
    out, g = _grads(att, x, coords, 1)
    want, g_ref = _grads(att, x, coords, 1, lambda: _dense_attention(att, x, coords, 1))
    assert _rel(out, want) < 1e-12
    for n in g_ref:
        assert _rel(g[n], g_ref[n]) < 1e-10, n


@pytest.mark.parametrize("name,opts,fold", PATHS)
def test_attention_second_derivatives(name, opts, fold):
    """Hessian-vector products through ``nn.Attention`` (folded and per-token) equal the dense reference's, at the
    origin and at ties (at main: PyTorch's fused CPU attention kernel has no double backward, so this raised)."""
    att, x, coords = _tied_layer(name, opts, fold)
    assert att.folds == fold
    got = _hvp(att, x, coords, 1, lambda: att(x, coords, 1))
    want = _hvp(att, x, coords, 1, lambda: _dense_attention(att, x, coords, 1))
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-9


def test_attention_second_derivatives_with_respect_to_the_input():
    """A gradient penalty on the input (``d/dtheta |d loss / dx|^2``) through the default folded ViT layer."""
    torch.manual_seed(0)
    pe = ropekit.create_pe("cayley", head_dim=8, coord_dim=2, num_heads=2).double()
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.3 * torch.randn_like(p))
    att = Attention(16, 2, pe).double()
    coords = torch.randn(5, 2, dtype=torch.float64)

    def penalty(forward):
        x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
        gx, = torch.autograd.grad(forward(x).square().sum(), x, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), list(att.parameters()))

    got = penalty(lambda x: att(x, coords))
    want = penalty(lambda x: _dense_attention(att, x, coords, 0))
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-9


def test_first_order_attention_keeps_the_fused_kernel():
    """Without ``create_graph`` the attention's backward is the fused kernel's, recorded in the forward pass: no
    math-backend recomputation (the profiler sees no second attention forward)."""
    from torch.profiler import ProfilerActivity, profile

    att = Attention(16, 2, ropekit.create_pe("mixed", head_dim=8, coord_dim=2, num_heads=2))
    x, coords = torch.randn(2, 5, 16), torch.randn(5, 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        att(x, coords).sum().backward()
    names = [e.name for e in prof.events()]
    assert names.count("aten::scaled_dot_product_attention") == 1
    assert "aten::_scaled_dot_product_attention_math" not in names
    assert math.isfinite(float(att.qkv.weight.grad.sum()))


@pytest.mark.parametrize("small", [4e-9, 1e-11, 1e-14, 0.0])
def test_schur_form_keeps_small_frequencies(small):
    """``skew_real_schur`` reconstructs ``K`` to round-off also when a plane turns 1e-8 to 1e-11 times slower than
    the fastest (at main such planes were taken as still: an angle error of ``mu * s``, 4e-5 rad at ``s = 1e4``)."""
    from ropekit.encodings.ops.skew import skew_real_schur

    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64, generator=g))
    mus = torch.tensor([1.0, 0.3, small, 0.0], dtype=torch.float64)
    k = q @ torch.block_diag(*[m * J for m in mus]) @ q.T
    qs, mu = skew_real_schur(k)
    assert torch.allclose(qs.T @ qs, torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-14)
    rebuilt = qs @ torch.block_diag(*[m * J for m in mu]) @ qs.T
    assert float((rebuilt - k).abs().max()) < 2e-14
    assert torch.allclose(mu.sort().values, mus.sort().values, rtol=1e-4, atol=1e-13)
    for s in (1e3, 1e4):  # the block exponential at a large coordinate
        want = torch.linalg.matrix_exp(s * k)
        got = qs @ torch.linalg.matrix_exp(s * torch.block_diag(*[m * J for m in mu])) @ qs.T
        assert float((got - want).abs().max()) < 1e-9


@pytest.mark.parametrize("coord", [1e3, 1e4])
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "unfolded"])
def test_comrope_with_a_nearly_still_plane_at_large_coordinates(coord, fold):
    """A block with one plane 1e-8 times slower than the other, coordinates up to 1e4: both attention paths equal
    the dense float64 reference (at main the per-token path dropped the slow plane: ~1e-6 relative)."""
    torch.manual_seed(0)
    pe = ropekit.create_pe("comrope-ld", head_dim=8, coord_dim=2, num_heads=2, block_size=4).double()
    _set_blocks(pe, [-1.0 + 8e-9])  # frequencies 0.5 and 4e-9
    att = Attention(16, 2, pe, fold=fold).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    coords = torch.rand(5, 2, dtype=torch.float64) * coord
    assert _rel(att(x, coords), _dense_attention(att, x, coords, 0)) < 1e-10
