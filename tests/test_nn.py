"""ropekit.nn: attention wiring, coordinates, ViT / ViTD / video models, invariances, training steps."""

import math

import pytest
import torch

import ropekit
from ropekit.nn import (Attention, DepthLift, VisionTransformer, ViTConfig, grid_coords, jitter_coords,
                        patch_mean_depth, sincos_pos_embed, vit_config)



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead on a shared machine
    yield
    torch.set_num_threads(previous)

ALL_PES = ropekit.list_pes() + ["absolute", "sincos"]
COMMUTING = ["axial", "mixed", "cayley", "circulant", "tensor", "string", "liere-commute", "comrope-ap", "comrope-ld"]


def tiny(**kw) -> ViTConfig:
    """A very small model: width 24, one head of 24 (splits over 2 or 3 axes), one block."""
    base = dict(embed_dim=24, depth=1, num_heads=1, mlp_ratio=2.0, patch_size=2, image_size=(8, 8),
                num_classes=5, in_chans=1)
    base.update(kw)
    if base.get("pe") == "comrope-ap":
        base.setdefault("pe_options", {"block_size": 4})  # 6 blocks: a multiple of 2 and of 3
    return ViTConfig(**base)


# ------------------------------------------------------------------------------------------------ coordinates


def test_grid_coords_conventions():
    g = grid_coords((2, 3))
    assert g.shape == (6, 2)
    assert g[:3].tolist() == [[0, 0], [0, 1], [0, 2]] and g[3].tolist() == [1, 0]  # row-major (y, x)
    n = grid_coords((2, 4), "normalized")
    assert torch.allclose(n[0], torch.tensor([0.25, 0.125])) and n.min() > 0 and n.max() < 1
    assert grid_coords((2, 2, 2)).shape == (8, 3)
    with pytest.raises(ValueError, match="coordinate mode"):
        grid_coords((2, 2), "pixels")


def test_jitter_stays_in_patch_and_only_in_training():
    c = grid_coords((4, 4))
    torch.manual_seed(0)
    j = jitter_coords(c, 3, sigma=1.0, unit=[1.0, 1.0])
    assert j.shape == (3, 16, 2)
    assert (j - c).abs().max() <= 0.5 + 1e-6 and (j - c).abs().max() > 0.2
    assert jitter_coords(c, 3, 0.0, [1.0, 1.0]) is c
    model = VisionTransformer(tiny(pe="mixed", jitter=1.0)).eval()
    x = torch.rand(2, 1, 8, 8)
    assert torch.equal(model(x), model(x))  # no jitter at evaluation
    model.train()
    assert not torch.equal(model(x), model(x))


def test_patch_mean_depth_masks_invalid_pixels():
    d = torch.full((1, 4, 4), 2.0)
    d[0, 0, 0] = 0.0  # invalid: ignored in the mean of patch (0, 0)
    d[0, 0, 1] = float("nan")
    d[0, 2:, 2:] = float("nan")  # a whole invalid patch
    d[0, 2:, :2] = torch.tensor([[4.0, 4.0], [4.0, float("inf")]])
    m = patch_mean_depth(d, 2)
    assert torch.isfinite(m).all()
    assert m[0, 0] == 2.0 and m[0, 2] == 4.0
    assert torch.isclose(m[0, 3], torch.tensor((2.0 + 2.0 + 4.0) / 3))  # fallback: mean of the valid patches
    assert torch.equal(patch_mean_depth(torch.zeros(1, 4, 4), 2), torch.zeros(1, 4))


def test_sincos_embedding_and_learned_ape_resize():
    e = sincos_pos_embed(grid_coords((3, 3)), 16)
    assert e.shape == (9, 16) and torch.allclose(e[0, :4], torch.zeros(4))
    model = VisionTransformer(tiny(pe="absolute"))
    assert model.ape.table.shape == (1, 24, 4, 4)
    assert model(torch.rand(2, 1, 12, 12)).shape == (2, 5)  # 6x6 grid: table resized bilinearly
    assert VisionTransformer(tiny(pe="sincos"))(torch.rand(2, 1, 10, 10)).shape == (2, 5)


# ------------------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("pe", ["tensor", "cayley", "none"])
def test_attention_takes_any_encoding(pe):
    enc = ropekit.create_pe(pe, head_dim=8, coord_dim=2, num_heads=2)
    attn = Attention(16, 2, enc)
    x = torch.randn(3, 5, 16)
    out = attn(x, torch.randn(4, 2), num_prefix_tokens=1)
    assert out.shape == x.shape and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="head_dim"):
        Attention(32, 2, enc)


