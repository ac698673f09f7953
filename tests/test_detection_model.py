"""Detector model (ViT / ViTD backbone + per-token heads) and its training loop (the study: test_detect3d_study.py)."""


import numpy as np
import pytest
import torch

from ropekit.detection.model import Detector3D, detector_config, intrinsics_features, token_rays
from ropekit.detection.plot import draw_boxes
from ropekit.detection.scenes import SceneSet, project_points
from ropekit.detection.train import (DetTrainConfig, evaluate_detector, matched_errors, matched_mean_iou, mean_box,
                                    train_detector)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: one thread is faster, and far faster on a shared, oversubscribed machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _toy_scenes(n: int = 8, size: int = 32, seed: int = 0) -> SceneSet:
    """Scenes without the renderer: random images and depth, 1–3 boxes in front of the camera."""
    rng = np.random.default_rng(seed)
    m = 6
    boxes = np.zeros((n, m, 12), np.float32)
    valid = np.zeros((n, m), bool)
    labels = np.full((n, m), -1, np.int64)
    for i in range(n):
        k = int(rng.integers(1, 4))
        valid[i, :k] = True
        labels[i, :k] = rng.integers(0, 4, k)
        yaw = rng.uniform(-np.pi, np.pi, k)
        boxes[i, :k, 0:2] = rng.uniform(-0.3, 0.3, (k, 2))
        boxes[i, :k, 2] = rng.uniform(0.8, 1.5, k)
        boxes[i, :k, 3:6] = np.stack([np.cos(yaw), np.zeros(k), np.sin(yaw)], 1)
        boxes[i, :k, 6:9] = [0.0, 1.0, 0.0]
        boxes[i, :k, 9:12] = rng.uniform(0.05, 0.3, (k, 3))
    f = size / 2 / np.tan(np.radians(rng.uniform(45, 70, n)) / 2)
    K = np.zeros((n, 3, 3), np.float32)
    K[:, 0, 0], K[:, 1, 1], K[:, 0, 2], K[:, 1, 2], K[:, 2, 2] = f, f, (size - 1) / 2, (size - 1) / 2, 1
    depth = rng.uniform(0.5, 2.0, (n, size, size)).astype(np.float32)
    depth[:, :2] = 0.0  # some invalid pixels
    return SceneSet(rgb=rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8), depth=depth, K=K,
                    extrinsics=np.tile(np.eye(4, dtype=np.float32), (n, 1, 1)), boxes=boxes, labels=labels,
                    valid=valid, pixels=valid.astype(np.int32) * 10, instance=np.full((n, size, size), -1, np.int8))


@pytest.mark.parametrize("pe, inp, depth_as", [
    ("none", "rgb", None), ("cayley", "rgb", None), ("cayley", "rgbd", "both"), ("circulant", "rgbd", "both"),
    ("none", "rgbd", "channel"), ("absolute", "rgbd", "channel"), ("axial", "rgbd-channel", "channel"),
    ("mixed", "rgbd-coord", "coord"),
])
def test_forward_shapes(pe, inp, depth_as):
    torch.manual_seed(0)
    model = Detector3D(detector_config(pe, inp, image_size=32, patch_size=8, depth=2))
    assert model.cfg.vit.resolved_depth_input == depth_as
    assert (model.backbone.depth_lift is not None) == (depth_as in ("coord", "both"))
    # the STRING paper's ViTD: depth as a 4th input channel and, with a rotary encoding, the 3rd coordinate
    assert model.backbone.patch_embed.proj.in_channels == (4 if depth_as in ("channel", "both") else 3)
    assert model.backbone.coord_dim == (3 if depth_as in ("coord", "both") else 2)
    scenes = _toy_scenes(3)
    x = torch.cat([torch.from_numpy(scenes.rgb).permute(0, 3, 1, 2).float() / 255,
                   torch.from_numpy(scenes.depth)[:, None]], dim=1)  # (3, 4, 32, 32)
    out = model(x, torch.from_numpy(scenes.K))
    assert out["logits"].shape == (3, 16, 5) and out["boxes"].shape == (3, 16, 12)
    assert torch.isfinite(out["boxes"]).all()
    if inp == "rgb":  # an RGB model ignores the depth channel and also takes 3-channel input
        x2 = x.clone()
        x2[:, 3] = 7.0
        assert torch.equal(model(x2, torch.from_numpy(scenes.K))["boxes"], out["boxes"])
        assert torch.equal(model(x[:, :3], torch.from_numpy(scenes.K))["boxes"], out["boxes"])
    else:  # depth changes the prediction
        x2 = x.clone()
        x2[:, 3] *= 2.0
        assert not torch.allclose(model(x2, torch.from_numpy(scenes.K))["boxes"], out["boxes"])
        with pytest.raises(ValueError):
            model(x[:, :3], torch.from_numpy(scenes.K))


