"""On a CUDA GPU with TF32 matmuls enabled, every encoding in float32 matches a float64 CPU reference to 1e-5.

Many GPU training scripts turn TF32 on (``torch.backends.cuda.matmul.allow_tf32 = True``), which rounds every
matmul/einsum input to a 10-bit mantissa. Rotary angles ``r . omega`` and the encodings' bases must not go
through such a product, or the rotated q and k are off by ~1e-3 relative at grid coordinates. This module builds
each registered encoding once, copies it to float64 on the CPU (the reference) and to float32 on the GPU, and
compares the rotated q, k and the gradients of q, k and every parameter, on a 14 x 14 grid of patch indices
(shared by the batch) and on per-example 3-D coordinates (grid plus a depth in [0, 13]).

It needs a GPU: on a machine without one the module is skipped as a whole (the CPU paths are checked against
dense float64 references by the other encoding tests).
"""

from __future__ import annotations

import copy

import pytest
import torch

from ropekit import create_pe, list_pes

pytestmark = [pytest.mark.gpu, pytest.mark.numerics,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (TF32 only exists there)")]

B, H, D, G = 2, 2, 24, 14
TOL = 1e-5
OPTS = {"circulant": {"block_size": 8}, "liere": {"block_size": 8}, "comrope-ap": {"block_size": 4},
        "comrope-ld": {"block_size": 4}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _coords(c: int, per_example: bool) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(G, dtype=torch.float64), torch.arange(G, dtype=torch.float64), indexing="ij")
    grid = torch.stack((ys, xs), -1).reshape(G * G, 2)  # (M, 2) patch indices 0..13
    if not per_example:
        return grid if c == 2 else torch.cat((grid, torch.zeros(G * G, c - 2, dtype=torch.float64)), -1)
    gen = torch.Generator().manual_seed(1)
    depth = torch.rand(B, G * G, c - 2, generator=gen, dtype=torch.float64) * (G - 1)
    return torch.cat((grid.expand(B, -1, -1), depth), -1)  # (B, M, c)


@pytest.fixture(autouse=True)
def _tf32_on():
    old_mm, old_cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old_mm, old_cudnn


@pytest.mark.parametrize("name", list_pes())
@pytest.mark.parametrize("per_example", [False, True], ids=["grid2d", "rgbd3d"])
def test_fp32_cuda_tf32_matches_float64_cpu(name, per_example):
    c = 3 if per_example else 2
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=D, coord_dim=c, num_heads=H, **OPTS.get(name, {}))
    ref, gpu = copy.deepcopy(pe).double(), copy.deepcopy(pe).float().cuda()
    coords = _coords(c, per_example)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 1 + G * G, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, 1 + G * G, D, generator=gen, dtype=torch.float64)
    w = torch.randn(B, H, 1 + G * G, gpu.out_dim if hasattr(gpu, "out_dim") else D, generator=gen,
                    dtype=torch.float64)

    outs = {}
    for tag, mod, dev, dt in (("ref", ref, "cpu", torch.float64), ("gpu", gpu, "cuda", torch.float32)):
        qq = q.to(dev, dt).detach().clone().requires_grad_()
        kk = k.to(dev, dt).detach().clone().requires_grad_()
        qe, ke = mod(qq, kk, coords.to(dev, dt), num_prefix_tokens=1)
        ww = w[..., :qe.shape[-1]].to(dev, dt)
        ((qe * ww).sum() + (ke * ww.flip(-2)).sum()).backward()
        outs[tag] = {"q": qe, "k": ke, "grad q": qq.grad, "grad k": kk.grad,
                     **{f"grad {n}": p.grad for n, p in mod.named_parameters() if p.grad is not None}}

    assert outs["ref"].keys() == outs["gpu"].keys()
    errs = {key: _rel(outs["gpu"][key], outs["ref"][key]) for key in outs["ref"]}
    bad = {k_: v for k_, v in errs.items() if not v <= TOL}
    assert not bad, f"{name}: relative errors above {TOL}: {bad}"
