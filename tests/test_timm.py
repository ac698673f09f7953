"""ropekit.integrations.timm: converted timm ViTs keep their weights and, with an identity encoding, their function."""

import inspect
import io
import warnings

import pytest
import torch

timm = pytest.importorskip("timm")
from timm.models.eva import Eva  # noqa: E402
from timm.models.vision_transformer import ResPostBlock, VisionTransformer  # noqa: E402

import ropekit  # noqa: E402
from ropekit.integrations.timm import (  # noqa: E402
    RopeEva, RopeVisionTransformer, apply_pe, encodings,
)

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=4)


def tiny_vit(**kw):
    torch.manual_seed(0)
    return VisionTransformer(**{**TINY, **kw}).eval()


def tiny_eva(**kw):
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=4, use_rot_pos_emb=False)
    return Eva(**{**args, **kw}).eval()


def images(*hw, b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, *hw, generator=g)


VIT_VARIANTS = {
    "cls": {},
    "registers+qknorm+dynamic": dict(reg_tokens=2, qk_norm=True, dynamic_img_size=True),
    "no-cls-avgpool": dict(class_token=False, global_pool="avg"),
    "respost": dict(block_fn=ResPostBlock),
}


@pytest.mark.parametrize("variant", list(VIT_VARIANTS))
def test_none_equals_original(variant):
    model = tiny_vit(**VIT_VARIANTS[variant])
    x = images(32, 32)
    ref = model(x)
    conv = apply_pe(model, "none", inplace=False)
    assert isinstance(conv, RopeVisionTransformer) and type(model) is VisionTransformer
    torch.testing.assert_close(conv(x), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["mixed", "cayley"])
def test_zero_frequencies_equal_original(name):
    """Cayley / RoPE-Mixed with zero frequencies (and S = 0) rotate by the identity: same outputs."""
    model = tiny_vit(reg_tokens=1, qk_norm=True)
    x = images(32, 32)
    ref = model(x)
    conv = apply_pe(model, name, inplace=False)
    with torch.no_grad():
        for pe in encodings(conv):
            pe.freq_param.zero_()
    torch.testing.assert_close(conv(x), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["mixed", "cayley", "circulant", "liere", "comrope-ld", "tensor"])
def test_init_identity_equals_original(name):
    model = tiny_vit(dynamic_img_size=True)
    x = images(40, 24)
    conv = apply_pe(model, name, inplace=False, init_identity=True, sharing="layer")
    torch.testing.assert_close(conv(x), model(x), rtol=0, atol=1e-5)


def test_init_identity_rejects_fixed_encoding():
    with pytest.raises(ValueError, match="not the identity"):
        apply_pe(tiny_vit(), "axial", inplace=False, init_identity=True)


