"""The per-step work of training-time folding: closed forms checked against the generic computations they
replace, and the count of expensive calls per forward pass."""

import pytest
import torch

from ropekit.encodings import create_pe
from ropekit.encodings import cayley as cayley_module
from ropekit.encodings.ops.blocks import block_diag
from ropekit.encodings.ops.forms import pair_frequencies
from ropekit.fold import fold_qkv_weight, rope_form


def _perturbed(name, **opts):
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=opts.pop("head_dim", 16), coord_dim=2, num_heads=3, **opts).double()
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return pe


@pytest.mark.parametrize("opts", [{}, {"block_size": 8}, {"block_size": 5, "head_dim": 20}, {"per_head": True}])
def test_circulant_form_frequencies_equal_generators_read_off(opts):
    pe = _perturbed("circulant", **opts)
    form = rope_form(pe)
    ref = pair_frequencies(pe.generators()[:pe.param_heads], form.basis)  # (P L_k P^T)[2n+1, 2n], float64
    torch.testing.assert_close(form.freqs, ref, rtol=0, atol=1e-12)
    # and the same gradient
    w = torch.randn_like(ref)
    g_new = torch.autograd.grad((form.freqs * w).sum(), pe.circ_params)[0]
    g_ref = torch.autograd.grad((ref * w).sum(), pe.circ_params)[0]
    torch.testing.assert_close(g_new, g_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("per_head", [False, True])
def test_cayley_form_one_solve_and_prefix_is_transpose(monkeypatch, per_head):
    pe = _perturbed("cayley", per_head=per_head)
    calls = []
    real = cayley_module.cayley_from_free
    monkeypatch.setattr(cayley_module, "cayley_from_free", lambda *a: calls.append(1) or real(*a))
    form = rope_form(pe)
    assert len(calls) == 1
    p = form.basis
    # T = P R(0)^T P^T with R(0) = P
    torch.testing.assert_close(form.prefix, p @ p.transpose(-1, -2) @ p.transpose(-1, -2), rtol=0, atol=1e-12)


@pytest.mark.parametrize("hp", [1, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fold_qkv_weight_matches_per_head_products(hp, with_bias):
    torch.manual_seed(1)
    h, d, d_in = 4, 8, 12
    w = torch.randn(3 * h * d, d_in, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3 * h * d, dtype=torch.float64, requires_grad=True) if with_bias else None
    p = torch.linalg.qr(torch.randn(hp, d, d, dtype=torch.float64))[0].requires_grad_()
    w2, b2 = fold_qkv_weight(w, b, p, h)
    ref_rows = []
    for part in range(2):
        for i in range(h):
            rows = slice((part * h + i) * d, (part * h + i + 1) * d)
            ref_rows.append(p[i if hp > 1 else 0] @ w[rows])
    ref_w = torch.cat(ref_rows + [w[2 * h * d:]])
    torch.testing.assert_close(w2, ref_w, rtol=0, atol=1e-12)
    gw = torch.randn_like(ref_w)
    loss, ref_loss = (w2 * gw).sum(), (ref_w * gw).sum()
    if with_bias:
        ref_b = torch.cat([p[i % h if hp > 1 else 0] @ b[i * d:(i + 1) * d] for i in range(2 * h)] + [b[2 * h * d:]])
        torch.testing.assert_close(b2, ref_b, rtol=0, atol=1e-12)
        gb = torch.randn_like(ref_b)
        loss, ref_loss = loss + (b2 * gb).sum(), ref_loss + (ref_b * gb).sum()
    inputs = [w, p] + ([b] if with_bias else [])
    for g1, g2 in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(ref_loss, inputs)):
        torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,opts", [("comrope-ld", {}), ("comrope-ap", {}), ("comrope-ld", {"per_head": True}),
                                       ("comrope-ap", {"block_size": 2, "per_head": True})])
