"""``create_pe(..., preset="paper")``: each encoding as its paper trained it; explicit options still win."""

from __future__ import annotations

import math

import pytest
import torch

from ropekit import create_pe, list_pes
from ropekit.encodings.registry import PAPER_PRESETS


def test_every_encoding_has_a_paper_preset_that_builds_and_runs():
    assert set(PAPER_PRESETS) == set(list_pes())
    for name in list_pes():
        pe = create_pe(name, head_dim=32, coord_dim=2, num_heads=2, preset="paper")
        x = torch.randn(1, 2, 5, 32)
        q, _ = pe(x, x, torch.rand(4, 2) * 13, num_prefix_tokens=1)
        assert torch.isfinite(q).all()


def test_mixed_paper_preset_is_heo_et_al():
    pe = create_pe("mixed", head_dim=32, coord_dim=2, num_heads=3, preset="paper")
    assert pe.per_head and pe.freqs.shape == (3, 2, 16)
    mag = pe.freqs.detach().norm(dim=1)  # (H, P): |w| per pair
    group = torch.arange(16) % 8
    assert torch.allclose(mag, (10.0 ** (-group / 8.0)).float().expand(3, -1), atol=1e-6)  # theta = 10


def test_liere_paper_preset_is_the_default_and_the_authors():
    torch.manual_seed(0)
    pe = create_pe("liere", head_dim=16, coord_dim=2, num_heads=4, preset="paper")
    assert pe.block_size == 16 and not pe.per_head
    raw = pe.generator_params.detach()
    assert raw.shape == (1, 2, 1, 16, 16) and raw.min() >= 0 and raw.max() < 2 * math.pi


@pytest.mark.parametrize("name", ["comrope-ap", "comrope-ld"])
def test_comrope_paper_preset_random_bases_per_head(name):
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=64, coord_dim=2, num_heads=4, block_size=8, preset="paper")
    assert pe.per_head and pe.block_params.shape == (4, 8, 28)
    # free entries of B - B^T with B ~ N(0, 1): variance 2
    assert abs(float(pe.block_params.detach().var()) - 2.0) < 0.3
    assert not torch.equal(pe.block_params[0], pe.block_params[1])
    explicit = create_pe(name, head_dim=64, coord_dim=2, num_heads=4, preset="paper", init="zero")
    assert explicit.block_params.abs().max() == 0  # explicit options override the preset


def test_unknown_preset_rejected():
    with pytest.raises(ValueError, match="preset"):
        create_pe("mixed", head_dim=8, coord_dim=2, preset="papers")
