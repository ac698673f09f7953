"""Core encodings against independent references (dense matrix exponentials, closed forms, classic RoPE).

Each reference below is rebuilt from the raw parameters with its own code (``scipy.linalg.circulant``,
explicit inverses, per-token ``torch.linalg.matrix_exp``, complex-number RoPE), never through the fast path
it checks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch

import ropekit
from ropekit import create_pe, diagnostics, list_pes
from ropekit.encodings.ops.frequencies import axial_frequencies

D = 16  # head dim for most tests
H = 2

# name -> options that make the configuration interesting in tests; commuting ones first
COMMUTING = {
    "none": {},
    "axial": {},
    "mixed": {},
    "cayley": {},
    "circulant": {"block_size": 8},
    "string": {},
    "liere-commute": {},
    "comrope-ap": {"block_size": 4},
    "comrope-ld": {"block_size": 4},
    "relaxed-exact": {"exact": True},
}
NON_COMMUTING = {"liere": {"block_size": 8}, "relaxed": {}}
ROTATIONS = {**COMMUTING, **NON_COMMUTING}
WITH_POST_ROTATION = {"cayley", "relaxed", "relaxed-exact"}


def make(key: str, coord_dim: int = 2, head_dim: int = D, num_heads: int = H, seed: int = 0, **extra):
    torch.manual_seed(seed)
    name = "relaxed" if key.startswith("relaxed") else key
    opts = {**ROTATIONS.get(key, {}), **extra}
    pe = create_pe(name, head_dim=head_dim, coord_dim=coord_dim, num_heads=num_heads, **opts)
    if name == "cayley":  # a non-trivial P (the default init is P = I)
        with torch.no_grad():
            pe.cayley_params.normal_(0, 0.3)
    if name in ("comrope-ap", "comrope-ld"):  # leave the RoPE init: random skew bases
        with torch.no_grad():
            pe.block_params.normal_(0, 0.5)
            if name == "comrope-ld":
                pe.axis_weights.normal_(0, 1.0)
    return pe


def coords_for(key: str, n: int, c: int, scale: float = 1.0, gen=None) -> torch.Tensor:
    """Random coordinates at the given scale (the same for every encoding: no per-encoding rescaling)."""
    return torch.randn(n, c, generator=gen) * scale


def _skew_from_upper(v: torch.Tensor, n: int) -> torch.Tensor:
    """``(..., n (n - 1) / 2)`` free entries in row-major upper-triangle order -> ``(..., n, n)`` skew matrices."""
    out = torch.zeros(*v.shape[:-1], n, n, dtype=v.dtype)
    k = 0
    for i in range(n):
        for j in range(i + 1, n):
            out[..., i, j], out[..., j, i] = v[..., k], -v[..., k]
            k += 1
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- registry
def test_registry_names_exact():
    assert list_pes() == ["none", "axial", "mixed", "cayley", "circulant", "tensor", "string", "liere",
                          "liere-commute", "comrope-ap", "comrope-ld", "relaxed"]


def test_unknown_name_lists_known():
    with pytest.raises(ValueError) as e:
        create_pe("rotary9000", head_dim=8, coord_dim=2)
    for n in list_pes():
        assert n in str(e.value)


def test_unknown_option_and_bad_config():
    with pytest.raises(ValueError, match="block_size"):
        create_pe("mixed", head_dim=8, coord_dim=2, block_size=4)
    with pytest.raises(ValueError, match="head_dim"):
        create_pe("axial", head_dim=7, coord_dim=2)
    with pytest.raises(ValueError, match="multiple of coord_dim"):
        create_pe("comrope-ap", head_dim=16, coord_dim=3, block_size=8)
    with pytest.raises(ValueError, match="block_size"):
        create_pe("circulant", head_dim=16, coord_dim=2, block_size=5)
    with pytest.raises(ValueError, match="block_size"):
        create_pe("liere", head_dim=16, coord_dim=2, block_size=3)


# ----------------------------------------------------------------------------- group properties
def _valid(keys, dims):
    """(key, c) pairs; comrope-ap needs d/b to be a multiple of c (3-D is covered with head_dim=24 below)."""
    return [(k, c) for k in keys for c in dims if not (k == "comrope-ap" and c == 3)]


@pytest.mark.parametrize("key,c", _valid(ROTATIONS, [2, 3]))
def test_orthogonal_det_one_and_rotate_matches_matrix(key, c):
    pe = make(key, coord_dim=c)
    coords = coords_for(key, 5, c, scale=3.0)
    r = pe.matrix(coords)
    assert r.shape == (H, 5, D, D)
    eye = torch.eye(D)
    assert (r.transpose(-1, -2) @ r - eye).abs().max() < 1e-5
    assert torch.allclose(torch.linalg.det(r.double()), torch.ones(H, 5, dtype=torch.float64), atol=1e-5)
    x = torch.randn(3, H, 5, D)
    assert torch.allclose(pe.rotate(x, coords), torch.einsum("hmij,bhmj->bhmi", r, x), atol=1e-5)


def test_comrope_ap_three_axes():
    pe = make("comrope-ap", coord_dim=3, head_dim=24, block_size=4)
    r = pe.matrix(torch.randn(4, 3))
    assert (r.transpose(-1, -2) @ r - torch.eye(24)).abs().max() < 1e-5


@pytest.mark.parametrize("key", [k for k in ROTATIONS if k not in WITH_POST_ROTATION])
def test_identity_at_origin(key):
    pe = make(key)
    assert torch.allclose(pe.matrix(torch.zeros(1, 2)), torch.eye(D).expand(H, 1, D, D), atol=1e-6)


@pytest.mark.parametrize("key", sorted(WITH_POST_ROTATION))
def test_origin_is_the_post_rotation(key):
    pe = make(key)
    r0 = pe.matrix(torch.zeros(1, 2))[:, 0]
    assert torch.allclose(r0, pe.post_rotation_matrix(), atol=1e-6)
    if key != "relaxed-exact":
        assert (r0 - torch.eye(D)).abs().max() > 1e-2


@pytest.mark.parametrize("key,c", _valid(COMMUTING, [1, 2, 3]))
def test_relative_identity_commuting(key, c):
    pe = make(key, coord_dim=c)
    r, s = torch.randn(6, c) * 2, torch.randn(6, c) * 2
    lhs = pe.matrix(r).transpose(-1, -2) @ pe.matrix(s)
    rhs = pe.matrix(torch.zeros(1, c)).transpose(-1, -2) @ pe.matrix(s - r)
    assert rel_err(lhs, rhs) < 1e-5


@pytest.mark.parametrize("key", list(NON_COMMUTING))
def test_relative_identity_violated_and_grows_quadratically(key):
    torch.manual_seed(1)
    pe = make(key)
    pe64 = pe.double()
    r = torch.tensor([[1.0, 0.0], [0.3, -0.7]], dtype=torch.float64)  # non-collinear
    s = torch.tensor([[0.0, 1.0], [0.9, 0.4]], dtype=torch.float64)

    def violation(t: float) -> float:
        lhs = pe64.matrix(t * r).transpose(-1, -2) @ pe64.matrix(t * s)
        rhs = pe64.matrix(torch.zeros(1, 2, dtype=torch.float64)).transpose(-1, -2) @ pe64.matrix(t * (s - r))
        return rel_err(lhs, rhs)

    base_t = 0.05 if key == "liere" else 1.0  # LieRE's default generators are large (entries up to 2 pi)
    assert violation(base_t) > 1e-3
    small = [violation(base_t * f) for f in (0.02, 0.01, 0.005)]
    ratios = [small[i] / small[i + 1] for i in range(2)]
    for q in ratios:  # halving t divides the error by ~4: second order (BCH)
        assert 3.5 < q < 4.5, (small, ratios)


def test_liere_exact_for_one_dimension_and_collinear():
    pe = make("liere", coord_dim=1).double()
    r, s = torch.rand(5, 1, dtype=torch.float64) * 0.3, torch.rand(5, 1, dtype=torch.float64) * 0.3
    lhs = pe.matrix(r).transpose(-1, -2) @ pe.matrix(s)
    assert rel_err(lhs, pe.matrix(s - r)) < 1e-10
    pe2 = make("liere", coord_dim=2).double()
    u = torch.tensor([0.6, -0.8], dtype=torch.float64)
    r2, s2 = torch.rand(5, 1, dtype=torch.float64) * u * 0.3, torch.rand(5, 1, dtype=torch.float64) * u * 0.3
    lhs = pe2.matrix(r2).transpose(-1, -2) @ pe2.matrix(s2)
    assert rel_err(lhs, pe2.matrix(s2 - r2)) < 1e-10


# ----------------------------------------------------------------------------- shift invariance of logits
def _logits(pe, q, k, coords, prefix=0):
    qe, ke = pe(q, k, coords, num_prefix_tokens=prefix)
    return qe @ ke.transpose(-1, -2)


@pytest.mark.parametrize("key,c", _valid(list(COMMUTING) + ["tensor"], [2, 3]) + [("comrope-ap", 3)])
@pytest.mark.parametrize("per_example", [False, True])
def test_logits_invariant_to_global_shift(key, c, per_example):
    if key == "tensor":
        pe = create_pe("tensor", head_dim=D, coord_dim=c, num_heads=H)
    elif key == "comrope-ap" and c == 3:
        pe = make(key, coord_dim=3, head_dim=24, block_size=4)
    else:
        pe = make(key, coord_dim=c)
    d = pe.head_dim
    b, m = 3, 7
    q, k = torch.randn(b, H, m, d), torch.randn(b, H, m, d)
    coords = torch.randn(b, m, c) * 3 if per_example else torch.randn(m, c) * 3
    shift = torch.randn(b, 1, c) * 5 if per_example else torch.randn(1, c) * 5
    base = _logits(pe, q, k, coords)
    assert rel_err(_logits(pe, q, k, coords + shift), base) < 1e-5


@pytest.mark.parametrize("key", list(NON_COMMUTING))
def test_logits_not_invariant_for_non_commuting(key):
    pe = make(key)
    q, k = torch.randn(1, H, 6, D), torch.randn(1, H, 6, D)
    coords = coords_for(key, 6, 2)
    shift = torch.tensor([[3.0, -2.0]])
    assert rel_err(_logits(pe, q, k, coords + shift), _logits(pe, q, k, coords)) > 1e-3


def test_tensor_logit_closed_form():
    pe = create_pe("tensor", head_dim=8, coord_dim=2, num_heads=1, num_features=3)
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    coords = torch.randn(4, 2)
    got = _logits(pe, q, k, coords)[0, 0]
    w = pe.feature_freqs[0].detach()  # (m, c)
    delta = coords[None, :, :] - coords[:, None, :]  # (i, j, c): r_j - r_i
    kernel = torch.cos(delta @ w.T).mean(-1)
    want = (q[0, 0] @ k[0, 0].T) * kernel
    assert torch.allclose(got, want, atol=1e-5)
    assert pe(q, k, coords)[0].shape == (1, 1, 4, 8 * 6)


# ----------------------------------------------------------------------------- fast paths vs dense expm
def _rot2(angle: torch.Tensor) -> torch.Tensor:
    """The 2x2 counter-clockwise rotation by ``angle`` (float64)."""
    a = float(angle)
    return torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=torch.float64)


def _expm_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Block-diagonal matrix from a list of square blocks (scipy, independent of ropekit)."""
    return torch.from_numpy(scipy.linalg.block_diag(*[b.numpy() for b in blocks]))


