"""The fused basis change and rotation (ropekit.kernels.fused_basis_rotary) against dense float64 matrices.

The reference builds, for every token, the dense ``d x d`` rotation ``RoPE(theta)`` (2 x 2 blocks on the diagonal)
and multiplies ``RoPE(theta) @ P @ x`` in float64; gradients come from autograd through it. Without a CUDA device
the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` for this module's tests only), on tiny sizes.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

import ropekit  # noqa: E402
import ropekit.kernels.basis as basis_mod  # noqa: E402
from ropekit.kernels import basis_rotary_supported, fused_basis_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def _interpreter(triton_mode):  # compiled on CUDA, else Triton's interpreter (tests/conftest.py)
    yield


def _dense_reference(x: Tensor, p: Tensor, coords: Tensor, freqs: Tensor, prefix: int, post: bool = False) -> Tensor:
    """``RoPE(theta_n) P x_n`` (``post``: ``P^T RoPE(theta_n) P x_n``) per token with dense float64 ``d x d``
    matrices; prefix tokens unchanged."""
    b, h, n, d = x.shape
    x, p, coords, freqs = (t.double() for t in (x, p, coords, freqs))
    r = coords.expand(b, -1, -1) if coords.dim() == 3 else coords.unsqueeze(0).expand(b, -1, -1)  # (B, M, c)
    w = freqs.expand(h, -1, -1) if freqs.dim() == 3 else freqs.unsqueeze(0).expand(h, -1, -1)  # (H, c, d/2)
    theta = torch.einsum("bmc,hcp->bhmp", r, w)  # (B, H, M, d/2)
    rot = torch.zeros(b, h, n - prefix, d, d, dtype=torch.float64)
    idx = torch.arange(d // 2)
    rot[..., 2 * idx, 2 * idx] = theta.cos()
    rot[..., 2 * idx + 1, 2 * idx + 1] = theta.cos()
    rot[..., 2 * idx, 2 * idx + 1] = -theta.sin()
    rot[..., 2 * idx + 1, 2 * idx] = theta.sin()
    ph = p.expand(h, -1, -1).unsqueeze(1)  # (H, 1, d, d)
    full = rot @ ph  # (B, H, M, d, d): RoPE(theta) P
    if post:
        full = ph.transpose(-1, -2) @ full
    body = (full @ x[:, :, prefix:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([x[:, :, :prefix], body], dim=2)


def _orthogonal(hp: int, d: int, gen: torch.Generator) -> Tensor:
    a = torch.randn(hp, d, d, generator=gen)
    s = 0.2 * (a - a.transpose(-1, -2))
    eye = torch.eye(d)
    return torch.linalg.solve(eye + s, eye - s)  # a Cayley rotation, (hp, d, d)


CASES = [  # B, H, N, d, c, basis heads, freq heads, per-example coords, prefix
    (2, 3, 37, 32, 2, 1, 3, False, 0),
    (2, 2, 20, 64, 3, 2, 1, True, 2),
    (1, 2, 9, 32, 1, 2, 2, True, 1),
    (3, 1, 70, 32, 2, 1, 1, False, 1),  # more tokens than one tile
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("post", [False, True])
def test_matches_dense_float64_forward_and_every_gradient(case, dtype, post):
    bsz, h, n, d, c, hp, hf, per_example, prefix = case
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    m = n - prefix
    x = torch.randn(bsz, h, n, d, generator=gen).to(dtype).to(DEVICE).requires_grad_(True)
    p = _orthogonal(hp, d, gen).to(DEVICE).requires_grad_(True)
    coords = (torch.randn(*((bsz,) if per_example else ()), m, c, generator=gen) * 40).to(DEVICE).requires_grad_(True)
    freqs = torch.randn(*((hf,) if hf > 1 else ()), c, d // 2, generator=gen).to(DEVICE).requires_grad_(True)
    y = fused_basis_rotary(x, p, coords, freqs, num_prefix_tokens=prefix, transpose_back=post)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y[:, :, :prefix], x[:, :, :prefix])  # prefix tokens pass through bit for bit
    ref = _dense_reference(x.detach().cpu(), p.detach().cpu(), coords.detach().cpu(), freqs.detach().cpu(), prefix,
                           post)
    out_tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16 outputs: one rounding of the result
    assert (y.detach().cpu().double() - ref).abs().max() <= out_tol * ref.abs().max()

    g = torch.randn(y.shape, generator=gen).to(dtype).to(DEVICE)
    got = torch.autograd.grad(y, (x, p, coords, freqs), g)
    leaves = [t.detach().cpu().double().requires_grad_(True) for t in (x, p, coords, freqs)]
    want = torch.autograd.grad(_dense_reference(*leaves, prefix, post), leaves, g.cpu().double())
    for name, a, b in zip(("x", "basis", "coords", "freqs"), got, want):
        assert a.shape == b.shape, name
        tol = 8e-3 if (name == "x" and dtype == torch.bfloat16) else 2e-5  # parameter gradients accumulate in fp32
        err = (a.detach().cpu().double() - b).abs().max() / b.abs().max()
        assert err <= tol, (name, err.item())


def test_any_strides_and_no_gradient_requested():
    gen = torch.Generator().manual_seed(3)
    x_bnhd = torch.randn(2, 11, 2, 32, generator=gen, device="cpu").to(DEVICE)  # (B, N, H, d) storage
    x = x_bnhd.transpose(1, 2)  # (B, H, N, d) view
    p = _orthogonal(1, 32, gen).to(DEVICE)
    coords, freqs = torch.randn(11, 2, generator=gen).to(DEVICE), torch.randn(2, 16, generator=gen).to(DEVICE)
    y = fused_basis_rotary(x, p, coords, freqs)
    ref = _dense_reference(x.cpu(), p.cpu(), coords.cpu(), freqs.cpu(), 0)
    assert (y.cpu().double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_unsupported_arguments_are_refused_with_the_reason():
    x = torch.randn(1, 2, 5, 48, device=DEVICE)
    p, coords = torch.eye(48, device=DEVICE)[None], torch.zeros(5, 2, device=DEVICE)
    freqs = torch.zeros(2, 24, device=DEVICE)
    assert not basis_rotary_supported(x, p, coords, freqs)  # d = 48 is not a power of two
    with pytest.raises(ValueError, match="does not handle d=48"):
        fused_basis_rotary(x, p, coords, freqs)
    x = torch.randn(1, 2, 5, 32, device=DEVICE)
    with pytest.raises(ValueError, match="basis must be"):
        fused_basis_rotary(x, torch.eye(32, device=DEVICE)[None].expand(3, -1, -1), coords,
                           torch.zeros(2, 16, device=DEVICE))
    with pytest.raises(ValueError, match="coords must be"):
        fused_basis_rotary(x, torch.eye(32, device=DEVICE)[None], coords[:4], torch.zeros(2, 16, device=DEVICE))


@pytest.mark.parametrize("name,head_dim,options,fused", [("cayley", 32, {"per_head": True}, True),
                                                          ("cayley", 48, {}, False),
                                                          ("circulant", 32, {}, True),
                                                          ("circulant", 64, {"block_size": 16, "per_head": True}, True),
                                                          ("circulant", 48, {"block_size": 16}, False)])
def test_encodings_take_the_fused_pass_where_it_runs_and_equal_their_other_form(name, head_dim, options, fused,
                                                                                monkeypatch):
    """Cayley- and Circulant-STRING applied to every token (their own forward) go through the fused kernel where
    it is supported and give the other form's outputs and gradients (which the encoding tests check against
    matrix_exp)."""
    torch.manual_seed(0)
    pe = ropekit.create_pe(name, head_dim=head_dim, coord_dim=2, num_heads=2, **options).to(DEVICE)
    with torch.no_grad():
        for prm in pe.parameters():
            prm.normal_(0, 0.1)
    q = torch.randn(2, 2, 13, head_dim, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 2, 13, head_dim, device=DEVICE, requires_grad=True)
    coords = torch.randn(2, 12, 2, device=DEVICE) * 3
    calls = []
    real = basis_mod._FusedBasisRotary.apply
    monkeypatch.setattr(basis_mod._FusedBasisRotary, "apply", lambda *a: calls.append(1) or real(*a))

    def run():
        qo, ko = pe(q, k, coords, num_prefix_tokens=1)
        loss = (qo * torch.linspace(-1, 1, head_dim, device=DEVICE)).sum() + (ko ** 2).sum()
        return [qo, ko, *torch.autograd.grad(loss, [q, k, *pe.parameters()])]

    got = run()
    assert len(calls) == (2 if fused else 0)
    monkeypatch.setattr("ropekit.encodings.rope.fused_basis_kernel", lambda *a: None)  # the other form (KernelState)
    want = run()
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_a_failing_kernel_is_not_hidden(monkeypatch):
    """A kernel that fails on the device raises its error in the encoding's forward pass (no silent switch to
    another form); ``backend="torch"`` is the way around it."""
    def broken(*a):
        raise RuntimeError("no such instruction on this GPU")

    monkeypatch.setattr(basis_mod._FusedBasisRotary, "apply", broken)
    pe = ropekit.create_pe("cayley", head_dim=32, coord_dim=2, num_heads=2).to(DEVICE)
    q = torch.randn(1, 2, 5, 32, device=DEVICE)
    coords = torch.zeros(5, 2, device=DEVICE)
    with pytest.raises(RuntimeError, match="no such instruction"):
        pe(q, q, coords)
    qo, ko = pe.set_conventions(backend="torch")(q, q, coords)
    assert torch.allclose(qo, q, atol=1e-6)  # zero coordinates and P = I at init: the identity


def test_the_first_call_may_come_in_inference_mode(triton_mode):
    pe = ropekit.create_pe("cayley", head_dim=32, coord_dim=2, num_heads=2).to(triton_mode)
    q = torch.randn(1, 2, 6, 32, device=triton_mode)
    coords = torch.randn(6, 2, device=triton_mode)
    with torch.inference_mode():
        out, _ = pe(q, q, coords)
    with torch.no_grad():
        assert torch.equal(out, pe(q, q, coords)[0])
