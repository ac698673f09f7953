"""One export serves every image size: ``torch.export`` with dynamic height and width, and one ONNX file, match the
unfolded PyTorch model to 1e-4 at several sizes and aspect ratios; the coordinates are computed in the graph, and
no fused 1-D rotary operator is left in it.

Tolerance 1e-4: folding changes the order of fp32 operations (the basis merged into the projections), a few ulp
on O(1) logits through two blocks (measured ~3e-7); the sizes here are never the traced one only.
"""

import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from onnx import helper  # noqa: E402

from ropekit.integrations.export import export_onnx, export_program, fused_rotary_ops  # noqa: E402
from ropekit.nn import VisionTransformer, vit_config  # noqa: E402

SIZES = [(16, 16), (8, 32), (28, 12), (40, 40)]  # square, wide, tall, larger than the traced 16 x 24


def model(pe="cayley", modality="image", cls="unrotated"):
    torch.manual_seed(0)
    in_chans = 3 if modality == "rgbd" else 1
    m = VisionTransformer(vit_config("tiny", num_classes=5, in_chans=in_chans, image_size=(16, 16), patch_size=4,
                                     embed_dim=48, depth=2, num_heads=2, pe=pe, cls=cls, modality=modality)).eval()
    with torch.no_grad():  # a non-trivial basis to fold
        for enc in m.encodings:
            for p in enc.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return m


def images(hw, chans=1, seed=0, batch=2):
    return torch.randn(batch, chans, *hw, generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.parametrize("pe", ["cayley", "circulant"])
def test_torch_export_any_size(pe):
    m = model(pe)
    program = export_program(m, images((16, 24)))
    run = program.module()
    for i, hw in enumerate(SIZES):
        x = images(hw, seed=i)
        with torch.no_grad():
            torch.testing.assert_close(run(x), m(x), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_one_onnx_file_any_size(tmp_path):
    m = model("cayley")
    path = export_onnx(m, images((16, 24)), tmp_path / "vit.onnx")
    proto = onnx.load(str(path))
    ops = {n.op_type for n in proto.graph.node}
    assert {"Range", "Sin", "Cos"} <= ops  # coordinates and angles computed in the graph, not baked in
    assert fused_rotary_ops(proto) == []
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[2].dim_param and dims[3].dim_param  # symbolic height and width
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for i, hw in enumerate(SIZES):
        x = images(hw, seed=i, batch=1 + i)  # the batch is dynamic too
        (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(out), m(x), rtol=1e-4, atol=1e-4)


def test_fused_rotary_guard_catches_fused_ops():
    """The guard finds a fused rotary node, in the main graph or nested in a subgraph (the check can fail)."""
    rot = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], domain="com.microsoft")
    g = helper.make_graph([rot], "g", [], [])
    assert fused_rotary_ops(helper.make_model(g)) == ["com.microsoft::RotaryEmbedding"]
    std = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"])
    inner = helper.make_graph([std], "inner", [], [])
    cond = helper.make_node("If", ["c"], ["z"], then_branch=inner, else_branch=helper.make_graph([], "e", [], []))
    assert fused_rotary_ops(helper.make_model(helper.make_graph([cond], "outer", [], []))) == [
        "ai.onnx::RotaryEmbedding"]
    plain = helper.make_node("Sin", ["x"], ["y"])
    assert fused_rotary_ops(helper.make_model(helper.make_graph([plain], "p", [], []))) == []


def test_rejects_non_image_example():
    with pytest.raises(ValueError, match="image batch"):
        export_program(model(), torch.randn(2, 1, 4, 16, 16))
