"""The CPU paths of training-time folding, each against an independent float64 reference written out here:

* the layer-by-layer merge of the bases into the q/k projections (``fold.fold_qkv_weights`` on the CPU,
  ``_MergeQKRows``) against per-head dense products, values, gradients and second derivatives, and against the
  stacked form that the GPU runs;
* the prefix transform applied inside the rotation's concatenation (``rotate_qk(..., prefix=)``) against the
  prefix tokens transformed by a per-head matrix product and the rest rotated by cos / sin written out;
* the angle gradient's fused dot product (``rotation._collect_times_conj``) against ``sum a * conj(b)`` in
  complex128, for every table shape.

Tolerances: float64 throughout; every quantity is a sum of at most a few hundred products of O(1) numbers, so
its round-off is below ``1e3 * 2^-53 ~ 1e-13`` relative; ``1e-12`` leaves room and still fails on any wrong row,
head or sign.
"""

import itertools

import pytest
import torch

import ropekit.encodings.fold as fold_mod
from ropekit.encodings.ops import rotation
from ropekit.encodings.ops.rotation import rotate_qk
from ropekit.fold import fold_qkv_weights

TOL = dict(rtol=1e-12, atol=1e-12)


def _reference_merge(w, b, p, h):
    """``[P_h W_q,h ; P_h W_k,h ; W_v]`` head by head (``p`` ``(Hp, d, d)``), and the bias likewise."""
    d = p.shape[-1]
    rows = [p[i % h if p.shape[0] > 1 else 0] @ w[i * d:(i + 1) * d] for i in range(2 * h)]
    ref_w = torch.cat(rows + [w[2 * h * d:]])
    ref_b = None
    if b is not None:
        ref_b = torch.cat([p[i % h if p.shape[0] > 1 else 0] @ b[i * d:(i + 1) * d] for i in range(2 * h)]
                          + [b[2 * h * d:]])
    return ref_w, ref_b


def _layers(n, h, d, d_in, bias, seed):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(3 * h * d, d_in, dtype=torch.float64, generator=g).requires_grad_() for _ in range(n)]
    bs = [torch.randn(3 * h * d, dtype=torch.float64, generator=g).requires_grad_() if bias else None
          for _ in range(n)]
    return ws, bs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("hp", [1, 4])
@pytest.mark.parametrize("layers_p,stacked", [(1, True), (3, True), (3, False)])
def test_layer_by_layer_merge_equals_per_head_products(seed, bias, hp, layers_p, stacked):
    """Values and the gradients of every weight, bias and basis (a stacked basis of one layer is shared by all:
    its gradient sums theirs)."""
    n, h, d, d_in = 3, 4, 6, 10
    assert fold_mod._merge_by_layer(torch.device("cpu"))  # the path under test
    ws, bs = _layers(n, h, d, d_in, bias, seed)
    g = torch.Generator().manual_seed(100 + seed)
    p = torch.linalg.qr(torch.randn(layers_p, hp, d, d, dtype=torch.float64, generator=g))[0].requires_grad_()
    if stacked:
        out = fold_qkv_weights(ws, bs, p, h)
    else:  # a list of bases: one per layer
        out = fold_qkv_weights(ws, bs, list(p.unbind(0)), h)
    refs = [_reference_merge(w, b, p[i if layers_p > 1 else 0], h) for i, (w, b) in enumerate(zip(ws, bs))]
    loss = ref_loss = 0
    for (w2, b2), (rw, rb) in zip(out, refs):
        torch.testing.assert_close(w2, rw, **TOL)
        assert w2.is_contiguous() and w2.shape == rw.shape
        gw = torch.randn(rw.shape, dtype=torch.float64, generator=g)
        loss, ref_loss = loss + (w2 * gw).sum(), ref_loss + (rw * gw).sum()
        if bias:
            torch.testing.assert_close(b2, rb, **TOL)
            gb = torch.randn(rb.shape, dtype=torch.float64, generator=g)
            loss, ref_loss = loss + (b2 * gb).sum(), ref_loss + (rb * gb).sum()
        else:
            assert b2 is None
    inputs = ws + [b for b in bs if b is not None] + [p]
    for got, ref in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(ref_loss, inputs)):
        torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_by_layer_merge_equals_the_stacked_form(bias, monkeypatch):
    """The CPU's layer-by-layer merge and the stacked form (what a GPU runs) agree in values and gradients."""
    n, h, d, d_in = 2, 3, 4, 7
    ws, bs = _layers(n, h, d, d_in, bias, 7)
    p = torch.linalg.qr(torch.randn(n, 1, d, d, dtype=torch.float64))[0].requires_grad_()
    inputs = ws + [b for b in bs if b is not None] + [p]

    def run():
        out = fold_qkv_weights(ws, bs, p, h)
        flat = [t for pair in out for t in pair if t is not None]
        loss = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum() for t in flat)
        return flat, torch.autograd.grad(loss, inputs)

    flat, grads = run()
    monkeypatch.setattr(fold_mod, "_merge_by_layer", lambda device: False)
    ref_flat, ref_grads = run()
    for a, b in zip(flat + list(grads), ref_flat + list(ref_grads)):
        torch.testing.assert_close(a, b, **TOL)