def test_box_geometry_stays_fp32_under_bf16_autocast():
    """The ray parametrisation (centre = ray · depth + offset) is computed in fp32 even when the network runs in
    bf16 (the GPU preset): bf16's 8-bit mantissa would put the centre of a box 1.3 m away ~5 mm off."""
    model = Detector3D(detector_config("cayley", "rgbd", image_size=32, depth=1))
    x = torch.rand(2, 4, 32, 32) + torch.tensor([0, 0, 0, 0.5])[:, None, None]
    K = torch.tensor([[40.0, 0, 15.5], [0, 40.0, 15.5], [0, 0, 1]]).expand(2, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, K)
    assert out["boxes"].dtype == torch.float32 and out["logits"].dtype == torch.bfloat16
    assert torch.allclose(out["boxes"], model(x, K)["boxes"], rtol=0.05, atol=0.05)


def test_intrinsics_conditioning():
    K = torch.tensor([[[40.0, 0, 15.5], [0, 40.0, 15.5], [0, 0, 1]]])
    feats = intrinsics_features(K, 32, 32)
    assert torch.allclose(feats, torch.tensor([[0.4, 0.4, 0.0, 0.0]]))
    model = Detector3D(detector_config("mixed", "rgb", image_size=32, depth=1))
    x = torch.rand(1, 3, 32, 32)
    with pytest.raises(ValueError, match="intrinsics"):
        model(x)
    K2 = K.clone()
    K2[:, :2, :2] *= 1.5
    assert not torch.allclose(model(x, K)["boxes"], model(x, K2)["boxes"])  # the box head sees the focal length
    assert torch.equal(model(x, K)["logits"], model(x, K2)["logits"])  # the class head does not
    with pytest.raises(ValueError, match="intrinsics"):  # the ray parametrisation needs K as well
        Detector3D(detector_config("mixed", "rgb", image_size=32, depth=1, intrinsics="none"))(x)
    blind = Detector3D(detector_config("mixed", "rgb", image_size=32, depth=1, intrinsics="none", box_param="direct"))
    assert blind(x)["boxes"].shape == (1, 16, 12)  # pixels only: no K needed


def test_token_rays_and_ray_parametrisation():
    K = torch.tensor([[[50.0, 0, 15.5], [0, 40.0, 15.5], [0, 0, 1]]])
    rays = token_rays(K, 32, 32, 8)  # (1, 16, 2)
    # a point on the ray of token m (row i, column j) projects to the centre of patch (i, j)
    z = 1.7
    pts = torch.cat([rays[0] * z, torch.full((16, 1), z)], dim=-1)  # (16, 3)
    uv = project_points(pts.numpy(), K[0].numpy())[:, :2]
    i, j = np.divmod(np.arange(16), 4)
    assert np.allclose(uv, np.stack([8 * j + 3.5, 8 * i + 3.5], 1), atol=1e-4)
    # with a zero box MLP the centre of token m is its ray at the prior depth
    model = Detector3D(detector_config("axial", "rgb", image_size=32, depth=1))
    prior = torch.tensor([0.3, -0.2, z, 1, 0, 0, 0, 1, 0, 0.1, 0.2, 0.3])
    model.init_box_prior(prior)
    torch.nn.init.zeros_(model.box_head.fc3.weight)
    boxes = model(torch.rand(1, 3, 32, 32), K)["boxes"][0]  # (16, 12)
    assert torch.allclose(boxes[:, :3], pts, atol=1e-5)
    assert torch.allclose(boxes[:, 3:], prior[3:].expand(16, -1))
    direct = Detector3D(detector_config("axial", "rgb", image_size=32, depth=1, box_param="direct"))
    direct.init_box_prior(prior)
    torch.nn.init.zeros_(direct.box_head.fc3.weight)
    assert torch.allclose(direct(torch.rand(1, 3, 32, 32), K)["boxes"][0], prior.expand(16, -1))


def test_box_prior_and_no_weight_decay():
    scenes = _toy_scenes(6)
    model = Detector3D(detector_config("cayley", "rgbd", image_size=32, depth=1))
    model.init_box_prior(mean_box(scenes))
    mean = torch.from_numpy(scenes.boxes[scenes.valid].mean(0))
    assert torch.allclose(model.box_head.fc3.bias[2:], mean[2:])  # ray parametrisation: lateral offsets start at 0
    assert torch.all(model.box_head.fc3.bias[:2] == 0)
    names = model.no_weight_decay()
    params = dict(model.named_parameters(remove_duplicate=False))
    assert names and all(n in params for n in names)
    assert any("depth_lift" in n for n in names) and any("pe" in n for n in names)


