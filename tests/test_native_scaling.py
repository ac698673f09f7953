"""Resolution scaling on the RoPE form (ropekit.encodings.scaling) and coordinate augmentation
(ropekit.coords.augment): each method against a hand-computed case, the wrapper against an independent float64
reference built from ``to_rope`` for every commuting encoding, folded and unfolded paths alike."""

import math

import pytest
import torch

from ropekit.coords.augment import (CoordAugmentDraws, apply_coord_augmentation, augment_coords,
                                    draw_coord_augmentation)
from ropekit.encodings import create_pe, list_pes
from ropekit.encodings.rope import AxialRoPE
from ropekit.encodings.scaling import (ResolutionScaling, ScaledEncoding, apply_resolution_scaling, cap_factors,
                                       interpolation_factors, ntk_factors, remove_resolution_scaling,
                                       scale_frequencies, yarn_attention_factor, yarn_factors)
from ropekit.nn import Attention
from ropekit.nn.vit import VisionTransformer, vit_config

TWO_PI = 2 * math.pi


def _commuting(coord_dim=2, head_dim=16, heads=2):
    out = []
    for name in list_pes():
        opts = {"block_size": 4} if name.startswith("comrope") else {}
        try:
            pe = create_pe(name, head_dim=head_dim, coord_dim=coord_dim, num_heads=heads, per_head=True, **opts)
        except ValueError:
            pe = create_pe(name, head_dim=head_dim, coord_dim=coord_dim, num_heads=heads, **opts)
        if pe.rope_kind is not None and pe.is_rotation:
            out.append((name, pe))
    return out


def test_interpolation_is_coordinate_division():
    torch.manual_seed(0)
    pe = create_pe("mixed", head_dim=8, coord_dim=2, num_heads=2).double()
    s = (2.0, 4.0)
    scaled = ScaledEncoding(pe, ResolutionScaling("pi", scale=s))
    q, k = torch.randn(2, 1, 2, 7, 8, dtype=torch.float64)
    r = torch.randn(7, 2, dtype=torch.float64) * 5
    a = scaled(q, k, r)
    b = pe(q, k, r / torch.tensor(s, dtype=torch.float64))
    torch.testing.assert_close(a[0] @ a[1].transpose(-1, -2), b[0] @ b[1].transpose(-1, -2), rtol=0, atol=1e-12)
    g = interpolation_factors(torch.ones(3, 2, 4), s)
    assert torch.equal(g[:, 0], torch.full((3, 4), 0.5, dtype=g.dtype)) and torch.equal(g[:, 1], torch.full((3, 4), 0.25, dtype=g.dtype))


