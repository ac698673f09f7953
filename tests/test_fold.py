"""Inference folding (ropekit.fold): every commuting encoding is RoPE in a fixed basis, and folding that basis into
the q/k projections leaves the logits unchanged."""

import copy

import pytest
import torch

import ropekit
from ropekit.encodings.ops.products import basis_change
from ropekit.encodings.ops.skew import full_to_free
from ropekit.fold import FoldedRoPE, fold, fold_pe, is_foldable, to_rope
from ropekit.nn import VisionTransformer, vit_config

# (name, options, head_dim): every commuting encoding, several block sizes, and the degenerate cases
COMMUTING = [
    ("axial", {}, 16), ("mixed", {}, 16), ("liere-commute", {}, 16), ("none", {}, 16),
    ("cayley", {}, 16), ("cayley", {"per_head": True}, 16), ("cayley", {"band": 2}, 16),
    ("circulant", {}, 16), ("circulant", {"block_size": 8}, 16), ("circulant", {"block_size": 5}, 20),
    ("circulant", {"block_size": 4, "per_head": True}, 16),
    ("comrope-ap", {"block_size": 4}, 16), ("comrope-ld", {"block_size": 4}, 16),
    ("comrope-ld", {"block_size": 8, "per_head": True}, 16), ("comrope-ld", {"block_size": 4, "init": "zero"}, 16),
    ("liere", {"block_size": 2}, 16), ("string", {}, 16), ("relaxed", {"exact": True}, 16),
]


def _perturbed(name, opts, head_dim, coord_dim=2, num_heads=2, scale=0.3, seed=0):
    """An encoding (float64) whose learnable parameters are moved away from their (often trivial) init."""
    torch.manual_seed(seed)
    pe = ropekit.create_pe(name, head_dim=head_dim, coord_dim=coord_dim, num_heads=num_heads, **opts).double()
    if opts.get("init") == "zero":
        return pe  # keep the zero generators: the fully degenerate case
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * scale)
    return pe


def _rope_matrix(freqs, coords):
    """Dense ``RoPE_freqs(r)`` ``(H, M, d, d)`` for ``coords`` ``(M, c)``, interleaved pairs, independent of ropekit."""
    theta = torch.einsum("mc,hcp->hmp", coords, freqs)
    h, m, p = theta.shape
    out = torch.zeros(h, m, 2 * p, 2 * p, dtype=freqs.dtype)
    idx = torch.arange(p)
    c, s = torch.cos(theta), torch.sin(theta)
    out[..., 2 * idx, 2 * idx], out[..., 2 * idx, 2 * idx + 1] = c, -s
    out[..., 2 * idx + 1, 2 * idx], out[..., 2 * idx + 1, 2 * idx + 1] = s, c
    return out


