"""Grouped-query and multi-query attention in ``ropekit.nn`` (``num_kv_heads``): the keys and values of a group of
query heads come from one projection, and each query head rotates its group's key with its own encoding.

Checked against a hand-written reference (projections by ``einsum``, the encoding's own ``pe(q, k, coords)`` on
each query head's copy of the shared key, softmax written out), on the folded and the unfolded path, with prefix
tokens; ``num_kv_heads = num_heads`` is today's attention to the bit; ``fold(model)`` folds a basis the heads of a
group share and refuses one per head. Everything numerical is float64.
"""

import pytest
import torch

import ropekit
from ropekit.fold import fold
from ropekit.nn import Attention, VisionTransformer, vit_config

D, H = 24, 4
HD = D // H


def _pe(name: str, seed: int, **opts):
    torch.manual_seed(seed)
    pe = ropekit.create_pe(name, head_dim=HD, coord_dim=2, num_heads=H, **opts).double()
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.4)
    return pe


def _reference(attn: Attention, x: torch.Tensor, coords: torch.Tensor, prefix: int) -> torch.Tensor:
    """What grouped-query attention computes, written out: ``(B, N, D)``."""
    g, r = attn.num_kv_heads, H // attn.num_kv_heads
    w, b = attn.qkv.weight, attn.qkv.bias
    wq, wk, wv = w.split([D, g * HD, g * HD])
    bq, bk, bv = b.split([D, g * HD, g * HD])
    q = torch.einsum("hed,bnd->bhne", wq.view(H, HD, D), x) + bq.view(1, H, 1, HD)
    k = torch.einsum("ged,bnd->bgne", wk.view(g, HD, D), x) + bk.view(1, g, 1, HD)  # (B, Hk, N, d)
    v = torch.einsum("ged,bnd->bgne", wv.view(g, HD, D), x) + bv.view(1, g, 1, HD)
    group = torch.arange(H) // r  # query head h reads key/value head h // (H / Hk)
    k, v = k[:, group], v[:, group]  # (B, H, N, d): each query head's copy
    if attn.pe is not None:
        q, k = attn.pe(q, k, coords, num_prefix_tokens=prefix)  # head h's encoding on head h's copy of the key
    weights = torch.softmax(q @ k.transpose(-1, -2) / HD ** 0.5, dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(x.shape)
    return attn.proj(out)


@pytest.mark.parametrize("name,opts", [("cayley", {"per_head": True}), ("cayley", {}), ("mixed", {}),
                                       ("circulant", {"per_head": True}), ("liere", {"per_head": True}),
                                       ("comrope-ld", {"per_head": True, "block_size": 2}), ("none", {})])
@pytest.mark.parametrize("kv", [1, 2])
def test_grouped_attention_equals_the_reference(name, opts, kv):
    pe = None if name == "none" else _pe(name, 0, **opts)
    torch.manual_seed(1)
    attn = Attention(D, H, pe, num_kv_heads=kv).double()
    assert attn.qkv.weight.shape == (D + 2 * kv * HD, D)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 10, D, generator=g, dtype=torch.float64)
    for coords in (torch.randn(9, 2, generator=g, dtype=torch.float64) * 3,
                   torch.randn(3, 9, 2, generator=g, dtype=torch.float64) * 3):
        ref = _reference(attn, x, coords, prefix=1)
        for folded in (True, False):
            attn.fold = folded
            torch.testing.assert_close(attn(x, coords, num_prefix_tokens=1), ref, rtol=0, atol=1e-12)


