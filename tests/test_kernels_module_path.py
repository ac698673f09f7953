"""Frequency encodings whose state is for the fused kernel: q and k go to the kernel in their own dtype, in one
launch, and give what the PyTorch path gives (Triton's interpreter on a machine without CUDA, tiny sizes)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from ropekit.encodings import create_pe  # noqa: E402
from ropekit.encodings.rope import KernelState  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture()
def kernel_mode(monkeypatch):
    """Run the fused kernel (interpreted on the CPU) inside the test, the PyTorch path outside."""
    def on(enabled: bool) -> None:
        if DEVICE == "cpu":
            monkeypatch.setenv("TRITON_INTERPRET", "1" if enabled else "0")
    return on


def _run(pe, q, k, coords, prefix, k_coords=None):
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    qo, ko = pe(q, k, coords, num_prefix_tokens=prefix, k_coords=k_coords)
    wq = torch.sin(torch.arange(qo.numel(), device=qo.device, dtype=torch.float32)).view(qo.shape)
    wk = torch.cos(torch.arange(ko.numel(), device=ko.device, dtype=torch.float32)).view(ko.shape)
    loss = (qo.float() * wq).sum() + (ko.float() * wk).sum()
    params = [p for p in pe.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [q, k] + params)
    return qo, ko, grads


@pytest.mark.parametrize("name", ["axial", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prefix,per_example,layout", [(0, False, "bhnd"), (1, True, "bhnd"), (2, False, "bnhd")])
def test_module_kernel_path_equals_pytorch_path(kernel_mode, monkeypatch, name, dtype, prefix, per_example, layout):
    torch.manual_seed(0)
    b, h, m, d = 2, 2, 6, 8
    pe = create_pe(name, head_dim=d, coord_dim=2, num_heads=h, layout=layout).to(DEVICE)
    coords = (torch.rand(b, m, 2) * 4 if per_example else torch.rand(m, 2) * 4).to(DEVICE)
    shape = (b, h, m + prefix, d) if layout == "bhnd" else (b, m + prefix, h, d)
    q = torch.randn(shape, device=DEVICE).to(dtype)
    k = torch.randn(shape, device=DEVICE).to(dtype)
    kernel_mode(False)
    ref = _run(pe, q, k, coords, prefix)
    kernel_mode(True)
    calls, casts = [], []
    from ropekit.kernels import rotary
    real = rotary.fused_rotary
    monkeypatch.setattr(rotary, "fused_rotary", lambda *a, **kw: calls.append(a[0].dtype) or real(*a, **kw))
    monkeypatch.setattr("ropekit.kernels.fused_rotary", rotary.fused_rotary)
    assert isinstance(pe.prepare(coords, prefix).q, KernelState)
    out = _run(pe, q, k, coords, prefix)
    assert calls == [dtype], "q and k must go to the kernel together, in their own dtype"
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for a, r in zip(out[:2], ref[:2]):
        assert a.dtype == dtype and a.shape == r.shape
        torch.testing.assert_close(a.float(), r.float(), **tol)
    for a, r in zip(out[2], ref[2]):
        torch.testing.assert_close(a.float(), r.float(), **tol)


def test_apply_one_and_separate_keys_on_kernel_path(kernel_mode):
    torch.manual_seed(1)
    pe = create_pe("mixed", head_dim=8, coord_dim=2, num_heads=2).to(DEVICE)
    coords, k_coords = torch.rand(5, 2, device=DEVICE) * 3, torch.rand(7, 2, device=DEVICE) * 3
    q = torch.randn(2, 2, 6, 8, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 8, 8, device=DEVICE, dtype=torch.bfloat16)
    kernel_mode(False)
    ref = _run(pe, q, k, coords, 1, k_coords)
    ref_one = pe.rotate(q, coords, num_prefix_tokens=1)
    kernel_mode(True)
    out = _run(pe, q, k, coords, 1, k_coords)
    one = pe.rotate(q, coords, num_prefix_tokens=1)
    assert one.dtype == torch.bfloat16
    torch.testing.assert_close(one.float(), ref_one.float(), rtol=2e-2, atol=2e-2)
    for a, r in zip(list(out[:2]) + list(out[2]), list(ref[:2]) + list(ref[2])):
        # bf16: the kernel reads the frequency gradient off its bf16 output, the PyTorch path off fp32 values
        a, r = a.detach().float(), r.detach().float()
        assert float((a - r).norm() / r.norm()) < 2e-2


@pytest.mark.parametrize("name,opts", [("cayley", {}), ("cayley", {"per_head": True}), ("circulant", {}),
                                       ("circulant", {"block_size": 4}), ("circulant", {"block_size": 3, "d": 6})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_basis_encodings_rotate_with_the_kernel(kernel_mode, name, opts, dtype):
    """Cayley (P x, then the mixed rotation) and circulant (the DFT basis per block, then its modes' rotation) use
    the kernel for the rotation where it runs (odd circulant blocks keep the PyTorch path); same values, same
    gradients (parameters included)."""
    opts = dict(opts)
    d = opts.pop("d", 8)
    torch.manual_seed(2)
    pe = create_pe(name, head_dim=d, coord_dim=2, num_heads=2, **opts).to(DEVICE)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.3 * torch.randn_like(p))
    coords = torch.rand(2, 5, 2, device=DEVICE) * 3
    q = torch.randn(2, 2, 6, d, device=DEVICE).to(dtype)
    k = torch.randn(2, 2, 6, d, device=DEVICE).to(dtype)
    kernel_mode(False)
    ref = _run(pe, q, k, coords, 1)
    kernel_mode(True)
    uses_kernel = name == "cayley" or pe.block_size % 2 == 0
    state = pe.prepare(coords, 1).q
    assert isinstance(state[0] if name == "cayley" else state, KernelState) == uses_kernel
    out = _run(pe, q, k, coords, 1)
    rel = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for a, r in zip(list(out[:2]) + list(out[2]), list(ref[:2]) + list(ref[2])):
        assert a.dtype == r.dtype and a.shape == r.shape
        a, r = a.detach().float(), r.detach().float()
        assert float((a - r).norm() / r.norm()) < rel


def test_folded_rope_prefix_matrix_on_kernel_path(kernel_mode):
    """A folded encoding transforms its prefix tokens (the kernel would pass them through): same as PyTorch."""
    from ropekit.fold import fold_pe

    torch.manual_seed(4)
    pe = create_pe("cayley", head_dim=8, coord_dim=2, num_heads=2)
    with torch.no_grad():
        pe.cayley_params.add_(0.3 * torch.randn_like(pe.cayley_params))
    folded, _ = fold_pe(pe)
    folded = folded.to(DEVICE)
    assert folded.prefix_matrix is not None
    coords = torch.rand(5, 2, device=DEVICE) * 3
    q = torch.randn(2, 2, 7, 8, device=DEVICE)
    k = torch.randn(2, 2, 7, 8, device=DEVICE)
    kernel_mode(False)
    ref = _run(folded, q, k, coords, 2)
    kernel_mode(True)
    out = _run(folded, q, k, coords, 2)
    for a, r in zip(list(out[:2]) + list(out[2]), list(ref[:2]) + list(ref[2])):
        torch.testing.assert_close(a.detach(), r.detach(), rtol=1e-5, atol=1e-5)
