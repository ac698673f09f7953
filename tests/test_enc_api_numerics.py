"""Numerics and hidden costs of the encodings: fp32 angles (TF32- and bf16-proof), second derivatives, no
recompilation per grid size, no host synchronisation for the coordinate check."""

import math

import pytest
import torch

from ropekit.encodings import create_pe
from ropekit.encodings.base import check_coords
from ropekit.encodings.ops.angles import frequency_angles
from ropekit.encodings.ops.blocks import block_apply
from ropekit.encodings.ops.rotation import apply_frequency_rope

H, D = 2, 16


def test_angles_are_elementwise_not_matmul(monkeypatch):
    """The angles never go through a matrix product (which TF32 would round on a GPU)."""
    coords = torch.randn(2, 7, 3)
    freqs = torch.randn(4, 3, 8)

    def forbidden(*args, **kwargs):
        raise AssertionError("angles must not use matmul / einsum")

    want = torch.einsum("bmc,hcp->bhmp", coords.double(), freqs.double())
    monkeypatch.setattr(torch, "einsum", forbidden)
    monkeypatch.setattr(torch, "matmul", forbidden)
    got = frequency_angles(coords, freqs)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
    pe = create_pe("mixed", head_dim=D, coord_dim=3, num_heads=H)
    pe(torch.randn(2, H, 7, D), torch.randn(2, H, 7, D), coords)  # no matmul anywhere in the mixed forward


@pytest.mark.parametrize("name", ["axial", "mixed", "liere-commute"])
def test_bf16_inputs_keep_fp32_angles(name):
    """bf16 q/k at coordinates up to 4096: the rotation applied is the float64 one to <= 1e-3 rad."""
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=D, coord_dim=2, num_heads=H)
    coords = torch.tensor([[4096.0, 4095.0], [1234.0, 4000.0], [0.0, 17.0]])
    # many random vectors per token: averaging over them separates the angle from bf16 rounding of q itself
    q = torch.randn(256, H, 3, D).to(torch.bfloat16)
    out, _ = pe(q, q, coords)
    assert out.dtype == torch.bfloat16
    x = q.double().unflatten(-1, (-1, 2))
    y = out.double().unflatten(-1, (-1, 2))
    cross = (x[..., 0] * y[..., 1] - x[..., 1] * y[..., 0]).sum(0)  # sum over vectors: (H, M, P)
    dot = (x[..., 0] * y[..., 0] + x[..., 1] * y[..., 1]).sum(0)
    implied = torch.atan2(cross, dot)
    want = (coords.double().unsqueeze(0).unsqueeze(-1) * pe.freqs.detach().double().unsqueeze(1)).sum(-2)  # (Hp, M, P)
    err = torch.remainder(implied - want + math.pi, 2 * math.pi) - math.pi
    assert err.abs().max() <= 1e-3
    # the state itself: fp32 tables, angles within fp32 round-off of float64
    state = pe.prepare(coords)
    theta, cos, sin = state.q
    assert theta.dtype == torch.float64 and cos.dtype == torch.float32
    table_err = torch.remainder(torch.atan2(sin.double(), cos.double()) - want + math.pi, 2 * math.pi) - math.pi
    assert table_err.abs().max() <= 1e-3


def test_apply_frequency_rope_bf16_output_dtype_and_fp32_math():
    q = torch.randn(1, 2, 3, 8).to(torch.bfloat16)
    coords = torch.tensor([[4096.0], [2048.0], [1.0]])
    freqs = torch.rand(1, 4)
    out, none = apply_frequency_rope(q, None, coords, freqs)
    assert none is None and out.dtype == torch.bfloat16
    ref, _ = apply_frequency_rope(q.double(), None, coords.double(), freqs.double())
    assert (out.double() - ref).abs().max() <= 2e-2  # bf16 output rounding only (|q| ~ 3)


