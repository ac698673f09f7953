"""The OWL-ViT-style open-vocabulary detector (ropekit.detection.owl) on toy tensors: its heads, its Hungarian
matching and set loss against brute-force references, and its errors for bad input."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from ropekit.detection.owl import OwlDetector, OwlLossConfig, owl_loss, owl_match, patch_box_prior, top_detections
from ropekit.nn import VisionTransformer, vit_config


class BagText(nn.Module):
    """A toy text tower: the mean of word embeddings (id 0 is padding)."""

    def __init__(self, vocab: int = 20, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        m = (ids != 0).float()[..., None]
        return (self.emb(ids) * m).sum(1) / m.sum(1).clamp_min(1)


def _model(boxes: str = "2d", input: str = "rgb", pe: str = "cayley") -> OwlDetector:
    torch.manual_seed(0)
    modality = "image" if input == "rgb" else "rgbd"
    vit = VisionTransformer(vit_config("tiny", num_classes=0, in_chans=3, image_size=(16, 16), patch_size=4, pe=pe,
                                       depth=1, embed_dim=24, num_heads=2, modality=modality))
    return OwlDetector(vit, BagText(), 16, boxes=boxes, input=input)


def test_patch_prior_puts_every_default_box_on_its_patch():
    prior = torch.sigmoid(patch_box_prior((2, 3)))  # (6, 4)
    assert torch.allclose(prior[0], torch.tensor([1 / 6, 1 / 4, 1 / 3, 1 / 2]))
    assert torch.allclose(prior[5], torch.tensor([5 / 6, 3 / 4, 1 / 3, 1 / 2]))
    model = _model()
    nn.init.zeros_(model.heads.box.fc3.weight)
    out = model(torch.rand(2, 3, 16, 16), torch.tensor([[1, 2], [3, 0]]))
    assert out["logits"].shape == (2, 16, 2) and out["boxes"].shape == (2, 16, 4)
    assert torch.allclose(out["boxes"][1], torch.sigmoid(patch_box_prior((4, 4))), atol=1e-6)


def test_logits_are_shifted_and_scaled_cosines_and_masked_queries_lose():
    model = _model()
    x = torch.rand(1, 3, 16, 16)
    q = torch.randn(3, 16)
    out = model(x, q, query_mask=torch.tensor([True, True, False]))
    tokens, _ = model.tokens(x)
    h = model.heads
    cos = torch.nn.functional.normalize(h.class_embed(tokens), dim=-1) @ torch.nn.functional.normalize(q, dim=-1).t()
    ref = (cos + h.logit_shift(tokens)) * (torch.nn.functional.elu(h.logit_scale(tokens)) + 1)
    assert torch.allclose(out["logits"][..., :2], ref[..., :2], atol=1e-5)
    assert (out["logits"][..., 2] <= -1e3).all()


def test_bad_input_is_refused_in_one_line():
    model = _model()
    with pytest.raises(ValueError, match="no text query"):
        model(torch.rand(1, 3, 16, 16), torch.zeros(0, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, 3 or 4, H, W\)"):
        model(torch.rand(3, 16, 16), torch.tensor([[1]]))
    with pytest.raises(ValueError, match="RGB-D"):
        _model(input="rgbd")(torch.rand(1, 3, 16, 16), torch.tensor([[1]]))
    with pytest.raises(ValueError, match="intrinsics"):
        _model("3d", "rgbd")(torch.rand(1, 4, 16, 16), torch.tensor([[1]]))
    with pytest.raises(ValueError, match="boxes must be"):
        OwlDetector(_model().vision, None, 16, boxes="4d")


def test_3d_boxes_sit_on_each_tokens_ray():
    model = _model("3d", "rgbd")
    nn.init.zeros_(model.heads.box.fc3.weight)
    model.init_box_prior(torch.tensor([9.0, 9.0, 2.0, 1, 0, 0, 0, 1, 0, 0.1, 0.2, 0.3]))
    K = torch.tensor([[[20.0, 0, 7.5], [0, 20.0, 7.5], [0, 0, 1]]])
    out = model(torch.rand(1, 4, 16, 16), torch.tensor([[1, 2]]), K)
    b = out["boxes"][0]  # (16, 12)
    assert b.shape == (16, 12)
    # token (0, 0): patch centre pixel (1.5, 1.5) -> ray ((1.5 - 7.5) / 20, same) at depth 2
    assert torch.allclose(b[0, :3], torch.tensor([-0.6, -0.6, 2.0]), atol=1e-5)
    assert torch.allclose(b[:, 9:], torch.tensor([0.1, 0.2, 0.3]).expand(16, 3))


def _focal(p: float, y: float, a: float = 0.25, g: float = 2.0) -> float:
    pt = p if y else 1 - p
    return -(a if y else 1 - a) * (1 - pt) ** g * math.log(pt)


def _giou(a, b) -> float:
    def xyxy(c):
        return (c[0] - c[2] / 2, c[1] - c[3] / 2, c[0] + c[2] / 2, c[1] + c[3] / 2)
    a, b = xyxy(a), xyxy(b)
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    hull = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    return inter / union - (hull - union) / hull


def test_matching_and_loss_against_brute_force():
    torch.manual_seed(1)
    cfg = OwlLossConfig()
    M, Q = 4, 3
    logits = torch.randn(1, M, Q, dtype=torch.float64)
    boxes = torch.rand(1, M, 4, dtype=torch.float64) * 0.5 + 0.25
    labels = torch.tensor([[2, 0, -1]])
    tgt = torch.rand(1, 3, 4, dtype=torch.float64) * 0.5 + 0.25
    mask = torch.tensor([[True, True, False]])
    p = logits.sigmoid()

    def pair_cost(m, t):
        c = labels[0, t]
        cls = (cfg.alpha * (1 - p[0, m, c]) ** 2 * -math.log(p[0, m, c])
               - (1 - cfg.alpha) * p[0, m, c] ** 2 * -math.log(1 - p[0, m, c]))
        l1 = float((boxes[0, m] - tgt[0, t]).abs().mean())
        return cfg.class_weight * cls + cfg.box_weight * l1 - cfg.giou_weight * _giou(boxes[0, m].tolist(),
                                                                                       tgt[0, t].tolist())

    best = min(itertools.permutations(range(M), 2), key=lambda ms: pair_cost(ms[0], 0) + pair_cost(ms[1], 1))
    (src, obj), = owl_match(logits, boxes, labels, tgt, mask, cfg)
    assert dict(zip(obj.tolist(), src.tolist())) == {0: best[0], 1: best[1]}

    pos = {(best[0], 2), (best[1], 0)}
    cls = sum(_focal(float(p[0, m, q]), (m, q) in pos) for m in range(M) for q in range(Q)) / 2
    l1 = sum(float((boxes[0, best[t]] - tgt[0, t]).abs().mean()) for t in range(2)) / 2
    giou = sum(1 - _giou(boxes[0, best[t]].tolist(), tgt[0, t].tolist()) for t in range(2)) / 2
    out = owl_loss(logits, boxes, labels, tgt, mask, cfg)
    assert float(out["loss_class"]) == pytest.approx(cls, rel=1e-5)
    assert float(out["loss_box"]) == pytest.approx(l1, rel=1e-5)
    assert float(out["loss_giou"]) == pytest.approx(giou, rel=1e-5)
    assert float(out["loss"]) == pytest.approx(2 * cls + 5 * l1 + 2 * giou, rel=1e-5)


def test_images_without_objects_give_negatives_only():
    logits = torch.zeros(2, 4, 3)
    boxes = torch.full((2, 4, 4), 0.5)
    out = owl_loss(logits, boxes, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, 4),
                   torch.zeros(2, 0, dtype=torch.bool))
    assert float(out["loss_class"]) == pytest.approx(24 * _focal(0.5, 0), rel=1e-5)  # 2 · 4 · 3 negatives, / 1
    assert float(out["loss_box"]) == 0.0 and float(out["loss_giou"]) == 0.0
    with pytest.raises(ValueError, match="query index"):
        owl_loss(logits, boxes, torch.tensor([[5], [0]]), torch.full((2, 1, 4), 0.5), torch.ones(2, 1, dtype=bool))


def test_3d_loss_and_a_few_steps_learn():
    model = _model("3d", "rgbd")
    K = torch.tensor([[20.0, 0, 7.5], [0, 20.0, 7.5], [0, 0, 1]]).expand(2, 3, 3)
    x = torch.rand(2, 4, 16, 16)
    q = torch.tensor([[1, 2], [3, 0], [4, 5]])
    labels = torch.tensor([[0, 2], [1, -1]])
    tgt = torch.tensor([0.1, 0, 2.0, 1, 0, 0, 0, 1, 0, 0.2, 0.2, 0.2]).expand(2, 2, 12).clone()
    mask = labels >= 0
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = model(x, q, K)
        loss = owl_loss(out["logits"], out["boxes"], labels, tgt, mask)
        assert set(loss) == {"loss", "loss_class", "loss_box", "loss_corners"}
        opt.zero_grad()
        loss["loss"].backward()
        opt.step()
        losses.append(float(loss["loss"].detach()))
    assert losses[-1] < 0.6 * losses[0]
    dets = top_detections(out["logits"], out["boxes"], k=5)
    assert len(dets) == 2 and dets[0]["boxes"].shape == (5, 12)
    assert (dets[0]["scores"][:-1] >= dets[0]["scores"][1:]).all()