def test_every_weight_kept():
    model = tiny_vit(reg_tokens=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    conv = apply_pe(model, "cayley", sharing="layer")  # in place
    assert conv is model
    after = conv.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    extra = set(after) - set(before)
    assert extra and all(".attn.pe." in k for k in extra)
    # a plain timm checkpoint loads into the converted model; only the encodings are missing
    fresh = apply_pe(tiny_vit(reg_tokens=1), "cayley", sharing="layer")
    missing, unexpected = fresh.load_state_dict(before, strict=False)
    assert not unexpected and set(missing) == extra


def test_encoding_changes_the_output_and_uses_grid():
    model = tiny_vit(dynamic_img_size=True)
    x = images(32, 32)
    conv = apply_pe(model, "mixed", inplace=False)
    assert not torch.allclose(conv(x), model(x), atol=1e-4)
    # explicit grid coordinates (row, col) give the same output as the default
    rows, cols = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    grid = torch.stack([rows.flatten(), cols.flatten()], -1)  # (16, 2)
    torch.testing.assert_close(conv(x, coords=grid), conv(x))


def test_normalized_coordinates():
    model = tiny_vit(dynamic_img_size=True)
    conv = apply_pe(model, "mixed", inplace=False, coords="normalized")
    x = images(32, 48)
    g = (torch.arange(4.0) + 0.5) / 4, (torch.arange(6.0) + 0.5) / 6
    rows, cols = torch.meshgrid(*g, indexing="ij")
    torch.testing.assert_close(conv(x), conv(x, coords=torch.stack([rows.flatten(), cols.flatten()], -1)))


@pytest.mark.parametrize("hw", [(32, 32), (48, 64), (16, 40)])
def test_variable_image_size(hw):
    conv = apply_pe(tiny_vit(dynamic_img_size=True, reg_tokens=2), "cayley")
    out = conv(images(*hw))
    assert out.shape == (2, 4) and torch.isfinite(out).all()
    feats = conv.forward_intermediates(images(*hw), intermediates_only=True)
    assert [f.shape for f in feats] == [(2, 64, hw[0] // 8, hw[1] // 8)] * 2


def test_forward_intermediates_matches_forward_features():
    conv = apply_pe(tiny_vit(dynamic_img_size=True), "cayley")
    x = images(32, 40)
    final, inter = conv.forward_intermediates(x, output_fmt="NLC", return_prefix_tokens=True)
    torch.testing.assert_close(final, conv.forward_features(x))
    assert inter[0][0].shape == (2, 20, 64) and inter[0][1].shape == (2, 1, 64)


def test_train_a_few_steps_with_cayley():
    torch.manual_seed(0)
    model = apply_pe(VisionTransformer(**TINY), "cayley")
    x, y = images(32, 32, b=16), torch.arange(16) % 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    model.train()
    for _ in range(15):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if not losses:
            pe = encodings(model)[0]
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in pe.parameters())
            assert pe.freq_param.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.7, losses


def test_no_weight_decay_lists_the_encodings():
    conv = apply_pe(tiny_vit(), "cayley", sharing="layer")
    nwd = conv.no_weight_decay()
    names = dict(conv.named_parameters())
    pe_names = {n for n in names if ".attn.pe." in n}
    assert pe_names and pe_names <= nwd and "cls_token" in nwd


@pytest.mark.parametrize("sharing,count,per_head", [("model", 1, False), ("layer", 2, False), ("head", 2, True)])
def test_sharing(sharing, count, per_head):
    conv = apply_pe(tiny_vit(), "mixed", sharing=sharing)
    pes = encodings(conv)
    assert len(pes) == count and all(pe.per_head == per_head for pe in pes)


def test_centroid_prefix_keeps_offset_invariance():
    """With a CLS token given the patch centroid (and no absolute embedding), a commuting encoding makes the model
    invariant to a global coordinate offset; an unrotated CLS token does not."""
    x = images(32, 32)
    grid = torch.stack(torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1).reshape(16, 2)
    offset = torch.tensor([3.7, -11.2])
    torch.manual_seed(3)
    cen = apply_pe(tiny_vit(), "cayley", prefix="centroid", keep_abs_pos=False, inplace=False)
    with torch.no_grad():  # a non-zero S, so the post-rotation is exercised too
        encodings(cen)[0].cayley_params.normal_(std=0.3)
    assert cen.pos_embed is None
    torch.testing.assert_close(cen(x, coords=grid + offset), cen(x, coords=grid), rtol=1e-5, atol=1e-5)
    unrot = apply_pe(tiny_vit(), "cayley", keep_abs_pos=False, inplace=False)
    assert not torch.allclose(unrot(x, coords=grid + offset), unrot(x, coords=grid), atol=1e-4)


def test_patch_dropout_and_grad_checkpointing():
    conv = apply_pe(tiny_vit(patch_drop_rate=0.5, dynamic_img_size=True), "cayley")
    x = images(32, 48)
    conv.eval()
    ref = conv(x)
    conv.train()
    out = conv(x)  # half the patches and their coordinates dropped
    assert out.shape == (2, 4) and torch.isfinite(out).all()
    conv.set_grad_checkpointing(True)
    conv.eval()
    torch.testing.assert_close(conv(x), ref)
    conv.train()
    conv(x).sum().backward()
    assert encodings(conv)[0].freq_param.grad is not None


def test_coord_dim_3_needs_coords():
    conv = apply_pe(tiny_vit(), "cayley", coord_dim=3)
    x = images(32, 32)
    with pytest.raises(ValueError, match="coord_dim=3"):
        conv(x)
    coords = torch.randn(2, 16, 3)
    assert conv(x, coords=coords).shape == (2, 4)


def test_copy_and_save():
    model = tiny_vit()
    conv = apply_pe(model, "cayley", inplace=False)
    assert type(model) is VisionTransformer and not encodings(model)
    buf = io.BytesIO()
    torch.save(conv, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = images(32, 32)
    torch.testing.assert_close(loaded(x), conv(x))


def test_rejects_unsupported():
    with pytest.raises(TypeError, match="already"):
        apply_pe(apply_pe(tiny_vit(), "none"), "cayley")
    with pytest.raises(TypeError, match="supports"):
        apply_pe(torch.nn.Linear(2, 2), "cayley")
    with pytest.raises(ValueError, match="sharing"):
        apply_pe(tiny_vit(), "cayley", sharing="block")
    with pytest.raises(ValueError, match="unknown position encoding"):
        apply_pe(tiny_vit(), "rope2")


EVA_HAS_QK_NORM = "qk_norm" in inspect.signature(Eva.__init__).parameters  # timm >= 1.0.30


def test_eva_identity_and_variable_size():
    # ``Eva(qk_norm=...)`` exists from timm 1.0.30 on; older timm builds the same model without q/k norms
    model = tiny_eva(dynamic_img_size=True, **({"qk_norm": True} if EVA_HAS_QK_NORM else {}))
    x = images(32, 32)
    ref = model(x)
    conv = apply_pe(model, "cayley", inplace=False, init_identity=True)
    assert isinstance(conv, RopeEva)
    torch.testing.assert_close(conv(x), ref, rtol=0, atol=1e-6)
    assert conv(images(48, 24)).shape == (2, 4)
    assert any(".attn.pe." in n for n in conv.no_weight_decay())


def test_eva_replaces_its_rope():
    model = tiny_eva(use_rot_pos_emb=True, patch_drop_rate=0.25)
    conv = apply_pe(model, "mixed", inplace=False)
    x = images(32, 32)
    conv.train()
    conv(x).sum().backward()  # patch dropout gathers the coordinates of the kept patches
    assert encodings(conv)[0].freq_param.grad is not None
    assert ropekit.PositionEncoding not in {type(m) for m in model.modules()}


# ---------------------------------------------------------------------------------------------- models with RoPE
def tiny_timm(name, **kw):
    """A tiny randomly initialised timm model with sharp attention (q/k weights scaled up, layer scale 1), so that
    its rotary embedding visibly changes the features."""
    torch.manual_seed(0)
    args = dict(pretrained=False, img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=4,
                init_values=1.0)
    model = timm.create_model(name, **{**args, **kw}).eval()
    with torch.no_grad():
        for blk in model.blocks:
            w = blk.attn.qkv.weight if blk.attn.qkv is not None else None
            if w is not None:
                w[: 2 * w.shape[1]] *= 20.0
            else:
                blk.attn.q_proj.weight.mul_(20.0)
                blk.attn.k_proj.weight.mul_(20.0)
    return model


def convert_quietly(model, name, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # keeping the model's RoPE must not warn
        return apply_pe(model, name, inplace=False, init_identity=True, **kw)


ROPE_MODELS = [  # (timm name, sharing that can hold its frequencies)
    ("eva02_tiny_patch14_224", "model"),  # axial, ref_feat_shape (16, 16) rescales the 4x4 grid
    ("vit_base_patch16_rope_224", "model"),  # rope-vit RoPE-Axial, "xy" grid
    ("vit_base_patch16_rope_mixed_224", "head"),  # rope-vit RoPE-Mixed: frequencies per block and head
    ("vit_base_patch16_rope_mixed_ape_224", "head"),  # RoPE-Mixed beside an absolute embedding
    ("vit_base_patch16_rope_reg1_gap_256", "layer"),  # register token, no class token
    ("vit_pe_core_tiny_patch16_384", "model"),  # grid offset 1, "xy", reference grid
]
ROPE_MODELS = [(m, s) for m, s in ROPE_MODELS if m in timm.list_models()]


@pytest.mark.parametrize("model_name,sharing", ROPE_MODELS)
@pytest.mark.parametrize("name", ["mixed", "cayley"])
def test_init_identity_keeps_the_models_rope(model_name, sharing, name):
    model = tiny_timm(model_name)
    x = images(32, 32)
    ref = model.forward_features(x)
    removed = apply_pe(model, "none", inplace=False).forward_features(x)
    assert (removed - ref).abs().max() > 1e-3  # the model's RoPE matters: the check below can fail
    conv = convert_quietly(model, name, sharing=sharing)
    torch.testing.assert_close(conv.forward_features(x), ref, rtol=0, atol=1e-5)
    assert not any("rope" in n and "pe." not in n for n, _ in conv.named_parameters())


@pytest.mark.parametrize("hw", [(32, 32), (48, 24), (64, 64)])
def test_kept_rope_at_other_image_sizes(hw):
    """EVA02 rescales its grid to the reference (pre-training) grid at every size; the converted model does too."""
    model = tiny_timm("eva02_tiny_patch14_224", dynamic_img_size=True)
    conv = convert_quietly(model, "cayley")
    x = images(*hw)
    torch.testing.assert_close(conv.forward_features(x), model.forward_features(x), rtol=0, atol=1e-5)


@pytest.mark.skipif("rope_rotate_half" not in inspect.signature(Eva.__init__).parameters,
                    reason="this timm has no half-split (rotate_half) rotary layout for Eva")
def test_kept_rope_with_half_split_pairs():
    """A model rotating pairs (x_i, x_{i+d/2}) is kept by reordering q and k channels alike (logits unchanged)."""
    model = tiny_timm("eva02_tiny_patch14_224", rope_rotate_half=True)
    x = images(32, 32)
    ref = model.forward_features(x)
    try:
        from timm.layers.pos_embed_sincos import _rope_layout  # noqa: F401  timm >= 1.0.31: consistent half layout
    except ImportError:  # older timm: the sin/cos table is interleaved but the rotation half-split (no rotation)
        with pytest.warns(UserWarning, match="does NOT compute"):
            apply_pe(model, "mixed", inplace=False, init_identity=True)
        return
    conv = convert_quietly(model, "mixed")
    assert conv.blocks[0].attn.rope_qk_perm is not None
    torch.testing.assert_close(conv.forward_features(x), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["no-frequencies", "shared-across-heads", "normalized", "centroid"])
def test_rope_that_cannot_be_kept_warns(case):
    """Where the requested encoding cannot hold the model's RoPE, the conversion says so and why; the result is
    then the model without its RoPE (exactly what the warning says)."""
    model_name, name, kw, why = {
        "no-frequencies": ("vit_base_patch16_rope_224", "liere", {}, "learnable frequency"),
        "shared-across-heads": ("vit_base_patch16_rope_mixed_224", "mixed", {"sharing": "layer"}, "sharing='head'"),
        "normalized": ("eva02_tiny_patch14_224", "mixed", {"coords": "normalized"}, "coords='grid'"),
        "centroid": ("eva02_tiny_patch14_224", "mixed", {"prefix": "centroid"}, "unrotated"),
    }[case]
    if model_name not in timm.list_models():
        pytest.skip(f"this timm has no {model_name}")
    model = tiny_timm(model_name)
    with pytest.warns(UserWarning, match=why) as rec:
        conv = apply_pe(model, name, inplace=False, init_identity=True, **kw)
    assert any("does NOT compute what the original did" in str(w.message) for w in rec)
    x = images(32, 32)
    if case in ("no-frequencies", "shared-across-heads", "normalized"):  # prefix unrotated: equal to removing RoPE
        removed = apply_pe(model, "none", inplace=False)
        torch.testing.assert_close(conv.forward_features(x), removed.forward_features(x), rtol=0, atol=1e-5)


def test_other_rope_kinds_warn():
    if "rope_type" not in inspect.signature(Eva.__init__).parameters:
        pytest.skip("this timm has a single kind of Eva rotary embedding")
    try:  # DINOv3's rotary embedding is kept now (tests/test_timm_families.py); timm's MRoPE is not
        model = tiny_timm("vit_base_patch16_rope_224", rope_type="mrope", rope_grid_indexing="ij")
    except (TypeError, AssertionError, ValueError) as exc:  # timm 1.0.29 cannot build it
        pytest.skip(f"this timm cannot build an Eva with its multimodal RoPE: {exc}")
    with pytest.warns(UserWarning, match="RotaryEmbeddingMRope"):
        apply_pe(model, "mixed", inplace=False, init_identity=True)


def test_kept_rope_trains():
    model = tiny_timm("vit_base_patch16_rope_mixed_224")
    conv = convert_quietly(model, "mixed", sharing="head")
    conv.train()
    conv(images(32, 32)).sum().backward()
    pes = encodings(conv)
    assert len(pes) == 2 and all(pe.freq_param.grad is not None for pe in pes)
    torch.testing.assert_close(pes[1].freq_param.detach(), model.rope.freqs.detach()[[1, 0], 1].transpose(0, 1))


@pytest.mark.skipif("num_kv_heads" not in inspect.signature(Eva.__init__).parameters,
                    reason="this timm has no grouped-query attention in Eva (num_kv_heads)")
def test_grouped_query_attention_keeps_rope():
    model = tiny_timm("vit_base_patch16_rope_224", num_heads=4, num_kv_heads=2, qkv_fused=False)
    x = images(32, 32)
    conv = convert_quietly(model, "cayley", sharing="head")
    torch.testing.assert_close(conv.forward_features(x), model.forward_features(x), rtol=0, atol=1e-5)


def test_version_check():
    from ropekit.integrations import timm as integ

    assert integ._version_tuple("1.0.29.dev0") == (1, 0, 29) and integ._version_tuple("1.1.0+cu") == (1, 1, 0)
    with pytest.warns(UserWarning, match="tested with timm >= 1.0.29"):
        integ._check_timm_version("0.9.16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integ._check_timm_version("1.0.29")
        integ._check_timm_version(timm.__version__)


def test_conversion_check_catches_a_wrong_reading(monkeypatch):
    """The probe comparison against timm's own rotation is a real check: frequencies read wrongly are caught, and
    the conversion then warns and falls back to the identity instead of returning a different model."""
    from ropekit.integrations import timm_rope

    real = timm_rope.read_timm_rope

    def misread(model, head_dim):
        rope = real(model, head_dim)
        rope.freqs = rope.freqs * 1.5
        return rope

    monkeypatch.setattr(timm_rope, "read_timm_rope", misread)
    model = tiny_timm("eva02_tiny_patch14_224")
    with pytest.warns(UserWarning, match="differs from the model's rotary embedding"):
        conv = apply_pe(model, "mixed", inplace=False, init_identity=True)
    x = images(32, 32)
    removed = apply_pe(model, "none", inplace=False)
    torch.testing.assert_close(conv.forward_features(x), removed.forward_features(x), rtol=0, atol=1e-5)


def test_kept_rope_after_set_input_size():
    model = tiny_timm("eva02_tiny_patch14_224")
    conv = convert_quietly(model, "mixed")
    for m in (model, conv):
        m.set_input_size(img_size=(48, 40))
    x = images(48, 40)
    torch.testing.assert_close(conv.forward_features(x), model.forward_features(x), rtol=0, atol=1e-5)
