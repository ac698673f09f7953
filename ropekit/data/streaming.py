"""Datasets that decode images as they are read, for data sets larger than memory (ImageNet-size folders and
WebDataset tar shards), and the loader that gives them a deterministic, resumable order.

This module holds the folder stream, the loader and :func:`open_stream`; the shard reader is
:mod:`ropekit.data.shard_stream`, image decoding :mod:`ropekit.data.decode`, the per-sample seeds and worker
errors :mod:`ropekit.data.worker` (the public names of the first two are re-exported here).

Shape legend: ``B`` batch size; ``C`` colour channels (3); ``H, W`` the transform's output size.

* :class:`ImageFolderStream` -- map-style over ``root/<class>/**/<image>``: construction lists file names only
  (class ``k`` is the ``k``-th class folder in sorted order), ``ds[i]`` opens, decodes and transforms one file (and,
  in an RGB-D folder, the depth map ``<stem>.depth.npy`` beside it).
* :class:`ShardStream` -- iterable over WebDataset tar shards (one sample = ``<key>.jpg`` (or ``.png``, ...)
  plus ``<key>.cls``, the label as decimal text), as ``ropekit data convert`` writes them, with the manifest
  ``shards.json`` (sample count per shard, class names) that gives the epoch its length.
* :func:`make_loader` -- ``(images, labels)`` batches of one epoch for one rank; :func:`open_stream` -- train and
  validation streams of a folder or shards with the standard transforms, and their :class:`DatasetInfo`.

Samples and batches
-------------------
A sample is ``(image, label)``: ``image`` whatever the transform returns -- with
:func:`ropekit.data.transforms.build_train_transform` float32 ``(C, H, W)`` normalised; without a transform
uint8 ``(3, H_in, W_in)`` -- and ``label`` an int64 scalar tensor. Batches are ``images (B, C, H, W)`` float32
and ``labels (B,)`` int64. Every image is decoded to an 8-bit RGB tensor, uint8 ``(3, H_in, W_in)``, which is
what the transform receives (:func:`decode_image`: JPEG by torchvision's decoder, other formats and modes
through Pillow, :func:`decode_rgb`).

Determinism
-----------
The batches of epoch ``e`` are a pure function of ``(seed, e, rank, world_size)`` for folder streams, and of
``(seed, e, rank, world_size, num_workers)`` for shards (each DataLoader worker reads its own shards; see
:class:`ShardStream`). That covers the augmentation too: each sample's transform runs under a torch seed derived
from ``(seed, e)`` and the sample's place in the epoch, so the same epoch gives the same pixels whatever the number
of workers and wherever a resumed run starts. ``make_loader(..., start_batch=k)`` yields exactly the batches
``k, k + 1, ...`` of that epoch without decoding the ones before (folder streams start their sampler at sample
``k * B``; shard readers skip the encoded bytes of the samples before theirs).

Bad data
--------
A file that cannot be decoded raises :class:`DataFileError`, one line naming it (and, in a shard, the sample
key), as does a shard sample without an image or label entry. With ``skip_corrupt=True`` such a sample is left
out of its batch instead (the batch is one smaller) and counted in :attr:`StreamLoader.skipped`, with a warning
at the end of the epoch. A missing shard, a truncated tar, or a shard whose sample count differs from the
manifest is always an error, as is a class folder without images.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from ._common import SKIP_HINT, DataFileError, DatasetInfo, PathLike, SizeLike, as_size, canonical_name, \
    stratified_split
from .decode import decode_image, decode_rgb, has_depth_beside, read_depth_beside
from .readers import IMAGE_EXTENSIONS
from .shard_stream import MANIFEST_NAME, EpochPlan, ShardStream, read_manifest
from .worker import WorkerFailure, collate_samples, failed_in_worker, mix_seed, sample_rng

__all__ = [
    "MANIFEST_NAME",
    "decode_rgb",
    "decode_image",
    "scan_image_folder",
    "ImageFolderStream",
    "ShardStream",
    "read_manifest",
    "StreamLoader",
    "make_loader",
    "folder_splits",
    "open_stream",
    "list_streams",
    "is_stream",
]


# ----------------------------------------------------------------------------------------------------------
# image folder
# ----------------------------------------------------------------------------------------------------------


def scan_image_folder(
    root: PathLike, *, classes: Optional[Sequence[str]] = None, allow_empty: bool = False
) -> Tuple[List[str], np.ndarray, List[str], int]:
    """List ``root/<class>/**/<image>`` without opening a file.

    Args:
        root: a directory with one sub-folder per class (hidden entries skipped).
        classes: the class names, in label order, to use instead of ``root``'s sorted folder names (a
            validation folder takes the training folder's); every folder of ``root`` must be one of them.
        allow_empty: accept class folders without images (by default one is an error naming it).

    Returns:
        ``(files, labels, classes, ignored)``: paths relative to ``root`` (sorted within each class), int64
        ``(N,)`` labels, the class names, and the number of non-image files passed over (by extension, see
        :data:`ropekit.data.readers.IMAGE_EXTENSIONS`).

    Raises:
        FileNotFoundError: ``root`` missing, no class folder, or no image at all.
        ValueError: an empty class folder (unless ``allow_empty``), or a folder not among ``classes``.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"image folder: no such directory: {root}")
    found = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not found:
        raise FileNotFoundError(f"image folder: no class sub-folders in {root}")
    names = list(classes) if classes is not None else found
    extra = sorted(set(found) - set(names))
    if extra:
        raise ValueError(f"image folder {root}: class folder(s) {', '.join(extra[:5])} not among the "
                         f"{len(names)} training classes")
    files: List[str] = []
    labels: List[int] = []
    ignored = 0
    empty = []
    exts = set(IMAGE_EXTENSIONS)
    for label, name in enumerate(names):
        if name not in found:
            continue
        mine = []
        for dirpath, dirnames, filenames in os.walk(root / name):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, root)
            for f in filenames:
                if f.startswith("."):
                    continue
                if os.path.splitext(f)[1].lower() in exts:
                    mine.append(os.path.join(rel, f))
                else:
                    ignored += 1
        if not mine:
            empty.append(name)
        mine.sort()
        files.extend(mine)
        labels.extend([label] * len(mine))
    if empty and not allow_empty:
        raise ValueError(f"image folder {root}: class folder(s) without images: {', '.join(empty[:5])}"
                         + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
                         + " (remove them, or pass allow_empty=True to keep their labels)")
    if not files:
        raise FileNotFoundError(f"image folder: no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")
    return files, np.asarray(labels, dtype=np.int64), names, ignored