def test_attention_scale_is_head_dim_for_widened_encodings():
    """The tensor encoding widens q, k to 2m*d; the logit must still be scaled by 1/sqrt(d)."""
    torch.manual_seed(0)
    enc = ropekit.create_pe("tensor", head_dim=4, coord_dim=1, num_heads=1, num_features=3)
    attn = Attention(4, 1, enc, qkv_bias=False)
    x, r = torch.randn(1, 3, 4), torch.randn(3, 1)
    q, k, v = attn.qkv(x).reshape(1, 3, 3, 1, 4).permute(2, 0, 3, 1, 4)
    qe, ke = enc(q, k, r)
    w = torch.softmax(qe @ ke.transpose(-1, -2) / 2.0, dim=-1)  # 1/sqrt(4)
    ref = attn.proj((w @ v).transpose(1, 2).reshape(1, 3, 4))
    assert torch.allclose(attn(x, r), ref, atol=1e-6)


# ------------------------------------------------------------------------------------------------ model options


def test_sizes_and_config_validation():
    assert vit_config("base").embed_dim == 768 and vit_config("base").depth == 12 and vit_config("base").num_heads == 12
    assert vit_config("tiny").head_dim % 6 == 0
    for bad, match in [(dict(pe="nope"), "unknown position encoding"), (dict(cls="first"), "cls"),
                       (dict(pe_sharing="block"), "pe_sharing"), (dict(modality="rgbd", pe="none", depth_input="coord"),
                                                                  "coordinate path")]:
        with pytest.raises(ValueError, match=match):
            VisionTransformer(tiny(**bad))
    with pytest.raises(ValueError, match="block_size"):
        VisionTransformer(tiny(pe="circulant", pe_options={"block_size": 5}))
    cfg = tiny(pe="liere", pe_options={"block_size": 4})
    assert ViTConfig.from_dict(cfg.to_dict()) == cfg


def test_image_size_an_int_is_a_square_and_a_bad_one_a_one_line_error():
    """``image_size=224`` (timm's ``img_size``) means ``(224, 224)``; numpy integers read as Python ones; an empty,
    one-axis, fractional or non-positive size is refused in one line before any module is built."""
    np = pytest.importorskip("numpy")
    assert ViTConfig(image_size=32).image_size == (32, 32) == ViTConfig(image_size=[np.int64(32), 32]).image_size
    model = VisionTransformer(ViTConfig(image_size=32, pe="cayley", depth=1, embed_dim=24, num_heads=2))
    assert model.cfg.image_size == (32, 32) and model(torch.randn(2, 1, 32, 32)).shape == (2, 10)
    cfg = ViTConfig(image_size=32)
    assert ViTConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["image_size"] == [32, 32]
    for bad in [(28,), (0, 28), (28, -4), (28.5, 28), 28.5, "28", True, ()]:
        with pytest.raises(ValueError, match="image_size must be a positive int"):
            VisionTransformer(ViTConfig(image_size=bad))


def test_pe_sharing_model_layer_head():
    shared = VisionTransformer(tiny(pe="mixed", depth=3, pe_sharing="model"))  # default for mixed: per head
    assert len(shared.encodings) == 1 and shared.blocks[0].attn.pe is shared.blocks[2].attn.pe
    per_layer = VisionTransformer(tiny(pe="mixed", depth=3, pe_sharing="layer"))
    assert len(per_layer.encodings) == 3 and not per_layer.encodings[0].per_head
    per_head = VisionTransformer(tiny(pe="mixed", depth=3, pe_sharing="head", embed_dim=48, num_heads=2))
    assert len(per_head.encodings) == 3 and per_head.encodings[0].freq_param.shape[0] == 2
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(per_layer) - count(shared) == 2 * shared.encodings[0].freq_param.numel()


def test_no_weight_decay_names_the_encoding_parameters():
    model = VisionTransformer(tiny(pe="cayley", cls="centroid", ape="learned", modality="rgbd", in_chans=3))
    names = model.no_weight_decay()
    params = dict(model.named_parameters())
    assert {"cls_token", "ape.table", "depth_lift.scale", "depth_lift.bias"} <= names
    assert any(n.endswith("cayley_params") for n in names) and any(n.endswith("freq_param") for n in names)
    assert names <= set(params)


