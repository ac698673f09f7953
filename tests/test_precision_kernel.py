"""Angle accuracy of the fused Triton rotation at large coordinates, against float64.

A plain fp32 sum ``sum_j r_j w_j`` is off by half an ulp per product and per addition: ~1e-3 rad at coordinates
up to 4096 with frequencies of magnitude ~1-3 (``|theta| ~ 10^4``). The kernel splits the products exactly and
reduces them modulo 2 pi before adding, so its angles stay within ~1e-6 rad. Checked on unit vectors (the output
of plane ``(1, 0)`` is ``(cos theta, sin theta)``), forward and backward (the inverse rotation), and on bf16
inputs by averaging many random vectors per token.

Without a CUDA device the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set for this module only).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from ropekit.kernels import fused_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0" if DEVICE == "cuda" else "1"
    yield
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old


def _wrap(a: Tensor) -> Tensor:
    return torch.remainder(a + math.pi, 2 * math.pi) - math.pi


def _case(c: int, per_example: bool, per_head: bool, seed: int = 0):
    """Coordinates in [0, 4097) (integers, a third with a fraction) and frequencies uniform in [-3, 3]."""
    g = torch.Generator().manual_seed(seed)
    lead = (2,) if per_example else ()
    coords = torch.randint(0, 4097, (*lead, 40, c), generator=g).float()
    coords[..., ::3, :] += torch.rand(coords[..., ::3, :].shape, generator=g)
    freqs = (torch.rand(*((2,) if per_head else ()), c, 16, generator=g) * 2 - 1) * 3.0
    return coords, freqs


def _want(coords: Tensor, freqs: Tensor) -> Tensor:
    """float64 angles ``(Bc, Hf, M, P)``."""
    r = coords.double() if coords.dim() == 3 else coords.double().unsqueeze(0)
    w = freqs.double() if freqs.dim() == 3 else freqs.double().unsqueeze(0)
    return (r[:, None, :, :, None] * w[None, :, None, :, :]).sum(-2)


@pytest.mark.parametrize("c", [1, 2, 3])
@pytest.mark.parametrize("per_example,per_head", [(False, False), (True, True)], ids=["shared", "per-example-head"])
def test_fp32_angles_within_1e5_rad_at_coordinates_up_to_4096(c, per_example, per_head):
    coords, freqs = _case(c, per_example, per_head)
    x = torch.zeros(2, 2, coords.shape[-2], 32)
    x[..., 0::2] = 1.0  # every plane is (1, 0): the output is (cos theta, sin theta)
    x = x.to(DEVICE).requires_grad_()
    y, _ = fused_rotary(x, None, coords.to(DEVICE), freqs.to(DEVICE))
    want = _want(coords, freqs)  # broadcasts over (B, H)
    got = torch.atan2(y[..., 1::2].detach().double(), y[..., 0::2].detach().double()).cpu()
    assert _wrap(got - want).abs().max() <= 1e-5
    # backward: the input gradient is the output gradient turned by -theta (same in-kernel angles)
    g = torch.zeros_like(y)
    g[..., 0::2] = 1.0
    (gx,) = torch.autograd.grad(y, x, g)
    back = torch.atan2(gx[..., 1::2].double(), gx[..., 0::2].double()).cpu()
    assert _wrap(back + want).abs().max() <= 1e-5
    # the plain fp32 sum is what the test would catch: ~1e-3 rad at these coordinates
    plain = (coords[..., :, :, None] * freqs[..., None, :, :]).sum(-2) if freqs.dim() == 2 else None
    if plain is not None and c > 1:
        assert _wrap(plain.double() - want[:, 0]).abs().max() > 1e-4


def test_bf16_inputs_keep_angles_within_1e3_rad():
    """bf16 q at coordinates up to 4096: averaging many random vectors per token separates the rotation angle
    from bf16 rounding of q and of the output; it is the float64 angle to well under 1e-3 rad."""
    coords, freqs = _case(2, False, False, seed=1)
    q = torch.randn(256, 1, coords.shape[0], 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y, _ = fused_rotary(q.to(DEVICE), None, coords.to(DEVICE), freqs.to(DEVICE))
    assert y.dtype == torch.bfloat16
    x, out = q.double().unflatten(-1, (-1, 2)), y.cpu().double().unflatten(-1, (-1, 2))
    cross = (x[..., 0] * out[..., 1] - x[..., 1] * out[..., 0]).sum(0)  # (1, M, P)
    dot = (x[..., 0] * out[..., 0] + x[..., 1] * out[..., 1]).sum(0)
    err = _wrap(torch.atan2(cross, dot) - _want(coords, freqs)[0])
    assert err.abs().max() <= 1e-3
