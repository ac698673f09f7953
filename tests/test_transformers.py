"""ropekit.integrations.transformers: Qwen2-VL, Qwen2.5-VL and Qwen3-VL built from small configs (random weights,
nothing downloaded) keep their function when converted, and ropekit's frequencies reproduce their cos/sin tables.

Tolerances: the cos/sin tables are the same fp32 products ``id * inv_freq`` (the frequencies are computed by the
same fp32 expression), so they agree to an ulp of the angle (angles < 100 rad here: < 1e-5 absolute worst case,
measured 0); against a float64 closed form fp32 angles up to ~100 rad carry ~1e-5 error, so that comparison uses
1e-4 on angles of that size. Attention outputs: the rotation is computed in fp32 by both, in different but
equivalent ways (ropekit multiplies pairs; transformers ``x cos + rotate_half(x) sin``): a few ulp on q and k,
far below the 1e-5 asked; dropping the rotary embedding changes the outputs by > 1e-3 (checked), so the test can
fail.
"""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
    Qwen3VLConfig, Qwen3VLForConditionalGeneration,
)

from ropekit import create_pe  # noqa: E402
from ropekit.integrations.transformers import (  # noqa: E402
    Coordinates, apply_pe, encodings, hf_cos_sin, mrope_frequencies, video_time_index, vision_frequencies,
)

PATCH, MERGE, TPATCH = 4, 2, 2
VISION = dict(depth=2, embed_dim=64, hidden_size=64, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
              temporal_patch_size=TPATCH, in_channels=3)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, bos_token_id=0, eos_token_id=1, pad_token_id=2)
IMAGE, VIDEO, VSTART = 250, 251, 252  # token ids of image / video placeholders and vision start


def build(kind, attn="sdpa"):
    """A small random Qwen-VL model of ``kind`` ("qwen2", "qwen2.5", "qwen3") with sharp attention (q/k weights
    scaled up so that positions matter)."""
    torch.manual_seed(0)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART)
    if kind == "qwen2":
        cfg = Qwen2VLConfig(vision_config=dict(VISION, mlp_ratio=2), text_config=dict(
            TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}), **ids)
        cls = Qwen2VLForConditionalGeneration
    elif kind == "qwen2.5":
        cfg = Qwen2_5_VLConfig(vision_config=dict(VISION, intermediate_size=128, out_hidden_size=64, window_size=16,
                                                  fullatt_block_indexes=[1]),
                               text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                       "mrope_section": [2, 3, 3]}), **ids)
        cls = Qwen2_5_VLForConditionalGeneration
    else:
        cfg = Qwen3VLConfig(vision_config=dict(VISION, intermediate_size=128, out_hidden_size=64,
                                               num_position_embeddings=64, deepstack_visual_indexes=[0]),
                            text_config=dict(TEXT, head_dim=16, rope_parameters={
                                "rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 3],
                                "mrope_interleaved": True}), **ids)
        cls = Qwen3VLForConditionalGeneration
    cfg._attn_implementation = attn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(cfg).eval()
    with torch.no_grad():
        for blk in model.model.visual.blocks:
            w = blk.attn.qkv.weight
            w[: 2 * w.shape[1]] *= 8.0
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


