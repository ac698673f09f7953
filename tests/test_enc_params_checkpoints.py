"""Skew matrices stored by their free entries: counts, Adam-relevant layout, the function of full matrices."""

from __future__ import annotations

import pytest
import torch

from ropekit import create_pe, list_pes
from ropekit.encodings.ops.skew import free_to_skew, full_to_free, skew_to_free

D = 16


def test_counts_free_entries():
    pe = create_pe("cayley", head_dim=D, coord_dim=2)
    assert pe.num_effective_parameters() == sum(p.numel() for p in pe.parameters()) == 2 * D // 2 + D * (D - 1) // 2
    assert pe.num_effective_parameters() == 136
    banded = create_pe("cayley", head_dim=D, coord_dim=2, band=2)
    assert banded.cayley_params.shape == (1, (D - 1) + (D - 2))
    ld = create_pe("comrope-ld", head_dim=D, coord_dim=2, block_size=8)
    assert ld.num_effective_parameters() == D * 7 // 2 + 2 * D // 8  # d (b - 1) / 2 + c d / b
    ap = create_pe("comrope-ap", head_dim=D, coord_dim=2, block_size=8)
    assert ap.num_effective_parameters() == D * 7 // 2


def test_liere_reports_effective_count():
    pe = create_pe("liere", head_dim=D, coord_dim=2, block_size=4)
    stored = sum(p.numel() for p in pe.parameters())
    assert stored == 2 * 4 * 4 * 4
    assert pe.num_effective_parameters() == 2 * D * 3 // 2  # c * d (b - 1) / 2
    dense = create_pe("liere", head_dim=D, coord_dim=2)
    assert dense.num_effective_parameters() == 2 * D * (D - 1) // 2


def test_effective_counts_of_every_encoding():
    """Stored numbers minus those that never act: LieRE's unused triangle, each ``A - A^T`` counted once."""
    d, c, tri = 8, 2, 8 * 7 // 2
    expected = {"string": c * d // 2 + tri, "relaxed": c * 2 + c * 4 * 3 // 2 + tri}  # relaxed: m = d/4 = 2 planes
    for name in list_pes():
        pe = create_pe(name, head_dim=d, coord_dim=c, num_heads=1, **({"block_size": 4} if "comrope" in name else {}))
        stored = sum(p.numel() for p in pe.parameters())
        want = expected.get(name, stored if name != "liere" else c * tri)
        assert pe.num_effective_parameters() == want, name


def test_relaxed_counts_with_an_empty_null_space():
    """Exact relaxed STRING with every plane active has a 0 x 0 null rotation: nothing to count there."""
    d, c = 8, 2
    exact = create_pe("relaxed", head_dim=d, coord_dim=c, exact=True, active_planes=d // 2)
    assert exact.num_effective_parameters() == c * d // 2  # the frequencies only
    relaxed = create_pe("relaxed", head_dim=d, coord_dim=c, exact=False, active_planes=d // 2)
    # frequencies + one skew generator per axis on the d active dims + the d x d mixing rotation
    assert relaxed.num_effective_parameters() == c * d // 2 + c * d * (d - 1) // 2 + d * (d - 1) // 2


def _cayley_state(pe, s: torch.Tensor, band) -> dict:
    sd = pe.state_dict()
    sd["cayley_params"] = skew_to_free(s, band)
    return sd


@pytest.mark.parametrize("band", [None, 3])
def test_cayley_free_entries_of_a_full_matrix(band):
    """The free entries of ``S = A - A^T`` (banded: of ``M * A - (M * A)^T``) give the encoding of ``S``."""
    torch.manual_seed(0)
    pe = create_pe("cayley", head_dim=D, coord_dim=2, num_heads=2, band=band)
    a = torch.randn(1, D, D)
    if band is None:
        s_old = a - a.transpose(-1, -2)
    else:  # banded: A masked to its upper band before A - A^T
        i = torch.arange(D)
        mask = ((i[None, :] - i[:, None]) > 0) & ((i[None, :] - i[:, None]) <= band)
        s_old = a * mask - (a * mask).transpose(-1, -2)
    pe.load_state_dict(_cayley_state(pe, s_old, band))
    assert torch.allclose(pe.skew_matrix(), s_old, atol=1e-6)
    # the function of the full-matrix form: R(r) = RoPE(r) (I - S)(I + S)^-1
    eye = torch.eye(D)
    p_old = (eye - s_old[0]) @ torch.linalg.inv(eye + s_old[0])
    x, coords = torch.randn(2, 2, 5, D), torch.randn(5, 2) * 3
    ref = create_pe("mixed", head_dim=D, coord_dim=2, num_heads=2, freqs=pe.freqs.detach()[0])
    assert torch.allclose(pe.rotate(x, coords), ref.rotate(x @ p_old.T, coords), atol=1e-5)


@pytest.mark.parametrize("name", ["comrope-ap", "comrope-ld"])
def test_comrope_free_entries_of_full_bases(name):
    """Full bases ``B_j`` (``K_j = B_j - B_j^T``, the authors' parametrisation) through ``full_to_free``."""
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=D, coord_dim=2, num_heads=2, block_size=4, per_head=True)
    b_full = torch.randn(2, 4, 4, 4)
    sd = pe.state_dict()
    sd["block_params"] = full_to_free(b_full)
    pe.load_state_dict(sd)
    k_old = b_full - b_full.transpose(-1, -2)
    assert torch.allclose(pe.block_generators(), k_old, atol=1e-6)
    # outputs equal the definition: block j of R(r) = expm(s_j K_j), checked with a dense matrix_exp
    coords = torch.randn(3, 2, dtype=torch.float64)
    s = pe.block_scales(coords).double().expand(2, -1, -1)  # (Hp, M, nb)
    blocks = torch.linalg.matrix_exp((s[..., None, None] * k_old.double()[:, None]).contiguous())  # (Hp, M, nb, b, b)
    x = torch.randn(1, 2, 3, D, dtype=torch.float64)
    want = torch.einsum("hmnij,bhmnj->bhmni", blocks, x.unflatten(-1, (4, 4))).flatten(-2)
    assert torch.allclose(pe.double().rotate(x, coords), want, atol=1e-10)


def test_free_entries_round_trip_and_new_checkpoints_load():
    v = torch.randn(3, 6)
    s = free_to_skew(v, 4)
    assert torch.equal(s, -s.transpose(-1, -2))
    pe = create_pe("comrope-ld", head_dim=D, coord_dim=2, block_size=8)
    pe2 = create_pe("comrope-ld", head_dim=D, coord_dim=2, block_size=8, init="zero")
    pe2.load_state_dict(pe.state_dict())
    assert torch.equal(pe2.block_params, pe.block_params)


def test_model_count_uses_effective_counts_once():
    from ropekit.encodings.counting import count_parameters
    pe = create_pe("liere", head_dim=D, coord_dim=2, block_size=4)
    model = torch.nn.ModuleDict({"a": pe, "b": pe, "lin": torch.nn.Linear(3, 2)})  # the encoding shared twice
    assert count_parameters(model) == pe.num_effective_parameters() + 3 * 2 + 2
    assert count_parameters(pe) == pe.num_effective_parameters() < sum(p.numel() for p in pe.parameters())