@pytest.mark.parametrize("block_size", [4, 8, 16, None])
def test_circulant_fft_matches_dense_expm(block_size):
    torch.manual_seed(0)
    pe = create_pe("circulant", head_dim=16, coord_dim=2, num_heads=1, block_size=block_size).double()
    with torch.no_grad():
        pe.circ_params.normal_()
    cols = pe.circ_params.detach()[0]  # (c, nb, b)
    coords = torch.randn(5, 2, dtype=torch.float64)
    got = pe.matrix(coords)[0]
    for t in range(5):
        gens = []
        for k in range(2):
            blocks = []
            for col in cols[k]:
                cm = torch.from_numpy(scipy.linalg.circulant(col.numpy()))
                blocks.append(cm - cm.T)
            gens.append(_expm_blocks(blocks))
        want = torch.linalg.matrix_exp(coords[t, 0] * gens[0] + coords[t, 1] * gens[1])
        assert torch.allclose(got[t], want, atol=1e-10)


def test_circulant_never_rotates_dc_and_nyquist():
    pe = create_pe("circulant", head_dim=16, coord_dim=2, block_size=8).double()
    r = pe.matrix(torch.randn(3, 2, dtype=torch.float64) * 5)[0]
    ones = torch.ones(16, dtype=torch.float64)  # DC of every block
    alt = torch.tensor([1.0, -1.0] * 8, dtype=torch.float64)  # Nyquist of every block
    for v in (ones, alt):
        assert torch.allclose(r @ v, v.expand(3, 16), atol=1e-10)