def image_inputs(h, w, seed=0):
    """``pixel_values`` ``(N, 3 * T * P * P)`` and ``grid_thw`` for one image of ``h x w`` patches."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h * w, 3 * TPATCH * PATCH * PATCH, generator=g), torch.tensor([[1, h, w]])


def vision_attention(model, pixel_values, grid_thw, **kw):
    outs = []
    hooks = [b.attn.register_forward_hook(lambda m, i, o: outs.append(o.detach())) for b in model.model.visual.blocks]
    try:
        with torch.no_grad():
            model.model.visual(pixel_values, grid_thw=grid_thw, **kw)
    finally:
        for hk in hooks:
            hk.remove()
    return outs


def worst(a, b):
    return max(float((u - v).abs().max()) for u, v in zip(a, b))


KINDS = ["qwen2", "qwen2.5", "qwen3"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["cayley", "mixed"])
def test_vision_tower_keeps_its_function(kind, name):
    model = build(kind)
    conv = apply_pe(model, name, parts=("vision",), inplace=False)
    dropped = apply_pe(model, name, parts=("vision",), inplace=False)
    for pe in encodings(dropped.model.visual):
        with torch.no_grad():
            pe.freq_param.zero_()  # the identity: the tower without its rotary embedding
    for hw in [(4, 4), (6, 10)]:  # two image sizes and aspect ratios (in patches, multiples of the merge size)
        x, grid = image_inputs(*hw)
        ref = vision_attention(model, x, grid)
        assert worst(vision_attention(conv, x, grid), ref) <= 1e-5
        assert min(float((u - v).abs().max()) for u, v in zip(vision_attention(dropped, x, grid), ref)) > 1e-3
    assert isinstance(conv.model.visual.rotary_pos_emb, Coordinates)


def text_inputs(h=4, w=4, text_before=3, text_after=4):
    """input_ids with one image of ``h x w`` patches (merged 2x2) between text, and its mm_token_type_ids."""
    n_img = h * w // MERGE ** 2
    ids = [5 + i for i in range(text_before)] + [VSTART] + [IMAGE] * n_img + [9 + i for i in range(text_after)]
    input_ids = torch.tensor([ids])
    mm = (input_ids == IMAGE).int()
    return input_ids, mm


def get_rope_index(model, input_ids, mm, grid):
    out = model.model.get_rope_index(input_ids, mm, image_grid_thw=grid)
    return out[0]  # (3, B, L)


@pytest.mark.parametrize("kind", KINDS)
def test_mrope_cos_sin_from_get_rope_index(kind):
    """ropekit's M-RoPE frequencies give transformers' cos/sin tables on the ids get_rope_index returns (chunked
    sections for Qwen2/2.5-VL, interleaved for Qwen3-VL), and on real-valued ids."""
    model = build(kind)
    rot = model.model.language_model.rotary_emb
    input_ids, mm = text_inputs(4, 6)
    _, grid = image_inputs(4, 6)
    pos = get_rope_index(model, input_ids, mm, grid)  # (3, 1, L)
    assert pos.shape[0] == 3 and not torch.equal(pos[1], pos[2])  # the image has distinct h and w ids
    d = model.model.language_model.layers[0].self_attn.head_dim
    freqs = mrope_frequencies(d, rot.mrope_section, float(rot.config.rope_parameters["rope_theta"]),
                              interleaved=(kind == "qwen3"))
    pe = create_pe("mixed", head_dim=d, coord_dim=3, freqs=freqs, pairs="half")
    x = torch.zeros(1, pos.shape[-1], 64)
    for ids in (pos, pos.float() + torch.rand(pos.shape, generator=torch.Generator().manual_seed(0))):
        cos_hf, sin_hf = rot(x, ids)
        cos, sin = hf_cos_sin(pe, ids.permute(1, 2, 0).float())
        torch.testing.assert_close(cos, cos_hf, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, sin_hf, rtol=0, atol=1e-6)
    # the other layout is a different table: the check can fail
    wrong = mrope_frequencies(d, rot.mrope_section, float(rot.config.rope_parameters["rope_theta"]),
                              interleaved=(kind != "qwen3"))
    cos_w, _ = hf_cos_sin(create_pe("mixed", head_dim=d, coord_dim=3, freqs=wrong, pairs="half"),
                          pos.permute(1, 2, 0).float())
    assert float((cos_w - rot(x, pos)[0]).abs().max()) > 1e-2


def test_mrope_frequencies_closed_form():
    """Chunked sections [2, 3, 3] of d = 16: pairs 0-1 on t, 2-4 on h, 5-7 on w; interleaved: t h w t h w t h
    (j % 3, limited to 3 * section), frequencies theta^(-2j/d) in float64."""
    inv = 10000.0 ** (-torch.arange(8, dtype=torch.float64) * 2 / 16)
    f = mrope_frequencies(16, [2, 3, 3]).double()
    axes = f.abs().argmax(0)
    assert axes.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    torch.testing.assert_close(f.sum(0), inv, rtol=1e-6, atol=0)
    assert (f != 0).sum(0).tolist() == [1] * 8
    fi = mrope_frequencies(16, [2, 3, 3], interleaved=True)
    assert fi.abs().argmax(0).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    fi = mrope_frequencies(16, [4, 2, 2], interleaved=True)  # h and w limited to their first 3 * 2 pairs
    assert fi.abs().argmax(0).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    v = vision_frequencies(16, 10000.0, coord_dim=3)
    inv_v = 10000.0 ** (-torch.arange(4, dtype=torch.float64) * 2 / 8)
    torch.testing.assert_close(v[0, :4].double(), inv_v, rtol=1e-6, atol=0)
    torch.testing.assert_close(v[1, 4:].double(), inv_v, rtol=1e-6, atol=0)
    assert float(v[2].abs().max()) == 0 and float(v[0, 4:].abs().max()) == 0
    with pytest.raises(ValueError, match="sum"):
        mrope_frequencies(16, [2, 3, 4])
    with pytest.raises(ValueError, match="multiple of 4"):
        vision_frequencies(18)


def test_fractional_time():
    """Real-valued time ids: the encoding's angle is t * inv exactly (float64 closed form), where an integer id
    (what get_rope_index keeps) is off by the truncated fraction."""
    times = video_time_index(4, seconds_per_grid=2 / 3, tokens_per_second=2)  # 0, 1.33, 2.67, 4.0
    torch.testing.assert_close(times, torch.tensor([0, 4 / 3, 8 / 3, 4.0], dtype=torch.float64))
    freqs = mrope_frequencies(16, [2, 3, 3])
    pe = create_pe("mixed", head_dim=16, coord_dim=3, freqs=freqs, pairs="half").double()
    coords = torch.stack([times, torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)], -1)
    cos, _ = hf_cos_sin(pe, coords)
    inv0 = 1.0  # pair 0 reads t with frequency theta^0
    torch.testing.assert_close(cos[:, 0], torch.cos(times * inv0), rtol=0, atol=1e-12)
    truncated, _ = hf_cos_sin(pe, coords.trunc())
    assert float((truncated[:, 0] - cos[:, 0]).abs().max()) > 0.1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_whole_model_keeps_its_function(kind, attn):
    """Vision tower and language model converted: the logits of an image+text prompt, and every language-model
    layer's attention output, match the original's (through the model's own attention interface)."""
    model = build(kind, attn)
    input_ids, mm = text_inputs(4, 6)
    pixels, grid = image_inputs(4, 6)
    kw = dict(input_ids=input_ids, mm_token_type_ids=mm, pixel_values=pixels, image_grid_thw=grid)

    def run(m):
        outs = []
        hooks = [layer.self_attn.register_forward_hook(lambda mod, i, o: outs.append(o[0].detach()))
                 for layer in m.model.language_model.layers]
        with torch.no_grad():
            logits = m(**kw).logits
        for hk in hooks:
            hk.remove()
        return logits, outs

    ref_logits, ref = run(model)
    conv = apply_pe(model, "cayley", inplace=False)
    logits, got = run(conv)
    assert worst(got, ref) <= 1e-5
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    dropped = apply_pe(model, "none", parts=("text",), inplace=False, init_identity=False)
    assert min(float((u - v).abs().max()) for u, v in zip(run(dropped)[1], ref)) > 1e-3
    assert conv.config._attn_implementation == attn


def test_generation_with_cache_matches():
    model = build("qwen2")
    input_ids, mm = text_inputs(4, 4)
    pixels, grid = image_inputs(4, 4)
    kw = dict(input_ids=input_ids, mm_token_type_ids=mm, pixel_values=pixels, image_grid_thw=grid, max_new_tokens=4,
              do_sample=False)
    with torch.no_grad():
        ref = model.generate(**kw)
        got = apply_pe(model, "cayley", inplace=False).generate(**kw)
    assert torch.equal(got, ref)


def test_learnable_after_conversion():
    model = build("qwen2.5")
    conv = apply_pe(model, "cayley", sharing="layer")
    pes = encodings(conv)
    assert len(pes) == 4  # 2 vision blocks + 2 language layers
    input_ids, mm = text_inputs(4, 4)
    pixels, grid = image_inputs(4, 4)
    conv.train()
    out = conv(input_ids=input_ids, mm_token_type_ids=mm, pixel_values=pixels, image_grid_thw=grid,
               labels=input_ids)
    out.loss.backward()
    for pe in pes:
        grads = [p.grad for p in pe.parameters()]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(float(g.abs().max()) > 0 for g in grads)


@pytest.mark.parametrize("kind", KINDS)
def test_depth_axis_starts_as_the_2d_tower(kind):
    """extra_axes=1: the vision tower takes (h, w, depth) ids and starts as the 2-D tower whatever the depth; once
    the depth frequencies move, depth changes the output (the axis is live)."""
    model = build(kind)
    conv = apply_pe(model, "cayley", parts=("vision",), extra_axes=1, inplace=False)
    x, grid = image_inputs(4, 6)
    ref = vision_attention(model, x, grid)
    from transformers.models.qwen2_vl.modeling_qwen2_vl import get_vision_position_ids

    hw = get_vision_position_ids(grid, MERGE)  # (N, 2)
    depth = torch.rand(hw.shape[0], 1, generator=torch.Generator().manual_seed(0)) * 5
    ids = torch.cat([hw.float(), depth], -1)  # (N, 3)
    assert worst(vision_attention(conv, x, grid, position_ids=ids), ref) <= 1e-5
    for pe in encodings(conv):
        with torch.no_grad():
            pe.freq_param[..., 2, :].fill_(0.5)
    assert worst(vision_attention(conv, x, grid, position_ids=ids), ref) > 1e-3


def test_rejects_bad_input():
    model = build("qwen2")
    with pytest.raises(ValueError, match="sharing"):
        apply_pe(model, "cayley", sharing="head", inplace=False)
    with pytest.raises(ValueError, match="parts"):
        apply_pe(model, "cayley", parts=("audio",), inplace=False)
    with pytest.raises(ValueError, match="learnable frequency"):
        apply_pe(model, "liere", inplace=False)
    with pytest.raises(TypeError, match="no Qwen-VL"):
        apply_pe(torch.nn.Linear(2, 2), "cayley")
    conv = apply_pe(model, "cayley", inplace=False)
    with pytest.raises(TypeError, match="already"):
        apply_pe(conv, "cayley")
