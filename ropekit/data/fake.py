"""Generated image folders for tests, examples and the data benchmark (nothing is downloaded).

:func:`write_fake_image_folder` draws ``classes`` kinds of picture -- class ``k`` is a shape (disc, square,
triangle, cross, ring, bar) in a class colour, at a random place and size, on a noisy background -- and saves
them as JPEG (or PNG) files ``root/class_<k>/<i>.jpg``, so a small model can learn them.
"""

from __future__ import annotations

import colorsys
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np

from ._common import PathLike

__all__ = ["write_fake_image_folder"]

_SHAPES = ("disc", "square", "triangle", "cross", "ring", "bar")


def _draw(k: int, size: int, rng: np.random.Generator, classes: int) -> "object":
    from PIL import Image, ImageDraw

    bg = rng.integers(0, 256, size=(size // 8 + 1, size // 8 + 1, 3), dtype=np.uint8)  # coarse noise
    img = Image.fromarray(bg).resize((size, size), Image.BILINEAR)
    draw = ImageDraw.Draw(img)
    hue = k / max(classes, 1)
    r, g, b = (int(255 * c) for c in colorsys.hsv_to_rgb(hue, 0.9, 0.95))
    s = size * rng.uniform(0.25, 0.45)
    cx, cy = rng.uniform(s, size - s, size=2)
    box = [cx - s, cy - s, cx + s, cy + s]
    shape = _SHAPES[k % len(_SHAPES)]
    fill = (r, g, b)
    if shape == "disc":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - s), (cx - s, cy + s), (cx + s, cy + s)], fill=fill)
    elif shape == "cross":
        w = s / 3
        draw.rectangle([cx - s, cy - w, cx + s, cy + w], fill=fill)
        draw.rectangle([cx - w, cy - s, cx + w, cy + s], fill=fill)
    elif shape == "ring":
        draw.ellipse(box, outline=fill, width=max(2, int(s / 3)))
    else:
        draw.rectangle([cx - s, cy - s / 4, cx + s, cy + s / 4], fill=fill)
    return img


def write_fake_image_folder(
    root: PathLike,
    *,
    classes: int = 4,
    per_class: int = 24,
    size: int = 64,
    seed: int = 0,
    image_format: str = "jpg",
    quality: int = 90,
    val_per_class: int = 0,
    progress: Optional[Callable[[int], None]] = None,
) -> Dict[str, int]:
    """Write a folder of generated images: ``root/class_<k>/<i>.<ext>`` (or ``root/train/...`` and
    ``root/val/...`` when ``val_per_class > 0``, the ImageNet layout).

    Args:
        root: output directory (created; existing files of the same names are overwritten).
        classes: number of classes (at least 2).
        per_class: training images per class.
        size: side of the square images in pixels.
        seed: the same seed writes the same pixels.
        image_format: ``"jpg"`` or ``"png"``.
        quality: JPEG quality.
        val_per_class: if positive, also write that many validation images per class under ``root/val``.
        progress: called with the number of images written after each one (e.g. a tqdm bar's ``update``).

    Returns:
        ``{"train": n_train, "val": n_val}`` image counts.
    """
    if classes < 2 or per_class < 1 or size < 8 or val_per_class < 0:
        raise ValueError(f"need classes >= 2, per_class >= 1, size >= 8, val_per_class >= 0; got {classes}, "
                         f"{per_class}, {size}, {val_per_class}")
    fmt = str(image_format).lower().lstrip(".")
    if fmt not in ("jpg", "png"):
        raise ValueError(f"image_format must be 'jpg' or 'png', got {image_format!r}")
    root = Path(root).expanduser()
    splits = {"train": per_class} if val_per_class == 0 else {"train": per_class, "val": val_per_class}
    counts = {"train": 0, "val": 0}
    width = len(str(classes - 1))
    for split, n in splits.items():
        base = root if val_per_class == 0 else root / split
        rng = np.random.default_rng([seed, 0 if split == "train" else 1])
        for k in range(classes):
            folder = base / f"class_{k:0{width}d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                img = _draw(k, size, rng, classes)
                path = folder / f"{i:06d}.{fmt}"
                if fmt == "jpg":
                    img.save(path, quality=quality)
                else:
                    img.save(path)
                counts[split] += 1
                if progress is not None:
                    progress(1)
    return counts