@pytest.mark.parametrize("with_bias", [True, False])
def test_block_fold_equals_dense_fold(name, opts, with_bias):
    """A block-diagonal basis merged block by block: the weight, the bias and every gradient (weight, bias,
    blocks) equal the dense merge of ``blockdiag(blocks)``. (The RoPE form's blocks are constants of the forward
    pass -- the encoding's gradient goes through its block exponentials, see ``fold.BlockEigenForm`` -- so the
    gradient with respect to the blocks is taken on a copy.)"""
    opts = {"block_size": 4, **opts}
    bs = opts["block_size"]
    pe = _perturbed(name, **opts)
    form = rope_form(pe)
    assert form.blocks is not None and form.blocks.shape == (pe.param_heads, 16 // bs, bs, bs)
    torch.testing.assert_close(torch.block_diag(*form.blocks[0]), form.basis[0], rtol=0, atol=0)
    torch.manual_seed(2)
    w = torch.randn(3 * 48, 20, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3 * 48, dtype=torch.float64, requires_grad=True) if with_bias else None
    blk = form.blocks.clone().requires_grad_()
    basis = block_diag(blk)
    dense = fold_qkv_weight(w, b, basis, 3)
    blocks = fold_qkv_weight(w, b, basis, 3, blocks=blk)
    outs = [t for t in dense if t is not None]
    grads = [torch.randn_like(t) for t in outs]
    inputs = [w] + ([b] if with_bias else []) + [blk]
    g_dense = torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
    g_blocks = torch.autograd.grad([t for t in blocks if t is not None], inputs, grads, allow_unused=True)
    for x, y in zip(outs, blocks):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-13)
    assert g_dense[-1] is not None and g_dense[-1].abs().sum() > 0  # the blocks are reached
    for x, y in zip(g_dense, g_blocks):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(y, x, rtol=0, atol=1e-12)


def test_block_fold_through_the_tf32_safe_product(monkeypatch):
    """Where float32 products run in TF32 (CUDA), the merge goes through ``_PreciseMatmul``, whose backward reduces
    over broadcast dimensions: forced here on the CPU, the block merge (blocks shared by the heads, broadcast
    over q/k and heads) still equals the dense merge in value and gradients, in float32."""
    import ropekit.encodings.fold as fold_module
    from ropekit.encodings.ops.products import _PreciseMatmul

    torch.manual_seed(0)
    pe = create_pe("comrope-ld", head_dim=16, coord_dim=2, num_heads=3, block_size=4)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.3 * torch.randn_like(p))
    w = torch.randn(144, 20, requires_grad=True)
    b = torch.randn(144, requires_grad=True)
    form = rope_form(pe)
    ref = fold_qkv_weight(w, b, form.basis, 3)
    monkeypatch.setattr(fold_module, "precise_matmul", _PreciseMatmul.apply)
    out = fold_qkv_weight(w, b, form.basis, 3, blocks=form.blocks)
    grads = [torch.randn_like(t) for t in out]
    inputs = [w, b] + [p for p in pe.parameters() if p.requires_grad]
    g_out = torch.autograd.grad(out, inputs, grads, allow_unused=True, retain_graph=True)
    g_ref = torch.autograd.grad(ref, inputs, grads, allow_unused=True)
    for x, y in zip(out, ref):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    for x, y in zip(g_out, g_ref):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-4 * float(y.abs().max()))


def test_half_pairs_and_dense_bases_have_no_blocks():
    assert rope_form(_perturbed("comrope-ld", block_size=4, pairs="half")).blocks is None
    assert rope_form(_perturbed("cayley")).blocks is None
    pe = _perturbed("comrope-ld", block_size=4)
    form = rope_form(pe)
    with pytest.raises(ValueError, match="blocks must have shape"):
        fold_qkv_weight(torch.zeros(144, 8, dtype=torch.float64), None, form.basis, 3, blocks=form.blocks[:, :2])


@pytest.mark.parametrize("name,opts,per_example", [("mixed", {}, False), ("mixed", {}, True), ("cayley", {}, False),
                                                   ("circulant", {}, True), ("comrope-ld", {}, True),
                                                   ("comrope-ld", {}, False)])
