"""The common representation every ropekit dataset uses, and the helpers its builders share.

Shape legend
------------
``N``  samples; ``C``  colour channels (``DatasetInfo.in_chans``); ``T``  frames (video only);
``H, W``  height and width in pixels.

A sample is ``(image, label)``:

* ``kind="image"`` — ``image`` float32 ``(C, H, W)`` with values in [0, 1];
* ``kind="video"`` — ``image`` float32 ``(C, T, H, W)`` with values in [0, 1];
* ``kind="rgbd"``  — ``image`` float32 ``(C + 1, H, W)``: channels ``0..C-1`` colour in [0, 1], the last
  channel metric depth (metres, *not* normalised; ``0`` or NaN marks an invalid pixel);

``label`` is an int64 scalar tensor. With ``load_dataset(..., normalize=True)`` the colour channels (never
the depth channel) are standardised with the training set's per-channel mean and std instead, and those
statistics are recorded in :class:`DatasetInfo`.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

__all__ = [
    "DatasetInfo",
    "DataRequest",
    "DataFileError",
    "TensorImageDataset",
    "stratified_split",
    "resize_images",
    "register_dataset",
    "list_datasets",
    "DATASET_KINDS",
]

DATASET_KINDS = ("image", "video", "rgbd")

SizeLike = Union[int, Sequence[int]]
PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class DatasetInfo:
    """What a model builder needs to know about a dataset.

    Attributes:
        name: canonical dataset name (as passed to :func:`ropekit.data.load_dataset`).
        num_classes: number of classes; labels lie in ``[0, num_classes)``.
        in_chans: number of *colour* channels ``C``. For ``kind="rgbd"`` every sample has one more
            channel, the last, which is metric depth (see :attr:`sample_shape`).
        image_size: ``(H, W)`` of an image or of a video frame.
        kind: ``"image"``, ``"video"`` (samples ``(C, T, H, W)``) or ``"rgbd"`` (samples ``(C + 1, H, W)``).
        num_frames: ``T`` for ``kind="video"``, else ``None``.
        class_names: one name per class, when the format provides them.
        mean, std: per-colour-channel statistics of the training set that were used to standardise the
            images (``normalize=True``), else ``None`` (images are in [0, 1]).
    """

    name: str
    num_classes: int
    in_chans: int
    image_size: Tuple[int, int]
    kind: str = "image"
    num_frames: Optional[int] = None
    class_names: Optional[Tuple[str, ...]] = None
    mean: Optional[Tuple[float, ...]] = None
    std: Optional[Tuple[float, ...]] = None

    def __post_init__(self) -> None:
        if self.kind not in DATASET_KINDS:
            raise ValueError(f"kind must be one of {DATASET_KINDS}, got {self.kind!r}")
        if self.kind == "video" and self.num_frames is None:
            raise ValueError("a video dataset needs num_frames")

    @property
    def sample_shape(self) -> Tuple[int, ...]:
        """Shape of one ``image`` tensor: ``(C, H, W)``, ``(C, T, H, W)`` or ``(C + 1, H, W)`` for RGB-D."""
        h, w = self.image_size
        if self.kind == "video":
            return (self.in_chans, int(self.num_frames), h, w)  # type: ignore[arg-type]
        if self.kind == "rgbd":
            return (self.in_chans + 1, h, w)
        return (self.in_chans, h, w)


class TensorImageDataset(Dataset):
    """A map-style dataset over in-memory tensors (like ``TensorDataset``, with named fields).

    Args:
        images: float32 ``(N, C, H, W)``, ``(N, C, T, H, W)`` or ``(N, C + 1, H, W)`` (RGB-D).
        labels: int64 ``(N,)``.
        transform: optional callable applied to each ``image`` in ``__getitem__`` (e.g. augmentation).

    ``ds[i]`` returns ``(images[i], labels[i])``: a float32 tensor and an int64 scalar tensor, so the
    default ``DataLoader`` collate gives batches ``(B, ...)`` float32 and ``(B,)`` int64.
    """

    def __init__(self, images: Tensor, labels: Tensor, transform: Optional[Callable[[Tensor], Tensor]] = None):
        if images.ndim < 3:
            raise ValueError(f"images must be (N, C, ...) with at least 3 dims, got shape {tuple(images.shape)}")
        if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
            raise ValueError(f"labels must be (N,) with N={images.shape[0]}, got shape {tuple(labels.shape)}")
        self.images = images.float()
        self.labels = labels.long()
        self.transform = transform

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> Tuple[Tensor, Tensor]:
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[index]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={len(self)}, sample_shape={tuple(self.images.shape[1:])})"


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


def as_size(size: SizeLike) -> Tuple[int, int]:
    """``32`` or ``(32, 48)`` → ``(H, W)`` as a tuple of two positive ints."""
    if isinstance(size, (int, np.integer)):
        h = w = int(size)
    else:
        hw = tuple(int(s) for s in size)
        if len(hw) != 2:
            raise ValueError(f"image_size must be an int or (H, W), got {size!r}")
        h, w = hw
    if h <= 0 or w <= 0:
        raise ValueError(f"image_size must be positive, got {size!r}")
    return h, w


def stratified_split(
    labels: Union[np.ndarray, Tensor, Sequence[int]], test_fraction: float = 0.2, seed: int = 0
) -> Tuple[np.ndarray, np.ndarray]:
    """Seeded, stratified, shuffled train/test split of sample indices.

    Each class contributes ``round(n_c * test_fraction)`` of its ``n_c`` samples to the test set (clipped so
    that a class with at least two samples has at least one in each split; a single-sample class goes to
    train). Both index arrays are then shuffled, so neither is sorted by label.

    Args:
        labels: ``(N,)`` integer labels.
        test_fraction: in ``(0, 1)``.
        seed: the same seed always gives the same split.

    Returns:
        ``(train_idx, test_idx)``: int64 arrays, disjoint, together a permutation of ``arange(N)``.
    """
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    y = labels.cpu().numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    rng = np.random.default_rng(seed)
    train_parts: List[np.ndarray] = []
    test_parts: List[np.ndarray] = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n = idx.size
        n_test = int(np.floor(n * test_fraction + 0.5))
        if n >= 2:
            n_test = min(max(n_test, 1), n - 1)
        else:
            n_test = 0
        test_parts.append(idx[:n_test])
        train_parts.append(idx[n_test:])
    train_idx = rng.permutation(np.concatenate(train_parts)).astype(np.int64)
    test_idx = rng.permutation(np.concatenate(test_parts)).astype(np.int64)
    return train_idx, test_idx


def resize_images(images: Tensor, size: Optional[SizeLike]) -> Tensor:
    """Bilinear resize of a batch of images, antialiased when shrinking.

    Args:
        images: float ``(N, C, H, W)``.
        size: target ``(H', W')`` (or an int for a square); ``None`` or the current size is a no-op.

    Returns:
        float ``(N, C, H', W')``, clamped to the input's value range (bilinear never overshoots, the
        antialiasing filter may by rounding error).
    """
    if size is None:
        return images
    hw = as_size(size)
    if tuple(images.shape[-2:]) == hw:
        return images
    shrinking = hw[0] < images.shape[-2] or hw[1] < images.shape[-1]
    out = F.interpolate(images, size=hw, mode="bilinear", align_corners=False, antialias=shrinking)
    return out.clamp_(float(images.min()), float(images.max())) if images.numel() else out


def split_tensors(
    images: Tensor, labels: Tensor, test_fraction: float, seed: int
) -> Tuple[TensorImageDataset, TensorImageDataset]:
    """Stratified split (see :func:`stratified_split`) of ``images (N, ...)`` / ``labels (N,)`` into datasets."""
    train_idx, test_idx = stratified_split(labels, test_fraction, seed)
    tr, te = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    return TensorImageDataset(images[tr], labels[tr]), TensorImageDataset(images[te], labels[te])


def require_path(root: Optional[PathLike], name: str) -> Path:
    """The user's ``root`` as a ``Path``; ``ValueError`` if not given, ``FileNotFoundError`` if absent."""
    if root is None:
        raise ValueError(f"dataset {name!r} reads user data: pass root=<path>")
    path = Path(root).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{name}: no such file or directory: {path}")
    return path


