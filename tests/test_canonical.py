"""Canonical coordinates: a commuting encoding on them makes a point-set model invariant to rotations."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ropekit
from ropekit.coords import (
    axis_frame, cylindrical, freeze_periodic_, from_cylindrical, from_spherical, integer_frequencies,
    periodicity_error, rotate_about_axis, spherical,
)

B, N, FEAT, DIM, HEADS = 2, 24, 4, 32, 2
HEAD_DIM = DIM // HEADS


class PointSetModel(nn.Module):
    """Two attention layers over points (features embedded, geometry only through the encoding), mean pooled."""

    def __init__(self, pe, depth=2):
        super().__init__()
        self.pe = pe
        self.embed = nn.Linear(FEAT, DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(depth))
        self.mlp = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(DIM, 3)

    def forward(self, feats, coords):  # feats (B, N, F), coords (B, N, c)
        x = self.embed(feats)  # (B, N, D)
        for qkv, mlp in zip(self.qkv, self.mlp):
            q, k, v = qkv(x).reshape(B, N, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)  # (B, H, N, d) each
            q, k = self.pe(q, k, coords)
            a = F.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM ** -0.5)  # (B, H, N, d)
            x = x + a.transpose(1, 2).reshape(B, N, DIM)
            x = x + mlp(x)
        return self.head(x.mean(dim=1))  # (B, 3)


def cloud(seed=0, polar_margin=0.0):
    g = torch.Generator().manual_seed(seed)
    pts = torch.randn(B, N, 3, generator=g, dtype=torch.float64)
    if polar_margin:  # keep every point at least polar_margin away from the poles
        sph = spherical(pts)
        sph[..., 1] = sph[..., 1].clamp(polar_margin, math.pi - polar_margin)
        pts = from_spherical(sph)
    feats = torch.randn(B, N, FEAT, generator=g, dtype=torch.float64)
    return pts, feats


def model_for(name, periodic=(0,), seed=0, coord_dim=3):
    torch.manual_seed(seed)
    opts = {}
    if periodic is not None:
        opts["freqs"] = integer_frequencies(HEAD_DIM, coord_dim, periodic, seed=seed)
    pe = ropekit.create_pe(name, head_dim=HEAD_DIM, coord_dim=coord_dim, num_heads=HEADS, **opts)
    if name == "cayley":
        with torch.no_grad():
            pe.cayley_params.normal_(std=0.3)
    return PointSetModel(pe).double().eval()


ANGLES = [0.7, 2.9, -1.3, 10.0]


@pytest.mark.parametrize("name", ["mixed", "cayley"])
@pytest.mark.parametrize("kind", ["cylindrical", "spherical"])
def test_canonical_coordinates_give_rotation_invariance(name, kind):
    model = model_for(name)
    pts, feats = cloud()
    to_coords = cylindrical if kind == "cylindrical" else spherical
    ref = model(feats, to_coords(pts))
    for angle in ANGLES:
        out = model(feats, to_coords(rotate_about_axis(pts, angle)))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_raw_xyz_is_not_rotation_invariant():
    model = model_for("cayley", periodic=None)
    pts, feats = cloud()
    ref = model(feats, pts)
    assert (model(feats, rotate_about_axis(pts, 0.7)) - ref).abs().max() > 1e-3
    # ... but, being commuting, it is translation invariant
    torch.testing.assert_close(model(feats, pts + torch.tensor([1.0, -2.0, 0.5], dtype=pts.dtype)), ref)


def test_non_integer_azimuth_frequencies_break_at_the_cut():
    """Without integer frequencies, a rotation is a translation of theta only while no point crosses theta = pi."""
    model = model_for("mixed", periodic=None)
    pts, feats = cloud()
    sph = spherical(pts)
    sph[..., 0] = sph[..., 0] * 0.4  # all azimuths in (-0.4 pi, 0.4 pi)
    pts = from_spherical(sph)
    ref = model(feats, spherical(pts))
    torch.testing.assert_close(model(feats, spherical(rotate_about_axis(pts, 0.5))), ref)  # nobody crosses the cut
    assert (model(feats, spherical(rotate_about_axis(pts, 2.5))) - ref).abs().max() > 1e-4  # some points wrap


def test_spherical_scaling_and_polar_shift():
    """log r turns scaling into a translation; a polar shift (every point along its meridian) is one too."""
    model = model_for("cayley")
    pts, feats = cloud(polar_margin=0.5)
    ref = model(feats, spherical(pts))
    torch.testing.assert_close(model(feats, spherical(pts * 3.7)), ref, rtol=1e-5, atol=1e-5)
    sph = spherical(pts)
    sph[..., 1] += 0.3  # stays inside (0, pi): no point crosses a pole
    torch.testing.assert_close(model(feats, spherical(from_spherical(sph))), ref, rtol=1e-5, atol=1e-5)


def test_cylindrical_axis_translation_and_general_axis():
    model = model_for("mixed")
    pts, feats = cloud()
    axis, origin = torch.tensor([1.0, 2.0, 0.5]), torch.tensor([0.3, -1.0, 2.0])
    ref = model(feats, cylindrical(pts, axis=axis, origin=origin))
    moved = rotate_about_axis(pts, 1.9, axis=axis, origin=origin) + 4.0 * axis.double() / axis.norm()
    torch.testing.assert_close(model(feats, cylindrical(moved, axis=axis, origin=origin)), ref,
                               rtol=1e-5, atol=1e-5)


def test_round_trips_and_frames():
    pts = torch.randn(5, 7, 3, dtype=torch.float64)
    for kw in [{}, dict(axis=(1.0, 1.0, 0.0), origin=(0.5, 0.0, -1.0))]:
        torch.testing.assert_close(from_spherical(spherical(pts, **kw), **kw), pts)
        torch.testing.assert_close(from_spherical(spherical(pts, radius="linear", **kw), radius="linear", **kw), pts)
        for radius in ("linear", "log"):
            cyl = cylindrical(pts, radius=radius, **kw)
            torch.testing.assert_close(from_cylindrical(cyl, radius=radius, **kw), pts)
    frame = axis_frame((0.0, 0.0, 1.0), dtype=torch.float64)
    torch.testing.assert_close(frame, torch.eye(3, dtype=torch.float64))
    f = axis_frame((1.0, 2.0, 3.0), dtype=torch.float64)
    torch.testing.assert_close(f @ f.T, torch.eye(3, dtype=torch.float64))
    assert torch.det(f) > 0
    sph = spherical(pts)
    assert sph.shape == (5, 7, 3) and spherical(pts, radius=None).shape == (5, 7, 2)
    assert (sph[..., 0].abs() <= math.pi).all() and (sph[..., 1] >= 0).all() and (sph[..., 1] <= math.pi).all()
    # a rotation about the axis shifts the azimuth (mod 2 pi) and nothing else
    rot = spherical(rotate_about_axis(pts, 0.8))
    torch.testing.assert_close(torch.remainder(rot[..., 0] - sph[..., 0], 2 * math.pi),
                               torch.full((5, 7), 0.8, dtype=torch.float64))
    torch.testing.assert_close(rot[..., 1:], sph[..., 1:])


def test_integer_frequencies_and_periodicity():
    freqs = integer_frequencies(HEAD_DIM, 3, periodic=(0, 2), num_heads=2, seed=1)
    assert freqs.shape == (2, 3, HEAD_DIM // 2)
    assert torch.equal(freqs[:, [0, 2]], freqs[:, [0, 2]].round()) and freqs[:, 0].abs().max() <= 8
    assert freqs[:, 0].abs().sum() > 0
    pe = ropekit.create_pe("cayley", head_dim=HEAD_DIM, coord_dim=3, num_heads=2, freqs=freqs[0])
    assert periodicity_error(pe, axis=0) < 1e-9 and periodicity_error(pe, axis=2) < 1e-9
    assert periodicity_error(pe, axis=1) > 1e-3
    assert periodicity_error(ropekit.create_pe("mixed", head_dim=HEAD_DIM, coord_dim=3), axis=0) > 1e-3
    with pytest.raises(ValueError, match="out of range"):
        integer_frequencies(HEAD_DIM, 3, periodic=(3,))


def test_freeze_periodic_keeps_integer_rows_in_training():
    model = model_for("cayley")
    freeze_periodic_(model.pe, axes=(0,))
    before = model.pe.freq_param.detach().clone()
    opt = torch.optim.AdamW([{"params": [model.pe.freq_param, model.pe.cayley_params], "weight_decay": 0.0},
                             {"params": [p for n, p in model.named_parameters() if not n.startswith("pe.")]}], lr=1e-2)
    pts, feats = cloud()
    model.train()
    for _ in range(3):
        loss = model(feats, spherical(pts)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = model.pe.freq_param.detach()
    assert torch.equal(after[:, 0], before[:, 0])
    assert not torch.allclose(after[:, 1:], before[:, 1:])
    assert periodicity_error(model.pe, axis=0) < 1e-9
    with pytest.raises(ValueError, match="integers"):
        freeze_periodic_(ropekit.create_pe("mixed", head_dim=HEAD_DIM, coord_dim=3))
    with pytest.raises(TypeError, match="freq_param"):
        freeze_periodic_(ropekit.create_pe("axial", head_dim=HEAD_DIM, coord_dim=3))