def first_image_size(root: PathLike, tries: int = 8) -> Optional[Tuple[int, int]]:
    """``(H, W)`` of the first image of an image folder (sorted class folder, sorted file; under ``train/`` in the
    train/val layout) that Pillow can open, read from its header only; ``None`` when none of the first ``tries``
    files opens."""
    from PIL import Image

    base = Path(root).expanduser()
    if (base / "train").is_dir() and (base / "val").is_dir():
        base = base / "train"
    if not base.is_dir():
        return None
    seen = 0
    for folder in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for path in sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS):
            try:
                with Image.open(path) as img:
                    w, h = img.size
                return int(h), int(w)
            except Exception:  # noqa: BLE001 - a bad file is named when it is read; try the next one here
                seen += 1
                if seen >= tries:
                    return None
    return None


class ImageFolderStream(Dataset):
    """Map-style dataset over ``root/<class>/**/<image>``, decoding each image when it is indexed.

    Args:
        root: the folder (see :func:`scan_image_folder`; construction reads directory entries only).
        transform: callable uint8 ``(3, H_in, W_in)`` RGB tensor (:func:`decode_image`) → sample, e.g.
            :func:`ropekit.data.transforms.build_train_transform`; ``None`` gives that tensor.
        classes: class names in label order (default: the sorted folder names).
        skip_corrupt: return ``None`` for an undecodable file instead of raising (the loaders of this module
            leave it out of its batch and count it).
        allow_empty: accept class folders without images.
        files, labels: a ready list of paths relative to ``root`` and their int labels (skips the scan; used by
            :meth:`subset`).

    ``ds[i]`` returns ``(image, label)``, ``label`` an int64 scalar tensor; ``ds[(i, seed)]`` runs the
    transform under ``torch.manual_seed(seed)`` (how :func:`make_loader` makes augmentation reproducible).
    The paths are held in one numpy byte array, so DataLoader workers share them without copying.

    RGB-D folders: when the first image has its depth map beside it (``0001.png`` and ``0001.depth.npy``, a numeric
    ``(H, W)`` array of metres, 0 or NaN invalid; :attr:`depth`), every image needs one, and the transform receives
    ``(rgb, depth)``: uint8 ``(3, H, W)`` and float32 ``(1, H, W)`` (see
    :func:`ropekit.data.transforms.build_train_transform` with ``rgbd=True``). A missing or malformed depth map is a
    :class:`DataFileError` naming it, skipped like an unreadable image with ``skip_corrupt``.

    Attributes:
        classes: class names, label order. labels: int64 ``(N,)``. root: the folder. ignored: non-image files
        (depth maps included). depth: whether the images carry depth maps (RGB-D).
    """

    seeded_index = True  # understands ``ds[(i, seed)]``
    _defer_errors = False  # set by make_loader: in a worker, return a DataFileError for the main process to raise

    def __init__(
        self,
        root: PathLike,
        transform: Optional[Callable[[Any], Any]] = None,
        *,
        classes: Optional[Sequence[str]] = None,
        skip_corrupt: bool = False,
        allow_empty: bool = False,
        files: Optional[Sequence[str]] = None,
        labels: Optional[Sequence[int]] = None,
    ) -> None:
        self.root = Path(root).expanduser()
        self.transform = transform
        self.skip_corrupt = bool(skip_corrupt)
        self.ignored = 0
        if files is None:
            files, labels, classes, self.ignored = scan_image_folder(self.root, classes=classes,
                                                                     allow_empty=allow_empty)
        elif labels is None or len(labels) != len(files) or classes is None:
            raise ValueError("files needs labels of the same length and classes")
        self.classes: List[str] = list(classes)  # type: ignore[arg-type]
        self._files = np.asarray([os.fsencode(f) for f in files], dtype=bytes)  # (N,) fixed-width bytes
        self.labels = np.asarray(labels, dtype=np.int64)
        self.depth = bool(len(files)) and has_depth_beside(self.root / files[0])

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def path(self, index: int) -> Path:
        """The file of sample ``index``."""
        return self.root / os.fsdecode(self._files[index])

    def __getitem__(self, key: Union[int, Tuple[int, int]]) -> Optional[Tuple[Any, Tensor]]:
        index, seed = key if isinstance(key, tuple) else (key, None)
        try:
            img = decode_image(self.path(index))
            if self.depth:
                img = (img, self._depth(index, tuple(img.shape[-2:])))
        except DataFileError as e:
            if self.skip_corrupt:
                return None
            e = DataFileError(e.path, f"{e.reason}; {SKIP_HINT}")
            if self._defer_errors:
                return failed_in_worker(e)  # type: ignore[return-value]
            raise e from None
        with sample_rng(seed):
            image = self.transform(img) if self.transform is not None else img
        return image, torch.tensor(self.labels[index], dtype=torch.int64)

    def _depth(self, index: int, shape: Tuple[int, int]) -> Tensor:
        """Image ``index``'s depth map, float32 ``(1, H, W)``."""
        return read_depth_beside(self.path(index), shape)[1]

    def subset(self, indices: Sequence[int], transform: Optional[Callable[[Any], Any]] = None) -> "ImageFolderStream":
        """The samples ``indices`` (in that order) as a new stream, with ``transform`` (default: this one's)."""
        idx = np.asarray(indices, dtype=np.int64)
        return ImageFolderStream(self.root, transform if transform is not None else self.transform,
                                 classes=self.classes, skip_corrupt=self.skip_corrupt,
                                 files=[os.fsdecode(f) for f in self._files[idx]], labels=self.labels[idx])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r}, n={len(self)}, classes={len(self.classes)})"


