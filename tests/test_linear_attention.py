"""Linear attention with rotary encodings: the RoFormer form, offset invariance, causality, the softmax limit."""

import pytest
import torch
import torch.nn.functional as F

import ropekit
from ropekit.nn.linear_attention import (
    LinearAttention, linear_attention, positive_features, random_projection, relu_features, rotary_linear_attention,
)

B, N, D, H = 2, 12, 32, 2
M_FEAT = 16
COMMUTING = ["axial", "mixed", "cayley", "circulant", "string", "liere-commute", "comrope-ap", "comrope-ld", "tensor"]


def make_pe(name, head_dim=M_FEAT, seed=0):
    torch.manual_seed(seed)
    pe = ropekit.create_pe(name, head_dim=head_dim, coord_dim=2, num_heads=H)
    if name == "cayley":  # a non-trivial post-rotation P
        with torch.no_grad():
            pe.cayley_params.normal_(std=0.3)
    return pe


def inputs(seed=1, n=N):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, n, D, generator=g), torch.randn(n, 2, generator=g) * 3


@pytest.mark.parametrize("kernel", ["positive", "relu"])
@pytest.mark.parametrize("name", COMMUTING)
def test_commuting_encoding_is_offset_invariant(name, kernel):
    att = LinearAttention(D, H, make_pe(name), kernel=kernel, num_features=M_FEAT)
    x, coords = inputs()
    shift = torch.tensor([5.3, -12.1])
    out = att(x, coords)
    torch.testing.assert_close(att(x, coords + shift), out, rtol=1e-5, atol=1e-5)
    # per-example coordinates with a different offset per example
    per_ex = coords.expand(B, -1, -1) + torch.tensor([[1.5, 2.0], [-7.0, 0.25]]).unsqueeze(1)
    torch.testing.assert_close(att(x, per_ex), out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["positive", "relu"])
