"""Synthetic RGB-D scenes with ground-truth 3-D boxes, rendered headless by pybullet.

Each scene is a floor (an optional table on it) with 1–6 objects of :data:`CLASS_NAMES` (boxes,
cylinders, spheres and, if enabled, the ``duck`` mesh of ``pybullet_data``) with random sizes, colours,
positions and rotation about the vertical axis, seen by a camera with random pose and field of view under a
random light.  Rendering uses ``p.ER_TINY_RENDERER`` in a ``p.DIRECT`` client (no display, no GPU).

Conventions
-----------
* **World**: z up, metres; the floor's top face is ``z = 0``.
* **Camera frame** (boxes, extrinsics): OpenCV — x right, y down, z forward (along the optical axis).
  ``extrinsics`` is the camera-from-world 4×4 ``T_cw`` (``x_cam = R x_world + t``).
* **Pixels**: OpenCV — row 0 at the top, the centre of pixel ``(u, v)`` (column, row) at integer
  coordinates, so ``K = [[f, 0, (W−1)/2], [0, f, (H−1)/2], [0, 0, 1]]`` with ``f = (H/2)/tan(fov_y/2)`` and
  ``[u, v, 1]^T ∝ K x_cam``.  (The tiny renderer's raster is half a pixel off the usual OpenGL
  convention; the projection matrix compensates, see ``_gl_projection``.  A floor rendered by this module
  matches ray–plane depth through ``K`` and ``T_cw`` to < 0.1 %.)
* **Depth**: metric z-depth (distance along the optical axis, not along the ray), float32 metres, converted
  from the OpenGL depth buffer ``d`` with ``z = far·near / (far − (far − near)·d)``; pixels that see no
  surface (sky) are 0 (= invalid).
* **Boxes**: the 12-vector of :mod:`ropekit.detection.boxes` in the camera frame, ``[t, r1, r2, s]``,
  ``s`` full side lengths along the object's own axes (local z = world up; cylinder and sphere boxes are
  their circumscribed boxes).  The heading is canonicalised to what the image can determine: for
  rotationally symmetric classes (cylinder, sphere) the local x axis is the camera's horizontal right
  direction; for boxes (symmetric under a half turn) the yaw is taken modulo π so that the local x axis
  points to the camera's right half-space (``x_local · x_cam ≥ 0``); the duck keeps its yaw.
* **Visibility**: an object is kept when its segmentation mask has at least
  ``SceneConfig.min_visible_pixels`` pixels and its box centre projects inside the image in front of the
  camera; kept objects come first (creation order), then padding up to ``SceneConfig.max_objects`` with
  ``labels = −1`` and ``valid = False``.

Outputs per scene are listed in :func:`render_scene`; :func:`generate_scenes` stacks them into a
:class:`SceneSet`, and :class:`SceneDataset` / :func:`collate_detection` feed them to torch.  Rendering
costs about 8–11 ms per 64×64 scene on one CPU core (most of it building the bodies; the duck mesh is
reloaded for every scene).

Determinism: scene ``i`` of ``generate_scenes(n, size, seed, ...)`` depends only on ``(seed, i, size,
config)`` (its RNG is ``SeedSequence([seed, i])``), not on the number of workers or on ``n``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from .._io import atomic_write
from .._optional import require

__all__ = [
    "CLASS_NAMES",
    "SceneConfig",
    "SceneSet",
    "SceneDataset",
    "render_scene",
    "generate_scenes",
    "collate_detection",
    "project_points",
    "make_scenes_main",
]

#: Object classes; a label is an index into this tuple.
CLASS_NAMES: tuple[str, ...] = ("box", "cylinder", "sphere", "duck")

#: Bump when the generator's output changes for the same parameters (invalidates caches).
GENERATOR_VERSION = 2

_ARRAY_KEYS = ("rgb", "depth", "K", "extrinsics", "boxes", "labels", "valid", "pixels", "instance")


@dataclass(frozen=True)
class SceneConfig:
    """Scene distribution.  Angles in degrees, lengths in metres."""

    min_objects: int = 1
    max_objects: int = 6  # also the padded object count of the arrays
    use_meshes: bool = True  # allow the "duck" class (pybullet_data/duck.obj)
    table_prob: float = 0.5  # probability that the objects stand on a table instead of the floor
    table_height: tuple[float, float] = (0.45, 0.8)
    region_half: float = 0.4  # half side of the floor placement square
    box_side: tuple[float, float] = (0.06, 0.3)
    cyl_radius: tuple[float, float] = (0.03, 0.1)
    cyl_height: tuple[float, float] = (0.06, 0.3)
    sphere_radius: tuple[float, float] = (0.03, 0.12)
    duck_extent: tuple[float, float] = (0.1, 0.25)  # longest side of the duck's box
    cam_distance: tuple[float, float] = (0.9, 1.6)
    cam_elevation: tuple[float, float] = (30.0, 70.0)
    fov: tuple[float, float] = (45.0, 70.0)  # vertical field of view
    target_jitter: float = 0.05  # std of the look-at point around the placement centre
    near: float = 0.02
    far: float = 20.0
    min_visible_pixels: int = 4

    def __post_init__(self) -> None:
        if not 0 <= self.min_objects <= self.max_objects <= 127:
            raise ValueError(f"need 0 <= min_objects <= max_objects <= 127, got {self.min_objects}, "
                             f"{self.max_objects}")


# --------------------------------------------------------------------------------------------- geometry


def _rot_z(yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _quat_z(yaw: float) -> list[float]:
    return [0.0, 0.0, math.sin(yaw / 2), math.cos(yaw / 2)]  # pybullet (x, y, z, w)


def _look_at_cv(eye: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Camera-from-world ``(4, 4)`` in the OpenCV convention for a camera at ``eye`` looking at ``target``,
    world z up (no roll)."""
    z = target - eye
    z = z / np.linalg.norm(z)
    x = np.cross(z, np.array([0.0, 0.0, 1.0]))
    x = x / np.linalg.norm(x)
    y = np.cross(z, x)  # points down in the image
    rot = np.stack([x, y, z])  # rows = camera axes in world coordinates
    t = np.eye(4)
    t[:3, :3] = rot
    t[:3, 3] = -rot @ eye
    return t


