"""Coordinate augmentation in training (``coord_augment``: shift, per-axis jitter, rescale, as DINOv3 and timm): the
ViT's coordinates in training mode are ``((r + t) * j) * g`` with one draw per image from the global torch generator,
fixed-size and packed alike; evaluation is untouched; the option is parsed, recorded in the run's config and a run
stopped mid-epoch resumes bit-exactly."""

import argparse
import json
import math

import pytest
import torch

from ropekit.nn import VisionTransformer, vit_config
from ropekit.nn.packing import pack, packed_embed, packed_forward, patchify

TINY = dict(embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0, drop_rate=0.0, drop_path_rate=0.0)
AUG = (0.75, 1.5, 2.0)


def _model(aug=AUG, pe="cayley", **kw) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(vit_config("tiny", pe=pe, in_chans=1, image_size=(16, 12), patch_size=4, num_classes=3,
                                        coord_augment=aug, **dict(TINY, **kw)))


def _reference_draws(seed: int, batch: int, c: int, aug=AUG):
    """The draws written out: ``u ~ U[0, 1)^(B, 2c + 1)`` in float64 from the global generator, then
    ``t = (2u - 1) shift``, ``j = jitter^(2u - 1)``, ``g = rescale^(2u - 1)``."""
    shift, jitter, rescale = aug
    torch.manual_seed(seed)
    u = torch.rand(batch, 2 * c + 1, dtype=torch.float64)
    return ((2 * u[:, :c] - 1) * shift, jitter ** (2 * u[:, c:2 * c] - 1), rescale ** (2 * u[:, 2 * c:] - 1))


def _grid(h: int, w: int) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    return torch.stack([ys, xs], -1).reshape(-1, 2)  # (h w, 2) integer patch indices (``coords="grid"``)


@pytest.mark.parametrize("seed", range(6))
def test_fixed_size_coordinates_in_training_and_evaluation(seed):
    model = _model()
    x = torch.randn(5, 1, 16, 12)
    model.train()
    torch.manual_seed(seed)
    _, coords, _ = model.embed(x)
    t, j, g = _reference_draws(seed, 5, 2)
    want = (_grid(4, 3)[None] + t[:, None]) * j[:, None] * g[:, None]  # (B, M, 2)
    # one float32 rounding of each of 3 operations on values below 2^4: relative error <= 3 * 2^-24
    torch.testing.assert_close(coords.double(), want, rtol=4 * 2.0 ** -24, atol=1e-12)
    assert not torch.allclose(coords.double(), _grid(4, 3)[None].expand(5, -1, -1))
    # every image its own draw, and the draws inside their bounds
    assert len({tuple(r) for r in coords[:, 1].tolist()}) == 5
    assert (t.abs() <= AUG[0]).all() and (j >= 1 / AUG[1]).all() and (j <= AUG[1]).all()
    model.eval()
    _, coords, _ = model.embed(x)
    assert torch.equal(coords.double().reshape(-1, 2), _grid(4, 3))


def test_evaluation_equals_the_model_without_augmentation_and_training_draws_repeat_from_the_seed():
    aug, off = _model(), _model(aug=(0.0, 1.0, 1.0))
    off.load_state_dict(aug.state_dict())
    x = torch.randn(4, 1, 16, 12)
    aug.eval(), off.eval()
    assert torch.equal(aug(x), off(x))
    aug.train()
    torch.manual_seed(7)
    a = aug(x)
    torch.manual_seed(7)
    b = aug(x)
    torch.manual_seed(8)
    c = aug(x)
    assert torch.equal(a, b) and not torch.allclose(a, c)
    assert not torch.allclose(a, off.train()(x))


@pytest.mark.parametrize("pe", ["cayley", "circulant", "mixed"])
def test_shift_alone_changes_no_logit_of_a_commuting_encoding(pe):
    """A global shift per image is an offset, which a commuting encoding with mean pooling cannot see: training-mode
    logits equal evaluation-mode ones (to the float32 rounding of angles at coordinates up to ~6)."""
    model = _model(aug=(5.0, 1.0, 1.0), pe=pe)
    x = torch.randn(6, 1, 16, 12)
    model.eval()
    ref = model(x)
    model.train()
    for seed in range(4):
        torch.manual_seed(seed)
        torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-5)
    model.cfg.coord_augment = (5.0, 1.5, 1.0)  # a scale jitter is seen
    torch.manual_seed(0)
    assert not torch.allclose(model(x), ref, atol=1e-3)


def _packed(sizes):
    torch.manual_seed(1)
    imgs = [patchify(torch.randn(1, h, w), 4, label=i % 3) for i, (h, w) in enumerate(sizes)]
    return pack(imgs, 24)


