"""The adversarial cases on the device the model trains on: the CPU everywhere, and CUDA where there is one.

On CUDA the paths differ from the CPU's: the rotations run the fused Triton kernels, attention runs PyTorch's
flash / memory-efficient kernels, and a NaN coordinate is counted on the device instead of raised at once. The same
assertions run on both devices against a float64 dense reference computed on the CPU
(``test_adversarial_ties._dense_attention``), so a CUDA machine (``tools/gpu_session.sh checks``) checks the CUDA
branches with the very tests the CPU passes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ropekit
from ropekit.nn import Attention
from test_adversarial_ties import _dense_attention, _hvp, _rel, _set_blocks

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


def _layer(name: str, opts: dict, device: str, tie: bool = True) -> Attention:
    """A float32 layer on ``device`` with parameters off their init (ComRoPE: a tie in every block)."""
    torch.manual_seed(0)
    pe = ropekit.create_pe(name, head_dim=32, coord_dim=2, num_heads=2, **opts)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if tie and name.startswith("comrope"):
        _set_blocks(pe, [0.0])
    return Attention(64, 2, pe, fold=True).to(device)


CASES = [("mixed", {}), ("cayley", {}), ("circulant", {"block_size": 8}), ("comrope-ld", {"block_size": 4})]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,opts", CASES, ids=str)
@pytest.mark.parametrize("scale", [3.0, 1e4], ids=["r3", "r1e4"])
def test_folded_layer_values_and_gradients(device, name, opts, scale):
    """The default (folded) layer in fp32 on the device: output and every gradient within fp32 accuracy of the
    float64 dense reference, at a ComRoPE tie and at coordinates of 1e4."""
    att = _layer(name, opts, device)
    ref = copy.deepcopy(att).cpu().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 64, generator=g)
    coords = torch.rand(6, 2, generator=g) * scale
    out = att(x.to(device), coords.to(device), 1)
    w = torch.linspace(-1, 1, out.numel()).view_as(out)
    grads = torch.autograd.grad((out * w.to(device)).sum(), list(att.parameters()))
    want = _dense_attention(ref, x.double(), coords.double(), 1)
    g_ref = torch.autograd.grad((want * w.double()).sum(), list(ref.parameters()))
    assert _rel(out.cpu(), want) < 1e-5
    for a, b in zip(grads, g_ref):
        assert _rel(a.cpu(), b) < 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,opts", CASES, ids=str)
def test_second_derivatives_on_the_device(device, name, opts):
    """Hessian-vector products through the folded layer on the device (fused attention and rotation kernels on
    CUDA) equal the float64 reference's to fp32 accuracy."""
    att = _layer(name, opts, device)
    ref = copy.deepcopy(att).cpu().double()
    g = torch.Generator().manual_seed(2)
    x, coords = torch.randn(2, 7, 64, generator=g), torch.randn(6, 2, generator=g) * 2
    got = _hvp(att, x.to(device), coords.to(device), 1, lambda: att(x.to(device), coords.to(device), 1))
    want = _hvp(ref, x.double(), coords.double(), 1, lambda: _dense_attention(ref, x.double(), coords.double(), 1))
    for a, b in zip(got, want):
        assert _rel(a.cpu(), b) < 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_nan_coordinates_are_reported_without_killing_the_device(device):
    """A NaN coordinate in the folded layer: on the CPU a ValueError at once; deferred (the default on CUDA) no
    host synchronisation during the forward pass, the same ValueError from ``check_deferred_coords``, and the
    device still works afterwards (a device-side assert would have left the CUDA context unusable)."""
    att = _layer("cayley", {}, device)
    x = torch.randn(2, 7, 64, device=device)
    coords = torch.rand(6, 2, device=device)
    coords[2, 1] = float("nan")
    ropekit.encodings.check_deferred_coords()  # nothing pending from elsewhere
    if device == "cpu":
        with pytest.raises(ValueError, match="1 non-finite value"):
            att(x, coords, 1)
        previous = ropekit.encodings.set_coord_validation("deferred")
    else:
        previous = ropekit.encodings.set_coord_validation("auto")
        torch.cuda.set_sync_debug_mode("error")
    try:
        att(x, coords, 1)  # counted, not raised
    finally:
        if device != "cpu":
            torch.cuda.set_sync_debug_mode("default")
        ropekit.encodings.set_coord_validation(previous)
    with pytest.raises(ValueError, match="1 non-finite value"):
        ropekit.encodings.check_deferred_coords()
    assert torch.isfinite(att(x, torch.rand(6, 2, device=device), 1)).all()
