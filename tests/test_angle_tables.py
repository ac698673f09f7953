"""Angle tables formed for several layers at once (``rotation.angle_tables``) and q and k rotated as one tensor
(``rotation.rotate_qk``), against an independent float64 reference: the rotation written out with cos/sin of
``coords @ freqs`` in real arithmetic, differentiated by autograd."""

from __future__ import annotations

import pytest
import torch

import ropekit.encodings.ops.rotation as rot
from ropekit.encodings.ops.angles import angle_table
from ropekit.encodings.ops.rotation import angle_tables, apply_frequency_rope, rotate_qk


def _reference(x: torch.Tensor, coords: torch.Tensor, freqs: torch.Tensor, p0: int) -> torch.Tensor:
    """``x`` ``(B, H, N, d)`` rotated after ``p0`` prefix tokens by ``theta = coords @ freqs``, float64, real pairs."""
    theta = torch.einsum("...mc,hcp->...hmp", coords.double(), freqs.double())  # (Hp, M, P) | (B, Hp, M, P)
    theta = theta.unsqueeze(0) if theta.dim() == 3 else theta
    x64 = x.double()
    x0, x1 = x64[:, :, p0:].unflatten(-1, (-1, 2)).unbind(-1)
    c, s = theta.cos(), theta.sin()
    y = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return torch.cat((x64[:, :, :p0], y), dim=2)