def _intrinsics(size: int, fov_deg: float) -> np.ndarray:
    f = (size / 2) / math.tan(math.radians(fov_deg) / 2)
    c = (size - 1) / 2
    return np.array([[f, 0.0, c], [0.0, f, c], [0.0, 0.0, 1.0]])


def _gl_view_matrix(t_cw: np.ndarray) -> list[float]:
    """pybullet's column-major OpenGL view matrix (x right, y up, z backward) from an OpenCV ``T_cw``."""
    v = np.diag([1.0, -1.0, -1.0, 1.0]) @ t_cw
    return v.T.reshape(-1).tolist()


def _gl_projection(fov_deg: float, near: float, far: float, size: int) -> list[float]:
    """Column-major OpenGL projection for a square image, with the principal point at the image centre.

    pybullet's tiny renderer samples pixel column ``i`` at window x = ``i`` (not ``i + 0.5``) and returns
    rows flipped from window y, so a centred frustum would put the principal point at
    ``(W/2, H/2 − 1)`` in OpenCV pixel coordinates (measured: sphere centroids sit +0.5 px in u and −0.5 px in
    v off the centred projection).  The off-axis terms below shift the image by half a pixel in each
    direction so that ``K`` has the symmetric principal point ``((W−1)/2, (H−1)/2)``.
    """
    f = 1.0 / math.tan(math.radians(fov_deg) / 2)
    ax, ay = 1.0 / size, 1.0 / size  # half a pixel in NDC units (one pixel = 2/size)
    m = np.array(
        [
            [f, 0.0, ax, 0.0],
            [0.0, f, ay, 0.0],
            [0.0, 0.0, (far + near) / (near - far), 2 * far * near / (near - far)],
            [0.0, 0.0, -1.0, 0.0],
        ]
    )
    return m.T.reshape(-1).tolist()