def test_folded_and_unfolded_gradients_agree_with_a_per_head_basis():
    """The folded path merges each query head's basis into its own copy of the shared key rows: values and every
    gradient (shared key projection included) equal the unfolded path's."""
    pe = _pe("cayley", 3, per_head=True)
    torch.manual_seed(4)
    attn = Attention(D, H, pe, num_kv_heads=1).double()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    coords = torch.randn(9, 2, dtype=torch.float64)
    grads = []
    for folded in (True, False):
        attn.fold = folded
        attn.zero_grad()
        (attn(x, coords) ** 2).sum().backward()
        grads.append([p.grad.clone() for p in attn.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert grads[0][list(dict(attn.named_parameters())).index("qkv.weight")].abs().max() > 0


def test_as_many_kv_heads_as_heads_is_multi_head_attention_bit_for_bit():
    torch.manual_seed(5)
    a = VisionTransformer(vit_config("tiny", embed_dim=32, depth=2, num_heads=4, pe="cayley", per_head=True))
    torch.manual_seed(5)
    b = VisionTransformer(vit_config("tiny", embed_dim=32, depth=2, num_heads=4, pe="cayley", per_head=True,
                                     num_kv_heads=4))
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(a(x), b(x))


def test_mqa_vit_has_fewer_parameters_and_trains():
    cfg = dict(embed_dim=32, depth=2, num_heads=4, pe="cayley", per_head=True)
    mha = VisionTransformer(vit_config("tiny", **cfg))
    mqa = VisionTransformer(vit_config("tiny", **cfg, num_kv_heads=1))
    n = sum(p.numel() for p in mha.parameters()) - sum(p.numel() for p in mqa.parameters())
    assert n == 2 * (2 * (4 - 1) * 8 * 32 + 2 * (4 - 1) * 8)  # per layer: k and v rows (weight and bias) of 3 heads
    loss = mqa(torch.randn(2, 1, 28, 28)).logsumexp(-1).sum()
    loss.backward()
    assert all(p.grad is not None for p in mqa.parameters() if p.requires_grad)


def _perturbed_vit(sharing: str) -> VisionTransformer:
    """A float64 ViT with 4 query heads in 2 groups, Cayley-STRING shared as ``sharing``, its bases moved off I."""
    torch.manual_seed(6)
    model = VisionTransformer(vit_config("tiny", embed_dim=32, depth=2, num_heads=4, pe="cayley", pe_sharing=sharing,
                                         num_kv_heads=2)).double().eval()
    with torch.no_grad():
        for blk in model.blocks:
            for p in blk.attn.pe.parameters():
                p.add_(torch.randn_like(p) * 0.4)
    return model


def test_fold_model_with_shared_keys():
    """``fold(model)``: a basis shared by the heads goes into the one key projection (same logits); a basis per
    head cannot (each query head would need its own key rows), and nothing is changed before the error."""
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    shared = _perturbed_vit("layer")
    with torch.no_grad():
        ref = shared(x)
        folded = fold(shared)
        assert all(type(blk.attn.pe).__name__ == "FoldedRoPE" for blk in folded.blocks)
        torch.testing.assert_close(folded(x), ref, rtol=0, atol=1e-10)
    per_head = _perturbed_vit("head")
    before = {k: v.clone() for k, v in per_head.state_dict().items()}
    with pytest.raises(ValueError, match="per-head basis into grouped-query attention"):
        fold(per_head, inplace=True)
    assert all(torch.equal(before[k], v) for k, v in per_head.state_dict().items())


@pytest.mark.parametrize("kv", [0, 3, -1])
def test_kv_heads_must_divide_heads(kv):
    with pytest.raises(ValueError, match="num_kv_heads"):
        Attention(D, H, None, num_kv_heads=kv)
    with pytest.raises(ValueError, match="num_kv_heads"):
        vit_config("tiny", embed_dim=32, num_heads=4, num_kv_heads=kv).validate()


def test_merged_projection_is_not_expanded_again(monkeypatch):
    """A model's merged projection (``FoldedState.qkv``, one batched product for its layers) is what the layer
    runs: under grouped-query attention its own weight is expanded once per forward, by ``prepare_layers``'s merge,
    and not again (the concatenation of the expanded k/v rows) by the layer. The logits are those of each layer
    preparing its own state (up to the rounding of the batched product against per-layer ones, float64)."""
    from ropekit.encodings.prepared import FoldedState, prepare_layers

    layers = [Attention(D, H, _pe("cayley", seed), num_kv_heads=2).double() for seed in range(3)]
    coords, x = torch.rand(6, 2, dtype=torch.float64) * 4, torch.randn(2, 7, D, dtype=torch.float64)
    own = [attn(x, coords, 1) for attn in layers]  # each layer's own, unmerged state
    calls = []
    real = Attention.expanded_qkv
    monkeypatch.setattr(Attention, "expanded_qkv", lambda self: calls.append(self) or real(self))
    states = prepare_layers(layers, coords, 1, torch.float64)
    assert all(isinstance(st, FoldedState) and st.qkv is not None for st in states)
    assert len(calls) == len(layers)  # the merge reads each layer's expanded weight once
    for attn, st, ref in zip(layers, states, own):
        torch.testing.assert_close(attn(x, coords, 1, pe_state=st), ref, rtol=1e-10, atol=1e-12)
    assert len(calls) == len(layers)  # ... and the layers, running the merged copy, never expand theirs