def test_batched_backward_equals_per_example_loop(monkeypatch, name, opts, per_example):
    """The accelerator form of the backward reductions (one batched operation) equals the CPU's loop."""
    from ropekit.encodings.ops import blocks, rotation

    torch.manual_seed(0)
    pe = create_pe(name, head_dim=16, coord_dim=2, num_heads=2, **opts)
    coords = torch.rand(3, 10, 2) * 5 if per_example else torch.rand(10, 2) * 5
    q, k = torch.randn(3, 2, 10, 16, requires_grad=True), torch.randn(3, 2, 10, 16, requires_grad=True)
    grads = []
    for loops in (True, False):
        for module in (rotation, blocks):  # every module that decides between the loop and the batched form
            monkeypatch.setattr(module, "slice_loops", lambda t, loops=loops: loops)
        qo, ko = pe(q, k, coords)
        w = torch.sin(torch.arange(qo.numel(), dtype=qo.dtype)).view_as(qo)
        loss = (qo * w).sum() + (ko * w.flip(0)).sum()
        grads.append(torch.autograd.grad(loss, [q, k] + list(pe.parameters())))
    for g1, g2 in zip(*grads):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-5)


def test_finite_check_on_every_call(monkeypatch):
    """The NaN check runs on every call -- nothing is remembered per tensor, so a value written where no version
    counter sees it (``.data``, a NumPy view) is caught at the next call -- once per call, not once per use."""
    from ropekit.encodings.ops import validation

    pe = create_pe("axial", head_dim=8, coord_dim=2, num_heads=1)
    q = torch.randn(1, 1, 4, 8)
    coords = torch.rand(4, 2)
    seen = []
    real = torch.isfinite
    monkeypatch.setattr(validation.torch, "isfinite", lambda t: seen.append(1) or real(t))
    pe(q, q, coords)
    pe(q, q, coords)
    assert len(seen) == 2
    coords.numpy()[1, 0] = float("nan")  # behind autograd's back: no version change
    with pytest.raises(ValueError, match="1 non-finite value"):
        pe(q, q, coords)


@pytest.mark.parametrize("name,opts", [("cayley", {"band": 3}), ("circulant", {"block_size": 6, "head_dim": 12})])
def test_cached_constants_first_built_in_inference_mode_still_train(name, opts):
    """Index and basis constants are cached per device; one first built under inference mode must still be
    usable by autograd afterwards (inference tensors cannot be saved for backward)."""
    from ropekit.encodings.ops import skew
    from ropekit.encodings import circulant

    skew._FLAT_INDICES.clear()
    circulant._DFT_BASES.clear()
    pe = _perturbed(name, **opts).float()
    with torch.inference_mode():
        rope_form(pe)
    form = rope_form(pe)
    loss = form.freqs.square().sum() + form.basis.sin().sum()
    grads = torch.autograd.grad(loss, list(pe.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name,opts", [("cayley", {}), ("cayley", {"per_head": True}), ("relaxed", {"exact": True})])
@pytest.mark.parametrize("batch,prefix", [(1, 1), (2, 1), (2, 3)])
def test_folded_attention_prefix_rows_in_place(name, opts, batch, prefix):
    """Folded attention transforms the prefix tokens' q/k in the projection output: logits and every gradient
    equal the unfolded layer's (one token batch, several prefix tokens, shared and per-head bases)."""
    from ropekit.nn.attention import Attention

    torch.manual_seed(3)
    pe = _perturbed(name, **opts)
    folded = Attention(48, 3, pe, fold=True).double()
    plain = Attention(48, 3, pe, fold=False).double()
    plain.load_state_dict(folded.state_dict())
    coords = torch.rand(5, 2, dtype=torch.float64) * 3
    x = torch.randn(batch, 5 + prefix, 48, dtype=torch.float64, requires_grad=True)
    outs = []
    for layer in (folded, plain):
        y = layer(x, coords, prefix)
        w = torch.sin(torch.arange(y.numel(), dtype=y.dtype)).view_as(y)
        params = [x] + list(layer.qkv.parameters()) + list(pe.parameters())
        outs.append((y, torch.autograd.grad((y * w).sum(), params)))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-9, atol=1e-9)
    for g1, g2 in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(g1, g2, rtol=1e-8, atol=1e-9)