class DataFileError(ValueError):
    """A file of the user's data cannot be read (corrupt, truncated, of another format, or unsafe).

    The message is one line that starts with the file's path; ``path`` holds it too. A ``ValueError``, so the
    command line reports it as a user error (one line, exit code 2).
    """

    def __init__(self, path: PathLike, reason: str) -> None:
        self.path = Path(path)
        self.reason = " ".join(str(reason).split())  # one line, whatever the underlying library said
        super().__init__(f"{self.path}: {self.reason}")

    def __reduce__(self) -> Tuple[Any, ...]:  # picklable (e.g. raised in a DataLoader worker)
        return type(self), (self.path, self.reason)


#: What an error about an unreadable image adds, on every data path (in memory, streamed, shards).
SKIP_HINT = "to skip unreadable images pass skip_corrupt=True (command line: --data-opt skip_corrupt=true)"


@dataclass(frozen=True)
class DataRequest:
    """What :func:`ropekit.data.load_dataset` asks of every dataset builder: where the user's data is, the
    image size, and how to split.

    Attributes:
        root: path of user data, or ``None`` (builders of packaged or generated data may accept it as an
            optional replacement source).
        image_size: ``(H, W)`` or an int: real images are resized to it, generated ones made at it;
            ``None`` keeps the dataset's own size.
        split_seed: seed of the stratified train/test split (and the default seed of generated data).
        test_fraction: fraction of each class put in the test set by the stratified split; formats with a
            split of their own ignore it.
    """

    root: Optional[PathLike] = None
    image_size: Optional[SizeLike] = None
    split_seed: int = 0
    test_fraction: float = 0.2

    def path(self, name: str) -> Path:
        """``root`` as an existing ``Path``; ``ValueError`` if not given, ``FileNotFoundError`` if absent."""
        return require_path(self.root, name)

    def resize(self, images: Tensor) -> Tensor:
        """:func:`resize_images` of float ``(N, C, H, W)`` to ``image_size`` (a no-op when ``None``)."""
        return resize_images(images, self.image_size)

    def split(self, images: Tensor, labels: Tensor) -> Tuple["TensorImageDataset", "TensorImageDataset"]:
        """The stratified train/test split of ``images (N, ...)`` / ``labels (N,)`` (see :func:`split_tensors`)."""
        return split_tensors(images, labels, self.test_fraction, self.split_seed)