def test_training_lowers_the_loss():
    torch.manual_seed(0)
    scenes = _toy_scenes(8)
    model = Detector3D(detector_config("cayley", "rgbd", image_size=32, patch_size=8, depth=1, embed_dim=48))
    model.init_box_prior(mean_box(scenes))
    cfg = DetTrainConfig(steps=40, batch_size=8, lr=2e-3, warmup_steps=2, log_every=5, iou_samples=256,
                         max_train_objects=6)
    before = evaluate_detector(model, scenes, cfg)
    rows = train_detector(model, scenes, cfg)
    after = evaluate_detector(model, scenes, cfg)
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    assert after["loss"] < 0.7 * before["loss"]
    assert not model.training  # left in eval mode
    for k in ("mean_iou", "mAP@0.25", "mAP@0.5"):
        assert 0.0 <= after[k] <= 1.0
    assert after["num_targets"] == scenes.valid.sum()
    errors = matched_errors(model, scenes, cfg)
    assert set(errors) == {"lateral_err", "depth_err", "size_err", "rot_err_deg", "class_acc", "depth_err_const"}
    assert all(np.isfinite(v) and v >= 0 for v in errors.values()) and errors["rot_err_deg"] <= 180


def test_learning_curve_matches_the_evaluator_and_leaves_training_unchanged():
    """``val_mean_iou`` is the evaluator's mean IoU (same Hungarian pairs; Monte Carlo IoU with another stream), and
    measuring it draws nothing from the global RNGs: the run trains bit for bit as without it."""
    scenes, held_out = _toy_scenes(8), _toy_scenes(6, seed=1)
    cfg = DetTrainConfig(steps=6, batch_size=4, lr=2e-3, warmup_steps=1, log_every=2, iou_samples=1024,
                         max_train_objects=1, val_scenes=5)

    def trained(val):
        torch.manual_seed(0)
        model = Detector3D(detector_config("cayley", "rgbd", image_size=32, patch_size=8, depth=1, embed_dim=48))
        model.init_box_prior(mean_box(scenes))
        rows = train_detector(model, scenes, cfg, val_scenes=val)
        return model, rows

    model, rows = trained(held_out)
    plain, plain_rows = trained(None)
    assert [r["step"] for r in rows] == [2, 4, 6] and all(0 <= r["val_mean_iou"] <= 1 for r in rows)
    assert "val_mean_iou" not in plain_rows[0]
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain_rows]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    first5 = SceneSet.from_arrays({k: v[:5] for k, v in held_out.arrays().items()})
    reference = evaluate_detector(model, first5, cfg)["mean_iou"]
    assert abs(matched_mean_iou(model, held_out, cfg, range(5)) - reference) < 0.03  # > 4 Monte Carlo sigmas
    assert rows[-1]["val_mean_iou"] == matched_mean_iou(model, held_out, cfg, range(5))  # deterministic


def test_draw_boxes_marks_projected_edges():
    scenes = _toy_scenes(1, size=32)
    box = np.array([[0, 0, 1.0, 1, 0, 0, 0, 1, 0, 0.3, 0.3, 0.3]], np.float32)
    small = box.copy()
    small[:, 9:] *= 0.5
    img = np.asarray(draw_boxes(np.zeros((32, 32, 3), np.uint8), scenes.K[0], true_boxes=box, pred_boxes=small,
                                scale=4))
    assert img.shape == (128, 128, 3)
    green = (img[..., 1] > 150) & (img[..., 0] < 50) & (img[..., 2] < 50)
    blue = (img[..., 2] > 200) & (img[..., 0] < 100)
    assert green.sum() > 50 and blue.sum() > 50
    assert not green[60:68, 60:68].any()  # the box centre is not on an edge


@pytest.mark.parametrize("pe", ["axial", "cayley", "circulant"])
def test_depth_as_coordinate_sees_relative_depth_only(pe):
    """With a commuting encoding, a ViTD that takes depth as a coordinate is exactly invariant to a global depth
    offset (logits depend on coordinate differences only): absolute depth must come from the image itself.
    Depth as a channel is not invariant.  (This is why the README's RGB-D results split by how depth enters.)"""
    torch.manual_seed(0)
    x = torch.rand(2, 4, 32, 32)
    x[:, 3] = 0.5 + x[:, 3]  # all pixels valid
    K = torch.tensor([[40.0, 0, 15.5], [0, 40.0, 15.5], [0, 0, 1]]).expand(2, 3, 3)
    shifted = x.clone()
    shifted[:, 3] += 0.7
    coord = Detector3D(detector_config(pe, "rgbd-coord", image_size=32, depth=2)).double()
    a, b = coord(x.double(), K.double()), coord(shifted.double(), K.double())
    assert torch.allclose(a["boxes"], b["boxes"], atol=1e-9) and torch.allclose(a["logits"], b["logits"], atol=1e-9)
    channel = Detector3D(detector_config(pe, "rgbd-channel", image_size=32, depth=2))
    assert not torch.allclose(channel(x, K)["boxes"], channel(shifted, K)["boxes"])
    both = Detector3D(detector_config(pe, "rgbd", image_size=32, depth=2))  # the paper's ViTD sees absolute depth
    assert not torch.allclose(both(x, K)["boxes"], both(shifted, K)["boxes"])
