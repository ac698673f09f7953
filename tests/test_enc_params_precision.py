"""fp32 exponentials at real image-grid coordinates: orthogonal to 1e-5 and close to a float64 reference.

Coordinates are the 14 x 14 grid of a 224-pixel image with 16-pixel patches (0 .. 13 per axis), the
generators as each encoding initialises them (LieRE: raw parameters uniform in [0, 2 pi), as its authors).
"""

from __future__ import annotations

import pytest
import torch

from ropekit import create_pe


def _grid(n: int = 14) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(n, dtype=torch.float32), torch.arange(n, dtype=torch.float32),
                            indexing="ij")
    return torch.stack((ys, xs), dim=-1).reshape(-1, 2)  # (n*n, 2)


CASES = [("liere", {}, 64), ("liere", {"block_size": 8}, 64), ("string", {}, 64), ("relaxed", {}, 64)]


@pytest.mark.parametrize("name,opts,d", CASES, ids=lambda v: str(v))
def test_fp32_orthogonal_at_grid_coordinates(name, opts, d):
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=d, coord_dim=2, num_heads=1, **opts)
    coords = _grid()
    with torch.no_grad():
        r = pe.matrix(coords)[0]  # (196, d, d), fp32 all the way
    assert r.dtype == torch.float32
    err = torch.linalg.matrix_norm(r.transpose(-1, -2) @ r - torch.eye(d), ord="fro").max()
    assert err <= 1e-5, float(err)
    # and it is the right rotation: against the same encoding in float64
    with torch.no_grad():
        ref = pe.double().matrix(coords.double())[0]
    assert (r.double() - ref).abs().max() < 1e-4


def test_liere_fp32_matches_dense_float64_matrix_exp_on_grid():
    torch.manual_seed(1)
    pe = create_pe("liere", head_dim=32, coord_dim=2, num_heads=1)
    coords = _grid()
    gen = pe.generators()[0].detach().double()  # (c, d, d)
    ref = torch.linalg.matrix_exp(torch.einsum("mc,cij->mij", coords.double(), gen))
    got = pe.matrix(coords)[0].double()
    assert (got - ref).abs().max() < 1e-4


@pytest.mark.parametrize("per_example", [False, True])
def test_liere_chunked_equals_unchunked(per_example):
    """The bounded-memory chunking changes nothing: one token per chunk vs all at once."""
    from ropekit.encodings.ops.expm import linear_skew_expm
    torch.manual_seed(2)
    pe = create_pe("liere", head_dim=16, coord_dim=3, num_heads=1)
    gen = pe.block_generators().detach().double()
    coords = torch.rand(*((2,) if per_example else ()), 7, 3, dtype=torch.float64) * 13
    flat = coords.reshape(-1, 3).requires_grad_()
    a = linear_skew_expm(flat, gen, budget=1)
    b = linear_skew_expm(flat, gen, budget=1 << 30)
    assert torch.equal(a, b) or (a - b).abs().max() < 1e-13
    ga, = torch.autograd.grad(a.square().sum() + a.sum(), flat)
    gb, = torch.autograd.grad(b.square().sum() + b.sum(), flat)
    assert (ga - gb).abs().max() < 1e-10


def test_gpu_path_matches_eigen_path():
    """The float64 matrix_exp used on GPUs and under torch.compile gives the CPU eigen path's values and grads."""
    from ropekit.encodings.ops.expm import _expm64, linear_skew_expm
    torch.manual_seed(3)
    pe = create_pe("liere", head_dim=16, coord_dim=3, num_heads=1)
    gen = pe.block_generators().detach().requires_grad_()
    coords = (torch.rand(6, 3) * 13).requires_grad_()
    a, b = linear_skew_expm(coords, gen), _expm64(coords, gen)
    assert (a - b).abs().max() < 1e-5
    w = torch.randn_like(a)
    ga = torch.autograd.grad((a * w).sum(), (coords, gen))
    gb = torch.autograd.grad((b * w).sum(), (coords, gen))
    for x, y in zip(ga, gb):
        assert (x - y).abs().max() <= 1e-4 * y.abs().max()
