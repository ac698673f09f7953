"""Synthetic RGB-D scene generator (pybullet, tiny renderer): arrays, conventions, determinism, cache."""

import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.sim
pytest.importorskip("pybullet")

from ropekit.detection import scenes as sc  # noqa: E402
from ropekit.detection.scenes import (  # noqa: E402
    CLASS_NAMES,
    SceneConfig,
    SceneDataset,
    collate_detection,
    generate_scenes,
    make_scenes_main,
    project_points,
    render_scene,
)

SIZE = 48
N = 12


@pytest.fixture(scope="module")
def scenes():
    return generate_scenes(N, size=SIZE, seed=1, workers=1, progress=False)


def test_shapes_and_dtypes(scenes):
    m = SceneConfig().max_objects
    assert len(scenes) == N
    expected = {
        "rgb": ((N, SIZE, SIZE, 3), np.uint8),
        "depth": ((N, SIZE, SIZE), np.float32),
        "K": ((N, 3, 3), np.float32),
        "extrinsics": ((N, 4, 4), np.float32),
        "boxes": ((N, m, 12), np.float32),
        "labels": ((N, m), np.int64),
        "valid": ((N, m), np.bool_),
        "pixels": ((N, m), np.int32),
        "instance": ((N, SIZE, SIZE), np.int8),
    }
    for key, (shape, dtype) in expected.items():
        arr = getattr(scenes, key)
        assert arr.shape == shape and arr.dtype == dtype, key
    # padding: valid entries first, labels −1 and zero boxes after
    assert np.all(scenes.valid == (scenes.labels >= 0))
    assert np.all(np.diff(scenes.valid.astype(int), axis=1) <= 0)
    assert np.all(scenes.boxes[~scenes.valid] == 0)
    assert scenes.valid.sum(1).min() >= 0 and scenes.valid.sum(1).max() <= m
    assert scenes.valid.any(1).mean() > 0.8  # almost every scene shows an object
    assert len(np.unique(scenes.labels[scenes.valid])) >= 3  # several classes
    assert scenes.rgb.std() > 10  # not a blank image


def test_deterministic_and_independent_of_workers(scenes):
    a = render_scene(3, SIZE, seed=1)
    b = render_scene(3, SIZE, seed=1)
    for key in a:
        assert np.array_equal(a[key], b[key]), key
        assert np.array_equal(a[key], getattr(scenes, key)[3]), key
    c = render_scene(3, SIZE, seed=2)
    assert not np.array_equal(a["rgb"], c["rgb"])
    par = generate_scenes(4, size=SIZE, seed=1, workers=2, progress=False, chunk_size=1)
    for key, arr in par.arrays().items():
        assert np.array_equal(arr, getattr(scenes, key)[:4]), key


def test_depth_positive_and_matches_ground_plane():
    cfg = SceneConfig(min_objects=0, max_objects=0, table_prob=0.0)
    for i in range(3):
        s = render_scene(i, SIZE, seed=5, config=cfg)
        K, T = s["K"].astype(np.float64), s["extrinsics"].astype(np.float64)
        rot, t = T[:3, :3], T[:3, 3]
        cam = -rot.T @ t  # camera centre in the world
        assert cam[2] > 0
        # optical axis hits the floor z = 0 at depth −C_z / a_z (a = axis in world coordinates)
        axis = rot[2]
        centre_depth = -cam[2] / axis[2]
        c = (SIZE - 1) / 2
        lo, hi = int(np.floor(c)), int(np.ceil(c))
        measured = s["depth"][lo : hi + 1, lo : hi + 1].mean()
        assert abs(measured - centre_depth) / centre_depth < 0.02
        # every floor pixel: ray–plane intersection through the pixel centre
        v, u = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64)
        rays = np.stack([u, v, np.ones_like(u)], -1) @ np.linalg.inv(K).T  # camera frame, z = 1
        rays_w = rays @ rot  # (R^T r) for each ray, world frame
        with np.errstate(divide="ignore"):
            z = -cam[2] / rays_w[..., 2]  # depth along the optical axis (rays have z = 1)
        d = s["depth"]
        hit = d > 0
        assert hit.mean() > 0.5 and np.all(d >= 0) and np.all(np.isfinite(d))
        assert np.all(z[hit] > 0)
        rel = np.abs(d[hit] - z[hit]) / z[hit]
        # exact up to float32 depth-buffer round-off: this pins down K (incl. the principal point) and T
        assert rel.max() < 1e-3
        assert np.all(d[hit] < cfg.far)


