"""2-D -> 3-D fine-tuning: the RGB-D model's first forward pass equals the 2-D model's.

The 2-D model is an RGB ViT (``depth_input="ignore"``) on RGB-D input; the 3-D one lifts each patch's mean valid
depth to a third coordinate for a 3-D encoding (or, without a rotary encoding, takes depth as an input channel).
"""

from pathlib import Path

import pytest
import torch

from ropekit.cli import main
from ropekit.train.finetune import init_3d_from_2d, init_3d_from_checkpoint, load_source_model, logits_match
from ropekit.nn import VisionTransformer, vit_config

BASE = dict(num_classes=5, in_chans=3, modality="rgbd", patch_size=4, embed_dim=48, depth=2, num_heads=2,
            image_size=(16, 16))


def vit(pe, **kw):
    return VisionTransformer(vit_config("tiny", **{**BASE, "pe": pe, **kw})).eval()


def trained_2d(pe, **kw):
    """A 2-D model whose parameters (encodings included) are moved away from their initialisation."""
    torch.manual_seed(0)
    model = vit(pe, depth_input="ignore", **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def rgbd_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 4, 16, 16, generator=g)  # RGB in [0, 1] + metric depth
    x[:, 3] = 0.5 + 3.0 * x[:, 3]
    x[0, 3, :5, :5] = 0.0  # invalid depth: 0 and NaN are masked, never propagated
    x[1, 3, 8:, 8:] = float("nan")
    return x


def assert_same_function(m3, m2):
    x = rgbd_batch()
    with torch.no_grad():
        f2, f3 = m2.forward_features(x), m3.forward_features(x)  # every token, before pooling
        assert torch.isfinite(f3).all()
        torch.testing.assert_close(f3, f2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m3(x), m2(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pe2d,pe3d,kw", [
    ("cayley", "cayley", {}),
    ("circulant", "circulant", dict(pe_sharing="layer")),
    ("liere", "liere", {}),
    ("comrope-ld", "comrope-ld", dict(cls="unrotated")),
    # Cayley's basis starts at P = I; one sharing for both (mixed's paper default is per head, cayley's per layer)
    ("mixed", "cayley", dict(cls="centroid", pe_sharing="layer")),
    ("none", "cayley", {}),                          # no rotary encoding in the checkpoint: generators start at 0
    ("absolute", "absolute", {}),                    # no coordinate path: depth as a zero-weight extra channel
])
def test_first_forward_equals_the_2d_model(pe2d, pe3d, kw):
    m2 = trained_2d(pe2d, **kw)
    torch.manual_seed(1)
    m3 = vit(pe3d, depth_input="auto", **kw)
    report = init_3d_from_2d(m3, m2)
    assert not report["missing"] and not report["skipped"]
    if m3.depth_lift is not None:
        assert report["depth_lift"] and m3.coord_dim == 3
    if pe2d == pe3d and pe3d != "absolute":
        assert report["widened"]  # the coordinate axis of the encoding parameters went 2 -> 3
    if pe2d == "none":
        assert report["zeroed"]
    if pe3d == "absolute":
        assert report["grown"] == ["patch_embed.proj.weight"]
    assert_same_function(m3, m2)


def test_new_z_slice_keeps_its_initialisation_and_depth_learns():
    m2 = trained_2d("cayley")
    m3 = vit("cayley", depth_input="coord")
    init_3d_from_2d(m3, m2)
    pe2, pe3 = m2.encodings[0], m3.encodings[0]
    torch.testing.assert_close(pe3.freq_param[:, :2], pe2.freq_param)
    assert pe3.freq_param[:, 2].abs().sum() > 0  # fresh z frequencies: the depth lift receives gradients
    assert m3.depth_lift.scale.item() == 0.0 and m3.depth_lift.bias.item() == 0.0
    m3.train()
    loss = torch.nn.functional.cross_entropy(m3(rgbd_batch()), torch.arange(4) % 5)
    loss.backward()
    assert m3.depth_lift.scale.grad is not None and m3.depth_lift.scale.grad.abs() > 0


def test_encodings_that_cannot_start_from_2d_are_refused():
    m2 = trained_2d("axial")
    with pytest.raises(ValueError, match="does not reproduce"):
        init_3d_from_2d(vit("axial", depth_input="coord"), m2)
    assert not logits_match(vit("axial", depth_input="coord").encodings[0], m2.encodings[0])
    with pytest.raises(ValueError, match="cannot map"):  # another head size
        init_3d_from_2d(vit("cayley", depth_input="coord", embed_dim=64), trained_2d("cayley"))


def test_state_dict_source_without_check():
    m2 = trained_2d("cayley")
    m3 = vit("cayley", depth_input="coord")
    init_3d_from_2d(m3, m2.state_dict())
    assert_same_function(m3, m2)


# ---------------------------------------------------------------------------------------------- through the CLI
COMMON = ["--data", "rgbd-digits", "--image-size", "16", "--train-fraction", "0.1", "--model-opt", "depth=2",
          "--model-opt", "embed_dim=48", "--epochs", "1", "--seed", "0", "--no-progress", "--no-tensorboard",
          "--threads", "1"]


def cli_train(out: Path, *args: str) -> Path:
    assert main(["train", *COMMON, "--out", str(out), *args]) == 0
    return out


@pytest.fixture(scope="module")
def run2d(tmp_path_factory):
    return cli_train(tmp_path_factory.mktemp("ft") / "2d", "--pe", "cayley", "--depth-input", "ignore")


def test_from_a_run_folder(run2d):
    """``init_3d_from_checkpoint`` reads a ``ropekit train`` run folder (the 2-D model and its weights)."""
    m2 = load_source_model(str(run2d))
    m3 = VisionTransformer(vit_config("tiny", **{**m2.cfg.to_dict(), "depth_input": "coord"})).eval()
    init_3d_from_checkpoint(m3, str(run2d))
    assert_same_function(m3, m2)


def test_cli_init_from_first_forward_equals_the_2d_model(run2d, tmp_path):
    # one epoch at a vanishing learning rate: the weights move by ~1e-12, so the checkpoint holds the initialisation
    run3d = cli_train(tmp_path / "3d", "--pe", "cayley", "--depth-input", "coord", "--depth-scale-init", "0",
                      "--init-from", str(run2d), "--lr", "1e-12")
    assert_same_function(load_source_model(str(run3d)), load_source_model(str(run2d)))