def project_points(points: np.ndarray, K: np.ndarray, extrinsics: Optional[np.ndarray] = None) -> np.ndarray:
    """Project points to pixels.

    Args:
        points: ``(..., 3)`` in the camera frame, or in the world frame if ``extrinsics`` is given.
        K: ``(3, 3)`` intrinsics.
        extrinsics: optional ``(4, 4)`` camera-from-world.

    Returns:
        ``(..., 3)``: pixel ``u`` (column), ``v`` (row) and the camera-frame depth ``z``.
    """
    pts = np.asarray(points, dtype=np.float64)
    if extrinsics is not None:
        pts = pts @ extrinsics[:3, :3].T + extrinsics[:3, 3]
    uvw = pts @ np.asarray(K, dtype=np.float64).T  # (..., 3)
    z = pts[..., 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.stack([uvw[..., 0] / z, uvw[..., 1] / z, z], axis=-1)


# --------------------------------------------------------------------------------------------- the duck


_DUCK_CACHE: dict[str, Any] = {}


def _duck_geometry() -> tuple[str, np.ndarray, np.ndarray]:
    """Path of ``duck.obj``, its box extent and centre after turning it z-up (unit mesh scale)."""
    if "geom" not in _DUCK_CACHE:
        import pybullet_data

        path = os.path.join(pybullet_data.getDataPath(), "duck.obj")
        with open(path) as fh:
            verts = np.array([[float(x) for x in line.split()[1:4]] for line in fh if line.startswith("v ")])
        # duck.obj is y-up: a quarter turn about x maps (x, y, z) → (x, −z, y).
        verts = np.stack([verts[:, 0], -verts[:, 2], verts[:, 1]], axis=1)
        lo, hi = verts.min(0), verts.max(0)
        _DUCK_CACHE["geom"] = (path, hi - lo, (hi + lo) / 2)
    return _DUCK_CACHE["geom"]


# --------------------------------------------------------------------------------------------- rendering


def _uniform(rng: np.random.Generator, lo_hi: Sequence[float]) -> float:
    return float(rng.uniform(lo_hi[0], lo_hi[1]))


def _random_color(rng: np.random.Generator, lo: float = 0.1, hi: float = 1.0) -> list[float]:
    return [*rng.uniform(lo, hi, size=3).tolist(), 1.0]


def _add_static(p: Any, client: int, shape: int, pos: Sequence[float], orn: Sequence[float], color, **kw) -> int:
    vis = p.createVisualShape(shape, rgbaColor=color, physicsClientId=client, **kw)
    return p.createMultiBody(
        baseMass=0, baseCollisionShapeIndex=-1, baseVisualShapeIndex=vis,
        basePosition=list(pos), baseOrientation=list(orn), physicsClientId=client,
    )


def render_scene(
    index: int,
    size: int = 64,
    seed: int = 0,
    config: SceneConfig = SceneConfig(),
    client: Optional[int] = None,
) -> dict[str, np.ndarray]:
    """Build and render scene ``index`` of the stream ``seed``.

    Args:
        index: scene index (with ``seed``, the scene's RNG is ``SeedSequence([seed, index])``).
        size: image height = width in pixels.
        seed: stream seed.
        config: scene distribution.
        client: a connected pybullet client id (``p.connect(p.DIRECT)``); a temporary one if ``None``.

    Returns:
        dict of arrays (``M = config.max_objects``):
        ``rgb (H, W, 3) uint8``, ``depth (H, W) float32`` metres (0 = no surface),
        ``K (3, 3) float32``, ``extrinsics (4, 4) float32`` camera-from-world,
        ``boxes (M, 12) float32`` camera frame, ``labels (M,) int64`` (−1 = padding),
        ``valid (M,) bool``, ``pixels (M,) int32`` visible pixel count of each kept object,
        ``instance (H, W) int8``: the object slot ``k`` seen at each pixel, −1 for background and
        dropped objects.
    """
    p = _pybullet()

    own = client is None
    if own:
        client = p.connect(p.DIRECT)
    try:
        return _render(p, client, index, size, seed, config)
    finally:
        if own:
            p.disconnect(physicsClientId=client)


def _render(p: Any, client: int, index: int, size: int, seed: int, cfg: SceneConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(index)]))
    p.resetSimulation(physicsClientId=client)

    # Support surface: a large floor, optionally a table standing on it.
    floor_color = [*(rng.uniform(0.3, 0.8) * np.ones(3) + rng.uniform(-0.1, 0.1, 3)).clip(0, 1).tolist(), 1.0]
    _add_static(p, client, p.GEOM_BOX, [0, 0, -0.01], [0, 0, 0, 1], floor_color, halfExtents=[10, 10, 0.01])
    if rng.uniform() < cfg.table_prob:
        top_z = _uniform(rng, cfg.table_height)
        half = np.array([rng.uniform(0.45, 0.65), rng.uniform(0.35, 0.5)])
        wood = [*(np.array([0.55, 0.35, 0.2]) * rng.uniform(0.6, 1.4) + rng.uniform(-0.05, 0.05, 3)).clip(0, 1), 1]
        _add_static(p, client, p.GEOM_BOX, [0, 0, top_z - 0.02], [0, 0, 0, 1], wood,
                    halfExtents=[half[0], half[1], 0.02])
        for sx in (-1, 1):
            for sy in (-1, 1):
                _add_static(p, client, p.GEOM_BOX, [sx * (half[0] - 0.04), sy * (half[1] - 0.04), (top_z - 0.04) / 2],
                            [0, 0, 0, 1], wood, halfExtents=[0.02, 0.02, (top_z - 0.04) / 2])
        region = half - 0.03
    else:
        top_z = 0.0
        region = np.array([cfg.region_half, cfg.region_half])

    # Camera (chosen before the objects so that headings can be canonicalised to it).
    target = np.array([*(rng.normal(0.0, cfg.target_jitter, 2)), top_z])
    dist = _uniform(rng, cfg.cam_distance)
    elev = math.radians(_uniform(rng, cfg.cam_elevation))
    azim = rng.uniform(0.0, 2 * math.pi)
    fov = _uniform(rng, cfg.fov)
    eye = target + dist * np.array([math.cos(elev) * math.cos(azim), math.cos(elev) * math.sin(azim), math.sin(elev)])
    t_cw = _look_at_cv(eye, target)
    cam_right = t_cw[0, :3]  # camera x axis in world coordinates (horizontal, no roll)
    right_yaw = math.atan2(cam_right[1], cam_right[0])

    # Objects: rejection sampling of non-overlapping footprints (discs) inside the region.
    classes = [0, 1, 2, 3] if cfg.use_meshes else [0, 1, 2]
    n_obj = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
    placed: list[tuple[float, float, float]] = []  # (x, y, radius)
    objects = []  # (body id, label, centre_world (3,), yaw of the box, size (3,))
    for _ in range(n_obj):
        label = int(rng.choice(classes))
        yaw = rng.uniform(-math.pi, math.pi)
        color = _random_color(rng)
        if label == 0:
            dims = rng.uniform(*cfg.box_side, size=3)
        elif label == 1:
            r, h = _uniform(rng, cfg.cyl_radius), _uniform(rng, cfg.cyl_height)
            dims = np.array([2 * r, 2 * r, h])
        elif label == 2:
            r = _uniform(rng, cfg.sphere_radius)
            dims = np.array([2 * r, 2 * r, 2 * r])
        else:
            _, extent, _ = _duck_geometry()
            scale = _uniform(rng, cfg.duck_extent) / extent.max()
            dims = extent * scale
        radius = 0.5 * math.hypot(dims[0], dims[1])
        lim = region - radius
        if np.any(lim <= 0):
            continue
        for _try in range(50):
            xy = rng.uniform(-lim, lim)
            if all(math.hypot(xy[0] - x, xy[1] - y) > radius + rr + 0.01 for x, y, rr in placed):
                break
        else:
            continue
        placed.append((float(xy[0]), float(xy[1]), radius))
        centre = np.array([xy[0], xy[1], top_z + dims[2] / 2])
        if label == 0:
            body = _add_static(p, client, p.GEOM_BOX, centre, _quat_z(yaw), color, halfExtents=(dims / 2).tolist())
            # Half-turn symmetry: keep the heading whose x axis faces the camera's right half-space.
            box_yaw = yaw if math.cos(yaw - right_yaw) >= 0 else yaw + math.pi
        elif label == 1:
            body = _add_static(p, client, p.GEOM_CYLINDER, centre, _quat_z(yaw), color,
                               radius=float(dims[0] / 2), length=float(dims[2]))
            box_yaw = right_yaw
        elif label == 2:
            body = _add_static(p, client, p.GEOM_SPHERE, centre, _quat_z(yaw), color, radius=float(dims[0] / 2))
            box_yaw = right_yaw
        else:
            path, extent, mid = _duck_geometry()
            orn = p.getQuaternionFromEuler([math.pi / 2, 0.0, 0.0])
            body = _add_static(p, client, p.GEOM_MESH, centre, _quat_z(yaw), color, fileName=path,
                               meshScale=[scale] * 3, visualFrameOrientation=orn,
                               visualFramePosition=(-mid * scale).tolist())
            box_yaw = yaw
        objects.append((body, label, centre, box_yaw, dims))

    # Light.
    light_dir = rng.normal(size=3)
    light_dir[2] = abs(light_dir[2]) + 0.5
    light_dir = light_dir / np.linalg.norm(light_dir)
    _, _, rgba, zbuf, seg = p.getCameraImage(
        size, size,
        viewMatrix=_gl_view_matrix(t_cw),
        projectionMatrix=_gl_projection(fov, cfg.near, cfg.far, size),
        lightDirection=(light_dir * 10).tolist(),
        lightColor=rng.uniform(0.8, 1.0, 3).tolist(),
        lightAmbientCoeff=_uniform(rng, (0.4, 0.7)),
        lightDiffuseCoeff=_uniform(rng, (0.3, 0.6)),
        lightSpecularCoeff=_uniform(rng, (0.0, 0.2)),
        shadow=0,
        renderer=p.ER_TINY_RENDERER,
        physicsClientId=client,
    )
    rgb = np.asarray(rgba, dtype=np.uint8).reshape(size, size, 4)[..., :3].copy()
    zbuf = np.asarray(zbuf, dtype=np.float64).reshape(size, size)
    seg = np.asarray(seg, dtype=np.int64).reshape(size, size)
    near, far = cfg.near, cfg.far
    depth = far * near / (far - (far - near) * zbuf)
    depth[(seg < 0) | (zbuf >= 1.0)] = 0.0

    K = _intrinsics(size, fov)
    m = cfg.max_objects
    boxes = np.zeros((m, 12), np.float32)
    labels = np.full((m,), -1, np.int64)
    valid = np.zeros((m,), bool)
    pixels = np.zeros((m,), np.int32)
    instance = np.full((size, size), -1, np.int8)
    k = 0
    for body, label, centre, box_yaw, dims in objects:
        count = int((seg == body).sum())
        if count < cfg.min_visible_pixels:
            continue
        rot_c = t_cw[:3, :3] @ _rot_z(box_yaw)  # box axes in the camera frame
        centre_c = t_cw[:3, :3] @ centre + t_cw[:3, 3]
        u, v, z = project_points(centre_c, K)
        if not (z > 0 and -0.5 <= u <= size - 0.5 and -0.5 <= v <= size - 0.5):
            continue
        boxes[k] = np.concatenate([centre_c, rot_c[:, 0], rot_c[:, 1], dims])
        labels[k], valid[k], pixels[k] = label, True, count
        instance[seg == body] = k
        k += 1
    return {
        "rgb": rgb,
        "depth": depth.astype(np.float32),
        "K": K.astype(np.float32),
        "extrinsics": t_cw.astype(np.float32),
        "boxes": boxes,
        "labels": labels,
        "valid": valid,
        "pixels": pixels,
        "instance": instance,
    }


