"""Figures of the 3-D detection study: boxes drawn into images, metric bars, training curves.

Boxes are drawn by projecting their 8 corners with the intrinsics ``K`` (camera-frame boxes, OpenCV pixel
convention of :mod:`ropekit.detection.scenes`) and joining the 12 edges with Pillow: true boxes in green,
predicted boxes in blue.  Images are enlarged by an integer factor (nearest neighbour) so the lines are
legible; a pixel centre ``u`` maps to ``(u + 0.5)·scale − 0.5`` in the enlarged image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .boxes import box12_to_corners
from .scenes import project_points

__all__ = ["BOX_EDGES", "TRUE_COLOR", "PRED_COLOR", "draw_boxes", "example_grid", "plot_metric_bars", "save_figure",
           "plot_training_curves"]

#: The 12 edges as corner index pairs (corner order of :data:`ropekit.detection.CORNER_SIGNS`): bottom face,
#: top face, verticals.
BOX_EDGES: Tuple[Tuple[int, int], ...] = (
    (0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4), (0, 4), (1, 5), (2, 6), (3, 7),
)
TRUE_COLOR = (0, 200, 0)
PRED_COLOR = (40, 90, 255)

PathLike = Union[str, Path]


def _draw_box_edges(draw, corners_uvz: np.ndarray, scale: int, color, width: int) -> None:
    for a, b in BOX_EDGES:
        pa, pb = corners_uvz[a], corners_uvz[b]
        if pa[2] <= 1e-3 or pb[2] <= 1e-3 or not (np.isfinite(pa).all() and np.isfinite(pb).all()):
            continue  # an edge behind the camera is not drawn
        xy = [((pa[0] + 0.5) * scale - 0.5, (pa[1] + 0.5) * scale - 0.5),
              ((pb[0] + 0.5) * scale - 0.5, (pb[1] + 0.5) * scale - 0.5)]
        draw.line(xy, fill=color, width=width)


def draw_boxes(rgb: np.ndarray, K: np.ndarray, true_boxes: Optional[np.ndarray] = None,
               pred_boxes: Optional[np.ndarray] = None, scale: int = 4, width: int = 2, caption: str = ""):
    """An RGB image with 3-D boxes drawn in.

    Args:
        rgb: ``(H, W, 3)`` uint8.
        K: ``(3, 3)`` intrinsics of ``rgb``.
        true_boxes: ``(N, 12)`` camera-frame boxes drawn in green.
        pred_boxes: ``(P, 12)`` camera-frame boxes drawn in blue (on top).
        scale: integer enlargement.
        width: line width in enlarged pixels.
        caption: optional text at the top-left.

    Returns:
        a ``PIL.Image.Image`` of size ``(W·scale, H·scale)``.
    """
    from PIL import Image, ImageDraw

    h, w = rgb.shape[:2]
    img = Image.fromarray(np.asarray(rgb, dtype=np.uint8)).resize((w * scale, h * scale), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    for boxes, color in ((true_boxes, TRUE_COLOR), (pred_boxes, PRED_COLOR)):
        if boxes is None or len(boxes) == 0:
            continue
        corners = box12_to_corners(torch.as_tensor(np.asarray(boxes), dtype=torch.float64)).numpy()  # (N, 8, 3)
        uvz = project_points(corners, np.asarray(K, dtype=np.float64))  # (N, 8, 3)
        for c in uvz:
            _draw_box_edges(draw, c, scale, color, width)
    if caption:
        draw.rectangle([0, 0, 7 * len(caption) + 6, 14], fill=(0, 0, 0))
        draw.text((3, 1), caption, fill=(255, 255, 255))
    return img


def example_grid(panels: Sequence[Sequence], row_labels: Sequence[str], path: PathLike) -> Path:
    """Save a grid of PIL images (``panels[row][col]``, all the same size) with a label left of each row."""
    from PIL import Image, ImageDraw

    rows, cols = len(panels), max(len(r) for r in panels)
    pw, ph = panels[0][0].size
    label_w = 8 * max((len(s) for s in row_labels), default=0) + 12
    sheet = Image.new("RGB", (label_w + cols * (pw + 4), rows * (ph + 4)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for r, row in enumerate(panels):
        draw.text((4, r * (ph + 4) + ph // 2 - 6), row_labels[r], fill=(0, 0, 0))
        for c, im in enumerate(row):
            sheet.paste(im, (label_w + c * (pw + 4), r * (ph + 4)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path


def _bars(ax, runs: Sequence[Dict], metric: str, encodings: Sequence[str], inputs: Sequence[str],
          input_labels: Dict[str, str]) -> None:
    width = 0.8 / max(1, len(inputs))
    colors = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c"]
    for j, inp in enumerate(inputs):
        labelled = False  # the legend names each input once, at its first bar (not every input has every encoding)
        for i, enc in enumerate(encodings):
            vals = np.array([r[metric] for r in runs if r["encoding"] == enc and r["input"] == inp], float)
            vals = vals[np.isfinite(vals)]
            if len(vals) == 0:
                continue
            x = i + (j - (len(inputs) - 1) / 2) * width
            err = vals.std(ddof=1) if len(vals) > 1 else 0.0
            ax.bar(x, vals.mean(), width * 0.9, yerr=err, capsize=3, color=colors[j % len(colors)],
                   label=None if labelled else input_labels.get(inp, inp), alpha=0.85)
            labelled = True
            ax.scatter(np.full(len(vals), x), vals, s=10, color="black", zorder=3)
            ax.scatter([x], [vals.max()], s=40, facecolors="none", edgecolors="black", zorder=3)
    ax.set_xticks(range(len(encodings)))
    ax.set_xticklabels(encodings)
    ax.set_ylabel(metric)
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)


def plot_metric_bars(runs: Sequence[Dict], metrics: Sequence[str], path: PathLike, encodings: Sequence[str],
                     inputs: Sequence[str], input_labels: Optional[Dict[str, str]] = None,
                     title: Optional[str] = None) -> Path:
    """One panel per metric: grouped bars per encoding (groups) and input (bars), height = mean over seeds,
    error bar = ±1 sample standard deviation, one dot per seed (the best seed ringed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    input_labels = input_labels or {}
    fig, axes = plt.subplots(1, len(metrics), figsize=((1.6 + 1.1 * len(encodings)) * len(metrics), 3.6),
                             squeeze=False)
    for ax, m in zip(axes[0], metrics):
        _bars(ax, runs, m, encodings, inputs, input_labels)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title or "mean ± std over seeds (dots: seeds, ring: best seed)", fontsize=9)
    return save_figure(fig, path)