@pytest.mark.parametrize("d,s", [(8, 4.0), (16, 2.5), (32, 8.0)])
def test_ntk_equals_raised_base(d, s):
    """NTK-aware scaling by wavelength is the base rule b -> b s^(d/(d-2)) for RoPE (1-D classic RoPE)."""
    freqs = AxialRoPE(d, 1).freqs.double()  # (1, 1, d/2)
    got = scale_frequencies(freqs, ResolutionScaling("ntk", scale=s))
    ref = AxialRoPE(d, 1, base=10000.0 * s ** (d / (d - 2))).freqs.double()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)  # the reference frequencies are float32
    n = torch.arange(d // 2, dtype=torch.float64)
    torch.testing.assert_close(ntk_factors(freqs, s)[0, 0], s ** (-2 * n / (d - 2)), rtol=1e-6, atol=0)


def test_ntk_hard_cases():
    f = torch.tensor([[[0.0, 3.0, -3.0, 0.0]], [[0.0, 0.0, 0.0, 0.0]], [[2.0, -0.5, 0.0, 1.0]]])
    g = ntk_factors(f, 4.0)
    assert torch.equal(g[0, 0], torch.ones(4, dtype=g.dtype))  # one distinct magnitude: kept (sign ignored)
    assert torch.equal(g[1, 0], torch.ones(4, dtype=g.dtype))  # all zero
    # 2.0 kept, 0.5 interpolated by 1/4, 1.0 halfway on the log scale: 4^(-1/2)
    torch.testing.assert_close(g[2, 0], torch.tensor([1.0, 0.25, 1.0, 0.5], dtype=g.dtype), rtol=1e-15, atol=0)


def test_yarn_hand_case():
    L, s = 10.0, 2.0
    rho = torch.tensor([40.0, 32.0, 16.5, 1.0, 0.5, 0.0], dtype=torch.float64)
    freqs = (TWO_PI * rho / L).view(1, 1, -1) * torch.tensor([1, -1, 1, -1, 1, 1], dtype=torch.float64)
    g = yarn_factors(freqs, s, L)
    torch.testing.assert_close(g[0, 0], torch.tensor([1, 1, 0.75, 0.5, 0.5, 0.5], dtype=torch.float64),
                               rtol=1e-13, atol=0)
    assert yarn_attention_factor(2.0) == pytest.approx(0.1 * math.log(2) + 1, rel=1e-15)
    assert yarn_attention_factor((2.0, 3.0)) == pytest.approx(0.1 * math.log(6) + 1, rel=1e-15)
    assert yarn_attention_factor(0.5) == 1.0


def test_cap_hand_case():
    L, s, margin = 10.0, 3.0, 0.9
    period = torch.tensor([5.0, 10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    freqs = (TWO_PI / period).view(1, 1, -1)
    target = margin * TWO_PI / 30.0
    want = torch.tensor([1.0, target / (TWO_PI / 10), target / (TWO_PI / 20), target / (TWO_PI / 30), 1.0],
                        dtype=torch.float64)
    torch.testing.assert_close(cap_factors(freqs, s, L, margin)[0, 0], want, rtol=1e-14, atol=0)
    assert torch.equal(cap_factors(freqs, 0.5, L), torch.ones_like(freqs))  # shrinking caps nothing


def _dense_reference(pe, scaling, q, k, r, p0):
    """Logits a^2 (T P q)^T RoPE(gamma w; r_j - r_i) (P k) built by hand from to_rope, in float64."""
    with torch.no_grad():
        p, freqs = pe.to_rope()  # (H, d, d), (H, c, d/2)
        post = pe.post_rotation_matrix()
    freqs = scale_frequencies(freqs.double(), scaling)
    a = scaling.factor()
    h, d = p.shape[0], p.shape[-1]

    def encode(x):  # (B, H, N, d)
        y = torch.einsum("hij,bhnj->bhni", p.double(), x)
        if p0 and post is not None:  # prefix tokens: T = P R(0)^T P^T
            t = p.double() @ post.double().transpose(-1, -2) @ p.double().transpose(-1, -2)
            y = torch.cat([torch.einsum("hij,bhnj->bhni", t, y[:, :, :p0]), y[:, :, p0:]], dim=2)
        theta = torch.einsum("mc,hcp->hmp", r, freqs)  # (H, M, d/2)
        z = torch.complex(y[..., 0::2], y[..., 1::2])
        z = torch.cat([z[:, :, :p0], z[:, :, p0:] * torch.exp(1j * theta)], dim=2)
        return a * torch.stack([z.real, z.imag], dim=-1).flatten(-2)

    return encode(q) @ encode(k).transpose(-1, -2)


SCALINGS = [ResolutionScaling("none"), ResolutionScaling("pi", scale=(2.0, 1.5)), ResolutionScaling("ntk", scale=3.0),
            ResolutionScaling("yarn", scale=(2.0, 3.0), train_extent=(6.0, 4.0), beta=8.0),
            ResolutionScaling("cap", scale=4.0, train_extent=3.0)]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s.method)
def test_wrapper_every_commuting_encoding_against_reference(scaling):
    for seed in range(3):
        torch.manual_seed(seed)
        for name, pe in _commuting():
            pe = pe.double()
            with torch.no_grad():  # move learned encodings off their initialisation
                for prm in pe.parameters():
                    prm.add_(0.3 * torch.randn_like(prm))
            p0 = 1
            q, k = torch.randn(2, 2, 2, p0 + 6, 16, dtype=torch.float64)
            r = torch.randn(6, 2, dtype=torch.float64) * 3
            wrapped = ScaledEncoding(pe, scaling)
            qo, ko = wrapped(q, k, r, num_prefix_tokens=p0)
            got = qo @ ko.transpose(-1, -2)
            want = _dense_reference(pe, scaling, q, k, r, p0)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{name} seed {seed}")
            if scaling.method == "none":
                qi, ki = pe(q, k, r, num_prefix_tokens=p0)
                torch.testing.assert_close(got, qi @ ki.transpose(-1, -2), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scaling", SCALINGS[1:], ids=lambda s: s.method)
def test_folded_attention_equals_module_path_and_trains(scaling):
    torch.manual_seed(1)
    for name, pe in _commuting():
        wrapped = ScaledEncoding(pe, scaling)
        outs, grads = [], []
        for fold in (True, False):
            torch.manual_seed(2)
            att = Attention(32, 2, wrapped, fold=fold)
            x = torch.randn(2, 7, 32)
            r = torch.randn(6, 2) * 2
            y = att(x, r, num_prefix_tokens=1)
            y.square().sum().backward()
            outs.append(y)
            grads.append([p.grad.clone() for p in pe.parameters()])
            for p in list(att.parameters()):
                p.grad = None
        torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=2e-5, msg=name)
        for g0, g1 in zip(*grads):
            assert torch.isfinite(g0).all()
            torch.testing.assert_close(g0, g1, rtol=1e-3, atol=1e-4, msg=name)


def test_apply_to_model_shared_once_and_removable():
    torch.manual_seed(0)
    cfg = vit_config("tiny", num_classes=3, in_chans=1, image_size=(16, 16), patch_size=4, depth=2, pe="cayley",
                     pe_sharing="model")
    model = VisionTransformer(cfg).eval()
    x = torch.randn(2, 1, 16, 16)
    ref = model(x)
    wrappers = apply_resolution_scaling(model, ResolutionScaling("none"))
    assert len(wrappers) == 1 and all(b.attn.pe is wrappers[0] for b in model.blocks)
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    apply_resolution_scaling(model, ResolutionScaling("pi", scale=2.0))  # re-wrapping replaces, never nests
    assert isinstance(model.blocks[0].attn.pe, ScaledEncoding)
    assert not isinstance(model.blocks[0].attn.pe.inner, ScaledEncoding)
    assert not torch.allclose(model(x), ref)
    remove_resolution_scaling(model)
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)


def test_scaling_errors():
    with pytest.raises(ValueError, match="unknown scaling method"):
        ResolutionScaling("nope")
    with pytest.raises(ValueError, match="train_extent"):
        ResolutionScaling("yarn", scale=2.0)
    with pytest.raises(ValueError, match="commuting"):
        ScaledEncoding(create_pe("liere", head_dim=8, coord_dim=2), ResolutionScaling("none"))
    with pytest.raises(ValueError, match="one per axis"):
        interpolation_factors(torch.ones(1, 2, 4), (1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="positive"):
        interpolation_factors(torch.ones(1, 2, 4), float("nan"))
    with pytest.raises(ValueError, match="finite"):
        ntk_factors(torch.tensor([[[float("nan"), 1.0]]]), 2.0)
    with pytest.raises(ValueError, match="alpha"):
        yarn_factors(torch.ones(1, 1, 2), 2.0, 3.0, alpha=5.0, beta=2.0)


def test_coord_augmentation_hand_case_and_ranges():
    coords = torch.tensor([[[0.0, 0.0], [1.0, 2.0]], [[3.0, -1.0], [0.5, 0.5]]], dtype=torch.float64)
    draws = CoordAugmentDraws(torch.tensor([[0.5, -1.0], [0.0, 2.0]]), torch.tensor([[2.0, 0.5], [1.0, 1.0]]),
                              torch.tensor([[3.0], [0.5]]))
    want = torch.tensor([[[0.5 * 2 * 3, -1.0 * 0.5 * 3], [1.5 * 2 * 3, 1.0 * 0.5 * 3]],
                         [[3.0 * 0.5, 1.0 * 0.5], [0.5 * 0.5, 2.5 * 0.5]]], dtype=torch.float64)
    torch.testing.assert_close(apply_coord_augmentation(coords, draws), want, rtol=0, atol=1e-15)
    # the packed form: tokens of two images in one row, padding untouched
    flat = torch.cat([coords[0], coords[1], torch.full((1, 2), 7.0, dtype=torch.float64)])
    seg = torch.tensor([0, 0, 1, 1, -1])
    got = apply_coord_augmentation(flat, draws, seg)
    torch.testing.assert_close(got, torch.cat([want[0], want[1], flat[-1:]]), rtol=0, atol=1e-15)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        d = draw_coord_augmentation(64, 3, shift=0.7, jitter=1.5, rescale=2.0, generator=g)
        assert d.shift.abs().max() <= 0.7 and d.shift.abs().max() > 0.3
        assert d.jitter.min() >= 1 / 1.5 - 1e-6 and d.jitter.max() <= 1.5 + 1e-6
        assert d.rescale.min() >= 0.5 - 1e-6 and d.rescale.max() <= 2.0 + 1e-6
        # log-uniform: the logs are symmetric around 0
        assert abs(float(d.jitter.log().mean())) < 3 * math.log(1.5) / math.sqrt(3 * 192)
    same = augment_coords(coords, generator=torch.Generator().manual_seed(0))  # defaults: the identity
    torch.testing.assert_close(same, coords, rtol=0, atol=0)
    with pytest.raises(ValueError, match="jitter"):
        draw_coord_augmentation(2, 2, jitter=0.5)