def _case(per_example: bool, dtype: torch.dtype, layers: int = 3, hp: int = 2, p0: int = 1, small: bool = False):
    g = torch.Generator().manual_seed(0)
    b, h, m, d, c = (1, 1, 2, 4, 2) if small else (2, 2, 5, 8, 3)
    coords = (torch.randn(b, m, c, generator=g) if per_example else torch.randn(m, c, generator=g)).to(dtype) * 30
    freqs = [torch.randn(hp, c, d // 2, generator=g, dtype=dtype).requires_grad_() for _ in range(layers)]
    qk = [torch.randn(2, b, h, m + p0, d, generator=g, dtype=dtype).requires_grad_() for _ in range(layers)]
    w = [torch.randn(2, b, h, m + p0, d, generator=g, dtype=dtype) for _ in range(layers)]
    return coords.requires_grad_(), freqs, qk, w, p0


@pytest.mark.parametrize("per_example", [False, True])
def test_tables_equal_one_table_per_matrix(per_example):
    coords, freqs, _, _, _ = _case(per_example, torch.float32)
    for (theta, cos, sin, col), f in zip(angle_tables(coords, freqs, torch.float32), freqs):
        ref = angle_table(coords, f, torch.float32)
        assert theta.dtype == torch.float64 and col is not None and col.is_complex()
        assert col.numel() == theta.numel() and not col.any()  # theta's shape less its leading 1-dimensions
        for a, r in zip((theta, cos, sin), ref):
            torch.testing.assert_close(a, r, rtol=0, atol=0)  # the same products and sums


@pytest.mark.parametrize("per_example", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_rotate_qk_with_tables_matches_the_reference(per_example, dtype, tol):
    """Values and gradients (q, k, every layer's frequencies, the coordinates) through the collector node."""
    coords, freqs, qk, w, p0 = _case(per_example, dtype)
    tables = angle_tables(coords, freqs, dtype)
    loss = 0
    for x, f, t, wx in zip(qk, freqs, tables, w):
        q, k = rotate_qk(x, coords, f, table=t, num_prefix_tokens=p0, backend="torch")
        for out, ref_in, wo in ((q, x[0], wx[0]), (k, x[1], wx[1])):
            torch.testing.assert_close(out.double(), _reference(ref_in.detach(), coords.detach(), f.detach(), p0),
                                       rtol=tol, atol=tol)
            loss = loss + (out * wo).sum()
    inputs = [coords, *freqs, *qk]
    got = torch.autograd.grad(loss, inputs)
    c64 = coords.detach().double().requires_grad_()
    f64 = [f.detach().double().requires_grad_() for f in freqs]
    x64 = [x.detach().double().requires_grad_() for x in qk]
    ref_loss = sum((_reference(x[i], c64, f, p0) * wx[i].double()).sum()
                   for x, f, wx in zip(x64, f64, w) for i in (0, 1))
    want = torch.autograd.grad(ref_loss, [c64, *f64, *x64])
    for a, r in zip(got, want):
        torch.testing.assert_close(a.double(), r, rtol=tol, atol=tol * max(1.0, float(r.abs().max())))


def test_rotate_qk_equals_apply_frequency_rope_without_a_table():
    coords, freqs, qk, w, p0 = _case(False, torch.float32, layers=1)
    x = qk[0]
    q, k = rotate_qk(x, coords, freqs[0], num_prefix_tokens=p0, backend="torch")
    q2, k2 = apply_frequency_rope(x[0], x[1], coords, freqs[0], num_prefix_tokens=p0, backend="torch")
    torch.testing.assert_close(q, q2, rtol=0, atol=0)
    torch.testing.assert_close(k, k2, rtol=0, atol=0)
    ga = torch.autograd.grad((q * w[0][0]).sum() + (k * w[0][1]).sum(), [x, freqs[0]])
    gb = torch.autograd.grad((q2 * w[0][0]).sum() + (k2 * w[0][1]).sum(), [x, freqs[0]])
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_second_derivatives_through_tables_are_exact():
    """Under create_graph the rotation differentiates theta itself (the collector is for first order only)."""
    coords, freqs, qk, w, p0 = _case(True, torch.float64, layers=2, hp=1, small=True)

    def f(c, f0, f1, x0, x1):
        tables = angle_tables(c, [f0, f1], torch.float64)
        out = [rotate_qk(x, c, fr, table=t, num_prefix_tokens=p0, backend="torch")
               for x, fr, t in zip((x0, x1), (f0, f1), tables)]
        return tuple(t for pair in out for t in pair)

    inputs = (coords.detach().double().requires_grad_(), *[fr.detach().requires_grad_() for fr in freqs],
              *[x.detach().requires_grad_() for x in qk])
    assert torch.autograd.gradgradcheck(f, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


def test_stacked_backward_loop_and_batched_forms_agree(monkeypatch):
    coords, freqs, qk, w, p0 = _case(False, torch.float32, layers=2)
    grads = []
    for threshold in (0, 1 << 40):  # loop over q/k and the batch in the CPU's scratch buffer, or one operation
        monkeypatch.setattr(rot, "LOOP_MIN_BYTES", threshold)
        tables = angle_tables(coords, freqs, torch.float32)
        loss = sum((rotate_qk(x, coords, f, table=t, num_prefix_tokens=p0, backend="torch")[i] * wx[i]).sum()
                   for x, f, t, wx in zip(qk, freqs, tables, w) for i in (0, 1))
        grads.append(torch.autograd.grad(loss, [*freqs, coords]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_bad_inputs_are_one_line_errors():
    coords, freqs, qk, _, _ = _case(False, torch.float32)
    with pytest.raises(ValueError, match="one shape"):
        angle_tables(coords, [freqs[0], freqs[1][:1]], torch.float32)
    with pytest.raises(ValueError, match=r"qk must be \(2, B, H, N, d\)"):
        rotate_qk(qk[0][0], coords, freqs[0], backend="torch")
    table = angle_tables(coords, freqs[:1], torch.float32)[0]
    with pytest.raises(ValueError, match="do not fit"):
        rotate_qk(qk[0], coords, freqs[0], table=table, num_prefix_tokens=0, backend="torch")  # 1 prefix token
    bad = coords.detach().clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        angle_tables(bad, freqs, torch.float32)
    assert angle_tables(coords, [], torch.float32) == []
