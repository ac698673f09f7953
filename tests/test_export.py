"""ONNX export of a folded model: `torch.onnx.export(dynamo=True)` at a fixed grid, onnxruntime matches to 1e-4."""

import warnings

import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from ropekit.fold import FoldedRoPE, fold  # noqa: E402
from ropekit.nn import VisionTransformer, vit_config  # noqa: E402


def model_and_input(modality, pe, cls):
    torch.manual_seed(0)
    kw = dict(num_classes=5, in_chans=1, pe=pe, cls=cls, patch_size=4, embed_dim=48, depth=2, num_heads=2,
              image_size=(16, 16))
    g = torch.Generator().manual_seed(1)
    if modality == "video":
        kw.update(modality="video", num_frames=4, tubelet_size=2)
        x = torch.randn(2, 1, 4, 16, 16, generator=g)
    elif modality == "rgbd":
        kw.update(modality="rgbd", in_chans=3)
        depth = 0.5 + 3.0 * torch.rand(2, 1, 16, 16, generator=g)
        depth[0, 0, :6, :6] = 0.0  # invalid depth is masked inside the exported graph too
        depth[1, 0, 10:, 10:] = float("nan")
        x = torch.cat([torch.rand(2, 3, 16, 16, generator=g), depth], dim=1)
    else:
        x = torch.randn(2, 1, 16, 16, generator=g)
    model = VisionTransformer(vit_config("tiny", **kw)).eval()
    with torch.no_grad():  # move every encoding away from its initialisation (a non-trivial basis to fold)
        for enc in model.encodings:
            for p in enc.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return model, x


@pytest.mark.parametrize("modality,pe,cls", [("image", "cayley", "unrotated"), ("image", "circulant", "centroid"),
                                             ("rgbd", "cayley", "none"), ("video", "comrope-ld", "none")])
@pytest.mark.slow
def test_folded_model_exports_and_matches_onnxruntime(tmp_path, modality, pe, cls):
    model, x = model_and_input(modality, pe, cls)
    folded = fold(model)
    assert all(isinstance(blk.attn.pe, FoldedRoPE) for blk in folded.blocks)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(folded(x), ref, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(folded, (x,), dynamo=True, verbose=False)
    path = tmp_path / "model.onnx"
    program.save(str(path))
    onnx.checker.check_model(onnx.load(str(path)))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert out.shape == tuple(ref.shape)
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-4, atol=1e-4)