# ----------------------------------------------------------------------------------------------------------
# loader
# ----------------------------------------------------------------------------------------------------------


class _EpochSampler(Sampler):
    """Sample keys of one epoch of one rank: a permutation seeded by ``(seed, epoch)``, sliced per rank, from
    sample ``start_batch * batch_size`` on; keys are ``(index, sample seed)`` for seeded datasets."""

    def __init__(self, n: int, *, seeded: bool, seed: int, world_size: int, rank: int, shuffle: bool,
                 drop_last: bool) -> None:
        self.n, self.seeded, self.seed, self.world_size, self.rank = n, seeded, seed, world_size, rank
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.start = 0, 0

    def indices(self) -> np.ndarray:
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n) if self.shuffle \
            else np.arange(self.n)
        if self.drop_last:
            perm = perm[: (self.n // self.world_size) * self.world_size]
        return perm[self.rank::self.world_size]

    def __len__(self) -> int:
        return max(0, len(self.indices()) - self.start)

    def __iter__(self) -> Iterator[Any]:
        idx = self.indices()
        if not self.seeded:
            return iter(idx[self.start:].tolist())
        seeds = np.random.default_rng([self.seed, self.epoch, self.rank, self.world_size, 11]).integers(
            0, 2 ** 62, size=len(idx))
        return iter(zip(idx[self.start:].tolist(), seeds[self.start:].tolist()))


class StreamLoader:
    """The batches of one epoch of one rank: iterate for ``(images, labels)``; made by :func:`make_loader`.

    ``len(loader)`` is the number of batches in the whole epoch for this rank (the same on every rank with
    ``drop_last=True``); iterating yields batches ``start_batch, ..., len(loader) - 1``. ``set_epoch(e,
    start_batch=0)`` moves to another epoch: a folder stream keeps its DataLoader (and its persistent workers,
    as the order is drawn in the main process); a shard stream makes a new one (its readers' assignment is
    fixed when the workers start), so persistent workers last one epoch there.

    Attributes:
        skipped: samples left out as unreadable (``skip_corrupt=True``) in the current epoch so far.
        epoch, start_batch: where the next iteration starts.
        warn: warn with the count at the end of an epoch that skipped samples (a caller that reports the count
            itself sets it ``False``).
    """

    warn = True

    def __init__(self, dataset: Any, kw: Dict[str, Any], loader_kw: Dict[str, Any]) -> None:
        self.dataset = dataset
        self._kw = kw
        self._loader_kw = loader_kw
        self.epoch = int(kw["epoch"])
        self.start_batch = int(kw["start_batch"])
        self.skipped = 0
        self._shards = isinstance(dataset, ShardStream)
        self._loader: Optional[DataLoader] = None
        self._plan: Optional[EpochPlan] = None
        if not self._shards:
            self._sampler = _EpochSampler(len(dataset), seeded=bool(getattr(dataset, "seeded_index", False)),
                                          seed=kw["seed"], world_size=kw["world_size"], rank=kw["rank"],
                                          shuffle=kw["shuffle"], drop_last=kw["drop_last"])
        self.set_epoch(self.epoch, self.start_batch)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> "StreamLoader":
        """Point the loader at batch ``start_batch`` of epoch ``epoch``; returns itself."""
        if start_batch < 0:
            raise ValueError(f"start_batch must be >= 0, got {start_batch}")
        self.epoch, self.start_batch = int(epoch), int(start_batch)
        kw = self._kw
        gen = torch.Generator().manual_seed(mix_seed(kw["seed"], epoch, kw["rank"], 3))  # workers' base seed
        if self._shards:
            self._plan = self.dataset.configure(
                seed=kw["seed"], epoch=self.epoch, rank=kw["rank"], world_size=kw["world_size"],
                workers=self._loader_kw["num_workers"], batch_size=kw["batch_size"], drop_last=kw["drop_last"],
                shuffle=kw["shuffle"], start_batch=self.start_batch)
            self._loader = DataLoader(self.dataset, batch_size=None, generator=gen, **self._loader_kw)
        else:
            self._sampler.epoch, self._sampler.start = self.epoch, self.start_batch * kw["batch_size"]
            if self._loader is None:
                self._loader = DataLoader(self.dataset, batch_size=kw["batch_size"], sampler=self._sampler,
                                          drop_last=kw["drop_last"], collate_fn=collate_samples, generator=gen,
                                          **self._loader_kw)
        return self

    def __len__(self) -> int:
        if self._shards:
            return len(self._plan.order)  # type: ignore[union-attr]
        n = len(self._sampler.indices())
        b = self._kw["batch_size"]
        return n // b if self._kw["drop_last"] else -(-n // b)

    def _raw(self) -> Iterator[Tuple[Any, Any, int, Optional[WorkerFailure]]]:
        if not self._shards:
            yield from self._loader  # type: ignore[misc]
            return
        # readers' batches arrive round robin from the workers that still have some; put them in plan order
        order = self._plan.order[self.start_batch:]  # type: ignore[union-attr]
        pending: Dict[Tuple[int, int], Any] = {}
        k = 0
        for w, j, batch in self._loader:  # type: ignore[union-attr]
            if batch[3] is not None:
                raise batch[3].error
            pending[(w, j)] = batch
            while k < len(order) and order[k] in pending:
                yield pending.pop(order[k])
                k += 1
        if k < len(order):
            raise RuntimeError(f"shard readers ended after {self.start_batch + k} of {len(self)} batches")

    def __iter__(self) -> Iterator[Tuple[Any, Tensor]]:
        self.skipped = 0
        for images, labels, skipped, failure in self._raw():
            if failure is not None:
                raise failure.error
            self.skipped += skipped
            if images is not None:
                yield images, labels
        if self.skipped and self.warn:
            warnings.warn(f"skipped {self.skipped} unreadable sample(s) in epoch {self.epoch} "
                          f"(skip_corrupt=True)", stacklevel=2)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.dataset!r}, epoch={self.epoch}, start_batch={self.start_batch}, "
                f"batches={len(self)})")