# --------------------------------------------------------------------------------------------- batches


_WORKER_CLIENT: Optional[int] = None


def _pybullet() -> Any:
    """The pybullet module, or :class:`~ropekit._optional.MissingDependency` naming the extra that installs it."""
    return require("pybullet", "sim", "rendering the RGB-D detection scenes")


def _worker_init() -> None:
    global _WORKER_CLIENT
    p = _pybullet()

    _WORKER_CLIENT = p.connect(p.DIRECT)


def _render_range(job: tuple[int, int, int, int, dict]) -> tuple[int, dict[str, np.ndarray]]:
    """Worker task: render scenes ``start:stop``; returns ``(start, stacked arrays)``."""
    start, stop, size, seed, cfg_dict = job
    cfg = SceneConfig(**cfg_dict)
    scenes = [render_scene(i, size, seed, cfg, client=_WORKER_CLIENT) for i in range(start, stop)]
    return start, {k: np.stack([s[k] for s in scenes]) for k in _ARRAY_KEYS}


@dataclass
class SceneSet:
    """Arrays of ``N`` scenes (``M`` = padded object count).

    Attributes:
        rgb: ``(N, H, W, 3) uint8``.
        depth: ``(N, H, W) float32`` metric z-depth, 0 = invalid.
        K: ``(N, 3, 3) float32``.
        extrinsics: ``(N, 4, 4) float32`` camera-from-world (OpenCV camera axes).
        boxes: ``(N, M, 12) float32`` camera-frame boxes.
        labels: ``(N, M) int64``, −1 for padding.
        valid: ``(N, M) bool``.
        pixels: ``(N, M) int32`` visible pixels per object.
        instance: ``(N, H, W) int8`` object slot seen at each pixel, −1 = none.
        class_names: the label names.
    """

    rgb: np.ndarray
    depth: np.ndarray
    K: np.ndarray
    extrinsics: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray
    valid: np.ndarray
    pixels: np.ndarray
    instance: np.ndarray
    class_names: tuple[str, ...] = CLASS_NAMES

    def __len__(self) -> int:
        return int(self.rgb.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in _ARRAY_KEYS}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "SceneSet":
        return cls(**{k: arrays[k] for k in _ARRAY_KEYS})

    @classmethod
    def concatenate(cls, parts: Sequence["SceneSet"]) -> "SceneSet":
        return cls(**{k: np.concatenate([getattr(s, k) for s in parts]) for k in _ARRAY_KEYS})