def save_figure(fig, path: Union[str, Path]) -> Path:
    """Lay ``fig`` out tightly, write it as a 110-dpi image to ``path`` (its folder created), close it: ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_training_curves(curves: Dict[Tuple[str, str], List[List[Dict[str, float]]]], path: PathLike,
                         key: str = "loss", input_labels: Optional[Dict[str, str]] = None,
                         ylabel: Optional[str] = None) -> Path:
    """``key`` of the metrics rows against step: one panel per input, one line per encoding (mean over seeds;
    an encoding has the same colour in every panel, and the legend lists every encoding); ``ylabel`` defaults
    to "training <key> (mean over seeds)"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    input_labels = input_labels or {}
    inputs = list(dict.fromkeys(i for _, i in curves))
    encodings = list(dict.fromkeys(e for e, _ in curves))
    colours = {e: plt.get_cmap("tab10")(k % 10) for k, e in enumerate(encodings)}
    fig, axes = plt.subplots(1, len(inputs), figsize=(4.2 * len(inputs), 3.2), sharey=True, squeeze=False)
    handles = {}
    for ax, inp in zip(axes[0], inputs):
        for (enc, i2), seeds in curves.items():
            if i2 != inp or not seeds:
                continue
            n = min(len(s) for s in seeds)
            if n == 0:
                continue
            steps = [seeds[0][k]["step"] for k in range(n)]
            vals = np.mean([[s[k][key] for k in range(n)] for s in seeds], axis=0)
            handles[enc] = ax.plot(steps, vals, label=enc, color=colours[enc])[0]
        ax.set_title(input_labels.get(inp, inp), fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel or f"training {key} (mean over seeds)", fontsize=8)
    axes[0][-1].legend([handles[e] for e in encodings if e in handles], [e for e in encodings if e in handles],
                       fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
