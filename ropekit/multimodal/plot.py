"""Figures of a retrieval run: learning curves and text queries with their top-ranked images."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .._io import atomic_write

__all__ = ["plot_retrieval_curves", "plot_queries", "display_rgb"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format=path.suffix.lstrip(".") or "png"))
    _pyplot().close(fig)
    return path


def plot_retrieval_curves(rows: Sequence[Dict[str, Any]], path: Path, title: Optional[str] = None) -> Optional[Path]:
    """Training loss and test recall@1/5/10 (both directions) against epoch, as a PNG."""
    if not rows:
        return None
    plt = _pyplot()
    ep = [r["epoch"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(ep, [r["train_loss"] for r in rows], "o-")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("SigLIP loss (train)")
    ax1.grid(alpha=0.3)
    for k, style in ((1, "o"), (5, "s"), (10, "^")):
        ax2.plot(ep, [r[f"i2t_r{k}"] for r in rows], f"{style}-", color="tab:blue", label=f"image→text R@{k}")
        ax2.plot(ep, [r[f"t2i_r{k}"] for r in rows], f"{style}--", color="tab:orange", label=f"text→image R@{k}")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("test recall")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=6, ncol=2)
    ax2.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def display_rgb(images: Tensor, mean: Optional[Sequence[float]] = None,
                std: Optional[Sequence[float]] = None) -> Tensor:
    """The colour channels of ``(N, C(+1), H, W)`` images as ``(N, H, W, 3)`` in [0, 1] for display (undoing a
    normalisation with ``mean`` / ``std``)."""
    rgb = images[:, :3].float()
    if mean is not None and std is not None:
        m = torch.as_tensor(mean, dtype=rgb.dtype)[:3].view(1, -1, 1, 1)
        s = torch.as_tensor(std, dtype=rgb.dtype)[:3].view(1, -1, 1, 1)
        rgb = rgb * s + m
    return rgb.clamp(0, 1).permute(0, 2, 3, 1)


def plot_queries(queries: Sequence[str], scores: Tensor, images: Tensor, truth: Sequence[Sequence[int]], path: Path,
                 top: int = 5, mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                 title: Optional[str] = None) -> Path:
    """One row per text query: the query, then its ``top`` highest-scoring images (colour), framed green where
    the image is a right answer, with the score above each.

    Args:
        queries: ``Q`` caption strings.
        scores: ``(Q, N)`` text-image similarities.
        images: ``(N, C(+1), H, W)`` the candidates.
        truth: for each query, the indices of its right images.
        path: the PNG to write.
        mean, std: the colour normalisation to undo for display.
    """
    plt = _pyplot()
    q = len(queries)
    fig, axes = plt.subplots(q, top + 1, figsize=(1.6 * top + 3.2, 1.75 * q + 0.6), squeeze=False,
                             gridspec_kw={"width_ratios": [2.2] + [1] * top})
    rgb = display_rgb(images, mean, std)
    for r, text in enumerate(queries):
        axes[r, 0].axis("off")
        axes[r, 0].text(0, 0.5, _wrap(f"“{text}”", 34), fontsize=7, va="center", ha="left",
                        transform=axes[r, 0].transAxes)
        best = torch.argsort(scores[r], descending=True, stable=True)[:top].tolist()
        right = set(truth[r])
        for c, j in enumerate(best):
            ax = axes[r, c + 1]
            ax.imshow(rgb[j].numpy())
            ax.set_xticks([])
            ax.set_yticks([])
            hit = j in right
            for side in ax.spines.values():
                side.set_color("tab:green" if hit else "0.7")
                side.set_linewidth(3 if hit else 1)
            ax.set_title(f"#{c + 1}  {float(scores[r, j]):.2f}", fontsize=7)
    fig.suptitle(title or "text → image: top-5 (green: a right answer)", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _wrap(text: str, width: int) -> str:
    words: List[str] = []
    line = ""
    for w in text.split():
        if len(line) + len(w) + 1 > width:
            words.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return "\n".join(words + [line])
