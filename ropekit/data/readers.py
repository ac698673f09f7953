"""Readers for user data on disk (``root=``); nothing is downloaded.

* ``imagefolder`` — ``root/<class>/<image>``, one sub-folder per class (sorted names → labels 0, 1, ...),
  images read with Pillow, converted to RGB or grayscale, resized to one fixed size; stratified split.
* ``cifar10`` — the python pickle batches ``data_batch_1..5`` and ``test_batch`` (in ``root`` or in
  ``root/cifar-10-batches-py``); the format's own train/test split.
* ``cifar100`` — the pickles ``train`` and ``test`` (in ``root`` or ``root/cifar-100-python``), fine labels
  by default; the format's own split.
* ``mnist-idx`` — the four IDX files ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (or with ``.idx3-ubyte`` spelling; each optionally
  ``.gz``; in ``root`` or ``root/raw``); the format's own split. Works for Fashion-MNIST / KMNIST too.

All samples are float32 ``(C, H, W)`` in [0, 1]. The CIFAR batches are Python pickles: only read files you
trust.
"""

from __future__ import annotations

import gzip
import pickle
import re
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from ._common import (
    DatasetInfo,
    PathLike,
    SizeLike,
    TensorImageDataset,
    as_size,
    register_dataset,
    require_path,
    resize_images,
    split_tensors,
)