def test_visible_boxes_project_inside_and_match_depth(scenes):
    checked = 0
    for i in range(N):
        K, T = scenes.K[i], scenes.extrinsics[i].astype(np.float64)
        up_cam = T[:3, :3] @ np.array([0.0, 0.0, 1.0])
        for k in np.flatnonzero(scenes.valid[i]):
            box = scenes.boxes[i, k].astype(np.float64)
            u, v, z = project_points(box[:3], K)
            assert z > 0
            assert -0.5 <= u <= SIZE - 0.5 and -0.5 <= v <= SIZE - 0.5
            # rotation columns orthonormal; third column (cross product) is world up; sizes positive
            r1, r2 = box[3:6], box[6:9]
            assert abs(np.linalg.norm(r1) - 1) < 1e-5 and abs(np.linalg.norm(r2) - 1) < 1e-5
            assert abs(r1 @ r2) < 1e-5
            assert np.allclose(np.cross(r1, r2), up_cam, atol=1e-5)
            assert np.all(box[9:] > 0)
            # convex classes contain their box centre: the surface seen there is not behind it
            if CLASS_NAMES[scenes.labels[i, k]] in ("box", "cylinder", "sphere"):
                d = scenes.depth[i, int(round(v)), int(round(u))]
                assert 0 < d <= z + 1e-3
                checked += 1
            # canonical heading: local x points to the camera's right half-space
            assert r1[0] >= -1e-6 or CLASS_NAMES[scenes.labels[i, k]] == "duck"
    assert checked > 5


def test_instance_masks_inside_projected_boxes(scenes):
    from ropekit.detection.boxes import box12_to_corners

    for i in range(N):
        for k in range(scenes.valid.shape[1]):
            mask = scenes.instance[i] == k
            assert mask.sum() == scenes.pixels[i, k]
            if not scenes.valid[i, k]:
                assert not mask.any()
                continue
            assert mask.sum() >= SceneConfig().min_visible_pixels
            corners = box12_to_corners(torch.from_numpy(scenes.boxes[i, k]).double()).numpy()
            uv = project_points(corners, scenes.K[i])[:, :2]  # (8, 2)
            rows, cols = np.nonzero(mask)
            # every pixel of the object lies in the image rectangle spanned by its box (±1 px raster slack)
            assert cols.min() >= uv[:, 0].min() - 1 and cols.max() <= uv[:, 0].max() + 1
            assert rows.min() >= uv[:, 1].min() - 1 and rows.max() <= uv[:, 1].max() + 1


def test_cache_round_trip(tmp_path, monkeypatch):
    a = generate_scenes(5, size=32, seed=4, workers=1, progress=False, cache_dir=tmp_path, shard_size=2)
    (folder,) = list(tmp_path.iterdir())
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["shards"] == ["shard_00000.npz", "shard_00001.npz", "shard_00002.npz"]

    def fail(*_a, **_k):
        raise AssertionError("re-rendered despite cache")

    monkeypatch.setattr(sc, "_render_range", fail)
    b = generate_scenes(5, size=32, seed=4, workers=1, progress=False, cache_dir=tmp_path, shard_size=2)
    for key, arr in a.arrays().items():
        assert np.array_equal(arr, getattr(b, key)), key
    # other parameters → another cache entry
    monkeypatch.undo()
    generate_scenes(2, size=32, seed=5, workers=1, progress=False, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2


def test_dataset_and_collate(scenes):
    ds = SceneDataset(scenes)
    img, tgt = ds[0]
    k = int(scenes.valid[0].sum())
    assert img.shape == (4, SIZE, SIZE) and img.dtype == torch.float32
    assert 0 <= img[:3].min() and img[:3].max() <= 1
    assert torch.equal(img[3], torch.from_numpy(scenes.depth[0]))
    assert tgt["boxes"].shape == (k, 12) and tgt["labels"].shape == (k,) and tgt["labels"].dtype == torch.long
    images, batch = collate_detection([ds[i] for i in range(4)])
    counts = [int(scenes.valid[i].sum()) for i in range(4)]
    assert images.shape == (4, 4, SIZE, SIZE)
    assert batch["boxes"].shape == (4, max(counts), 12)
    assert batch["mask"].sum(1).tolist() == counts
    assert torch.all(batch["labels"][~batch["mask"]] == -1)
    capped = SceneDataset(scenes, max_targets=1)
    assert all(len(capped[i][1]["labels"]) <= 1 for i in range(N))


def test_make_scenes_cli(tmp_path, capsys):
    assert make_scenes_main(["--n", "2", "--size", "24", "--workers", "1", "--out", str(tmp_path),
                             "--no-progress"]) == 0
    assert "2 scenes" in capsys.readouterr().out
    assert len(list(tmp_path.glob("*/meta.json"))) == 1