def make_loader(
    dataset: Any,
    *,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    start_batch: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: Optional[int] = None,
    drop_last: bool = True,
    shuffle: bool = True,
) -> StreamLoader:
    """The ``(images, labels)`` batches of epoch ``epoch`` for rank ``rank`` of ``world_size``.

    Args:
        dataset: an :class:`ImageFolderStream`, a :class:`ShardStream`, or any map-style dataset of
            ``(image, label)`` (e.g. a :class:`ropekit.data.TensorImageDataset`).
        batch_size: ``B``, per rank.
        seed, epoch: the order (and each sample's augmentation seed) of the epoch.
        rank, world_size: this process's share: map-style data takes every ``world_size``-th sample of the
            epoch's permutation (like ``DistributedSampler``); shards, every ``world_size``-th shard.
        start_batch: first batch to yield (resuming mid-epoch); the batches before it are not decoded.
        num_workers, pin_memory, persistent_workers, prefetch_factor: passed to ``torch.utils.data.DataLoader``.
        drop_last: drop incomplete batches and equalise ranks (training); ``False`` keeps every sample once
            over the ranks (evaluation), ranks then may differ by a batch.
        shuffle: permute the order per epoch (``False`` for evaluation).

    Returns:
        a :class:`StreamLoader`: iterable of ``images`` (B, ...) and ``labels`` (B,) int64; ``len`` = batches
        per epoch for this rank.

    Raises:
        ValueError: bad sizes or ranks, or fewer samples than one batch per rank with ``drop_last``.
    """
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size or num_workers < 0:
        raise ValueError(f"need batch_size >= 1, 0 <= rank < world_size, num_workers >= 0; got batch_size="
                         f"{batch_size}, rank={rank}, world_size={world_size}, num_workers={num_workers}")
    kw = dict(seed=int(seed), epoch=int(epoch), rank=int(rank), world_size=int(world_size),
              start_batch=int(start_batch), batch_size=int(batch_size), drop_last=bool(drop_last),
              shuffle=bool(shuffle))
    loader_kw: Dict[str, Any] = dict(num_workers=int(num_workers), pin_memory=bool(pin_memory))
    if num_workers > 0:
        loader_kw["persistent_workers"] = bool(persistent_workers)
        if prefetch_factor is not None:
            loader_kw["prefetch_factor"] = int(prefetch_factor)
    if isinstance(dataset, ImageFolderStream) and num_workers > 0:
        dataset = copy.copy(dataset)  # shares the file list; the caller's dataset keeps raising
        dataset._defer_errors = True
    loader = StreamLoader(dataset, kw, loader_kw)
    if drop_last and len(loader) == 0:
        what = f"{len(dataset)} images of {dataset.root}" if isinstance(dataset, ImageFolderStream) else repr(dataset)
        raise ValueError(f"{what} give no full batch of {batch_size} per rank (world_size {world_size}"
                         + (f", {num_workers} workers reading whole shards" if isinstance(dataset, ShardStream)
                            else "") + "): lower the batch size")
    return loader


