"""Every timm RoPE ViT family (``timm.list_models("*rope*")`` and ``"*dinov3*"``) converted with
``apply_pe(..., init_identity=True)`` keeps its function: every block's attention output matches the original's.

The models are built from their timm configs with random weights (nothing is downloaded) at a tiny width and depth;
the rotary embedding, its coordinates, base, pair layout and prefix/register tokens are the family's own. A random
ViT's features hardly depend on positions, so the q/k weights are scaled up (sharp attention) and every block's
attention output is compared; dropping the rotary embedding changes those outputs by more than 1e-3, so the 1e-5
check can fail.

Tolerance: the converted model computes each angle as ``coordinate * frequency`` in fp32 where timm computes
``coordinate * band`` (or DINOv3's ``2 pi coordinate / period``): a few ulp of angles below ~60 rad, i.e. below
1e-5 relative on q and k; the attention outputs here are ~0.05 in size, so 1e-5 absolute holds with a wide margin
(measured: 2e-8).
"""

import warnings

import pytest
import torch

timm = pytest.importorskip("timm")

from ropekit.integrations.timm import TimmGrid, apply_pe  # noqa: E402

try:
    from timm.layers.pos_embed_sincos import _build_grid  # noqa: F401
except ImportError:  # pragma: no cover - older timm
    pytest.skip("this timm has no grid builder (timm >= 1.0.31)", allow_module_level=True)

NAMES = sorted(set(timm.list_models("*rope*")) | set(timm.list_models("*dinov3*")))
#: the smallest variant of each family: (name, what makes it a family)
FAMILIES = {
    "vit_small_patch16_rope_224": "rope-vit RoPE-Axial: base 100, 'xy' grid, CLS",
    "vit_small_patch16_rope_ape_224": "rope-vit RoPE-Axial beside an absolute embedding",
    "vit_small_patch16_rope_mixed_224": "rope-vit RoPE-Mixed: frequencies per block and head",
    "vit_small_patch16_rope_mixed_ape_224": "RoPE-Mixed beside an absolute embedding",
    "vit_medium_patch16_rope_reg1_gap_256": "SBB: base 10000, reference grid 16x16, one register, no CLS",
    "vit_betwixt_patch16_rope_reg4_gap_256": "SBB with four registers",
    "vit_small_patch16_dinov3": "DINOv3: centres in [-1, 1] per axis, base 100, half-split pairs, CLS + 4 registers",
    "vit_tiny_patch16_dinov3_qkvb": "DINOv3 with q/k/v biases",
    "vit_small_plus_patch16_dinov3": "DINOv3 with a SwiGLU MLP",
}
SIZES = [(64, 64), (48, 96)]
TINY = dict(pretrained=False, img_size=64, depth=2, embed_dim=64, num_heads=2, dynamic_img_size=True)


def sharp(name, **kw):
    """A tiny random ``name`` whose q/k weights are scaled up so that positions matter."""
    torch.manual_seed(0)
    model = timm.create_model(name, **{**TINY, **kw}).eval()
    with torch.no_grad():
        for blk in model.blocks:
            w = blk.attn.qkv.weight
            w[: 2 * w.shape[1]] *= 8.0  # q and k rows
    return model


def attention_outputs(model, x):
    """Every block's attention output ``(B, N, D)`` for images ``x``."""
    outs = []
    hooks = [blk.attn.register_forward_hook(lambda m, i, o: outs.append(o.detach())) for blk in model.blocks]
    try:
        with torch.no_grad():
            model.forward_features(x)
    finally:
        for h in hooks:
            h.remove()
    return outs


def worst(a, b):
    return max(float((u - v).abs().max()) for u, v in zip(a, b))


