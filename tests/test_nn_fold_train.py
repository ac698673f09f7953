"""Training-time folding: the folded attention (basis merged into the q/k projection, then plain RoPE per token)
has the unfolded attention's logits and gradients -- to the encoding's parameters and to the qkv weight/bias."""

import copy

import pytest
import torch

import ropekit
from ropekit.fold import fold, foldable_kind, rope_form, to_rope
from ropekit.nn import Attention, VisionTransformer, vit_config

# every commuting encoding, with options that fit head_dim=16 and 2 or 3 coordinates
FOLDABLE = [
    ("cayley", {}), ("cayley", {"band": 3}), ("circulant", {}), ("circulant", {"block_size": 8}),
    ("comrope-ap", {"block_size": 4}), ("comrope-ld", {"block_size": 4}), ("string", {}),
    ("relaxed", {"exact": True}), ("mixed", {}), ("axial", {}), ("axial", {"learnable_freqs": True}),
    ("liere-commute", {}), ("liere", {"block_size": 2}),
]


def _perturb(module, scale=0.3, seed=1):
    """Move every encoding parameter away from its init (cayley starts at P = I, comrope at axial RoPE)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "pe." in n or n.startswith("pe") or isinstance(module, ropekit.encodings.PositionEncoding):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def _rel(a, b, floor=1e-30):
    """Largest difference relative to the reference's largest entry (or ``floor``, for gradients that vanish
    mathematically, e.g. a rotation of relaxed STRING's never-rotated subspace without prefix tokens)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def _grad_scale(grads):
    return max(g.abs().max().item() for g in grads.values())


def _run(att, x, coords, p0, fold):
    att.fold = fold
    att.zero_grad(set_to_none=True)
    out = att(x, coords, p0)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in att.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-5)])
@pytest.mark.parametrize("per_example", [False, True])
@pytest.mark.parametrize("p0", [0, 1])
@pytest.mark.parametrize("name,opts", FOLDABLE)
def test_folded_attention_matches_unfolded(name, opts, p0, per_example, dtype, tol):
    torch.manual_seed(0)
    c = 3 if per_example else 2
    if name == "comrope-ap" and c == 3:
        c = 2  # d / b blocks must split evenly over the axes: per-example 2-D coordinates instead
    pe = ropekit.create_pe(name, head_dim=16, coord_dim=c, num_heads=2, **opts)
    att = Attention(32, 2, pe).to(dtype)
    _perturb(att)
    assert foldable_kind(pe) is not None and att.folds
    b, m = 3, 9
    x = torch.randn(b, p0 + m, 32, dtype=dtype)
    coords = torch.randn(b, m, c, dtype=dtype) * 2 if per_example else torch.randn(m, c, dtype=dtype) * 2
    out_f, g_f = _run(att, x, coords, p0, True)
    out_u, g_u = _run(att, x, coords, p0, False)
    assert _rel(out_f, out_u) < tol
    assert set(g_f) == set(g_u)
    assert any(n.startswith("pe.") for n in g_u) == any(q.requires_grad for q in pe.parameters())
    scale = _grad_scale(g_u) * 1e-3
    for n in g_u:
        assert _rel(g_f[n], g_u[n], scale) < tol * 10, n


@pytest.mark.parametrize("name,opts", [("liere", {"block_size": 4}), ("relaxed", {}), ("tensor", {})])
def test_non_commuting_encodings_take_the_unfolded_path(name, opts):
    pe = ropekit.create_pe(name, head_dim=16, coord_dim=2, num_heads=2, **opts)
    att = Attention(32, 2, pe)
    assert att.fold and not att.folds and foldable_kind(pe) is None
    with pytest.raises(ValueError, match="does not commute|not a rotation"):
        rope_form(pe)
    x = torch.randn(2, 9, 32)
    assert att(x, torch.randn(9, 2)).shape == (2, 9, 32)


def test_to_rope_is_differentiable_and_exact():
    """``R(r)^T R(s) = P^T RoPE(s - r) P`` with the differentiable form, and gradients reach the parameters."""
    from ropekit.encodings.ops.frequencies import pair_generators

    torch.manual_seed(0)
    for name, opts in FOLDABLE:
        pe = ropekit.create_pe(name, head_dim=16, coord_dim=2, num_heads=2, **opts).double()
        _perturb(pe)
        p, freqs = to_rope(pe)  # (H, d, d), (H, c, d/2)
        r, s = torch.randn(1, 2, dtype=torch.float64), torch.randn(1, 2, dtype=torch.float64)
        rr, rs = pe.matrix(r)[:, 0], pe.matrix(s)[:, 0]  # (H, d, d)
        gen = torch.einsum("c,hcij->hij", (s - r)[0], pair_generators(freqs))
        want = p.transpose(-1, -2) @ torch.linalg.matrix_exp(gen) @ p
        assert torch.allclose(rr.transpose(-1, -2) @ rs, want, atol=1e-10), name
        params = [q for q in pe.parameters() if q.requires_grad]
        if params:
            loss = (p * torch.randn_like(p)).sum() + (freqs * torch.randn_like(freqs)).sum()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            assert any(g is not None and g.abs().sum() > 0 for g in grads), name


def _vit_pair(pe, cls, modality="image", **kw):
    torch.manual_seed(0)
    cfg = vit_config("tiny", num_classes=4, in_chans=1, image_size=(12, 12), depth=2, embed_dim=32, num_heads=2,
                     pe=pe, cls=cls, modality=modality, **kw)
    model = VisionTransformer(cfg).double()
    _perturb(model)
    if model.cls_token is not None:
        with torch.no_grad():
            model.cls_token.normal_()
    ref = copy.deepcopy(model)
    for blk in ref.blocks:
        blk.attn.fold = False
    return model, ref