def test_layer_by_layer_merge_second_derivatives():
    """Under ``create_graph`` the backward is recorded: gradcheck and gradgradcheck in every input."""
    h, d, d_in = 2, 2, 2  # small: gradgradcheck differentiates every output entry numerically
    ws, bs = _layers(2, h, d, d_in, True, 3)
    p = torch.linalg.qr(torch.randn(2, h, d, d, dtype=torch.float64))[0].requires_grad_()

    def f(p, w0, w1, b0, b1):
        out = fold_qkv_weights([w0, w1], [b0, b1], p, h)
        return tuple(t for pair in out for t in pair)

    args = (p, *ws, *bs)
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


def test_layer_by_layer_merge_with_an_unused_output():
    """A layer whose merged weight gets no gradient (its output unused) contributes nothing to the basis's."""
    h, d, d_in = 2, 4, 5
    ws, bs = _layers(2, h, d, d_in, True, 5)
    p = torch.linalg.qr(torch.randn(1, 1, d, d, dtype=torch.float64))[0].requires_grad_()
    out = fold_qkv_weights(ws, bs, p, h)
    ref = _reference_merge(ws[1], bs[1], p[0], h)
    loss, ref_loss = out[1][0].square().sum(), ref[0].square().sum()
    got = torch.autograd.grad(loss, [p, ws[1], ws[0], bs[0]], allow_unused=True)
    want = torch.autograd.grad(ref_loss, [p, ws[1]])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    assert all(t is None or torch.count_nonzero(t) == 0 for t in got[2:])  # the unused layer's weight and bias


def test_layer_by_layer_merge_under_autocast_stays_in_the_weights_dtype():
    """Under CPU autocast (bfloat16) the merge still runs in float32, as the stacked form does: equal to the
    float64 reference to float32 round-off (at most 2 H D_in = 96 products per entry: below 1e-5 relative; bfloat16
    would be off by ~1e-2), forward and backward."""
    h, d, d_in = 3, 8, 16
    ws, bs = _layers(2, h, d, d_in, True, 11)
    p = torch.linalg.qr(torch.randn(2, 1, d, d, dtype=torch.float64))[0]
    w32, b32 = [w.detach().float().requires_grad_() for w in ws], [b.detach().float().requires_grad_() for b in bs]
    p32 = p.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fold_qkv_weights(w32, b32, p32, h)
        loss = sum(t.sum() for pair in out for t in pair)
    loss.backward()
    for (w2, b2), w, b, pl in zip(out, ws, bs, p):
        assert w2.dtype == b2.dtype == torch.float32
        rw, rb = _reference_merge(w, b, pl, h)
        torch.testing.assert_close(w2.double(), rw, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b2.double(), rb, rtol=1e-5, atol=1e-5)
    pr = p.clone().requires_grad_()
    ref_loss = sum(t.sum() for w, b, pl in zip(ws, bs, pr) for t in _reference_merge(w, b, pl, h))
    ref = torch.autograd.grad(ref_loss, ws + [pr])
    for got, want in zip(w32 + [p32], ref):
        assert got.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad.double(), want, rtol=1e-5, atol=1e-5)