# ----------------------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------------------

#: What a builder returns: ``(train_ds, test_ds, info)``.
DatasetSplits = Tuple[TensorImageDataset, TensorImageDataset, DatasetInfo]
#: ``fn(request: DataRequest, **options) -> DatasetSplits``.
DatasetBuilder = Callable[..., DatasetSplits]
_REGISTRY: Dict[str, DatasetBuilder] = {}


def canonical_name(name: str) -> str:
    """Lower-case, ``_`` → ``-`` (so ``"Moving_Digits"`` names ``"moving-digits"``)."""
    return str(name).strip().lower().replace("_", "-")


def register_dataset(name: str) -> Callable[[DatasetBuilder], DatasetBuilder]:
    """Decorator registering a builder under ``name``.

    The builder is called as ``fn(request, **options)``: ``request`` a :class:`DataRequest` (root, image size,
    split), ``options`` the dataset's own keyword options (declared as keyword parameters, so that
    :func:`ropekit.data.load_dataset` can name the accepted ones when given another); it returns
    ``(train_ds, test_ds, info)``.
    """

    def deco(fn: DatasetBuilder) -> DatasetBuilder:
        key = canonical_name(name)
        if key in _REGISTRY and _REGISTRY[key] is not fn:
            raise ValueError(f"dataset {key!r} is already registered")
        _REGISTRY[key] = fn
        return fn

    return deco


def list_datasets() -> List[str]:
    """Names accepted by :func:`ropekit.data.load_dataset`, sorted."""
    return sorted(_REGISTRY)


def get_builder(name: str) -> DatasetBuilder:
    """The builder registered as ``name``; ``ValueError`` listing the known names if there is none."""
    key = canonical_name(name)
    if key not in _REGISTRY:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(list_datasets())}")
    return _REGISTRY[key]


def check_options(name: str, builder: DatasetBuilder, options: Mapping[str, Any]) -> None:
    """``ValueError`` naming the options ``builder`` accepts if ``options`` holds another one.

    A builder with a ``**kwargs`` parameter accepts anything (it checks for itself).
    """
    params = list(inspect.signature(builder).parameters.values())[1:]  # after the request
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    known = [p.name for p in params if p.kind in named]
    unknown = sorted(set(options) - set(known))
    if unknown:
        accepted = ", ".join(known) if known else "none"
        raise ValueError(f"dataset {canonical_name(name)!r} has no option {', '.join(unknown)} "
                         f"(its options: {accepted})")