@pytest.mark.parametrize("pe,opts", [("cayley", {}), ("circulant", {"block_size": 8}),
                                     ("comrope-ld", {"block_size": 4}), ("string", {}), ("relaxed", {"exact": True}),
                                     ("mixed", {})])
@pytest.mark.parametrize("cls", ["none", "unrotated", "centroid"])
@pytest.mark.parametrize("modality", ["image", "rgbd"])
def test_folded_vit_logits_and_gradients(pe, opts, cls, modality):
    """The whole model: shared grid (image) and per-example 3-D coordinates (RGB-D, depth as coordinate)."""
    model, ref = _vit_pair(pe, cls, modality, pe_options=opts, pe_sharing="model")
    assert all(b.attn.folds for b in model.blocks) and not any(b.attn.folds for b in ref.blocks)
    x = torch.rand(2, 2 if modality == "rgbd" else 1, 12, 12, dtype=torch.float64) + 0.5
    outs = []
    for m in (model, ref):
        out = m(x)
        out.pow(2).sum().backward()
        outs.append((out.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (of, gf), (ou, gu) = outs
    assert _rel(of, ou) < 1e-9
    assert set(gf) == set(gu) and any(".pe." in n for n in gu)
    for n in gu:
        assert _rel(gf[n], gu[n], _grad_scale(gu) * 0.1) < 1e-8, n


def test_shared_encoding_is_prepared_once_per_forward(monkeypatch):
    """With one encoding for all layers, its folded form is computed once per model forward, not per layer;
    per-layer encodings get their forms together, once per forward (one ``rope_forms_stacked`` call for both
    layers)."""
    import ropekit.encodings.prepared as prepared  # where the layers' states are prepared

    calls, batched = [], []
    real, real_batched = prepared.rope_form, prepared.rope_forms_stacked
    monkeypatch.setattr(prepared, "rope_form", lambda pe: calls.append(id(pe)) or real(pe))
    monkeypatch.setattr(prepared, "rope_forms_stacked",
                        lambda pes, **kw: batched.append([id(p) for p in pes]) or real_batched(pes, **kw))
    shared, _ = _vit_pair("cayley", "none", pe_sharing="model")
    shared(torch.rand(2, 1, 12, 12, dtype=torch.float64))
    assert len(calls) == 1 and batched == []
    calls.clear()
    per_layer, _ = _vit_pair("cayley", "none", pe_sharing="layer")
    per_layer(torch.rand(2, 1, 12, 12, dtype=torch.float64))
    assert calls == [] and len(batched) == 1 and len(set(batched[0])) == 2


def test_unfolded_shared_encoding_is_prepared_once_per_forward():
    """LieRE (not foldable, one set for the model): its matrix exponentials are prepared once per model forward."""
    model, _ = _vit_pair("liere", "unrotated", pe_options={"block_size": 4})
    pe = model.encodings[0]
    assert len(model.encodings) == 1 and not model.blocks[0].attn.folds
    calls = []
    real = pe.prepare
    pe.prepare = lambda *a, **k: calls.append(1) or real(*a, **k)
    x = torch.rand(2, 1, 12, 12, dtype=torch.float64)
    out = model(x)
    assert len(calls) == 1
    del pe.prepare
    want = model(x)  # nothing stale or random in the shared state
    assert torch.equal(out, want)


def test_fold_train_option_and_inference_fold():
    """``pe_fold_train=False`` keeps the per-token path; the inference ``fold()`` still works on a folded-training
    model and gives the same logits."""
    cfg = vit_config("tiny", num_classes=4, in_chans=1, image_size=(12, 12), depth=2, pe="cayley", cls="unrotated",
                     pe_fold_train=False)
    model = VisionTransformer(cfg)
    assert not any(b.attn.folds for b in model.blocks)
    model, _ = _vit_pair("cayley", "unrotated")
    x = torch.rand(2, 1, 12, 12, dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
        got = fold(model)(x)
    assert _rel(got, want) < 1e-9


@pytest.mark.parametrize("name,opts", [("cayley", {}), ("mixed", {}), ("circulant", {"block_size": 8}),
                                       ("comrope-ld", {"block_size": 4}), ("string", {})])
@pytest.mark.parametrize("conv", [dict(per_head=True), dict(pairs="half"), dict(layout="bnhd"),
                                  dict(pairs="half", layout="bnhd", per_head=True)])
def test_folded_attention_per_head_and_conventions(name, opts, conv):
    """Parameters per head, half-split pairs (HF / Llama) and the (B, N, H, d) layout of the encoding: the folded
    layer still equals the unfolded one (a per-head basis per head; the pair permutation goes into the basis)."""
    torch.manual_seed(0)
    pe = ropekit.create_pe(name, head_dim=16, coord_dim=2, num_heads=2, **opts, **conv)
    att = Attention(32, 2, pe).double()
    _perturb(att)
    x, coords = torch.randn(2, 1 + 9, 32, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64)
    out_f, g_f = _run(att, x, coords, 1, True)
    out_u, g_u = _run(att, x, coords, 1, False)
    assert _rel(out_f, out_u) < 1e-9
    for n in g_u:
        assert _rel(g_f[n], g_u[n], _grad_scale(g_u) * 1e-3) < 1e-8, n