# ----------------------------------------------------------------------------------------------------------
# open a stream by name
# ----------------------------------------------------------------------------------------------------------

_STREAMS = {"folder-stream": "folder-stream", "imagefolder-stream": "folder-stream", "imagefolder":
            "folder-stream", "shards": "shards", "wds": "shards"}


def list_streams() -> List[str]:
    """The names :func:`open_stream` accepts (canonical ones first)."""
    return ["folder-stream", "shards"]


def is_stream(name: str) -> bool:
    """Whether ``name`` is a streaming data set (``folder-stream``, ``shards``) rather than one of
    :func:`ropekit.data.list_datasets` held in memory (``imagefolder`` is the in-memory one here)."""
    return canonical_name(name) in ("folder-stream", "imagefolder-stream", "shards", "wds")


def folder_splits(root: PathLike, *, test_fraction: float = 0.2, split_seed: int = 0,
                  skip_corrupt: bool = False) -> Tuple[ImageFolderStream, ImageFolderStream]:
    """The training and validation images of a folder, without transforms: ``root/train`` and ``root/val`` as they
    are (the ImageNet layout), or a flat ``root/<class>/<image>`` split stratified by ``split_seed`` with
    ``test_fraction`` of each class held out (:func:`ropekit.data.stratified_split`). Every reader of a folder
    (fixed-size, native resolution, evaluation) holds out the same images."""
    root = Path(root).expanduser()
    if (root / "train").is_dir() and (root / "val").is_dir():
        train = ImageFolderStream(root / "train", skip_corrupt=skip_corrupt)
        return train, ImageFolderStream(root / "val", classes=train.classes, skip_corrupt=skip_corrupt,
                                        allow_empty=True)
    full = ImageFolderStream(root, None, skip_corrupt=skip_corrupt)
    tr, te = stratified_split(full.labels, test_fraction, split_seed)
    return full.subset(np.sort(tr)), full.subset(np.sort(te))


