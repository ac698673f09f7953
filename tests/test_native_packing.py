"""Packed sequences (ropekit.nn.packing, ropekit.nn.masks): every image of a packed batch gets the logits and the
gradients it gets alone, for every encoding of list_pes(), every CLS mode and path (module, folded in training,
folded for inference), with SDPA and FlexAttention; RGB-D, video, NaFlex dicts, token dropping."""

import pytest
import torch

from ropekit.encodings import list_pes
from ropekit.encodings.scaling import ResolutionScaling, apply_resolution_scaling
from ropekit.nn.fold import fold
from ropekit.nn.masks import cu_seqlens, flex_segment_mask, segment_mask
from ropekit.nn.packing import from_naflex, pack, packed_forward, patchify
from ropekit.nn.vit import VisionTransformer, vit_config


def _model(pe, cls="none", fold_train=True, **kw):
    opts = {"block_size": 4} if pe.startswith("comrope") else {}
    kw.setdefault("in_chans", 1)
    cfg = vit_config("tiny", num_classes=3, image_size=(16, 16), patch_size=4, depth=2, pe=pe, pe_options=opts,
                     cls=cls, pe_fold_train=fold_train, **kw)
    return VisionTransformer(cfg)


def _images(seed, chans=1):
    g = torch.Generator().manual_seed(seed)
    sizes = [(12, 20), (16, 8), (8, 8), (20, 12), (4, 28)]  # mixed aspect ratios; 15, 8, 4, 15, 7 tokens
    return [torch.randn(chans, h, w, generator=g) for h, w in sizes]


# a few encodings in the fast loop (a basis, block eigenbases, non-commuting, widened q/k); all of them when slow
# tests run
FAST = {"cayley", "comrope-ld", "liere", "tensor"}
ENCODINGS = [name if name in FAST else pytest.param(name, marks=pytest.mark.slow) for name in list_pes()]

# fp32: a depth-2 tiny ViT's logits are O(1); packed and alone differ only in summation order (softmax over more
# masked terms, mean pooling as a product), a few ulp per operation: 2e-6 is ~20 ulp of an O(1) logit
ATOL = 2e-6