def _rotate_reference(x, coords, freqs, p0, prefix):
    """Prefix tokens by ``prefix`` per head (a loop of matrix products), the others rotated pair by pair with
    cos / sin of ``coords . freqs`` written out (interleaved pairs)."""
    heads = x.shape[-3]
    out = x.clone()
    for hh in range(heads):
        t = prefix[hh if prefix.shape[0] > 1 else 0]
        out[..., hh, :p0, :] = x[..., hh, :p0, :] @ t.T
    theta = coords @ freqs  # (M, d/2)
    c, s = torch.cos(theta), torch.sin(theta)
    xe, xo = x[..., p0:, 0::2], x[..., p0:, 1::2]
    out[..., p0:, 0::2] = xe * c - xo * s
    out[..., p0:, 1::2] = xe * s + xo * c
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("hp", [1, 3])
@pytest.mark.parametrize("p0", [0, 1, 2])
@pytest.mark.parametrize("with_table", [True, False])
def test_rotate_qk_prefix_transform_matches_the_reference(seed, hp, p0, with_table):
    g = torch.Generator().manual_seed(seed)
    b, h, m, d, c = 2, 3, 5, 8, 2
    qk = torch.randn(2, b, h, p0 + m, d, dtype=torch.float64, generator=g, requires_grad=True)
    coords = torch.randn(m, c, dtype=torch.float64, generator=g)
    freqs = torch.randn(1, c, d // 2, dtype=torch.float64, generator=g)
    prefix = torch.randn(hp, d, d, dtype=torch.float64, generator=g, requires_grad=True)
    table = rotation.angle_tables(coords, [freqs], torch.float64)[0] if with_table else None
    q, k = rotate_qk(qk, coords, freqs, table=table, num_prefix_tokens=p0, backend="torch", prefix=prefix)
    ref = _rotate_reference(qk, coords, freqs[0], p0, prefix)
    torch.testing.assert_close(torch.stack([q, k]), ref, **TOL)
    gout = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad((torch.stack([q, k]) * gout).sum(), [qk, prefix], allow_unused=True)
    want = torch.autograd.grad((ref * gout).sum(), [qk, prefix], allow_unused=True)
    torch.testing.assert_close(got[0], want[0], **TOL)
    if p0:
        torch.testing.assert_close(got[1], want[1], **TOL)
    else:  # no prefix token: the matrix is not used
        assert got[1] is None or torch.count_nonzero(got[1]) == 0


def test_rotate_qk_rejects_a_misshapen_prefix():
    qk, coords, freqs = torch.randn(2, 1, 3, 5, 8), torch.randn(4, 2), torch.randn(2, 4)
    for bad in (torch.eye(8), torch.eye(8).expand(2, 8, 8), torch.eye(6)[None]):
        with pytest.raises(ValueError, match="prefix must be"):
            rotate_qk(qk, coords, freqs, num_prefix_tokens=1, backend="torch", prefix=bad)


@pytest.mark.parametrize("bs,hp", list(itertools.product([1, 4], [1, 3])))
@pytest.mark.parametrize("contiguous", [True, False])
def test_collect_times_conj_matches_complex128_sums(bs, hp, contiguous):
    """Every table shape ``(Bs, Hp, M, P)`` (shared / per-example coordinates, shared / per-head frequencies) and
    strided operands (the fallback forms), against the sum of ``a * conj(b)`` over the broadcast dimensions."""
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        shape = (bs, hp, 6, 5)
        full = (2, 4, 3, 6, 5)  # (q | k, B, H, M, P)

        def draw():
            t = torch.complex(torch.randn(full, dtype=torch.float64, generator=g),
                              torch.randn(full, dtype=torch.float64, generator=g))
            return t if contiguous else t.transpose(-1, -2).contiguous().transpose(-1, -2)

        a, b = draw(), draw()
        got = rotation._collect_times_conj(a, b, shape)
        prod = a * b.conj()
        dims = [0] + [1 + i for i in (0, 1) if shape[i] == 1]
        ref = prod.sum(dim=dims)
        assert got.shape == rotation._collector_shape(shape) == ref.shape
        torch.testing.assert_close(got, ref, **TOL)


def test_collect_times_conj_empty_batch():
    a = torch.zeros(2, 0, 3, 6, 5, dtype=torch.complex128)
    got = rotation._collect_times_conj(a, a, (1, 1, 6, 5))
    assert got.shape == (6, 5) and torch.count_nonzero(got) == 0