def test_variable_image_size_and_normalized_coordinates():
    for coords in ("grid", "normalized"):
        model = VisionTransformer(tiny(pe="cayley", coords=coords))
        for size in (8, 12, 7):  # 7: cropped to the 3x3 grid
            assert model(torch.rand(2, 1, size, size)).shape == (2, 5)


# ------------------------------------------------------------------------------------------------ invariances


def _trained_looking(model):
    for name, p in model.named_parameters():  # at init attention is near uniform and hides position effects
        if p.dim() >= 2 and ".pe." not in name:
            torch.nn.init.normal_(p, std=0.3)
    return model


@pytest.mark.parametrize("pe", COMMUTING)
def test_mean_pooled_commuting_model_is_offset_invariant(pe):
    torch.manual_seed(0)
    model = _trained_looking(VisionTransformer(tiny(pe=pe, depth=2, embed_dim=48, num_heads=2))).eval()
    x = torch.rand(3, 1, 8, 8)
    offset = torch.randn(3, 2) * 5
    with torch.no_grad():
        a, b = model(x), model(x, coord_offset=offset)
    assert (a - b).abs().max() < 2e-5, (pe, (a - b).abs().max())


def test_cls_centroid_keeps_and_unrotated_breaks_offset_invariance():
    torch.manual_seed(0)
    x = torch.rand(3, 1, 8, 8)
    offset = torch.tensor([3.0, -7.0])
    errs = {}
    for cls in ("centroid", "unrotated"):
        model = _trained_looking(VisionTransformer(tiny(pe="cayley", cls=cls, depth=2))).eval()
        with torch.no_grad():
            errs[cls] = (model(x) - model(x, coord_offset=offset)).abs().max().item()
    assert errs["centroid"] < 2e-5
    assert errs["unrotated"] > 1e-3


def test_liere_is_not_offset_invariant():
    torch.manual_seed(0)
    model = _trained_looking(VisionTransformer(tiny(pe="liere", depth=2))).eval()
    x = torch.rand(3, 1, 8, 8)
    with torch.no_grad():
        err = (model(x) - model(x, coord_offset=torch.tensor([2.0, -3.0]))).abs().max()
    assert err > 1e-4


def test_offset_shape_is_checked():
    model = VisionTransformer(tiny(pe="mixed"))
    with pytest.raises(ValueError, match="coord_offset"):
        model(torch.rand(2, 1, 8, 8), coord_offset=torch.zeros(2, 3))


# ------------------------------------------------------------------------------------------------ ViTD and video


def _rgbd(b=4, size=8):
    torch.manual_seed(1)
    x = torch.rand(b, 4, size, size)
    x[:, 3] = 1.0 + 3.0 * x[:, 3]  # metres
    x[0, 3, :2, :2] = float("nan")  # one fully invalid patch
    x[1, 3, 0, :] = 0.0
    return x