def _cache_key(n: int, size: int, seed: int, config: SceneConfig) -> str:
    payload = json.dumps(
        {"version": GENERATOR_VERSION, "n": n, "size": size, "seed": seed, "config": dataclasses.asdict(config)},
        sort_keys=True,
    )
    return hashlib.sha1(payload.encode()).hexdigest()[:12]


def generate_scenes(
    n: int,
    size: int = 64,
    seed: int = 0,
    workers: int = 2,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    progress: bool = True,
    config: SceneConfig = SceneConfig(),
    shard_size: int = 500,
    chunk_size: int = 16,
) -> SceneSet:
    """Render ``n`` scenes in parallel worker processes, with an optional on-disk cache.

    Each worker owns one pybullet ``DIRECT`` client; scenes are handed out in chunks of ``chunk_size``.
    With ``cache_dir``, scenes are stored as compressed npz shards of ``shard_size`` scenes in
    ``cache_dir/scenes-n{n}-s{size}-seed{seed}-{hash}/`` (the hash covers the parameters, the config and
    :data:`GENERATOR_VERSION`); a later call with the same parameters loads them, and an interrupted run
    resumes at the first missing shard.  ``meta.json`` is written last and marks a complete set.

    Args:
        n: number of scenes.
        size: image side in pixels.
        seed: stream seed (scene ``i`` is the same for every ``n > i`` and every ``workers``).
        workers: worker processes (``≤ 1`` renders in this process).
        cache_dir: cache directory or ``None``.
        progress: show a tqdm progress bar.
        config: scene distribution.
        shard_size: scenes per cache shard.
        chunk_size: scenes per worker task.

    Returns:
        a :class:`SceneSet` of ``n`` scenes.
    """
    from tqdm.auto import tqdm

    cache: Optional[Path] = None
    if cache_dir is not None:
        cache = Path(cache_dir) / f"scenes-n{n}-s{size}-seed{seed}-{_cache_key(n, size, seed, config)}"
        meta_path = cache / "meta.json"
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            parts = []
            for name in meta["shards"]:
                with np.load(cache / name) as z:
                    parts.append(SceneSet.from_arrays({k: z[k] for k in _ARRAY_KEYS}))
            return SceneSet.concatenate(parts)
        cache.mkdir(parents=True, exist_ok=True)

    _pybullet()  # here, not in the workers: a worker that fails to start is restarted, forever
    cfg_dict = dataclasses.asdict(config)
    shard_ranges = [(s, min(s + shard_size, n)) for s in range(0, n, shard_size)]
    pool = None
    n_jobs = math.ceil(n / chunk_size)
    if workers > 1 and n_jobs > 1:
        import multiprocessing as mp

        method = "fork" if "fork" in mp.get_all_start_methods() else None
        pool = mp.get_context(method).Pool(min(workers, n_jobs), initializer=_worker_init)
    else:
        _worker_init()
    parts: list[SceneSet] = []
    names: list[str] = []
    bar = tqdm(total=n, desc="render scenes", unit="scene", disable=not progress)
    try:
        for i, (lo, hi) in enumerate(shard_ranges):
            name = f"shard_{i:05d}.npz"
            names.append(name)
            if cache is not None and (cache / name).exists():
                with np.load(cache / name) as z:
                    parts.append(SceneSet.from_arrays({k: z[k] for k in _ARRAY_KEYS}))
                bar.update(hi - lo)
                continue
            jobs = [(s, min(s + chunk_size, hi), size, seed, cfg_dict) for s in range(lo, hi, chunk_size)]
            results = pool.imap_unordered(_render_range, jobs) if pool is not None else map(_render_range, jobs)
            chunks: dict[int, dict[str, np.ndarray]] = {}
            for start, arrays in results:
                chunks[start] = arrays
                bar.update(len(arrays["rgb"]))
            shard = {k: np.concatenate([chunks[s][k] for s in sorted(chunks)]) for k in _ARRAY_KEYS}
            if cache is not None:
                atomic_write(cache / name, lambda f: np.savez_compressed(f, **shard))
            parts.append(SceneSet.from_arrays(shard))
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
        else:
            _disconnect_worker()
    if cache is not None:
        meta = {"n": n, "size": size, "seed": seed, "version": GENERATOR_VERSION, "config": cfg_dict,
                "class_names": list(CLASS_NAMES), "shards": names}
        (cache / "meta.json").write_text(json.dumps(meta, indent=1))
    if not parts:
        return _empty_set(size, config.max_objects)
    return SceneSet.concatenate(parts)