@pytest.mark.parametrize("pe", ENCODINGS)
@pytest.mark.parametrize("cls", ["none", "unrotated", "centroid"])
def test_packed_logits_equal_alone_every_encoding(pe, cls):
    for seed in range(2):
        torch.manual_seed(seed)
        model = _model(pe, cls).eval()
        imgs = _images(seed)
        batch = pack([patchify(im, 4, label=i) for i, im in enumerate(imgs)], max_tokens=24)
        assert batch.segment_ids.shape[0] >= 2  # several rows, several images per row
        ref = torch.cat([model(im[None]) for im in imgs])
        torch.testing.assert_close(packed_forward(model, batch), ref, rtol=ATOL, atol=ATOL)
        with torch.no_grad():  # FlexAttention has no CPU backward
            torch.testing.assert_close(packed_forward(model, batch, attention="flex"), ref, rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("pe", ENCODINGS)
def test_packed_gradients_equal_alone_module_and_folded_paths(pe):
    """float64, so that the comparison is tight: the gradients of sum_i w_i logits_i, packed and image by image."""
    for fold_train in (True, False):
        for cls in ("none", "unrotated"):
            torch.manual_seed(3)
            model = _model(pe, cls, fold_train).double()
            imgs = [im.double() for im in _images(5)]
            w = torch.randn(len(imgs), 3, dtype=torch.float64)
            batch = pack([patchify(im, 4, label=i) for i, im in enumerate(imgs)], max_tokens=24)
            (packed_forward(model, batch) * w).sum().backward()
            packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            sum((model(im[None])[0] * w[i]).sum() for i, im in enumerate(imgs)).backward()
            alone = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            assert packed.keys() == alone.keys()
            for n in alone:
                torch.testing.assert_close(packed[n], alone[n], rtol=1e-9, atol=1e-11, msg=f"{pe} {cls} {n}")


@pytest.mark.parametrize("pe", ["cayley", "circulant", "comrope-ld", "string", "mixed"])
def test_packed_inference_folded_and_scaled(pe):
    torch.manual_seed(0)
    model = _model(pe, "unrotated").eval()
    folded = fold(model)
    imgs = _images(1)
    batch = pack([patchify(im, 4) for im in imgs], max_tokens=32, max_images=2)
    assert batch.image_index.shape[1] == 2
    ref = torch.cat([model(im[None]) for im in imgs])
    torch.testing.assert_close(packed_forward(folded, batch), ref, rtol=1e-5, atol=1e-5)
    apply_resolution_scaling(model, ResolutionScaling("yarn", scale=2.0, train_extent=4.0))
    ref = torch.cat([model(im[None]) for im in imgs])
    torch.testing.assert_close(packed_forward(model, batch), ref, rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("depth_input", ["coord", "channel", "both"])
def test_packed_rgbd(depth_input):
    torch.manual_seed(0)
    model = _model("circulant", modality="rgbd", in_chans=3, depth_input=depth_input).eval()
    imgs = _images(2, chans=4)
    for im in imgs:  # metric depth with holes: zeros and NaN
        im[-1] = im[-1].abs() + 0.5
        im[-1, 0, :3] = 0.0
        im[-1, -1, -2:] = float("nan")
    imgs[2][-1] = 0.0  # one image without any valid depth
    batch = pack([patchify(im, 4, depth=True) for im in imgs], max_tokens=24)
    ref = torch.cat([model(im[None]) for im in imgs])
    torch.testing.assert_close(packed_forward(model, batch), ref, rtol=ATOL, atol=ATOL)


def test_packed_video():
    torch.manual_seed(0)
    model = _model("axial", modality="video", in_chans=1, tubelet_size=2, coords="normalized").eval()
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(1, 4, 8, 12, generator=g), torch.randn(1, 2, 16, 8, generator=g)]
    batch = pack([patchify(cl, 4, tubelet_size=2) for cl in clips], max_tokens=20)
    ref = torch.cat([model(cl[None]) for cl in clips])
    torch.testing.assert_close(packed_forward(model, batch), ref, rtol=ATOL, atol=ATOL)


def test_naflex_dict_and_coord_offset():
    torch.manual_seed(0)
    model = _model("mixed", coords="normalized").eval()
    imgs = _images(3)[:3]
    parts = [patchify(im, 4) for im in imgs]
    n = 20
    batch = {"patches": torch.zeros(3, n, 16), "patch_coord": torch.zeros(3, n, 2, dtype=torch.long),
             "patch_valid": torch.zeros(3, n, dtype=torch.bool)}
    for i, p in enumerate(parts):
        m = p.patches.shape[0]
        batch["patches"][i, :m], batch["patch_coord"][i, :m], batch["patch_valid"][i, :m] = p.patches, p.patch_coord, True
        batch["patches"][i, m:] = 9.0  # padding content must not matter
    ref = torch.cat([model(im[None]) for im in imgs])
    torch.testing.assert_close(packed_forward(model, from_naflex(batch)), ref, rtol=ATOL, atol=ATOL)
    off = torch.randn(3, 2)
    ref = torch.cat([model(im[None], coord_offset=off[i]) for i, im in enumerate(imgs)])
    packed = pack(parts, max_tokens=32)
    torch.testing.assert_close(packed_forward(model, packed, coord_offset=off), ref, rtol=ATOL, atol=ATOL)
    with pytest.raises(ValueError, match="patch_valid"):
        from_naflex({"patches": batch["patches"]})


def test_token_dropping_keeps_coordinates():
    im = torch.arange(2 * 8 * 12, dtype=torch.float32).view(2, 8, 12)
    full = patchify(im, 4)
    for seed in range(10):
        part = patchify(im, 4, drop=0.5, generator=torch.Generator().manual_seed(seed))
        assert part.patches.shape[0] == 3 and part.grid == (2, 3)
        for p, c in zip(part.patches, part.patch_coord):  # each kept patch still sits at its own coordinate
            j = int(c[0]) * 3 + int(c[1])
            assert torch.equal(p, full.patches[j]) and torch.equal(c, full.patch_coord[j])
    # channels last within a patch, as timm: the first values are pixel (0, 0) of every channel
    assert full.patches[0, :2].tolist() == [im[0, 0, 0].item(), im[1, 0, 0].item()]


def test_pack_first_fit_and_errors():
    ims = [patchify(torch.zeros(1, 4 * h, 4), 4, label=h) for h in (5, 3, 4, 2, 6)]
    b = pack(ims, max_tokens=8)
    # first fit in order: [5, 3], [4, 2], [6]
    assert b.image_index.tolist() == [[0, 1], [2, 3], [4, -1]]
    assert b.segment_ids[0].tolist() == [0] * 5 + [1] * 3
    assert b.segment_ids[2].tolist() == [0] * 6 + [-1] * 2
    assert b.labels.tolist() == [5, 3, 4, 2, 6]
    padded = pack(ims, max_tokens=8, max_images=3, num_rows=5, pad_to=10)  # fixed B, S and N (torch.compile)
    assert padded.segment_ids.shape == (5, 10) and padded.image_index.shape == (5, 3)
    assert padded.image_index[3:].eq(-1).all() and padded.segment_ids[3:].eq(-1).all()
    planned = pack(ims, max_tokens=9, rows=[[4, 1], [0, 3], [2]])
    assert planned.image_index.tolist() == [[4, 1], [0, 3], [2, -1]]
    with pytest.raises(ValueError, match="once"):
        pack(ims, max_tokens=9, rows=[[4, 1], [0, 3]])
    with pytest.raises(ValueError, match="num_rows"):
        pack(ims, max_tokens=8, num_rows=2)
    with pytest.raises(ValueError, match="more than max_tokens"):
        pack(ims, max_tokens=5)
    with pytest.raises(ValueError, match="at least one"):
        pack([], max_tokens=5)
    with pytest.raises(ValueError, match="absolute"):
        packed_forward(_model("absolute"), b)
    with pytest.raises(ValueError, match="attention"):
        packed_forward(_model("axial"), b, attention="varlen")


def test_masks():
    seg = torch.tensor([[0, 0, 1, -1], [0, 1, 1, 1]])
    m = segment_mask(seg)
    assert m.shape == (2, 1, 4, 4) and m[0, 0].tolist() == [[True, True, False, False], [True, True, False, False],
                                                            [False, False, True, False], [False, False, False, True]]
    assert m.any(-1).all()  # no empty row: padding attends to padding
    bm = flex_segment_mask(seg)
    assert torch.equal(bm.to_dense()[..., :1, :1].bool().flatten(), torch.ones(2, dtype=torch.bool))
    assert cu_seqlens(torch.tensor([3, 1, 4])).tolist() == [0, 3, 4, 8]
    with pytest.raises(ValueError, match="integer"):
        segment_mask(seg.float())
