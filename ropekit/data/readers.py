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

All samples are float32 ``(C, H, W)`` in [0, 1]. A file that cannot be read raises :class:`DataFileError`,
one line that starts with the file's path. The CIFAR batches are Python pickles, which can run code when
loaded: they are read with an unpickler that builds only what a CIFAR batch holds (dicts, lists, strings,
numbers and numpy arrays) and refuses anything else.
"""

from __future__ import annotations

import gzip
import pickle
import re
import struct
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from ._common import DataFileError, DataRequest, DatasetInfo, DatasetSplits, PathLike, SizeLike, TensorImageDataset
from ._common import SKIP_HINT, as_size, register_dataset, require_path

__all__ = ["IMAGE_EXTENSIONS", "read_image_folder", "read_image", "read_cifar_batch", "read_idx"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
_MODES = {"rgb": "RGB", "color": "RGB", "colour": "RGB", "l": "L", "gray": "L", "grey": "L", "grayscale": "L"}


# ----------------------------------------------------------------------------------------------------------
# image folder
# ----------------------------------------------------------------------------------------------------------


#: Pillow modes of more than 8 bits per pixel → the value that maps to 1.0. 16-bit PNGs open as ``I;16*`` or
#: (older Pillow) ``I``; 32-bit integer images are taken on the same 16-bit scale (values above it clip to 1).
#: Float images (``F``) are taken as already in [0, 1].
_WIDE_MODES = {"I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I;16N": 65535.0, "I": 65535.0, "F": 1.0}


def read_image(path: PathLike, *, mode: str = "RGB", size: Optional[SizeLike] = None) -> np.ndarray:
    """Read one image file into float32 ``(H, W, C)`` values in [0, 1].

    8-bit images are converted by Pillow to ``mode`` and divided by 255. Images of more bits per pixel
    (16-bit greyscale PNG, 32-bit integer or float greyscale) keep their precision: they are scaled by their
    own range (65535 for 16-bit, see :data:`_WIDE_MODES`), so 50% grey is 0.5 whatever the depth; with
    ``mode="RGB"`` the grey channel is repeated three times.

    Args:
        path: the image file (any format Pillow reads).
        mode: ``"RGB"`` (``C = 3``) or ``"L"`` / ``"grayscale"`` (``C = 1``).
        size: ``(H, W)`` to resize to (bilinear), or ``None`` for the file's own size.

    Returns:
        float32 ``(H, W, C)`` in [0, 1].

    Raises:
        DataFileError: the file is not an image Pillow can decode (corrupt, truncated, another format).
        ValueError: unknown ``mode``.
    """
    from PIL import Image  # local: only the image readers need Pillow

    pil_mode = _pil_mode(mode)
    hw = as_size(size) if size is not None else None
    try:
        with Image.open(path) as img:
            img.load()  # decode now: a truncated file fails here, not later
            if img.mode in _WIDE_MODES:
                arr = np.asarray(img, dtype=np.float32) / np.float32(_WIDE_MODES[img.mode])  # (H, W)
                arr = np.clip(arr, 0.0, 1.0)
                if hw is not None and arr.shape != hw:
                    arr = np.asarray(Image.fromarray(arr).resize((hw[1], hw[0]), Image.BILINEAR))
                arr = np.repeat(arr[..., None], 3 if pil_mode == "RGB" else 1, axis=-1)  # (H, W, C)
            else:
                img = img.convert(pil_mode)
                if hw is not None and (img.height, img.width) != hw:
                    img = img.resize((hw[1], hw[0]), Image.BILINEAR)  # PIL takes (W, H)
                arr = np.asarray(img, dtype=np.uint8).reshape(img.height, img.width, -1)  # (H, W, C)
                arr = arr.astype(np.float32) / np.float32(255.0)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, ValueError, ... on bad files
        raise DataFileError(path, f"not a readable image ({type(e).__name__}: {e})") from e
    return arr


def _pil_mode(mode: str) -> str:
    pil_mode = _MODES.get(str(mode).lower())
    if pil_mode is None:
        raise ValueError(f"mode must be one of {sorted(set(_MODES))}, got {mode!r}")
    return pil_mode


def read_image_folder(
    root: PathLike, *, image_size: Optional[SizeLike] = None, mode: str = "RGB", skip_corrupt: bool = False
) -> Tuple[Tensor, Tensor, List[str]]:
    """Read ``root/<class>/**/<image>`` into memory.

    Args:
        root: a directory with one sub-folder per class (hidden folders are skipped; class ``k`` is the
            ``k``-th folder name in sorted order). Files with an extension in :data:`IMAGE_EXTENSIONS`
            (any case) are read, recursively, with :func:`read_image`.
        image_size: ``(H, W)`` every image is resized to (bilinear); default: the first image's size.
        mode: ``"RGB"`` (3 channels) or ``"L"`` / ``"grayscale"`` (1 channel).
        skip_corrupt: skip files that cannot be decoded, with a warning that counts them and names the
            first; by default the first such file is an error.

    Returns:
        ``(images, labels, class_names)``: float32 ``(N, C, H, W)`` in [0, 1], int64 ``(N,)``, ``list[str]``.

    Raises:
        DataFileError: an unreadable image (one line naming it), unless ``skip_corrupt``.
        FileNotFoundError: no class folder, or no (readable) image.
    """
    _pil_mode(mode)
    if not isinstance(skip_corrupt, bool):
        raise ValueError(f"skip_corrupt must be true or false, got {skip_corrupt!r}")
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
    arrays: List[np.ndarray] = []
    labels: List[int] = []
    skipped: List[DataFileError] = []
    for path, label in files:
        try:
            arr = read_image(path, mode=mode, size=size_hw)
        except DataFileError as e:
            if not skip_corrupt:
                raise DataFileError(e.path, f"{e.reason}; {SKIP_HINT}") from e
            skipped.append(e)
            continue
        size_hw = size_hw or arr.shape[:2]
        arrays.append(arr)
        labels.append(label)
    if skipped:
        warnings.warn(f"imagefolder: skipped {len(skipped)} unreadable image(s) of {len(files)} under {root} "
                      f"(first: {skipped[0]})", stacklevel=2)
    if not arrays:
        raise FileNotFoundError(f"imagefolder: none of the {len(files)} image files under {root} could be read")
    images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()  # (N, H, W, C) -> (N, C, H, W)
    return images, torch.tensor(labels, dtype=torch.int64), classes


@register_dataset("imagefolder")
def build_imagefolder(request: DataRequest, *, mode: str = "RGB", skip_corrupt: bool = False) -> DatasetSplits:
    """A folder of images per class; samples float32 ``(C, H, W)`` in [0, 1], ``C`` = 3 (RGB) or 1 (``mode="L"``).

    Split with :func:`ropekit.data.stratified_split`. See :func:`read_image_folder` (``skip_corrupt``: skip
    undecodable files with a warning instead of stopping at the first). At least two class folders must hold
    images: a classifier of one class learns nothing.
    """
    root = request.path("imagefolder")
    images, labels, classes = read_image_folder(root, image_size=request.image_size, mode=mode,
                                                skip_corrupt=skip_corrupt)
    present = [classes[i] for i in torch.unique(labels).tolist()]
    if len(present) < 2:
        found = f"{len(classes)} class folders of which only {present[0]!r} holds images" if len(classes) > 1 \
            else f"one class folder ({classes[0]!r})"
        raise ValueError(f"imagefolder: {root} has {found}; classification needs at least 2 classes, "
                         f"one sub-folder of images each")
    train, test = request.split(images, labels)
    info = DatasetInfo("imagefolder", len(classes), images.shape[1], as_size(tuple(images.shape[-2:])), "image",
                       class_names=tuple(classes))
    return train, test, info


# ----------------------------------------------------------------------------------------------------------
# CIFAR
# ----------------------------------------------------------------------------------------------------------


#: ``(module, name)`` pairs a CIFAR pickle may name: numpy's array, dtype and scalar reconstruction (under its
#: numpy 1 and numpy 2 module names; ``_frombuffer`` is what pickle protocol 5 writes) and how Python 3
#: writes ``bytes`` in protocols 0-2. Builtin containers and numbers need no lookup except in old protocols.
_CIFAR_GLOBALS = frozenset(
    [(m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray") for n in ("_reconstruct", "scalar")]
    + [("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"), ("numpy", "ndarray"),
       ("numpy", "dtype"), ("_codecs", "encode")]
    + [(m, n) for m in ("builtins", "__builtin__") for n in ("dict", "list", "tuple", "set", "frozenset", "bytes",
                                                             "bytearray", "str", "int", "float", "complex", "bool")]
)


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that builds only what a CIFAR batch holds and refuses every other class or function.

    A pickle names the callables that rebuild its objects; a crafted one can name ``os.system`` or any
    other function and have it called while loading. Only the names in :data:`_CIFAR_GLOBALS` are looked up.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _CIFAR_GLOBALS:
            raise pickle.UnpicklingError(f"refused: it calls {module}.{name}, which a CIFAR batch never holds")
        return super().find_class(module, name)


def _unpickle(path: Path) -> Dict[str, Any]:
    """Load a CIFAR pickle (written by Python 2 or 3) with :class:`_CifarUnpickler`; keys as ``str``.

    Raises:
        DataFileError: the file is not a pickled dict, is corrupt, or names something a CIFAR batch
            never holds (then nothing it names has been called).
    """
    try:
        with open(path, "rb") as f:
            obj = _CifarUnpickler(f, encoding="bytes").load()
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt pickle raises almost any exception type
        if isinstance(e, pickle.UnpicklingError) and str(e).startswith("refused"):
            raise DataFileError(path, f"not loaded: a pickle that {str(e)[len('refused: it '):]} "
                                      "(crafted or not a CIFAR batch)") from None
        raise DataFileError(path, f"not a CIFAR python batch ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise DataFileError(path, f"not a CIFAR python batch (holds a {type(obj).__name__}, not a dict)")
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

    Raises:
        DataFileError: the file is not such a batch (one line naming it). The file is read with a restricted
            unpickler (see :class:`_CifarUnpickler`), so a crafted pickle is refused rather than run.
    """
    d = _unpickle(Path(path))
    if "data" not in d or label_key not in d:
        raise DataFileError(path, f"not a CIFAR batch with 'data' and {label_key!r} (keys: {sorted(d)})")
    try:
        data = np.asarray(d["data"], dtype=np.uint8)
        labels = np.asarray(d[label_key], dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise DataFileError(path, f"not a CIFAR batch: 'data' or {label_key!r} is not numeric ({e})") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.ndim != 1 or data.shape[0] != labels.shape[0]:
        raise DataFileError(path, f"expected data (N, 3072) and N labels, got {data.shape} and {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_dir(root: Path, sub: str) -> Path:
    return root / sub if (root / sub).is_dir() else root


def _own_split(
    request: DataRequest, train: Tuple[np.ndarray, np.ndarray], test: Tuple[np.ndarray, np.ndarray]
) -> Tuple[TensorImageDataset, TensorImageDataset, Tuple[int, int]]:
    """The datasets of a format with a train/test split of its own, and their image size ``(H, W)``.

    ``train`` and ``test`` are ``(images, labels)``: ``(N, C, H, W)`` uint8 (divided by 255) or float (kept as
    they are), and ``(N,)`` integers. Images become float32, resized to ``request.image_size``.
    """
    out = []
    for x, y in (train, test):
        x = x.astype(np.float32) / np.float32(255.0) if x.dtype == np.uint8 else x.astype(np.float32)
        images = request.resize(torch.from_numpy(np.ascontiguousarray(x)))
        out.append(TensorImageDataset(images, torch.from_numpy(np.asarray(y, dtype=np.int64))))
    return out[0], out[1], as_size(tuple(out[0].images.shape[-2:]))


def _batch_number(p: Path) -> int:
    m = re.search(r"(\d+)$", p.name)
    return int(m.group(1)) if m else 0


@register_dataset("cifar10")
def build_cifar10(request: DataRequest) -> DatasetSplits:
    """CIFAR-10 python batches; samples float32 ``(3, 32, 32)`` in [0, 1] (``(3, H, W)`` if resized).

    Uses every ``data_batch_*`` present for training and ``test_batch`` for testing (``split_seed`` and
    ``test_fraction`` are ignored). Class names come from ``batches.meta`` when present.
    """
    d = _cifar_dir(request.path("cifar10"), "cifar-10-batches-py")
    train_files = sorted(d.glob("data_batch_*"), key=_batch_number)
    if not train_files or not (d / "test_batch").is_file():
        raise FileNotFoundError(f"cifar10: expected data_batch_1..5 and test_batch in {d}")
    parts = [read_cifar_batch(p) for p in train_files]
    train = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    test = read_cifar_batch(d / "test_batch")
    names = _names(_unpickle(d / "batches.meta").get("label_names", [])) if (d / "batches.meta").is_file() else ()
    train_ds, test_ds, hw = _own_split(request, train, test)
    info = DatasetInfo("cifar10", 10, 3, hw, "image", class_names=names if len(names) == 10 else None)
    return train_ds, test_ds, info


@register_dataset("cifar100")
def build_cifar100(request: DataRequest, *, label_type: str = "fine") -> DatasetSplits:
    """CIFAR-100 python pickles ``train`` / ``test``; samples float32 ``(3, 32, 32)`` in [0, 1].

    ``label_type="fine"`` (100 classes, default) or ``"coarse"`` (20 super-classes). Uses the format's own
    split (``split_seed`` and ``test_fraction`` are ignored). Class names come from ``meta`` when present.
    """
    if label_type not in ("fine", "coarse"):
        raise ValueError(f"label_type must be 'fine' or 'coarse', got {label_type!r}")
    d = _cifar_dir(request.path("cifar100"), "cifar-100-python")
    if not (d / "train").is_file() or not (d / "test").is_file():
        raise FileNotFoundError(f"cifar100: expected files 'train' and 'test' in {d}")
    key = f"{label_type}_labels"
    train, test = read_cifar_batch(d / "train", key), read_cifar_batch(d / "test", key)
    num_classes = 100 if label_type == "fine" else 20
    names = _names(_unpickle(d / "meta").get(f"{label_type}_label_names", [])) if (d / "meta").is_file() else ()
    train_ds, test_ds, hw = _own_split(request, train, test)
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

    Raises:
        DataFileError: not an IDX file, a broken gzip stream, or a payload of the wrong length.
    """
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, ValueError) as e:  # BadGzipFile, zlib.error, truncated stream
            raise DataFileError(path, f"broken gzip stream ({type(e).__name__}: {e})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataFileError(path, "not an IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataFileError(path, f"IDX header of {ndim} dimensions is cut short")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    count = int(np.prod(dims, dtype=np.int64)) if ndim else 1
    if len(raw) - header != count * dtype.itemsize:
        raise DataFileError(path, f"header says {dims} of {dtype} but the payload has {len(raw) - header} bytes")
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
def build_mnist_idx(request: DataRequest, *, num_classes: Optional[int] = None) -> DatasetSplits:
    """The four MNIST IDX files; samples float32 ``(1, H, W)`` in [0, 1] (uint8 pixels / 255).

    Uses the format's own train (``train-*``) / test (``t10k-*``) split (``split_seed`` and
    ``test_fraction`` are ignored). ``num_classes`` defaults to the largest label + 1.
    """
    d = request.path("mnist-idx")
    parts = []
    for prefix in ("train", "t10k"):
        images = read_idx(_find_idx(d, prefix, "images", 3))
        labels = read_idx(_find_idx(d, prefix, "labels", 1))
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"mnist-idx: {prefix} images {images.shape} do not match labels {labels.shape}")
        parts.append((images[:, None], labels.astype(np.int64)))  # (N, 1, H, W), (N,)
    train, test, hw = _own_split(request, parts[0], parts[1])
    k = int(num_classes) if num_classes is not None else int(max(y.max(initial=-1) for _, y in parts)) + 1
    return train, test, DatasetInfo("mnist-idx", k, 1, hw, "image")
