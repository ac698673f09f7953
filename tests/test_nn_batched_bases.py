"""Per-layer Cayley-STRING bases are solved together once per forward (``fold.rope_forms_stacked``; circulant's
frequencies from one product, the RoPE family's stacked), and per-layer ComRoPE
block eigenbases come from one batched Schur form: the model's outputs and every gradient are bit for bit those of
factorising each layer's basis alone, and only one solve (one set of Jacobi rounds) runs. Per-layer ComRoPE's
gradients are mapped in one batched Frechet map too (``blocks.batch_block_gradients``), equal to the per-layer maps
in float64 to round-off."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ropekit.fold as fold_mod
import ropekit.encodings.prepared as prepared_mod  # where a model prepares its layers' states (prepare_layers)
from ropekit.fold import rope_form, rope_forms
from ropekit.nn import VisionTransformer, vit_config


def _model(pe: str = "cayley") -> VisionTransformer:
    torch.manual_seed(0)
    m = VisionTransformer(vit_config("tiny", num_classes=10, in_chans=3, image_size=(16, 16), patch_size=4, pe=pe,
                                     depth=3, pe_sharing="layer"))  # ComRoPE's own default shares one set
    with torch.no_grad():  # non-trivial parameters in every layer
        for blk in m.blocks:
            for p in blk.attn.pe.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return m


def _run(m: VisionTransformer):
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    out = m(x)
    grads = torch.autograd.grad(out.square().sum(), [p for p in m.parameters()])
    return out, grads


@pytest.mark.parametrize("pe", ["cayley", "circulant", "mixed", "comrope-ld", "comrope-ap"])
def test_batched_bases_equal_per_layer_bases_bit_for_bit(pe, monkeypatch):
    """Also for the other per-layer encodings, whose forms are now computed before the blocks run."""
    m = _model(pe)
    assert all(blk.attn.folds for blk in m.blocks) and len({id(b.attn.pe) for b in m.blocks}) == 3
    out, grads = _run(m)
    monkeypatch.setattr(prepared_mod, "rope_forms_stacked", lambda pes, **kw: ([rope_form(pe) for pe in pes], []))  # per layer
    ref_out, ref_grads = _run(m)
    assert torch.equal(out, ref_out)
    for (name, _), a, b in zip(m.named_parameters(), grads, ref_grads):
        if pe.startswith("comrope") and name.endswith("qkv.bias"):
            # the batched block merge multiplies the biases as a last column of the weights' product, the per-layer
            # merge on their own: the same sums of products, rounded in another order (float32 round-off)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
        else:
            assert torch.equal(a, b), name


def test_one_solve_per_forward():
    m = _model()
    x = torch.randn(2, 3, 16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        m(x)
    # one factorisation of every layer's I + S (``cayley_from_free`` keeps its LU factors for the backward; a
    # ``linalg_solve_ex`` would show its own factorisation here too)
    factorisations = [e for e in prof.events() if e.name == "aten::linalg_lu_factor_ex"]
    assert len(factorisations) == 1


def test_one_schur_form_per_forward():
    """ComRoPE's block Schur forms come from fixed block Jacobi rounds (``skew.skew_real_schur``: no eigensolver,
    whose error check would make the host wait for the device); they run once per model forward for all layers
    together -- one closed-form 4x4 step (one ``addcmul``: its two projectors) per round, not one per round and
    layer."""
    from ropekit.encodings.ops.skew import _jacobi_rounds, _jacobi_sweeps

    m = _model("comrope-ld")
    b = m.blocks[0].attn.pe.block_size
    x = torch.randn(2, 3, 16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        m(x)
    names = [e.name for e in prof.events()]
    assert "aten::linalg_eigh" not in names and "aten::_linalg_eigh" not in names
    assert names.count("aten::addcmul") == _jacobi_sweeps(b) * len(_jacobi_rounds(b, x.device))


def test_rope_forms_mixes_kinds():
    """Cayley encodings of one configuration are batched (the first and the last here); other kinds, and a Cayley of
    another configuration, are written one by one; the forms come back in the order given."""
    from ropekit import create_pe

    torch.manual_seed(0)
    pes = [create_pe("cayley", head_dim=8, coord_dim=2, num_heads=2),
           create_pe("axial", head_dim=8, coord_dim=2, num_heads=2),
           create_pe("cayley", head_dim=8, coord_dim=2, num_heads=2, band=2),
           create_pe("cayley", head_dim=8, coord_dim=2, num_heads=2)]
    with torch.no_grad():
        for pe in (pes[0], pes[2], pes[3]):
            pe.cayley_params.normal_(0, 0.5)
    for got, pe in zip(rope_forms(pes), pes):
        for a, b in zip(got, rope_form(pe)):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert fold_mod.rope_forms([]) == []


@pytest.mark.parametrize("pe,sharing", [("cayley", "layer"), ("cayley", "model"), ("circulant", "layer"),
                                        ("circulant", "model"), ("comrope-ld", "layer")])
def test_batched_merge_equals_the_per_layer_merge(pe, sharing, monkeypatch):
    """The bases merged into every layer's q/k projection in one batched product (``fold.fold_qkv_weights``; block by
    block for ComRoPE's stacked blocks) give the logits and every gradient of merging layer by layer
    (``fold.fold_qkv_weight``), in float64 to round-off."""
    from ropekit.fold import fold_qkv_weight

    torch.manual_seed(0)
    m = VisionTransformer(vit_config("tiny", num_classes=10, in_chans=3, image_size=(16, 16), patch_size=4, pe=pe,
                                     depth=3, pe_sharing=sharing)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    calls = []
    real = prepared_mod.fold_qkv_weights
    monkeypatch.setattr(prepared_mod, "fold_qkv_weights", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        out = m(x)
        return out, torch.autograd.grad(out.square().sum(), list(m.parameters()))

    out, grads = run()
    assert calls == [1]  # one batched merge for the three layers
    def per_layer(ws, bs, ps, h, blocks=None):  # a stacked basis (and blocks) sliced layer by layer
        n = len(ws)
        ps = list(ps.expand(n, *ps.shape[1:])) if isinstance(ps, torch.Tensor) else ps
        ks = [None] * n if blocks is None else list(blocks.expand(n, *blocks.shape[1:]))
        return [fold_qkv_weight(w, b, p, h, blocks=k) for w, b, p, k in zip(ws, bs, ps, ks)]

    monkeypatch.setattr(prepared_mod, "fold_qkv_weights", per_layer)
    ref_out, ref_grads = run()
    assert torch.allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-11, atol=1e-13)


def test_fold_qkv_weights_rejects_mismatched_layers():
    from ropekit.fold import fold_qkv_weights

    w, b, p = torch.randn(24, 8), torch.randn(24), torch.eye(4).expand(2, 4, 4)
    with pytest.raises(ValueError, match="as many"):
        fold_qkv_weights([w, w], [b], [p, p], 2)
    with pytest.raises(ValueError, match="one shape"):
        fold_qkv_weights([w, torch.randn(24, 6)], [b, b], [p, p], 2)
    with pytest.raises(ValueError, match="every layer or for none"):
        fold_qkv_weights([w, w], [b, None], [p, p], 2)
    with pytest.raises(ValueError, match="every basis"):
        fold_qkv_weights([w, w], [b, b], [p, torch.eye(3)[None]], 2)
    out = fold_qkv_weights([w, w], [None, None], [p, p[:1]], 2)
    assert torch.equal(out[0][0], w) and out[1][1] is None  # the identity basis leaves the weight as it is


def _comrope_float64(sharing: str, init: str, per_example: bool):
    """A float64 three-layer ComRoPE-LD ViT (``init="zero"``: its blocks left at ``K = 0``, every frequency tied), an
    input and, ``per_example``, per-example coordinate offsets."""
    torch.manual_seed(0)
    m = VisionTransformer(vit_config("tiny", num_classes=10, in_chans=3, image_size=(16, 16), patch_size=4,
                                     pe="comrope-ld", depth=3, pe_sharing=sharing,
                                     pe_options={"block_size": 8, "init": init})).double()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "pe." not in n or init == "normal":
                p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return m, x, (torch.randn(2, 2, dtype=torch.float64) if per_example else None)


@pytest.mark.parametrize("init", ["normal", "zero"], ids=["random", "all-tied"])
@pytest.mark.parametrize("per_example", [False, True])
def test_shared_comrope_maps_its_gradient_once(init, per_example, monkeypatch):
    """ComRoPE shared by every layer (its own default): the layers' gradients are gathered and mapped to the
    encoding's parameters by one Frechet map per step (``blocks.share_block_gradients``), equal to one map per
    layer in float64 to round-off -- also at ``K = 0``, where every frequency ties."""
    import ropekit.encodings.ops.blocks as blocks_mod

    m, x, offset = _comrope_float64("model", init, per_example)
    assert len({id(b.attn.pe) for b in m.blocks}) == 1
    calls = []
    real = blocks_mod._frechet_block_grads
    monkeypatch.setattr(blocks_mod, "_frechet_block_grads", lambda *a: calls.append(1) or real(*a))

    def run():
        out = m(x, coord_offset=offset)
        return out, torch.autograd.grad(out.square().sum(), list(m.parameters()))

    out, grads = run()
    assert len(calls) == 1  # one map for the three layers
    monkeypatch.setattr(prepared_mod, "share_block_gradients", lambda form, coords: form)
    ref_out, ref_grads = run()
    assert len(calls) == 4  # one per layer
    assert torch.equal(out, ref_out)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-12, atol=1e-14)


def test_gathered_and_per_rotation_gradients_keep_float64_angles():
    """float32 tokens at coordinates up to 1e4: the ComRoPE gradient mapped per rotation and the one gathered over
    rotations (``share_block_gradients``) both form the angles ``s mu`` in float64 -- in float32 they would be off
    by ~1e-3 rad -- and agree with a float64 computation."""
    import ropekit
    from ropekit.encodings.ops.blocks import share_block_gradients
    from ropekit.fold import frequency_rope

    torch.manual_seed(0)
    pe = ropekit.create_pe("comrope-ld", head_dim=8, coord_dim=2, num_heads=2, block_size=4, init="normal",
                           init_std=0.3)
    coords = torch.rand(6, 2) * 1e4
    q, k = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)

    def grads(dtype, shared):
        p = pe.to(dtype)
        form = rope_form(p)
        form = share_block_gradients(form, coords.to(dtype)) if shared else form
        qo, ko = frequency_rope(q.to(dtype), k.to(dtype), coords.to(dtype), form, backend="torch")
        loss = (qo * ko).sum() + (qo.square() * torch.linspace(0, 1, 8, dtype=dtype)).sum()
        return [g.double() for g in torch.autograd.grad(loss, [p.block_params, p.axis_weights])]

    ref = grads(torch.float64, False)
    for shared in (False, True):
        for g, r in zip(grads(torch.float32, shared), ref):
            assert float((g - r).abs().max() / r.abs().max()) < 1e-4


@pytest.mark.parametrize("init", ["normal", "zero"], ids=["random", "all-tied"])
@pytest.mark.parametrize("per_example", [False, True])
def test_per_layer_comrope_runs_one_schur_form_and_one_gradient_map(init, per_example, monkeypatch):
    """ComRoPE owned layer by layer and head by head (its paper's sharing): the layers' block Schur forms come from
    one batched ``skew_real_schur`` call (``fold.rope_forms_stacked``) and their gradients from one batched Frechet map
    (``blocks.batch_block_gradients``), each layer keeping its own generators -- logits and every gradient equal to
    factorising and mapping layer by layer, in float64 to round-off, also at ``K = 0`` where every frequency ties."""
    import ropekit.encodings.ops.blocks as blocks_mod
    import ropekit.encodings.fold as enc_fold
    import ropekit.encodings.ops.forms as forms_mod

    m, x, offset = _comrope_float64("head", init, per_example)
    assert len({id(b.attn.pe) for b in m.blocks}) == 3 and m.blocks[0].attn.pe.param_heads > 1
    maps, schurs = [], []
    real_map, real_fold_schur, real_form_schur = (blocks_mod._frechet_block_grads, enc_fold.skew_real_schur,
                                                  forms_mod.skew_real_schur)
    monkeypatch.setattr(blocks_mod, "_frechet_block_grads", lambda *a: maps.append(1) or real_map(*a))
    monkeypatch.setattr(enc_fold, "skew_real_schur", lambda k: schurs.append(k.shape) or real_fold_schur(k))
    monkeypatch.setattr(forms_mod, "skew_real_schur", lambda k: schurs.append(k.shape) or real_form_schur(k))

    def run():
        maps.clear(), schurs.clear()
        out = m(x, coord_offset=offset)
        return out, torch.autograd.grad(out.square().sum(), list(m.parameters()))

    out, grads = run()
    assert len(schurs) == 1 and schurs[0][0] == 3  # the three layers' blocks stacked along the batch dimension
    assert len(maps) == 1  # one map for the three layers
    monkeypatch.setattr(prepared_mod, "rope_forms_stacked", lambda pes, **kw: ([rope_form(pe) for pe in pes], []))
    monkeypatch.setattr(prepared_mod, "batch_block_gradients", lambda forms, coords, stacked=(): forms)
    ref_out, ref_grads = run()
    assert len(schurs) == 3 and len(maps) == 3  # one of each per layer
    assert torch.allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-11, atol=1e-14)
    gen_grads = [g for (n, _), g in zip(m.named_parameters(), grads) if n.endswith("pe.block_params")]
    assert len(gen_grads) == 3 and all(g.abs().max() > 0 for g in gen_grads)  # every layer's generators reached


def test_batch_block_gradients_groups_by_configuration():
    """Forms of one configuration share one gradient node, another configuration gets its own, forms without
    block generators pass as they are, and without a gradient no node is built; the forms come back in order."""
    from ropekit import create_pe
    from ropekit.encodings.ops.blocks import batch_block_gradients, share_block_gradients

    torch.manual_seed(0)
    opts = dict(head_dim=8, coord_dim=2, num_heads=2, init="normal", per_head=True)
    pes = [create_pe("comrope-ld", block_size=4, **opts), create_pe("axial", head_dim=8, coord_dim=2, num_heads=2),
           create_pe("comrope-ld", block_size=2, **opts), create_pe("comrope-ld", block_size=4, **opts)]
    coords = torch.rand(5, 2)
    forms = batch_block_gradients([rope_form(pe) for pe in pes], coords)
    assert forms[1].eigen is None
    c0, c2, c3 = forms[0].eigen.collector, forms[2].eigen.collector, forms[3].eigen.collector
    assert c0.grad_fn.next_functions[0][0] is c3.grad_fn.next_functions[0][0]  # one node for the first and last
    assert c2.grad_fn.next_functions[0][0] is not c0.grad_fn.next_functions[0][0]
    for form, pe in zip(forms, pes):
        if form.eigen is not None:
            alone = share_block_gradients(rope_form(pe), coords).eigen  # this layer's scalars, formed alone
            assert form.eigen.scales.shape == (1, 2, 5, 8 // pe.block_size)
            assert torch.allclose(form.eigen.scales, alone.scales, rtol=1e-14, atol=0)
            assert torch.equal(form.eigen.generators, alone.generators)
    with torch.no_grad():
        plain = batch_block_gradients([rope_form(pe) for pe in pes], coords)
    assert all(f.eigen is None or f.eigen.collector is None for f in plain)
    assert batch_block_gradients([], coords) == []


@pytest.mark.parametrize("pe", ["cayley", "circulant", "mixed", "comrope-ld"])
def test_stacked_forms_slice_to_each_encodings_own_form(pe):
    """``rope_forms_stacked``: slice ``l`` of the stacked form is layer ``l``'s ``rope_form()``; the stacked basis
    merged into the projections in one product equals merging the list of bases."""
    from ropekit.fold import fold_qkv_weights, rope_forms_stacked

    m = _model(pe)
    pes = [blk.attn.pe for blk in m.blocks]
    forms, stacks = rope_forms_stacked(pes)
    assert len(stacks) == 1 and stacks[0][0] == [0, 1, 2]
    stacked = stacks[0][1]
    for i, (form, p) in enumerate(zip(forms, pes)):
        ref = p.rope_form()
        torch.testing.assert_close(form.freqs, ref.freqs, rtol=0, atol=0)
        torch.testing.assert_close(stacked.freqs[i], ref.freqs, rtol=0, atol=0)
        assert (form.eigen is None) == (ref.eigen is None)
        for got, want in ((form.basis, ref.basis), (form.prefix, ref.prefix), (form.blocks, ref.blocks)):
            assert (got is None) == (want is None)
            if got is not None:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if stacked.basis is not None:
        w = [blk.attn.qkv.weight for blk in m.blocks]
        b = [blk.attn.qkv.bias for blk in m.blocks]
        heads = m.blocks[0].attn.num_heads
        for (wa, ba), (wb, bb) in zip(fold_qkv_weights(w, b, stacked.basis, heads),
                                      fold_qkv_weights(w, b, [f.basis for f in forms], heads)):
            assert torch.equal(wa, wb) and torch.equal(ba, bb)
    bare, bare_stacks = rope_forms_stacked(pes, prefix=False)  # no prefix token: no prefix transform formed
    assert all(f.prefix is None for f in bare) and bare_stacks[0][1].prefix is None
    for f, ref in zip(bare, forms):
        assert (f.basis is None) == (ref.basis is None) and torch.equal(f.freqs, ref.freqs)
        assert f.basis is None or torch.equal(f.basis, ref.basis)
    with pytest.raises(ValueError, match="stacked bases"):
        fold_qkv_weights([m.blocks[0].attn.qkv.weight], [None], torch.zeros(2, 1, 4, 4), 3)


def test_stack_layers_is_torch_stack_with_a_one_operation_backward():
    from ropekit.bench.ops import count_step_ops
    from ropekit.encodings.ops.forms import stack_layers

    ts = [torch.randn(3, 4, requires_grad=True) for _ in range(5)]
    w = torch.randn(5, 3, 4)
    out = stack_layers(ts)
    assert torch.equal(out, torch.stack(ts))
    got = torch.autograd.grad((out * w).sum(), ts)
    assert all(torch.equal(g, w[i]) for i, g in enumerate(got))
    g = torch.ones(5, 3, 4)
    ours = count_step_ops(lambda: torch.autograd.grad(stack_layers(ts), ts, g))
    theirs = count_step_ops(lambda: torch.autograd.grad(torch.stack(ts), ts, g))
    assert ours["all"] < theirs["all"]  # one unbind, not a select per tensor
    assert not stack_layers([t.detach() for t in ts]).requires_grad