@pytest.mark.parametrize("seed", range(4))
def test_packed_coordinates_one_draw_per_image_padding_untouched(seed):
    model = _model()
    batch = _packed([(8, 12), (16, 4), (4, 4), (12, 8), (8, 8)])
    model.train()
    torch.manual_seed(seed)
    _, coords, _, _ = packed_embed(model, batch)
    t, j, g = _reference_draws(seed, batch.num_images, 2)
    seg = batch.segment_ids
    base = batch.patch_coord.double()
    for r in range(seg.shape[0]):
        for n in range(seg.shape[1]):
            s = int(seg[r, n])
            if s < 0:  # padding keeps its coordinates
                assert torch.equal(coords[r, n].double(), base[r, n])
                continue
            i = int(batch.image_index[r, s])
            want = (base[r, n] + t[i]) * j[i] * g[i]
            torch.testing.assert_close(coords[r, n].double(), want, rtol=4 * 2.0 ** -24, atol=1e-12)
    model.eval()
    _, coords, _, _ = packed_embed(model, batch)
    assert torch.equal(coords.double(), base)


def test_packed_evaluation_equals_the_model_without_augmentation():
    aug, off = _model(), _model(aug=(0.0, 1.0, 1.0))
    off.load_state_dict(aug.state_dict())
    batch = _packed([(8, 12), (16, 4), (4, 4)])
    aug.eval(), off.eval()
    assert torch.equal(packed_forward(aug, batch), packed_forward(off, batch))
    aug.train()
    torch.manual_seed(3)
    assert not torch.allclose(packed_forward(aug, batch), packed_forward(off, batch))


def test_rgbd_depth_coordinate_is_not_augmented():
    torch.manual_seed(0)
    model = VisionTransformer(vit_config("tiny", pe="cayley", in_chans=3, image_size=(8, 8), patch_size=4,
                                         modality="rgbd", depth_input="coord", coord_augment=AUG, **TINY))
    x = torch.rand(3, 4, 8, 8) + 0.5
    model.eval()
    _, ref, _ = model.embed(x)
    model.train()
    torch.manual_seed(2)
    _, coords, _ = model.embed(x)
    assert torch.equal(coords[..., 2], ref[..., 2])
    assert not torch.allclose(coords[..., :2], ref[..., :2])


@pytest.mark.parametrize("bad", [(-0.1, 1.0, 1.0), (0.0, 0.5, 1.0), (0.0, 1.0, math.nan), (0.0, 1.0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="coord"):
        vit_config("tiny", coord_augment=bad).validate()
    from ropekit.classification.config import TrainConfig

    with pytest.raises(ValueError, match="coord"):
        TrainConfig.from_dict(dict(coord_augment=list(bad))).validate()


@pytest.mark.parametrize("pe", ["absolute", "sincos", "none"])
def test_coordinate_noise_without_a_rotary_encoding_is_refused(pe):
    """Jitter and coordinate augmentation move the rotary encoding's coordinates; a model without one has none, so
    the option would be recorded and do nothing: a one-line error instead."""
    for option, word in ((dict(jitter=0.5), "jitter"), (dict(coord_augment=(1.0, 1.0, 1.0)), "coord_augment")):
        with pytest.raises(ValueError, match=f"^{word} moves the coordinates of a rotary encoding; pe='{pe}' has none"):
            vit_config("tiny", pe=pe, **option).validate()
    vit_config("tiny", pe="cayley", jitter=0.5, coord_augment=(1.0, 1.0, 1.0)).validate()


def test_cli_option_reaches_the_config():
    from ropekit.train.commands import add_train_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    cfg, _, _ = config_from_args(p.parse_args(["--coord-augment", "0.5", "1.25", "2", "--device", "cpu"]))
    assert cfg.model.vit().coord_augment == [0.5, 1.25, 2.0]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("native", [False, True])
def test_run_records_the_option_and_resumes_bit_exactly(tmp_path, native):
    from ropekit.train import load_checkpoint
    from ropekit.classification.config import TrainConfig
    from ropekit.classification.trainer import train

    def cfg(out):
        kw = dict(data="digits", train_fraction=0.1, model_options=dict(TINY), batch_size=32, epochs=2, lr=3e-3,
                  progress=False, tensorboard=False, threads=1, out=str(out), device="cpu",
                  coord_augment=[0.5, 1.3, 1.5], log_every=1, native_resolution=native)
        if native:
            kw.update(pe="circulant", pe_options={"block_size": 8},
                      native_options={"seq_len": 32, "rows": 4, "min_tokens": 1, "max_tokens": 4})
        return TrainConfig.from_dict(kw)

    full = train(cfg(tmp_path / "full"), quiet=True)
    recorded = json.loads((tmp_path / "full" / "config.json").read_text())
    assert recorded["train"]["model"]["coord_augment"] == [0.5, 1.3, 1.5]
    part = train(cfg(tmp_path / "part"), quiet=True, on_step=lambda s: s == 3)
    assert part.interrupted and load_checkpoint(tmp_path / "part")["step_in_epoch"] > 0
    torch.manual_seed(123)  # the checkpoint's RNG state, not this one, drives the draws
    again = train(cfg(tmp_path / "part"), resume=True, quiet=True)
    a, b = full.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["train_loss"] for r in again.history] == [r["train_loss"] for r in full.history]