def _disconnect_worker() -> None:
    global _WORKER_CLIENT
    if _WORKER_CLIENT is not None:
        import pybullet as p

        p.disconnect(physicsClientId=_WORKER_CLIENT)
        _WORKER_CLIENT = None


def _empty_set(size: int, m: int) -> SceneSet:
    return SceneSet(
        rgb=np.zeros((0, size, size, 3), np.uint8), depth=np.zeros((0, size, size), np.float32),
        K=np.zeros((0, 3, 3), np.float32), extrinsics=np.zeros((0, 4, 4), np.float32),
        boxes=np.zeros((0, m, 12), np.float32), labels=np.zeros((0, m), np.int64),
        valid=np.zeros((0, m), bool), pixels=np.zeros((0, m), np.int32),
        instance=np.zeros((0, size, size), np.int8),
    )


# --------------------------------------------------------------------------------------------- torch


class SceneDataset(Dataset):
    """``torch`` view of a :class:`SceneSet`.

    ``dataset[i]`` is ``(image, targets)``: ``image (4, H, W) float32`` — RGB in [0, 1] then metric depth
    (metres, 0 = invalid); ``targets = {"boxes": (K, 12) float32, "labels": (K,) int64}`` with the ``K``
    visible objects of the scene.

    Args:
        scenes: the arrays.
        max_targets: if set, at most this many objects per image, drawn at random on each access
            (training-time subsampling; leave ``None`` for evaluation).
    """

    def __init__(self, scenes: SceneSet, max_targets: Optional[int] = None) -> None:
        self.scenes = scenes
        self.max_targets = max_targets

    def __len__(self) -> int:
        return len(self.scenes)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = self.scenes
        rgb = torch.from_numpy(s.rgb[i]).permute(2, 0, 1).float() / 255.0  # (3, H, W)
        depth = torch.from_numpy(s.depth[i]).float().unsqueeze(0)  # (1, H, W)
        keep = np.flatnonzero(s.valid[i])
        if self.max_targets is not None and len(keep) > self.max_targets:
            keep = keep[torch.randperm(len(keep))[: self.max_targets].sort().values.numpy()]
        targets = {
            "boxes": torch.from_numpy(s.boxes[i][keep]).float(),  # (K, 12)
            "labels": torch.from_numpy(s.labels[i][keep]).long(),  # (K,)
        }
        return torch.cat([rgb, depth], dim=0), targets  # (4, H, W)