__all__ = ["IMAGE_EXTENSIONS", "read_image_folder", "read_cifar_batch", "read_idx"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
_MODES = {"rgb": "RGB", "color": "RGB", "colour": "RGB", "l": "L", "gray": "L", "grey": "L", "grayscale": "L"}


# ----------------------------------------------------------------------------------------------------------
# image folder
# ----------------------------------------------------------------------------------------------------------


def read_image_folder(
    root: PathLike, *, image_size: Optional[SizeLike] = None, mode: str = "RGB"
) -> Tuple[Tensor, Tensor, List[str]]:
    """Read ``root/<class>/**/<image>`` into memory.

    Args:
        root: a directory with one sub-folder per class (hidden folders are skipped; class ``k`` is the
            ``k``-th folder name in sorted order). Files with an extension in :data:`IMAGE_EXTENSIONS`
            (any case) are read, recursively.
        image_size: ``(H, W)`` every image is resized to (bilinear); default: the first image's size.
        mode: ``"RGB"`` (3 channels) or ``"L"`` / ``"grayscale"`` (1 channel).

    Returns:
        ``(images, labels, class_names)``: float32 ``(N, C, H, W)`` in [0, 1], int64 ``(N,)``, ``list[str]``.
    """
    from PIL import Image  # local: only this reader needs Pillow

    pil_mode = _MODES.get(str(mode).lower())
    if pil_mode is None:
        raise ValueError(f"mode must be one of {sorted(set(_MODES))}, got {mode!r}")
    root = require_path(root, "imagefolder")
    if not root.is_dir():
        raise NotADirectoryError(f"imagefolder: not a directory: {root}")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"imagefolder: no class sub-folders in {root}")
    files: List[Tuple[Path, int]] = []
    for label, name in enumerate(classes):
        found = sorted(p for p in (root / name).rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
        files.extend((p, label) for p in found)
    if not files:
        raise FileNotFoundError(f"imagefolder: no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")

    size_hw = as_size(image_size) if image_size is not None else None
    arrays = []
    for path, _ in files:
        with Image.open(path) as img:
            img = img.convert(pil_mode)
            if size_hw is None:
                size_hw = (img.height, img.width)
            if (img.height, img.width) != size_hw:
                img = img.resize((size_hw[1], size_hw[0]), Image.BILINEAR)  # PIL takes (W, H)
            arrays.append(np.asarray(img, dtype=np.uint8))
    stack = np.stack(arrays)  # (N, H, W) or (N, H, W, 3)
    if stack.ndim == 3:
        stack = stack[..., None]
    images = torch.from_numpy(stack).permute(0, 3, 1, 2).float().div_(255.0).contiguous()  # (N, C, H, W)
    labels = torch.tensor([label for _, label in files], dtype=torch.int64)
    return images, labels, classes


@register_dataset("imagefolder")
def build_imagefolder(
    *,
    root: Optional[PathLike] = None,
    image_size: Optional[SizeLike] = None,
    split_seed: int = 0,
    test_fraction: float = 0.2,
    mode: str = "RGB",
) -> Tuple[TensorImageDataset, TensorImageDataset, DatasetInfo]:
    """A folder of images per class; samples float32 ``(C, H, W)`` in [0, 1], ``C`` = 3 (RGB) or 1 (``mode="L"``).

    Split with :func:`ropekit.data.stratified_split`. See :func:`read_image_folder`.
    """
    images, labels, classes = read_image_folder(require_path(root, "imagefolder"), image_size=image_size, mode=mode)
    train, test = split_tensors(images, labels, test_fraction, split_seed)
    info = DatasetInfo("imagefolder", len(classes), images.shape[1], as_size(tuple(images.shape[-2:])), "image",
                       class_names=tuple(classes))
    return train, test, info


# ----------------------------------------------------------------------------------------------------------
# CIFAR
# ----------------------------------------------------------------------------------------------------------


def _unpickle(path: Path) -> Dict[str, Any]:
    """Load a CIFAR pickle (written by Python 2 or 3) with its keys as ``str``."""
    with open(path, "rb") as f:
        obj = pickle.load(f, encoding="bytes")
    return {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


def _names(values: Sequence[Any]) -> Tuple[str, ...]:
    return tuple(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values)


def read_cifar_batch(path: PathLike, label_key: str = "labels") -> Tuple[np.ndarray, np.ndarray]:
    """One CIFAR python batch.

    Args:
        path: a pickle with ``data`` (uint8 ``(N, 3072)``, row-major R, G, B planes of 32×32) and
            ``label_key`` (``"labels"`` for CIFAR-10, ``"fine_labels"`` / ``"coarse_labels"`` for CIFAR-100).

    Returns:
        ``(images, labels)``: uint8 ``(N, 3, 32, 32)`` and int64 ``(N,)``.
    """
    d = _unpickle(Path(path))
    if "data" not in d or label_key not in d:
        raise ValueError(f"{path}: not a CIFAR batch with 'data' and {label_key!r} (keys: {sorted(d)})")
    data = np.asarray(d["data"], dtype=np.uint8)
    labels = np.asarray(d[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != labels.shape[0]:
        raise ValueError(f"{path}: expected data (N, 3072) and N labels, got {data.shape} and {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_dir(root: Path, sub: str) -> Path:
    return root / sub if (root / sub).is_dir() else root


def _to_datasets(
    train: Tuple[np.ndarray, np.ndarray], test: Tuple[np.ndarray, np.ndarray], image_size: Optional[SizeLike]
) -> Tuple[TensorImageDataset, TensorImageDataset, Tuple[int, int]]:
    """uint8 ``(N, C, H, W)`` + labels pairs → datasets of float32 in [0, 1], resized to ``image_size``."""
    out = []
    for x, y in (train, test):
        images = resize_images(torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0), image_size)
        out.append(TensorImageDataset(images, torch.from_numpy(np.asarray(y, dtype=np.int64))))
    return out[0], out[1], as_size(tuple(out[0].images.shape[-2:]))


def _batch_number(p: Path) -> int:
    m = re.search(r"(\d+)$", p.name)
    return int(m.group(1)) if m else 0


@register_dataset("cifar10")
def build_cifar10(
    *,
    root: Optional[PathLike] = None,
    image_size: Optional[SizeLike] = None,
    split_seed: int = 0,
    test_fraction: float = 0.2,
) -> Tuple[TensorImageDataset, TensorImageDataset, DatasetInfo]:
    """CIFAR-10 python batches; samples float32 ``(3, 32, 32)`` in [0, 1] (``(3, H, W)`` if resized).

    Uses every ``data_batch_*`` present for training and ``test_batch`` for testing (``split_seed`` and
    ``test_fraction`` are ignored). Class names come from ``batches.meta`` when present.
    """
    d = _cifar_dir(require_path(root, "cifar10"), "cifar-10-batches-py")
    train_files = sorted(d.glob("data_batch_*"), key=_batch_number)
    if not train_files or not (d / "test_batch").is_file():
        raise FileNotFoundError(f"cifar10: expected data_batch_1..5 and test_batch in {d}")
    parts = [read_cifar_batch(p) for p in train_files]
    train = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    test = read_cifar_batch(d / "test_batch")
    names = _names(_unpickle(d / "batches.meta").get("label_names", [])) if (d / "batches.meta").is_file() else ()
    train_ds, test_ds, hw = _to_datasets(train, test, image_size)
    info = DatasetInfo("cifar10", 10, 3, hw, "image", class_names=names if len(names) == 10 else None)
    return train_ds, test_ds, info


@register_dataset("cifar100")
def build_cifar100(
    *,
    root: Optional[PathLike] = None,
    image_size: Optional[SizeLike] = None,
    split_seed: int = 0,
    test_fraction: float = 0.2,
    label_type: str = "fine",
) -> Tuple[TensorImageDataset, TensorImageDataset, DatasetInfo]:
    """CIFAR-100 python pickles ``train`` / ``test``; samples float32 ``(3, 32, 32)`` in [0, 1].

    ``label_type="fine"`` (100 classes, default) or ``"coarse"`` (20 super-classes). Uses the format's own
    split (``split_seed`` and ``test_fraction`` are ignored). Class names come from ``meta`` when present.
    """
    if label_type not in ("fine", "coarse"):
        raise ValueError(f"label_type must be 'fine' or 'coarse', got {label_type!r}")
    d = _cifar_dir(require_path(root, "cifar100"), "cifar-100-python")
    if not (d / "train").is_file() or not (d / "test").is_file():
        raise FileNotFoundError(f"cifar100: expected files 'train' and 'test' in {d}")
    key = f"{label_type}_labels"
    train, test = read_cifar_batch(d / "train", key), read_cifar_batch(d / "test", key)
    num_classes = 100 if label_type == "fine" else 20
    names = _names(_unpickle(d / "meta").get(f"{label_type}_label_names", [])) if (d / "meta").is_file() else ()
    train_ds, test_ds, hw = _to_datasets(train, test, image_size)
    class_names = names if len(names) == num_classes else None
    info = DatasetInfo("cifar100", num_classes, 3, hw, "image", class_names=class_names)
    return train_ds, test_ds, info


# ----------------------------------------------------------------------------------------------------------
# IDX (MNIST format)
# ----------------------------------------------------------------------------------------------------------

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: PathLike) -> np.ndarray:
    """Read an IDX file (plain or gzipped; gzip is detected from the content, not the name).

    Format: two zero bytes, a type code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32,
    0x0E float64), the number of dimensions, then each dimension as a big-endian uint32, then the data
    big-endian in C order.

    Returns:
        an array of the stored shape, in native byte order.
    """
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    count = int(np.prod(dims)) if ndim else 1
    if len(raw) - header != count * dtype.itemsize:
        raise ValueError(f"{path}: header says {dims} of {dtype} but the payload has {len(raw) - header} bytes")
    arr = np.frombuffer(raw, dtype=dtype, count=count, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="))


def _find_idx(root: Path, prefix: str, what: str, ndim: int) -> Path:
    stems = [f"{prefix}-{what}-idx{ndim}-ubyte", f"{prefix}-{what}.idx{ndim}-ubyte"]
    for folder in (root, root / "raw"):
        for stem in stems:
            for name in (stem, stem + ".gz"):
                if (folder / name).is_file():
                    return folder / name
    raise FileNotFoundError(f"mnist-idx: no {stems[0]}[.gz] in {root}")


@register_dataset("mnist-idx")
def build_mnist_idx(
    *,
    root: Optional[PathLike] = None,
    image_size: Optional[SizeLike] = None,
    split_seed: int = 0,
    test_fraction: float = 0.2,
    num_classes: Optional[int] = None,
) -> Tuple[TensorImageDataset, TensorImageDataset, DatasetInfo]:
    """The four MNIST IDX files; samples float32 ``(1, H, W)`` in [0, 1] (uint8 pixels / 255).

    Uses the format's own train (``train-*``) / test (``t10k-*``) split (``split_seed`` and
    ``test_fraction`` are ignored). ``num_classes`` defaults to the largest label + 1.
    """
    d = require_path(root, "mnist-idx")
    arrays = {}
    for prefix in ("train", "t10k"):
        images = read_idx(_find_idx(d, prefix, "images", 3))
        labels = read_idx(_find_idx(d, prefix, "labels", 1))
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"mnist-idx: {prefix} images {images.shape} do not match labels {labels.shape}")
        x = images.astype(np.float32) / 255.0 if images.dtype == np.uint8 else images.astype(np.float32)
        arrays[prefix] = (x[:, None], labels.astype(np.int64))  # (N, 1, H, W), (N,)
    out = []
    for x, y in arrays.values():
        out.append(TensorImageDataset(resize_images(torch.from_numpy(x), image_size), torch.from_numpy(y)))
    k = int(num_classes) if num_classes is not None else int(max(a[1].max(initial=-1) for a in arrays.values())) + 1
    info = DatasetInfo("mnist-idx", k, 1, as_size(tuple(out[0].images.shape[-2:])), "image")
    return out[0], out[1], info
