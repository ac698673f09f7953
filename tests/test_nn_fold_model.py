"""Model-side contract of ropekit.nn: paper sharing presets, reset_parameters / meta-device builds, and
model-level no_weight_decay names."""

import pytest
import torch

from ropekit.encodings import PositionEncoding
from ropekit.nn import PAPER_SHARING, Attention, VisionTransformer, vit_config


def _cfg(**kw):
    base = dict(num_classes=3, in_chans=1, image_size=(16, 16), depth=3, embed_dim=32, num_heads=2)
    return vit_config("tiny", **{**base, **kw})


# ------------------------------------------------------------------ sharing presets
def test_paper_sharing_defaults():
    mixed = VisionTransformer(_cfg(pe="mixed"))
    assert mixed.cfg.pe_sharing == "head" and mixed.cfg.per_head
    assert len(mixed.encodings) == 3 and all(pe.freq_param.shape[0] == 2 for pe in mixed.encodings)  # layer x head
    liere = VisionTransformer(_cfg(pe="liere", pe_options={"block_size": 4}))
    assert liere.cfg.pe_sharing == "model" and len(liere.encodings) == 1
    for name in ("cayley", "circulant"):
        m = VisionTransformer(_cfg(pe=name))
        assert m.cfg.pe_sharing == "layer" and len(m.encodings) == 3 and not m.encodings[0].per_head, name
    for name in ("comrope-ap", "comrope-ld"):  # ComRoPE Table 7: parameters per layer and head
        m = VisionTransformer(_cfg(pe=name, pe_options={"block_size": 4}))
        assert m.cfg.pe_sharing == "head" and len(m.encodings) == 3 and m.encodings[0].per_head, name
    assert set(PAPER_SHARING) >= {"mixed", "liere", "cayley", "circulant", "axial", "comrope-ap", "comrope-ld"}


def test_sharing_override_is_free():
    m = VisionTransformer(_cfg(pe="mixed", pe_sharing="model"))
    assert len(m.encodings) == 1 and m.encodings[0].freq_param.shape[0] == 1
    c = VisionTransformer(_cfg(pe="cayley", pe_sharing="head"))
    assert len(c.encodings) == 3 and c.encodings[0].cayley_params.shape[0] == 2
    # the run's saved config records the concrete choice, so a later change of presets cannot alter it
    assert VisionTransformer(_cfg(pe="mixed")).cfg.to_dict()["pe_sharing"] == "head"


# ------------------------------------------------------------------ reset_parameters and meta builds
def _eager_and_meta(seed=7, **kw):
    cfg = _cfg(**kw)
    eager = VisionTransformer(cfg)
    with torch.device("meta"):
        meta = VisionTransformer(cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(seed)
    eager.reset_parameters()
    torch.manual_seed(seed)
    meta.reset_parameters()
    return eager, meta


def _assert_same(a, b):
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sa.keys() == sb.keys()
    for n in sa:
        assert torch.equal(sa[n], sb[n]), n
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    for n in ba:
        assert torch.equal(ba[n], bb[n]), n


@pytest.mark.parametrize("kw", [dict(pe="none"), dict(pe="absolute", cls="unrotated"),
                                dict(pe="sincos", cls="centroid"),
                                dict(pe="none", modality="rgbd", in_chans=3, depth_input="channel"),
                                dict(pe="none", modality="video", num_frames=4, ape="learned")])
def test_meta_build_reset_equals_eager(kw):
    eager, meta = _eager_and_meta(**kw)
    _assert_same(eager, meta)
    channels = 4 if kw.get("modality") == "rgbd" else 1
    x = torch.rand(2, channels, *((4,) if kw.get("modality") == "video" else ()), 16, 16)
    with torch.no_grad():
        assert torch.equal(eager.eval()(x), meta.eval()(x))


@pytest.mark.parametrize("pe", ["axial", "mixed", "cayley", "circulant", "comrope-ld", "liere"])
def test_meta_build_reset_equals_eager_rotary(pe):
    """With an encoding: the ViT's own parameters and the encoding's (whose re-initialisation, which also rebuilds
    derived buffers, lives with the encodings)."""
    opts = {"block_size": 4} if pe in ("comrope-ld", "liere") else {}
    cfg = _cfg(pe=pe, pe_options=opts, cls="unrotated", modality="rgbd", in_chans=1)
    eager, meta = _eager_and_meta(pe=pe, pe_options=opts, cls="unrotated", modality="rgbd", in_chans=1)
    _assert_same(eager, meta)


def test_reset_parameters_scheme():
    torch.manual_seed(0)
    m = VisionTransformer(_cfg(pe="cayley", ape="learned", cls="unrotated", modality="rgbd", depth_scale_init=0.5))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # as after training
    m.reset_parameters()
    d = 32
    for blk in m.blocks:
        bound = (6.0 / (d + d)) ** 0.5  # q, k and v each a D x D xavier matrix
        assert blk.attn.qkv.weight.abs().max() <= bound and blk.attn.qkv.weight.abs().max() > 0.8 * bound
        assert torch.count_nonzero(blk.attn.qkv.bias) == 0 and torch.count_nonzero(blk.mlp.fc1.bias) == 0
        assert torch.equal(blk.norm1.weight, torch.ones(d)) and torch.count_nonzero(blk.norm2.bias) == 0
    assert m.depth_lift.scale.item() == 0.5 and m.depth_lift.bias.item() == 0.0
    assert 0.01 < m.ape.table.std().item() < 0.03  # normal(0.02)
    assert 0.005 < m.cls_token.std().item() < 0.04
    assert m.head.weight.std().item() < 0.04 and torch.count_nonzero(m.head.bias) == 0


# ------------------------------------------------------------------ no_weight_decay names
@pytest.mark.parametrize("kw", [dict(pe="cayley", pe_sharing="model"), dict(pe="mixed"), dict(pe="circulant"),
                                dict(pe="cayley", cls="unrotated", ape="learned", modality="rgbd"),
                                dict(pe="none", cls="unrotated")])
def test_no_weight_decay_full_names(kw):
    m = VisionTransformer(_cfg(**kw))
    names = m.no_weight_decay()
    params = dict(m.named_parameters())
    assert names <= set(params)
    pe_params = {n for n in params if ".pe." in n}
    expected = pe_params | {n for n in params if n in ("cls_token", "ape.table") or n.startswith("depth_lift.")}
    assert names == expected
    if m.encodings:
        assert pe_params and all(n.startswith("blocks.") for n in pe_params)
    # the layers' own names are relative to them and name their parameters
    for i, blk in enumerate(m.blocks):
        own = dict(blk.named_parameters())
        assert blk.no_weight_decay() <= set(own)
        assert {f"blocks.{i}.{n}" for n in blk.no_weight_decay()} <= {f"blocks.{i}.{n}" for n in own}
    att = Attention(32, 2, None)
    assert att.no_weight_decay() == set()


def test_no_weight_decay_shared_encoding_named_once():
    m = VisionTransformer(_cfg(pe="cayley", pe_sharing="model"))
    names = m.no_weight_decay()
    assert all(n.startswith("blocks.0.attn.pe.") for n in names)
    assert {n.split(".")[-1] for n in names} == {n for n, _ in m.encodings[0].named_parameters()}
    assert isinstance(m.encodings[0], PositionEncoding)