def test_cayley_matches_explicit_inverse_and_expm_of_implied_generators():
    pe = make("cayley", num_heads=1).double()
    s = _skew_from_upper(pe.cayley_params.detach()[0], D)  # free entries: the strict upper triangle of S
    eye = torch.eye(D, dtype=torch.float64)
    p = (eye - s) @ torch.linalg.inv(eye + s)
    freqs = pe.freqs.detach()[0]  # (c, P)
    coords = torch.randn(4, 2, dtype=torch.float64) * 2
    got = pe.matrix(coords)[0]
    for t in range(4):
        theta = coords[t] @ freqs
        rope = _expm_blocks([_rot2(v) for v in theta])
        assert torch.allclose(got[t], rope @ p, atol=1e-10)
        gen = pe.generators()[0]
        want = p @ torch.linalg.matrix_exp(torch.einsum("c,cij->ij", coords[t], gen))
        assert torch.allclose(got[t], want, atol=1e-10)


@pytest.mark.parametrize("name", ["comrope-ap", "comrope-ld"])
@pytest.mark.parametrize("per_example", [False, True])
def test_comrope_matches_per_token_matrix_exp(name, per_example):
    pe = make(name, block_size=4, num_heads=H).double()
    with torch.no_grad():
        pe.block_params.normal_(0, 1.0)
    k_blocks = _skew_from_upper(pe.block_params.detach()[0], 4)  # (nb, b, b) from the free entries
    lam = pe._axis_weights().detach()[0]  # (c, nb)
    coords = torch.randn(2, 5, 2, dtype=torch.float64) if per_example else torch.randn(5, 2, dtype=torch.float64)
    got = pe.matrix(coords)
    flat_c = coords.reshape(-1, 2)
    flat_r = got.transpose(1, 2).reshape(-1, H, D, D) if per_example else got.transpose(0, 1)  # (tokens, H, d, d)
    for t in range(flat_c.shape[0]):
        s = flat_c[t] @ lam  # (nb,)
        want = _expm_blocks([torch.linalg.matrix_exp(s[j] * k_blocks[j]) for j in range(len(k_blocks))])
        for h in range(H):
            assert torch.allclose(flat_r[t, h], want, atol=1e-10)
        assert torch.allclose(want, torch.linalg.matrix_exp(torch.einsum("c,cij->ij", flat_c[t], pe.generators()[0])),
                              atol=1e-10)