def test_liere_is_not_offset_invariant(kernel):
    att = LinearAttention(D, H, make_pe("liere"), kernel=kernel, num_features=M_FEAT)
    x, coords = inputs()
    diff = (att(x, coords + torch.tensor([5.3, -12.1])) - att(x, coords)).abs().max()
    assert diff > 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_matches_the_explicit_roformer_formula(causal):
    """out_i = sum_j (R_i phi(q_i))^T (R_j phi(k_j)) v_j / sum_j phi(q_i)^T phi(k_j), written out as N x N matrices."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, B, H, N, 8, dtype=torch.float64).unbind(0)
    coords = torch.randn(N, 2, dtype=torch.float64)
    pe = make_pe("cayley").double()
    w = random_projection(M_FEAT, 8, seed=3, dtype=torch.float64)

    def fm(x, is_query):
        return positive_features(x, w, is_query=is_query, scale=8 ** -0.25)

    out = rotary_linear_attention(q, k, v, fm, pe=pe, coords=coords[2:], num_prefix_tokens=2, causal=causal)
    fq, fk = fm(q, True), fm(k, False)
    rq, rk = pe.rotate(fq, coords[2:], 2), pe.rotate(fk, coords[2:], 2)
    num = rq @ rk.transpose(-1, -2)  # (B, H, N, N)
    den = fq @ fk.transpose(-1, -2)
    if causal:
        mask = torch.ones(N, N, dtype=torch.bool).tril()
        num, den = num * mask, den * mask
    ref = (num @ v) / den.sum(-1, keepdim=True)
    torch.testing.assert_close(out, ref)
    # prefix tokens are unrotated in the numerator
    torch.testing.assert_close(rq[:, :, :2], fq[:, :, :2])


def test_positive_features_approximate_softmax():
    torch.manual_seed(0)
    q, k, v = (0.5 * torch.randn(3, 1, 1, 16, 8, dtype=torch.float64)).unbind(0)
    ref = F.scaled_dot_product_attention(q, k, v / 0.5)
    errs = []
    for m in (64, 4096):
        w = random_projection(m, 8, seed=1, dtype=torch.float64)
        out = rotary_linear_attention(q, k, v / 0.5,
                                      lambda x, iq: positive_features(x, w, is_query=iq, scale=8 ** -0.25))
        errs.append((out - ref).abs().max().item())
    assert errs[1] < 0.06 and errs[1] < errs[0], errs


def test_positive_features_are_positive_and_stable():
    w = random_projection(32, 8, seed=0)
    x = torch.randn(1, 1, 10, 8) * 50  # huge inputs: the stabiliser keeps exp finite
    for is_query in (True, False):
        f = positive_features(x, w, is_query=is_query, scale=8 ** -0.25)
        assert torch.isfinite(f).all() and (f >= 0).all() and f.amax() > 0
    assert (relu_features(x, w) >= 0).all()


def test_random_projection_rows():
    w = random_projection(24, 8, seed=0)
    assert w.shape == (24, 8)
    block = w[:8] / w[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(8), atol=1e-5, rtol=0)
    torch.testing.assert_close(random_projection(24, 8, seed=0), w)
    assert not torch.allclose(random_projection(24, 8, seed=1), w)


def test_causal_prefix_property():
    """Causal: the first t outputs do not depend on tokens after t (the recurrent / streaming form)."""
    att = LinearAttention(D, H, make_pe("mixed"), num_features=M_FEAT, causal=True)
    x, coords = inputs()
    full = att(x, coords)
    torch.testing.assert_close(att(x[:, :7], coords[:7]), full[:, :7], rtol=1e-5, atol=1e-6)


def test_inputs_mode():
    x, coords = inputs()
    pe = make_pe("mixed", head_dim=D // H)
    att = LinearAttention(D, H, pe, rotate="inputs", num_features=64)
    out = att(x, coords)
    assert out.shape == (B, N, D) and torch.isfinite(out).all()
    # without an encoding both modes are the same computation
    a = LinearAttention(D, H, None, rotate="inputs", num_features=24)
    b = LinearAttention(D, H, None, rotate="features", num_features=24)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(x), b(x))
    # the tensor-product encoding widens q/k: the feature map is built for the encoded width
    t = LinearAttention(D, H, make_pe("tensor", head_dim=D // H), rotate="inputs", num_features=8)
    assert t.projection.shape[1] == t.pe.out_dim and torch.isfinite(t(x, coords)).all()


def test_gradients_and_state_dict():
    att = LinearAttention(D, H, make_pe("cayley"), num_features=M_FEAT, seed=7)
    x, coords = inputs()
    att(x, coords).square().mean().backward()
    for name, p in att.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert "projection" not in att.state_dict()
    twin = LinearAttention(D, H, make_pe("cayley", seed=5), num_features=M_FEAT, seed=7)
    twin.load_state_dict(att.state_dict())
    torch.testing.assert_close(twin(x, coords), att(x, coords))
    twin.redraw(8)
    assert not torch.allclose(twin(x, coords), att(x, coords))


def test_prefix_tokens_and_dtype():
    att = LinearAttention(D, H, make_pe("mixed"), num_features=M_FEAT)
    x, coords = inputs()
    out = att(x, coords[1:], num_prefix_tokens=1)
    assert out.shape == (B, N, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = att(x, coords)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low.float()).all()
    assert att.double()(x.double(), coords.double()).dtype == torch.float64


def test_linear_attention_non_negative_weights_sum_to_one_without_pe():
    torch.manual_seed(0)
    f = torch.rand(1, 1, 5, 4)
    v = torch.ones(1, 1, 5, 3)
    torch.testing.assert_close(linear_attention(f, f, f, f, v), v)
    zero = torch.zeros(1, 1, 5, 4)  # all-zero (ReLU) features: zero output, no NaN
    assert torch.equal(linear_attention(zero, zero, zero, zero, v), torch.zeros_like(v))


def test_bad_configurations():
    with pytest.raises(ValueError, match="head_dim=24"):
        LinearAttention(D, H, ropekit.create_pe("mixed", head_dim=D // H, coord_dim=2, num_heads=H), num_features=24)
    with pytest.raises(ValueError, match="kernel"):
        LinearAttention(D, H, kernel="softmax")
    with pytest.raises(ValueError, match="rotate"):
        LinearAttention(D, H, rotate="values")
    att = LinearAttention(D, H, make_pe("mixed"), num_features=M_FEAT)
    with pytest.raises(ValueError, match="coords"):
        att(inputs()[0])