@pytest.mark.parametrize("name,opts,d", COMMUTING, ids=lambda v: str(v))
def test_to_rope_relative_form(name, opts, d):
    """R(r)^T R(s) = P^T RoPE_freqs(s - r) P, P orthogonal, against the encoding's own dense matrices."""
    pe = _perturbed(name, opts, d)
    p, freqs = (t.double() for t in to_rope(pe))  # (the identity has no parameters to take float64 from)
    assert p.shape == (2, d, d) and freqs.shape == (2, 2, d // 2)
    assert torch.allclose(p @ p.transpose(-1, -2), torch.eye(d, dtype=p.dtype).expand_as(p), atol=1e-10)
    r, s = torch.randn(6, 2, dtype=torch.float64) * 2, torch.randn(6, 2, dtype=torch.float64) * 2
    lhs = (pe.matrix(r).transpose(-1, -2) @ pe.matrix(s)).double()  # (H, M, d, d)
    rhs = p.unsqueeze(1).transpose(-1, -2) @ _rope_matrix(freqs, s - r) @ p.unsqueeze(1)
    assert torch.allclose(lhs, rhs, atol=1e-9)


def test_to_rope_liere_one_coordinate():
    pe = _perturbed("liere", {"block_size": 4, "init_scale": 1.0}, 16, coord_dim=1)
    p, freqs = to_rope(pe)
    r, s = torch.randn(5, 1, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    lhs = pe.matrix(r).transpose(-1, -2) @ pe.matrix(s)
    rhs = p.unsqueeze(1).transpose(-1, -2) @ _rope_matrix(freqs, s - r) @ p.unsqueeze(1)
    assert torch.allclose(lhs, rhs, atol=1e-9)


def test_comrope_degenerate_eigenvalues_fold_exactly():
    """Repeated and zero eigenvalues of a block generator (the real Schur form must still pair them)."""
    pe = ropekit.create_pe("comrope-ld", head_dim=16, coord_dim=2, num_heads=1, block_size=8).double()
    j = torch.zeros(8, 8, dtype=torch.float64)
    j[1, 0], j[3, 2] = 0.7, 0.7  # two equal planes, two zero planes
    j = j - j.transpose(0, 1)
    q = torch.linalg.qr(torch.randn(2, 8, 8, dtype=torch.float64))[0]
    # full bases B = K / 2 give K = B - B^T = q j q^T in each of the 2 blocks
    bases = (q @ j @ q.transpose(-1, -2)).unsqueeze(0) / 2  # (1, 2, 8, 8)
    pe.load_state_dict({**pe.state_dict(), "block_params": full_to_free(bases)})
    p, freqs = to_rope(pe)
    r, s = torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    lhs = pe.matrix(r).transpose(-1, -2) @ pe.matrix(s)
    rhs = p.unsqueeze(1).transpose(-1, -2) @ _rope_matrix(freqs, s - r) @ p.unsqueeze(1)
    assert torch.allclose(lhs, rhs, atol=1e-9)


@pytest.mark.parametrize("name,opts,d", [c for c in COMMUTING if c[0] != "none"], ids=lambda v: str(v))
@pytest.mark.parametrize("prefix", [0, 2])
def test_fold_pe_logits(name, opts, d, prefix):
    """folded(P q, P k) has the logits of pe(q, k), prefix tokens included (float32, 1e-5 relative)."""
    pe = _perturbed(name, opts, d).float()
    folded, p = fold_pe(pe)
    assert isinstance(folded, FoldedRoPE)
    q, k = torch.randn(3, 2, 9, d), torch.randn(3, 2, 9, d)
    coords = torch.randn(9 - prefix, 2) * 3
    qe, ke = pe(q, k, coords, prefix)
    fq, fk = folded(basis_change(q, p), basis_change(k, p), coords, prefix)
    want, got = qe @ ke.transpose(-1, -2), fq @ fk.transpose(-1, -2)
    assert torch.allclose(got, want, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("name,opts", [("liere", {"block_size": 8}), ("relaxed", {}), ("tensor", {})])
def test_non_commuting_encodings_are_refused(name, opts):
    pe = ropekit.create_pe(name, head_dim=16, coord_dim=2, num_heads=2, **opts)
    assert not is_foldable(pe)
    with pytest.raises(ValueError):
        to_rope(pe)


def _vit(pe, cls="none", sharing="model", per_head=False, seed=0):
    torch.manual_seed(seed)
    cfg = vit_config("tiny", num_classes=5, in_chans=1, image_size=(16, 16), depth=2, pe=pe, cls=cls,
                     pe_sharing=sharing, per_head=per_head)
    model = VisionTransformer(cfg).eval()
    with torch.no_grad():  # move the encodings (and the CLS token) away from their init: P = I for cayley at init
        for n, p in model.named_parameters():
            if ".pe." in n or n == "cls_token":
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("pe", ["cayley", "circulant", "comrope-ld", "comrope-ap"])
@pytest.mark.parametrize("cls", ["none", "unrotated", "centroid"])
def test_fold_vit_logits(pe, cls):
    """A folded ViT (ropekit.nn) gives the unfolded logits to 1e-5; the original model is not modified."""
    model = _vit(pe, cls)
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 1, 16, 16)
    with torch.no_grad():
        want = model(x)
        folded = fold(model)
        got = folded(x)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert all(isinstance(b.attn.pe, FoldedRoPE) for b in folded.blocks)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("sharing,per_head", [("layer", False), ("head", True)])
def test_fold_vit_sharing(sharing, per_head):
    model = _vit("cayley", "unrotated", sharing, per_head)
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        want = model(x)
        folded = fold(model)
        got = folded(x)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    pes = [b.attn.pe for b in folded.blocks]
    assert len({id(p) for p in pes}) == len(folded.blocks)


def test_fold_vit_shared_encoding_stays_shared_and_plain_rope_untouched():
    model = _vit("circulant")
    folded = fold(model)
    assert len({id(b.attn.pe) for b in folded.blocks}) == 1
    mixed = _vit("mixed")
    assert fold(mixed).blocks[0].attn.pe.__class__.__name__ == "MixedRoPE"


def test_fold_vit_non_commuting():
    model = _vit("liere")
    with pytest.raises(ValueError):
        fold(model)
    kept = fold(model, strict=False)
    assert kept.blocks[0].attn.pe.__class__.__name__ == "LieRE"


def test_folded_state_dict_round_trip():
    folded = fold(_vit("comrope-ld", "unrotated"))
    state = folded.state_dict()
    assert any(k.endswith("pe.freq_table") for k in state)
    again = fold(_vit("comrope-ld", "unrotated", seed=1))
    again.load_state_dict(state)
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        assert torch.allclose(again(x), folded(x))