def open_stream(
    name: str,
    root: PathLike,
    *,
    image_size: SizeLike = 224,
    split_seed: int = 0,
    test_fraction: float = 0.2,
    auto_augment: Optional[str] = None,
    random_erasing: float = 0.0,
    scale: Tuple[float, float] = (0.08, 1.0),
    ratio: Tuple[float, float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    interpolation: str = "bicubic",
    crop_pct: float = 0.875,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    train_transform: Optional[Callable[[Any], Any]] = None,
    eval_transform: Optional[Callable[[Any], Any]] = None,
    skip_corrupt: bool = False,
    shuffle_buffer: int = 1000,
) -> Tuple[Any, Any, DatasetInfo]:
    """Train and validation streams of real images, with the ImageNet transforms: ``(train, val, info)``.

    Args:
        name: ``"folder-stream"`` (alias ``"imagefolder"``): a folder ``root/<class>/<image>`` split
            stratified by ``split_seed`` / ``test_fraction``, or ``root/train/<class>/...`` with
            ``root/val/<class>/...`` (the ImageNet layout), used as they are. ``"shards"``: a directory
            with ``shards.json`` and its ``train`` and ``val`` splits (``ropekit data convert`` writes them).
        root: the folder or shard directory.
        image_size: ``(H, W)`` or an int; the transforms' output size.
        auto_augment, random_erasing, scale, ratio, hflip, interpolation: of
            :func:`ropekit.data.transforms.build_train_transform`; crop_pct of the evaluation transform.
        mean, std: normalisation (default ImageNet's); recorded in ``info``.
        train_transform, eval_transform: replace the built transforms; they receive uint8 ``(3, H_in, W_in)``
            RGB tensors (then ``info.mean`` / ``std`` are those given, or ``None``).
        skip_corrupt: leave unreadable samples out of their batches (counted) instead of raising.
        shuffle_buffer: of the shard readers.

    Returns:
        ``(train, val, info)``: two streams for :func:`make_loader` (:class:`ImageFolderStream` or
        :class:`ShardStream`) and a :class:`ropekit.data.DatasetInfo` (``kind="image"``, ``in_chans=3``,
        ``image_size``, ``class_names``). RGB-D shards (samples with ``depth.npy``) give ``kind="rgbd"``: the
        transforms are built with ``rgbd=True`` (depth cropped, resized with nearest and flipped with its image,
        left in metres) and samples are float32 ``(4, H, W)``, RGB then depth, as the in-memory RGB-D data sets
        give them; ``train_transform`` / ``eval_transform`` then receive ``(rgb, depth)``. So does an RGB-D folder
        (each image with ``<stem>.depth.npy`` beside it, see :class:`ImageFolderStream`).

    Raises:
        ValueError: unknown name, bad option, or fewer than two classes. FileNotFoundError, DataFileError: as
        the streams raise them.
    """
    from .transforms import IMAGENET_MEAN, IMAGENET_STD, build_eval_transform, build_train_transform

    key = _STREAMS.get(canonical_name(name))
    if key is None:
        raise ValueError(f"unknown stream {name!r}; known streams: {', '.join(list_streams())}")
    hw = as_size(image_size)
    root_p = Path(root).expanduser()
    if key == "shards":  # the streams first, without transforms: whether they carry depth decides the transforms
        train: Any = ShardStream(root_p, split="train", shuffle_buffer=shuffle_buffer, skip_corrupt=skip_corrupt)
        val: Any = ShardStream(root_p, split="val", skip_corrupt=skip_corrupt)
        classes = train.classes or []
        num_classes = len(classes) if classes else None
    else:
        train, val = folder_splits(root_p, test_fraction=test_fraction, split_seed=split_seed,
                                   skip_corrupt=skip_corrupt)
        classes, num_classes = train.classes, len(train.classes)
    rgbd = bool(train.depth)
    if len(val) and bool(val.depth) != rgbd:
        raise ValueError(f"{root_p}: the training images {'have' if rgbd else 'have no'} depth maps, the validation "
                         f"images {'have' if val.depth else 'have none'}")
    given = mean is not None or std is not None
    own = train_transform is None and eval_transform is None  # info records the statistics of our transforms
    m = tuple(mean) if mean is not None else IMAGENET_MEAN
    s = tuple(std) if std is not None else IMAGENET_STD
    if train_transform is None:
        train_transform = build_train_transform(hw, scale=scale, ratio=ratio, hflip=hflip, auto_augment=auto_augment,
                                                random_erasing=random_erasing, mean=m, std=s,
                                                interpolation=interpolation, rgbd=rgbd)
    if eval_transform is None:
        eval_transform = build_eval_transform(hw, crop_pct=crop_pct, mean=m, std=s, interpolation=interpolation,
                                              rgbd=rgbd)
    train.transform, val.transform = train_transform, eval_transform
    if num_classes is None:
        raise ValueError(f"shards {root_p}: the manifest names no classes")
    if num_classes < 2:
        raise ValueError(f"{canonical_name(name)} {root_p} has {num_classes} class; classification needs at least 2 "
                         f"classes, one sub-folder of images each")
    stats = own or given
    info = DatasetInfo(key, num_classes, 3, hw, "rgbd" if rgbd else "image", class_names=tuple(classes),
                       mean=m if stats else None, std=s if stats else None)
    return train, val, info