@pytest.mark.parametrize("block_size", [4, 8, None])
def test_liere_matches_dense_generator_expm(block_size):
    pe = make("liere", block_size=block_size, num_heads=1).double()
    raw = pe.generator_params.detach()[0]  # (c, nb, b, b)
    gens = []
    for k in range(2):
        blocks = [torch.triu(a, 1) - torch.triu(a, 1).T for a in raw[k]]
        gens.append(_expm_blocks(blocks))
    coords = torch.randn(4, 2, dtype=torch.float64) * 0.2
    got = pe.matrix(coords)[0]
    for t in range(4):
        want = torch.linalg.matrix_exp(coords[t, 0] * gens[0] + coords[t, 1] * gens[1])
        assert torch.allclose(got[t], want, atol=1e-9)


def test_string_reference_is_q_rope_qt():
    pe = make("string", num_heads=1).double()
    q = pe.basis().detach()[0]
    freqs = pe.freq_param.detach()[0]
    coords = torch.randn(3, 2, dtype=torch.float64)
    for t, rm in enumerate(pe.matrix(coords)[0]):
        theta = coords[t] @ freqs
        rope = _expm_blocks([_rot2(v) for v in theta])
        assert torch.allclose(rm, q @ rope @ q.T, atol=1e-10)


# ----------------------------------------------------------------------------- reductions
def test_cayley_with_zero_s_equals_mixed():
    torch.manual_seed(3)
    mixed = create_pe("mixed", head_dim=D, coord_dim=2, num_heads=H, per_head=True)
    cay = create_pe("cayley", head_dim=D, coord_dim=2, num_heads=H, per_head=True, freqs=mixed.freqs.detach())
    x, coords = torch.randn(2, H, 5, D), torch.randn(5, 2) * 4
    assert torch.allclose(cay.rotate(x, coords), mixed.rotate(x, coords), atol=1e-6)


