"""Streaming video with a KV cache gives the same tokens as the whole clip (frame-causal), keys encoded once."""

import pytest
import torch

from ropekit.integrations.video_stream import VideoStream, check_streamable, frame_causal_mask, video_features
from ropekit.nn import VisionTransformer, vit_config

TT, T, HW = 2, 8, 16


def video_vit(pe="cayley", **kw):
    torch.manual_seed(0)
    cfg = vit_config("tiny", num_classes=5, in_chans=1, modality="video", pe=pe, patch_size=4, tubelet_size=TT,
                     embed_dim=48, depth=2, num_heads=2, image_size=(HW, HW), num_frames=T, **kw)
    model = VisionTransformer(cfg).eval()
    if pe == "cayley":
        with torch.no_grad():
            for enc in model.encodings:
                enc.cayley_params.normal_(std=0.2)
    return model


def clip(seed=1, frames=T, hw=HW):
    return torch.randn(2, 1, frames, hw, hw, generator=torch.Generator().manual_seed(seed))


def stream_all(model, x):
    stream = VideoStream(model)
    return torch.cat([stream.step(x[:, :, t:t + TT]) for t in range(0, x.shape[2], TT)], dim=1), stream


@pytest.mark.parametrize("pe,ape", [("cayley", "none"), ("circulant", "none"), ("axial", "sincos"),
                                    ("liere", "none"), ("tensor", "none"), ("none", "sincos")])
def test_stream_equals_whole_clip(pe, ape):
    model = video_vit(pe, ape=ape)
    x = clip()
    with torch.no_grad():
        whole = video_features(model, x)  # (B, N, D), frame-causal
    streamed, stream = stream_all(model, x)
    torch.testing.assert_close(streamed, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stream.logits(), model.head(whole.mean(dim=1)), rtol=1e-5, atol=1e-5)
    assert stream.num_tokens == whole.shape[1] == (T // TT) * (HW // 4) ** 2


def test_reference_without_mask_is_the_models_forward():
    model = video_vit("cayley")
    x = clip()
    with torch.no_grad():
        torch.testing.assert_close(video_features(model, x, causal=False), model.forward_features(x))
        # the causal reference never looks ahead: changing the last tubelet leaves earlier tokens unchanged
        y = x.clone()
        y[:, :, -TT:] = torch.randn_like(y[:, :, -TT:])
        a, b = video_features(model, x), video_features(model, y)
    m = (HW // 4) ** 2
    torch.testing.assert_close(a[:, :-m], b[:, :-m])
    assert not torch.allclose(a[:, -m:], b[:, -m:])


def test_keys_are_encoded_once():
    model = video_vit("cayley")
    calls = []
    for enc in model.encodings:
        original = enc.rotate

        def counting(x, coords, num_prefix_tokens=0, _orig=original):
            calls.append(x.shape[2])
            return _orig(x, coords, num_prefix_tokens)

        enc.rotate = counting
    stream_all(model, clip())
    m, steps = (HW // 4) ** 2, T // TT
    # per step and block: one rotation of the m new queries and one of the m new keys -- never of cached keys
    assert calls == [m] * (2 * model.cfg.depth * steps)


def test_commuting_cache_ignores_the_absolute_time_origin():
    """A long-running stream's time index can keep growing: with a commuting encoding (and no absolute embedding)
    starting at step 1000 changes nothing; LieRE's outputs do change."""
    x = clip()
    for pe, invariant in [("cayley", True), ("liere", False)]:
        model = video_vit(pe)
        ref, _ = stream_all(model, x)
        stream = VideoStream(model)
        stream.steps = 1000
        late = torch.cat([stream.step(x[:, :, t:t + TT]) for t in range(0, T, TT)], dim=1)
        assert torch.allclose(late, ref, atol=1e-4) == invariant, pe


def test_reset_and_errors():
    model = video_vit("cayley")
    x = clip()
    first, stream = stream_all(model, x)
    stream.reset()
    again = torch.cat([stream.step(x[:, :, t:t + TT]) for t in range(0, T, TT)], dim=1)
    torch.testing.assert_close(again, first)
    with pytest.raises(ValueError, match="one tubelet"):
        stream.step(x[:, :, :3])
    with pytest.raises(ValueError, match="frame size changed"):
        stream.step(clip(hw=20)[:, :, :TT])
    with pytest.raises(RuntimeError, match="no frames"):
        VideoStream(model).logits()


@pytest.mark.parametrize("pe,kw,match", [("absolute", {}, "learned absolute"), ("cayley", dict(cls="unrotated"), "cls"),
                                         ("cayley", dict(coords="normalized"), "grid")])
def test_rejects_unstreamable_models(pe, kw, match):
    with pytest.raises(ValueError, match=match):
        check_streamable(video_vit(pe, **kw))


def test_rejects_image_models():
    cfg = vit_config("tiny", num_classes=3, in_chans=1, embed_dim=48, depth=1, num_heads=2)
    with pytest.raises(ValueError, match="video"):
        VideoStream(VisionTransformer(cfg))


def test_frame_causal_mask():
    mask = frame_causal_mask(3, 2)
    expected = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_stream_with_one_shared_key_head():
    """Multi-query attention (one key/value head, the encoding per query head) streams like the whole clip, and
    the reference without a mask is the model's own forward."""
    model = video_vit("cayley", num_kv_heads=1, pe_sharing="head")
    x = clip()
    with torch.no_grad():
        torch.testing.assert_close(video_features(model, x, causal=False), model.forward_features(x))
        whole = video_features(model, x)
    streamed, _ = stream_all(model, x)
    torch.testing.assert_close(streamed, whole, rtol=1e-5, atol=1e-5)