def convert(model, name, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # keeping the model's RoPE must not warn
        return apply_pe(model, name, inplace=False, init_identity=True, **kw)


def family_of(name):
    """The family of a listed model: its rotary embedding and what sits beside it (not its size)."""
    for key in ("dinov3", "rope_mixed_ape", "rope_mixed", "rope_ape", "gap"):
        if key in name:
            return key
    return "rope"


def test_families_cover_every_listed_model():
    assert set(FAMILIES) <= set(NAMES)
    assert {family_of(n) for n in NAMES} == {family_of(f) for f in FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("model_name", NAMES)
def test_every_listed_model_keeps_its_attention(model_name):
    model = sharp(model_name)
    conv = convert(model, "cayley", sharing="head")
    removed = apply_pe(model, "none", inplace=False)  # the model without its rotary embedding
    for hw in SIZES:
        x = torch.randn(2, 3, *hw, generator=torch.Generator().manual_seed(1))
        ref = attention_outputs(model, x)
        assert worst(attention_outputs(conv, x), ref) <= 1e-5, (model_name, hw)
        assert min(float((u - v).abs().max()) for u, v in zip(attention_outputs(removed, x), ref)) > 1e-3


@pytest.mark.parametrize("model_name", list(FAMILIES))
@pytest.mark.parametrize("name", ["mixed", "cayley"])
def test_family_smallest_variant(model_name, name):
    """Both encodings with a free frequency per pair and axis hold every family; with the coarsest sharing the
    family allows (RoPE-Mixed differs per block and head)."""
    model = sharp(model_name)
    sharing = "head" if "mixed" in model_name else "model"
    conv = convert(model, name, sharing=sharing)
    for hw in SIZES:
        x = torch.randn(1, 3, *hw, generator=torch.Generator().manual_seed(2))
        assert worst(attention_outputs(conv, x), attention_outputs(model, x)) <= 1e-5
        torch.testing.assert_close(conv.forward_features(x), model.forward_features(x), rtol=0, atol=1e-5)


def test_dinov3_coordinates_are_timms():
    """DINOv3's coordinates: patch centres ``(i + 1/2) / g`` mapped to ``[-1, 1]`` per axis (a closed form), and
    its frequencies ``2 pi / 100^(2n / (d/2))`` on half-split pairs."""
    model = sharp("vit_small_patch16_dinov3")
    conv = convert(model, "mixed")
    coords = conv.rope.eval().get_embed((3, 5))
    rows = (torch.arange(3) + 0.5) / 3 * 2 - 1
    cols = (torch.arange(5) + 0.5) / 5 * 2 - 1
    torch.testing.assert_close(coords, torch.cartesian_prod(rows, cols), rtol=0, atol=1e-7)
    d = model.blocks[0].attn.head_dim
    bands = 2 * torch.pi / 100.0 ** (2 * torch.arange(d // 4, dtype=torch.float64) / (d // 2))
    freq = conv.blocks[0].attn.pe.freq_param.detach().double()  # (.., 2, d/2): (row, col)
    torch.testing.assert_close(freq[..., 0, : d // 4].reshape(-1, d // 4)[0], bands, rtol=1e-6, atol=0)
    torch.testing.assert_close(freq[..., 1, d // 4:].reshape(-1, d // 4)[0], bands, rtol=1e-6, atol=0)
    assert float(freq[..., 0, d // 4:].abs().max()) == 0 and float(freq[..., 1, : d // 4].abs().max()) == 0
    assert conv.blocks[0].attn.rope_qk_perm is not None  # half-split pairs reordered to interleaved


@pytest.mark.parametrize("model_name", ["vit_small_patch16_dinov3", "vit_small_patch16_rope_224",
                                        "vit_small_patch16_rope_mixed_224", "vit_medium_patch16_rope_reg1_gap_256"])
def test_coordinate_augmentation_reproduced_in_training(model_name):
    """timm's train-time shift / jitter / rescale of the rotary coordinates: the converted model draws the same
    transform from the same seed (timm's own draws, in timm's order), so in training mode it computes what the
    original does; another seed gives another transform (the augmentation is active)."""
    model = sharp(model_name, rope_shift_coords=0.5, rope_jitter_coords=1.5, rope_rescale_coords=2.0)
    sharing = "head" if "mixed" in model_name else "model"
    conv = convert(model, "cayley", sharing=sharing)
    assert isinstance(conv.rope.timm_grid, TimmGrid) and conv.rope.timm_grid.augments
    model.train()
    conv.train()
    x = torch.randn(1, 3, 64, 48, generator=torch.Generator().manual_seed(3))
    outs = {}
    for tag, m in (("ref", model), ("conv", conv)):
        for seed in (0, 1):
            torch.manual_seed(seed)
            outs[tag, seed] = attention_outputs(m, x)
    for seed in (0, 1):
        assert worst(outs["conv", seed], outs["ref", seed]) <= 1e-5
    assert worst(outs["ref", 0], outs["ref", 1]) > 1e-4  # the draws matter
    conv.eval()
    model.eval()
    assert worst(attention_outputs(conv, x), attention_outputs(model, x)) <= 1e-5  # no augmentation in eval


@pytest.mark.parametrize("model_name", ["vit_small_patch16_dinov3", "vit_small_patch16_rope_mixed_224"])
def test_depth_axis_starts_as_the_2d_model(model_name):
    """coord_dim=3: (row, col, depth), depth at zero frequency -- the converted model takes RGB-D patch depths and
    starts exactly as the 2-D model; once the depth frequencies move, depth changes the attention (the axis is
    live, so the first check could fail)."""
    model = sharp(model_name)
    sharing = "head" if "mixed" in model_name else "model"
    conv = convert(model, "cayley", sharing=sharing, coord_dim=3)
    x = torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(4))
    depth = torch.rand(2, 12, 1, generator=torch.Generator().manual_seed(5)) * 3  # (B, M, 1), a 4 x 3 grid
    ref = attention_outputs(model, x)

    def with_depth(m, d):
        outs = []
        hooks = [blk.attn.register_forward_hook(lambda mod, i, o: outs.append(o.detach())) for blk in m.blocks]
        with torch.no_grad():
            m.forward_features(x, extra_coords=d)
        for h in hooks:
            h.remove()
        return outs

    assert worst(with_depth(conv, depth), ref) <= 1e-5
    assert worst(attention_outputs(conv, x), ref) <= 1e-5  # no depth given: zeros
    for blk in conv.blocks:
        with torch.no_grad():
            blk.attn.pe.freq_param[..., 2, :].fill_(0.5)
    assert worst(with_depth(conv, depth), ref) > 1e-3
    with pytest.raises(ValueError, match="extra_coords must be"):
        conv.forward_features(x, extra_coords=depth[:, :5])


def test_older_timm_fallback(monkeypatch):
    """Without timm's grid builder (timm < 1.0.31) integer grids are still kept, with the same coordinates (to the
    rounding of the reference-grid rescale: x * (r / g) vs x / g * r, a few ulp of values <= 16), and DINOv3's
    normalised grid is refused with the reason instead of being reproduced wrongly."""
    from ropekit.integrations import timm_grid

    grids = [TimmGrid("index", [16, 16], 0.0, "ij"), TimmGrid("index", [16, 12], 1.0, "xy"),
             TimmGrid("index", None, 0.0, "xy")]
    want = {(i, s): g.coords(s, False, torch.device("cpu")) for i, g in enumerate(grids) for s in [(4, 6), (5, 3)]}
    monkeypatch.setattr(timm_grid, "build_grid", None)
    for (i, s), ref in want.items():
        torch.testing.assert_close(grids[i].coords(s, False, torch.device("cpu")), ref, rtol=0, atol=4e-6)
    with pytest.warns(UserWarning, match="needs timm >= 1.0.31"):
        apply_pe(sharp("vit_small_patch16_dinov3"), "cayley", inplace=False, init_identity=True)
    conv = convert(sharp("vit_small_patch16_rope_224"), "cayley")  # integer grid: kept without a warning
    x = torch.randn(1, 3, 64, 48, generator=torch.Generator().manual_seed(6))
    assert worst(attention_outputs(conv, x), attention_outputs(sharp("vit_small_patch16_rope_224"), x)) <= 1e-5
