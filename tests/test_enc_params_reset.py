"""``reset_parameters()``: meta-device builds, ``to_empty`` and re-initialisation equal an eager build."""

from __future__ import annotations

import pytest
import torch

from ropekit import create_pe, list_pes

OPTS = {"circulant": {"block_size": 4}, "comrope-ap": {"block_size": 4}, "comrope-ld": {"block_size": 4}}
VARIANTS = [(n, OPTS.get(n, {})) for n in list_pes()] + [
    ("axial", {"learnable_freqs": True}), ("comrope-ld", {"block_size": 4, "init": "zero"}),
    ("relaxed", {"exact": True}), ("cayley", {"band": 3}), ("liere", {"block_size": 4, "per_head": True}),
    ("comrope-ld", {"block_size": 4, "init": "normal"}), ("comrope-ap", {"block_size": 4, "init": "normal"}),
]


def _tensors(pe) -> dict:
    return {**dict(pe.named_parameters()), **dict(pe.named_buffers())}


@pytest.mark.parametrize("name,opts", VARIANTS, ids=lambda v: str(v))
def test_meta_to_empty_reset_equals_eager(name, opts):
    kw = dict(head_dim=8, coord_dim=2, num_heads=2, **opts)
    torch.manual_seed(123)
    eager = create_pe(name, **kw)
    with torch.device("meta"):
        lazy = create_pe(name, **kw)
    assert all(t.is_meta for t in _tensors(lazy).values())
    lazy.to_empty(device="cpu")
    torch.manual_seed(123)
    lazy.reset_parameters()
    want, got = _tensors(eager), _tensors(lazy)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    x, coords = torch.randn(2, 2, 5, 8), torch.rand(5, 2) * 5
    assert torch.equal(lazy.rotate(x, coords), eager.rotate(x, coords))


@pytest.mark.parametrize("name,opts", VARIANTS, ids=lambda v: str(v))
def test_reset_after_training_step_restores_init(name, opts):
    kw = dict(head_dim=8, coord_dim=2, num_heads=2, **opts)
    torch.manual_seed(7)
    pe = create_pe(name, **kw)
    init = {k: v.clone() for k, v in _tensors(pe).items()}
    with torch.no_grad():
        for t in _tensors(pe).values():
            if t.is_floating_point():
                t.add_(1.0)
    torch.manual_seed(7)
    pe.reset_parameters()
    for key, value in _tensors(pe).items():
        assert torch.equal(value, init[key]), key


def test_axial_table_is_refilled_after_to_empty():
    with torch.device("meta"):
        pe = create_pe("axial", head_dim=8, coord_dim=2)
    pe.to_empty(device="cpu")
    pe.freq_table.fill_(float("nan"))  # what uninitialised memory may hold
    pe.reset_parameters()
    ref = create_pe("axial", head_dim=8, coord_dim=2)
    assert torch.equal(pe.freq_table, ref.freq_table)