def test_mixed_with_axis_aligned_freqs_equals_axial():
    axial = create_pe("axial", head_dim=D, coord_dim=2, num_heads=H)
    mixed = create_pe("mixed", head_dim=D, coord_dim=2, num_heads=H, freqs=axial_frequencies(D, 2))
    x, coords = torch.randn(2, H, 6, D), torch.randn(6, 2) * 7
    assert torch.allclose(mixed.rotate(x, coords), axial.rotate(x, coords), atol=1e-5)


def test_comrope_ld_block2_equals_mixed():
    torch.manual_seed(4)
    ld = create_pe("comrope-ld", head_dim=D, coord_dim=2, num_heads=1, block_size=2)
    with torch.no_grad():
        ld.block_params.normal_()
        ld.axis_weights.normal_()
    beta = ld.block_params[0, :, 0].detach()  # K_j = [[0, b], [-b, 0]]: its one free entry
    freqs = -(ld.axis_weights[0].detach() * beta)  # rotation by -s beta
    mixed = create_pe("mixed", head_dim=D, coord_dim=2, num_heads=1, freqs=freqs)
    x, coords = torch.randn(2, 1, 5, D), torch.randn(5, 2) * 3
    assert torch.allclose(ld.rotate(x, coords), mixed.rotate(x, coords), atol=1e-5)


@pytest.mark.parametrize("c", [1, 2, 4])
def test_comrope_ap_block2_rope_init_equals_axial_up_to_pair_order(c):
    ap = create_pe("comrope-ap", head_dim=D, coord_dim=c, num_heads=1, block_size=2, init="rope")
    axial = create_pe("axial", head_dim=D, coord_dim=c, num_heads=1)
    p = D // 2 // c
    # block j of AP = pair floor(j / c) of axis j mod c = axial pair (j mod c) * p + floor(j / c)
    perm = [(j % c) * p + j // c for j in range(D // 2)]
    dims = torch.tensor([2 * n + i for n in perm for i in (0, 1)])
    x, coords = torch.randn(2, 1, 5, D), torch.randn(5, c) * 9
    got = ap.rotate(x, coords)
    want = axial.rotate(_scatter_dims(x, dims), coords)[..., dims]  # AP pair j is axial pair perm[j]
    assert torch.allclose(got, want, atol=1e-5)


def _scatter_dims(y: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """``out[..., dims[i]] = y[..., i]``: the inverse of the gather ``out[..., dims]``."""
    out = torch.empty_like(y)
    out[..., dims] = y
    return out


def test_one_dim_axial_is_classic_rope():
    """Against RoFormer's formulation with complex numbers: (x_2n + i x_2n+1) * exp(i m theta_n)."""
    d, base = 32, 10000.0
    pe = create_pe("axial", head_dim=d, coord_dim=1, num_heads=1, base=base)
    positions = torch.arange(11, dtype=torch.float32)
    x = torch.randn(1, 1, 11, d, dtype=torch.float64)
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.exp(1j * positions.double()[:, None] * theta)
    want = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    assert torch.allclose(pe.rotate(x.float(), positions[:, None]).double(), want, atol=1e-5)


def test_axial_leftover_pairs_not_rotated():
    pe = create_pe("axial", head_dim=10, coord_dim=2)  # 5 pairs, 2 per axis, 1 left over
    x, coords = torch.randn(1, 1, 4, 10), torch.randn(4, 2) * 3
    y = pe.rotate(x, coords)
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert not torch.allclose(y[..., :8], x[..., :8])


# ----------------------------------------------------------------------------- gradients
def test_gradcheck_cayley_solve():
    from ropekit.encodings.ops.skew import cayley_transform
    a = torch.randn(2, 6, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: cayley_transform(t - t.transpose(-1, -2)), (a,))


@pytest.mark.parametrize("n,band", [(6, None), (7, 2), (2, None), (8, 1)])
def test_cayley_from_free_is_the_solve_with_its_own_backward(n, band):
    """``cayley_from_free`` (one gather, one solve; a backward without a second solve) against the Cayley transform
    of the skew matrix through autograd: values, gradients, second order; P orthogonal with det 1; bad sizes."""
    from ropekit.encodings.ops.skew import cayley_from_free, cayley_transform, free_to_skew, num_free

    torch.manual_seed(0)
    v = (2 * torch.randn(3, 2, num_free(n, band), dtype=torch.float64)).requires_grad_()
    p = cayley_from_free(v, n, band)
    ref = cayley_transform(free_to_skew(v, n, band))
    torch.testing.assert_close(p, ref, rtol=0, atol=1e-14)
    eye = torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(p @ p.mT, eye.expand_as(p), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.linalg.det(p), torch.ones(3, 2, dtype=torch.float64))
    g = torch.randn_like(p)
    (got,), (want,) = torch.autograd.grad(p, v, g), torch.autograd.grad(ref, v, g)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: cayley_from_free(t, n, band), (v,))
    assert torch.autograd.gradgradcheck(lambda t: cayley_from_free(t, n, band), (v,))
    zero = cayley_from_free(torch.zeros(num_free(n, band)), n, band)  # S = 0: P = I
    assert torch.equal(zero, torch.eye(n))
    with pytest.raises(ValueError, match="free entries"):
        cayley_from_free(torch.zeros(num_free(n, band) + 1), n, band)


def test_gradcheck_circulant_fft_path():
    pe = create_pe("circulant", head_dim=8, coord_dim=2, block_size=4).double()
    x = torch.randn(1, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    coords = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x_, c_: pe.rotate(x_, c_), (x, coords))
    params = pe.circ_params.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda p: _functional_rotate(pe, {"circ_params": p}, x.detach(), coords.detach()),
                                    (params,))