def collate_detection(
    batch: Sequence[tuple[torch.Tensor, dict[str, torch.Tensor]]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stack images and pad targets: ``images (B, C, H, W)``, ``{"boxes": (B, M, 12), "labels": (B, M)
    (−1 = padding), "mask": (B, M) bool}`` with ``M`` the largest object count in the batch."""
    images = torch.stack([b[0] for b in batch])
    m = max((len(b[1]["labels"]) for b in batch), default=0)
    bsz = len(batch)
    boxes = torch.zeros(bsz, m, 12)
    labels = torch.full((bsz, m), -1, dtype=torch.long)
    mask = torch.zeros(bsz, m, dtype=torch.bool)
    for j, (_, t) in enumerate(batch):
        k = len(t["labels"])
        boxes[j, :k], labels[j, :k], mask[j, :k] = t["boxes"], t["labels"], True
    return images, {"boxes": boxes, "labels": labels, "mask": mask}


# --------------------------------------------------------------------------------------------- CLI


def make_scenes_main(argv: Optional[Sequence[str]] = None) -> int:
    """``ropekit data make-scenes``: render (or load from cache) a scene set and report timing."""
    ap = argparse.ArgumentParser(prog="ropekit data make-scenes", description=make_scenes_main.__doc__)
    ap.add_argument("--n", type=int, default=1000, help="number of scenes")
    ap.add_argument("--size", type=int, default=64, help="image side in pixels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--out", type=str, default="data/scenes", help="cache directory for the npz shards")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    scenes = generate_scenes(args.n, size=args.size, seed=args.seed, workers=args.workers,
                             cache_dir=args.out, progress=not args.no_progress)
    dt = time.perf_counter() - t0
    objs = scenes.valid.sum(axis=1)
    counts = np.bincount(scenes.labels[scenes.valid], minlength=len(CLASS_NAMES))
    print(f"{len(scenes)} scenes of {args.size}x{args.size} in {dt:.1f}s under {args.out}; "
          f"objects per scene {objs.mean():.2f} (min {objs.min() if len(objs) else 0}, "
          f"max {objs.max() if len(objs) else 0}); per class "
          + ", ".join(f"{c}={k}" for c, k in zip(CLASS_NAMES, counts.tolist())))
    return 0