@pytest.mark.parametrize("eshape", [(2, 1, 3, 2, 2, 2), (1, 1, 3, 2, 2, 2), (2, 2, 3, 2, 2, 2), (1, 2, 3, 2, 2, 2)])
def test_block_apply_second_derivatives(eshape):
    torch.manual_seed(0)
    e = torch.randn(*eshape, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(block_apply, (e, x))


@pytest.mark.parametrize("name", ["mixed", "axial", "liere-commute"])
def test_frequency_rope_second_derivatives(name):
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=8, coord_dim=2, num_heads=2).double()
    x = torch.randn(2, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    coords = torch.randn(2, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x_, c_: pe(x_, x_, c_, num_prefix_tokens=1)[0], (x, coords))


@pytest.mark.parametrize("name", ["mixed", "axial", "cayley", "circulant"])
def test_no_recompile_per_grid_size(name):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    pe = create_pe(name, head_dim=D, coord_dim=2, num_heads=H)
    counter = CompileCounter()
    compiled = torch.compile(pe, backend=counter, dynamic=True, fullgraph=True)
    for g in (3, 4, 5):
        ys, xs = torch.meshgrid(torch.arange(g, dtype=torch.float32), torch.arange(g, dtype=torch.float32),
                                indexing="ij")
        coords = torch.stack([ys.reshape(-1), xs.reshape(-1)], -1)
        q = torch.randn(2, H, g * g + 1, D)
        qe, _ = compiled(q, q, coords, num_prefix_tokens=1)
        torch.testing.assert_close(qe, pe(q, q, coords, num_prefix_tokens=1)[0])
    assert counter.frame_count == 1


def test_coordinate_check_does_not_sync_on_accelerators(monkeypatch):
    """On a non-CPU device the finiteness check never reads a value on the host, and never asserts device-side
    (a failed device-side assert leaves a CUDA context unusable): it counts, see tests/test_adversarial_coords.py."""
    calls = []
    monkeypatch.setattr(torch, "_assert_async", lambda t, *a: calls.append(t))
    coords = torch.randn(5, 2, device="meta")  # not on the CPU: reading a value back would be a sync
    check_coords(coords, 2, 5)
    assert not calls
    with pytest.raises(ValueError, match="NaN"):  # on the CPU the error is immediate
        check_coords(torch.tensor([[0.0, float("nan")]]), 2, 1)


def _tf32_emulated_matmul(a, b):
    """A float32 product whose inputs are rounded to TF32 (10 mantissa bits, nearest), as on a GPU with TF32."""
    def rnd(t):
        bits = t.contiguous().view(torch.int32)
        return ((bits + 0x1000) & -8192).view(torch.float32)
    return torch.matmul(rnd(a).double(), rnd(b).double()).float()


def test_precise_matmul_is_tf32_proof(monkeypatch):
    """The split form used for basis changes on TF32 GPUs: forward and gradients to ~1e-6 relative under an
    emulated TF32 product, where the plain product is ~1e-3 off."""
    import ropekit.encodings.ops.products as fn

    torch.manual_seed(0)
    a = torch.randn(3, 2, 50, 16, requires_grad=True)
    b = torch.linalg.qr(torch.randn(16, 16))[0].requires_grad_(True)
    g = torch.randn(3, 2, 50, 16)
    a64, b64 = a.detach().double(), b.detach().double()
    ref = a64 @ b64
    ref_ga, ref_gb = g.double() @ b64.T, (a64.transpose(-1, -2) @ g.double()).sum((0, 1))
    plain = _tf32_emulated_matmul(a.detach(), b.detach())
    rel = lambda x, y: float((x.detach().double() - y).norm() / y.norm())  # noqa: E731
    assert rel(plain, ref) > 1e-4  # the emulation does round like TF32
    monkeypatch.setattr(fn, "_mm", _tf32_emulated_matmul)
    out = fn._PreciseMatmul.apply(a, b)
    ga, gb = torch.autograd.grad(out, (a, b), g)
    assert rel(out, ref) < 5e-6 and rel(ga, ref_ga) < 5e-6 and rel(gb, ref_gb) < 5e-6
    # second derivative flows through the split form too: d/da <d(out.g)/db, v> = g v^T
    v = torch.randn(16, 16)
    _, gb2 = torch.autograd.grad(fn._PreciseMatmul.apply(a, b), (a, b), g, create_graph=True)
    (gga,) = torch.autograd.grad((gb2 * v).sum(), a)
    assert rel(gga, g.double() @ v.double().T) < 5e-6