def _functional_rotate(pe, params, x, coords):
    """``pe.rotate`` with parameters replaced by ``params`` (for gradcheck on parameters)."""

    class _Rot(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x_, c_):
            return self.inner.rotate(x_, c_)

    prefixed = {f"inner.{k}": v for k, v in params.items()}
    return torch.func.functional_call(_Rot(pe), prefixed, (x, coords))


@pytest.mark.parametrize("name,param", [("liere", "generator_params"), ("comrope-ld", "block_params"),
                                        ("comrope-ld", "axis_weights"), ("comrope-ap", "block_params"),
                                        ("relaxed", "relax_params"), ("cayley", "cayley_params"),
                                        ("mixed", "freq_param")])
def test_gradcheck_parameters(name, param):
    opts = {"liere": {"block_size": 4, "init_scale": 1.0}, "comrope-ld": {"block_size": 4},
            "comrope-ap": {"block_size": 4}}.get(name, {})
    pe = create_pe(name, head_dim=8, coord_dim=2, num_heads=1, **opts).double()
    x = torch.randn(2, 1, 3, 8, dtype=torch.float64)
    coords = torch.randn(3, 2, dtype=torch.float64) * 0.5
    p0 = getattr(pe, param).detach().clone().normal_(0, 0.5).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda p: _functional_rotate(pe, {param: p}, x, coords), (p0,))