def test_vitd_uses_depth_as_coordinate_and_never_propagates_nan():
    model = VisionTransformer(tiny(pe="mixed", modality="rgbd", in_chans=3))
    assert model.cfg.depth_input == "coord" and model.coord_dim == 3 and model.depth_lift is not None
    assert model.patch_embed.proj.in_channels == 3
    x = _rgbd()
    tokens, coords, _ = model.embed(x)
    assert coords.shape == (4, 16, 3) and torch.isfinite(coords).all()
    out = model(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(model.depth_lift.scale.grad)
    assert model.depth_lift.scale.grad != 0
    # depth changes the output through the coordinates only
    _trained_looking(model)
    x2 = x.clone()
    x2[:, 3] *= 2
    assert (model(x) - model(x2)).abs().max() > 1e-3


def test_vitd_depth_as_input_and_coordinate():
    """depth_input='both' (the STRING paper's ViTD): depth enters the patch embedding and the third coordinate;
    each path alone changes the output, and both receive gradients."""
    model = VisionTransformer(tiny(pe="cayley", modality="rgbd", in_chans=3, depth_input="both"))
    assert model.coord_dim == 3 and model.depth_lift is not None and model.patch_embed.proj.in_channels == 4
    x = _rgbd()
    _, coords, _ = model.embed(x)
    assert coords.shape == (4, 16, 3) and torch.isfinite(coords).all()
    out = model(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and model.depth_lift.scale.grad != 0
    assert model.patch_embed.proj.weight.grad[:, 3].abs().sum() > 0  # the depth channel's filter learns
    _trained_looking(model)
    with torch.no_grad():
        base = model(x)
        lift = model.depth_lift
        a = lift.scale.detach().clone()
        lift.scale.zero_()  # coordinate path off: only the channel sees depth
        x2 = x.clone()
        x2[:, 3] *= 2
        assert (model(x2) - model(x)).abs().max() > 1e-3
        lift.scale.copy_(a)
        model.patch_embed.proj.weight[:, 3] = 0  # channel path off: only the coordinate sees depth
        assert (model(x2) - model(x)).abs().max() > 1e-3
        assert torch.isfinite(base).all()
    with pytest.raises(ValueError, match="needs a rotary encoding"):
        VisionTransformer(tiny(pe="none", modality="rgbd", in_chans=3, depth_input="both"))


@pytest.mark.parametrize("pe", ["none", "absolute"])
def test_vitd_without_rotary_encoding_takes_depth_as_a_channel(pe):
    model = VisionTransformer(tiny(pe=pe, modality="rgbd", in_chans=3))
    assert model.cfg.depth_input == "channel" and model.patch_embed.proj.in_channels == 4
    assert model.depth_lift is None
    assert torch.isfinite(model(_rgbd())).all()


def test_vitd_with_zero_depth_scale_starts_as_the_2d_model():
    """depth_scale_init=0: z is constant, so copying a 2-D model's weights gives the same logits."""
    torch.manual_seed(0)
    m2 = VisionTransformer(tiny(pe="mixed", in_chans=3)).eval()
    m3 = VisionTransformer(tiny(pe="mixed", in_chans=3, modality="rgbd", depth_scale_init=0.0)).eval()
    with torch.no_grad():
        m3.depth_lift.bias.fill_(0.7)  # a constant z is a global offset: still the same logits
    state = m2.state_dict()
    own = m3.state_dict()
    for k, v in state.items():
        own[k] = v if own[k].shape == v.shape else torch.cat([v, own[k][:, v.shape[1]:]], dim=1)  # freqs: (Hp, c, P)
    m3.load_state_dict(own)
    x = _rgbd()
    with torch.no_grad():
        assert torch.allclose(m2(x[:, :3]), m3(x), atol=1e-5)


def test_video_tubelets_and_coordinates():
    model = VisionTransformer(tiny(pe="axial", modality="video", num_frames=4, tubelet_size=2))
    x = torch.rand(2, 1, 4, 8, 8)
    tokens, coords, _ = model.embed(x)
    assert tokens.shape == (2, 2 * 4 * 4, 24) and coords.shape == (32, 3)
    assert coords[:, 0].max() == 1 and coords[:, 1].max() == 3  # (t, y, x)
    assert model(x).shape == (2, 5)
    assert model(torch.rand(2, 1, 6, 10, 10)).shape == (2, 5)  # another clip length and size


# ------------------------------------------------------------------------------------------------ training steps


def _inputs(modality):
    g = torch.Generator().manual_seed(0)
    if modality == "image":
        return torch.rand(8, 1, 8, 8, generator=g), {}
    if modality == "rgbd":
        x = torch.rand(8, 4, 8, 8, generator=g)
        x[:, 3] = 1 + 3 * x[:, 3]
        x[0, 3, :3, :3] = float("nan")
        x[1, 3, 4:, 4:] = 0.0
        return x, dict(modality="rgbd", in_chans=3)
    return torch.rand(8, 1, 4, 8, 8, generator=g), dict(modality="video", num_frames=4, tubelet_size=2)


@pytest.mark.parametrize("modality", ["image", "rgbd", "video"])
def test_a_few_steps_lower_the_loss_for_every_encoding(modality):
    x, kw = _inputs(modality)
    y = torch.arange(8) % 5
    for pe in ALL_PES:
        torch.manual_seed(0)
        model = VisionTransformer(tiny(pe=pe, cls="centroid" if pe == "cayley" else "none", **kw))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(8):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            if not losses:
                missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
                assert not missing, (pe, modality, missing)
            opt.step()
            losses.append(loss.item())
        assert all(math.isfinite(v) for v in losses), (pe, modality)
        assert losses[-1] < 0.97 * losses[0], (pe, modality, losses)


def test_depth_lift_module():
    lift = DepthLift(0.5)
    z = lift(torch.full((2, 4, 4), 2.0), 2)
    assert z.shape == (2, 4) and torch.allclose(z, torch.ones(2, 4))
    assert lift.no_weight_decay() == {"scale", "bias"}


def test_readme_python_example_runs():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M)
    assert blocks
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