def test_gradcheck_comrope_at_zero_and_degenerate():
    """The sinc-form backward must agree with finite differences even where eigenvalues coincide."""
    from ropekit.encodings.ops.blocks import scaled_block_exp_apply
    x = torch.randn(2, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    s = torch.randn(1, 3, 2, dtype=torch.float64, requires_grad=True)
    for kmat in (torch.zeros(1, 2, 4, 4, dtype=torch.float64),
                 torch.tensor([[0, 1, 0, 0], [-1, 0, 0, 0], [0, 0, 0, 1], [0, 0, -1, 0]],
                              dtype=torch.float64).expand(1, 2, 4, 4).clone()):
        k = kmat.requires_grad_(True)
        assert torch.autograd.gradcheck(lambda x_, s_, k_: scaled_block_exp_apply(x_, s_, k_ - k_.transpose(-1, -2)),
                                        (x, s, k))
    # per-example scales, per-head generators
    x = torch.randn(2, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    s = torch.randn(2, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x_, s_, k_: scaled_block_exp_apply(x_, s_, k_ - k_.transpose(-1, -2)),
                                    (x, s, k))


def test_gradcheck_matrix_exp_path():
    pe = create_pe("string", head_dim=6, coord_dim=2).double()
    x = torch.randn(1, 1, 3, 6, dtype=torch.float64)
    coords = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c: pe.rotate(x, c), (coords,))


@pytest.mark.parametrize("name", list_pes())
@pytest.mark.parametrize("zero_init", [False, True])
def test_every_parameter_gets_finite_gradient(name, zero_init):
    opts = {"circulant": {"block_size": 8}, "liere": {"block_size": 8}, "comrope-ap": {"block_size": 4},
            "comrope-ld": {"block_size": 4}}.get(name, {})
    if zero_init and name.startswith("comrope"):
        opts["init"] = "zero"
    pe = create_pe(name, head_dim=D, coord_dim=2, num_heads=H, **opts)
    if zero_init:
        with torch.no_grad():
            for p in pe.parameters():
                p.zero_()
    q = torch.randn(2, H, 6, D, requires_grad=True)
    k = torch.randn(2, H, 6, D)
    coords = torch.randn(5, 2)
    qe, ke = pe(q, k, coords, num_prefix_tokens=1)
    (qe @ ke.transpose(-1, -2)).pow(2).sum().backward()
    assert torch.isfinite(q.grad).all()
    for pname, p in pe.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        if not zero_init:
            assert p.grad.abs().sum() > 0, pname


def test_comrope_zero_init_is_identity_but_trainable():
    pe = create_pe("comrope-ld", head_dim=D, coord_dim=2, num_heads=1, block_size=4, init="zero")
    x, coords = torch.randn(2, 1, 5, D), torch.randn(5, 2)
    assert torch.allclose(pe.rotate(x, coords), x, atol=1e-6)
    (pe.rotate(x, coords) * torch.randn_like(x)).sum().backward()
    assert pe.block_params.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- dtypes and autocast
@pytest.mark.parametrize("name", ["axial", "mixed", "cayley", "circulant", "comrope-ld", "liere", "tensor"])
def test_bf16_autocast_dtype_and_fp32_math(name):
    opts = {"liere": {"block_size": 4, "init_scale": 0.5}, "comrope-ld": {"block_size": 4}}.get(name, {})
    pe = create_pe(name, head_dim=D, coord_dim=2, num_heads=H, **opts)
    x = torch.randn(2, H, 5, D)
    coords = torch.randn(5, 2) * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = pe.rotate(x.bfloat16(), coords)
        y32 = pe.rotate(x, coords)
    assert y16.dtype == torch.bfloat16
    assert y32.dtype == torch.float32
    ref = pe.rotate(x, coords)  # no autocast
    assert torch.allclose(y32, ref, atol=1e-6), "autocast leaked into the rotation math"


@pytest.mark.parametrize("name", ["axial", "mixed"])
def test_angles_fp32_accuracy_large_coordinates(name):
    pe = create_pe(name, head_dim=64, coord_dim=2, num_heads=1)
    coords = torch.tensor([[4096.0, 4096.0], [4095.5, 17.25], [0.0, 4096.0]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ang = pe.angles(coords)
    assert ang.dtype == torch.float32
    want = coords.double() @ pe.freqs.detach()[0].double()
    assert (ang[0].double() - want).abs().max() < 1e-3


# ----------------------------------------------------------------------------- prefix, errors, determinism
@pytest.mark.parametrize("name", list_pes())
def test_prefix_tokens_untouched(name):
    pe = make(name) if name in ROTATIONS else create_pe(name, head_dim=D, coord_dim=2, num_heads=H)
    q, k = torch.randn(2, H, 7, D), torch.randn(2, H, 7, D)
    qe, ke = pe(q, k, torch.randn(5, 2), num_prefix_tokens=2)
    if pe.is_rotation:
        assert torch.equal(qe[:, :, :2], q[:, :, :2]) and torch.equal(ke[:, :, :2], k[:, :, :2])
    else:  # tensor: prefix-prefix logits are exactly q^T k
        assert torch.allclose(qe[:, :, :2] @ ke[:, :, :2].transpose(-1, -2),
                              q[:, :, :2] @ k[:, :, :2].transpose(-1, -2), atol=1e-5)


def test_bad_inputs_raise_useful_errors():
    pe = create_pe("mixed", head_dim=D, coord_dim=2, num_heads=H)
    q = torch.randn(2, H, 5, D)
    with pytest.raises(ValueError, match=r"coord_dim=2.*\(5, 2\)"):
        pe(q, q, torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"tokens.*\(4, 2\)"):
        pe(q, q, torch.randn(5, 2), num_prefix_tokens=1)
    with pytest.raises(ValueError, match="NaN"):
        pe(q, q, torch.tensor([[0.0, float("nan")]] * 5))
    with pytest.raises(ValueError, match="infinite"):
        pe(q, q, torch.tensor([[0.0, float("inf")]] * 5))
    with pytest.raises(ValueError, match=r"\(B, H, N, d\)"):
        pe(q[0], q[0], torch.randn(5, 2))
    with pytest.raises(ValueError, match="d=16"):
        pe(torch.randn(2, H, 5, 8), torch.randn(2, H, 5, 8), torch.randn(5, 2))
    with pytest.raises(ValueError, match="batch"):
        pe(q, q, torch.randn(3, 5, 2))
    with pytest.raises(ValueError, match="real"):
        pe(q, q, torch.zeros(5, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        pe(q, q, torch.randn(5, 2), num_prefix_tokens=-1)


def test_integer_grid_coordinates_accepted():
    pe = create_pe("axial", head_dim=D, coord_dim=2, num_heads=H)
    grid = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(2), indexing="ij"), -1).reshape(-1, 2)
    x = torch.randn(1, H, 6, D)
    assert torch.allclose(pe.rotate(x, grid), pe.rotate(x, grid.float()))


@pytest.mark.parametrize("name", list_pes())
def test_same_seed_same_output(name):
    def run():
        torch.manual_seed(123)
        pe = create_pe(name, head_dim=D, coord_dim=2, num_heads=H)
        return pe.rotate(torch.randn(2, H, 4, D), torch.randn(4, 2))
    assert torch.equal(run(), run())


@pytest.mark.parametrize("name", list_pes())
def test_state_dict_holds_only_learnable_parameters(name):
    pe = create_pe(name, head_dim=D, coord_dim=2, num_heads=H)
    params = {n for n, p in pe.named_parameters()}
    assert set(pe.state_dict()) == params
    assert pe.no_weight_decay() == params


def test_per_head_parameters_and_sharing():
    shared = create_pe("mixed", head_dim=D, coord_dim=2, num_heads=4)
    per_head = create_pe("mixed", head_dim=D, coord_dim=2, num_heads=4, per_head=True)
    assert shared.freq_param.shape[0] == 1 and per_head.freq_param.shape[0] == 4
    r = per_head.matrix(torch.randn(3, 2))
    assert not torch.allclose(r[0], r[1])
    r = shared.matrix(torch.randn(3, 2))
    assert torch.equal(r[0], r[3])


# ----------------------------------------------------------------------------- diagnostics
@pytest.mark.parametrize("key", [k for k in COMMUTING if k != "none"])
def test_commutator_error_zero_for_commuting(key):
    assert diagnostics.commutator_error(make(key))["rel"] < 1e-5


def test_commutator_error_large_for_relaxed_and_liere():
    assert diagnostics.commutator_error(make("relaxed"))["rel"] > 1e-2
    assert diagnostics.commutator_error(make("liere"))["rel"] > 1e-2


def test_mixing_norm_and_invariant_residual_exact_vs_relaxed():
    exact, relaxed = make("relaxed-exact"), make("relaxed")
    assert diagnostics.mixing_norm(exact) < 1e-10
    assert diagnostics.mixing_norm(relaxed) > 1e-2
    small = {"num_deltas": 4, "num_r": 8}
    assert diagnostics.invariant_residual(exact, **small) < 1e-8
    assert diagnostics.invariant_residual(relaxed, **small) > 1e-2
    for key in ("cayley", "circulant", "comrope-ld"):  # other exact encodings, with their own P
        assert diagnostics.invariant_residual(make(key), **small) < 1e-5


def test_relative_operator_error_grows_with_l1_product_for_relaxed():
    relaxed, exact = make("relaxed"), make("relaxed-exact")
    g = torch.Generator().manual_seed(0)
    r, s = torch.randn(16, 2, generator=g), torch.randn(16, 2, generator=g)
    errs = [diagnostics.relative_operator_error(relaxed, t * r, t * s) for t in (0.05, 0.1, 0.2)]
    assert errs[0] < errs[1] < errs[2]
    assert 3.0 < errs[1] / errs[0] < 5.0 and 3.0 < errs[2] / errs[1] < 5.0  # ~ ||r||_1 ||s||_1 ~ t^2
    assert diagnostics.relative_operator_error(exact, 5 * r, 5 * s) < 1e-10


def test_commutator_error_zero_for_one_axis():
    assert diagnostics.commutator_error(make("liere", coord_dim=1)) == {"abs": 0.0, "rel": 0.0}
