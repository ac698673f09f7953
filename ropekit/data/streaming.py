"""Datasets that decode images as they are read, for data sets larger than memory (ImageNet-size folders and
WebDataset tar shards), and the loader that gives them a deterministic, resumable order.

Shape legend: ``B`` batch size; ``C`` colour channels (3); ``H, W`` the transform's output size.

* :class:`ImageFolderStream` -- map-style over ``root/<class>/**/<image>``: construction lists file names only
  (class ``k`` is the ``k``-th class folder in sorted order), ``ds[i]`` opens, decodes and transforms one file.
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

import contextlib
import copy
import functools
import io
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info
from torch.utils.data import default_collate

from ._common import SKIP_HINT, DataFileError, DatasetInfo, PathLike, SizeLike, as_size, canonical_name, \
    stratified_split
from .readers import IMAGE_EXTENSIONS

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
    "open_stream",
    "list_streams",
    "is_stream",
]

#: The manifest ``ropekit data convert`` writes beside the shards.
MANIFEST_NAME = "shards.json"
#: Sample keys that hold an encoded image in a shard (the file extension WebDataset writes).
IMAGE_KEYS = tuple(e.lstrip(".") for e in IMAGE_EXTENSIONS)
_WIDE = {"I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I;16N": 65535.0, "I": 65535.0, "F": 1.0}


# ----------------------------------------------------------------------------------------------------------
# decoding
# ----------------------------------------------------------------------------------------------------------


def decode_rgb(source: Union[PathLike, bytes], name: Optional[str] = None) -> Any:
    """Open and decode one image into an 8-bit RGB ``PIL.Image``.

    Conversions: ``L`` / ``1`` / ``P`` / ``CMYK`` / ``YCbCr`` / ... by Pillow's ``convert("RGB")``; images with
    alpha (``RGBA``, ``LA``, ``P`` with transparency) drop the alpha channel and keep their colours (as
    torchvision's ``ImageFolder`` does); 16-bit and 32-bit integer greyscale (``I;16*``, ``I``) are scaled by
    255 / 65535 (rounded, values above 65535 clip), float greyscale (``F``) taken as [0, 1]: scaled, not clipped
    to 255.

    Args:
        source: a file path, or the encoded bytes (then ``name`` names them in errors).
        name: what to call the image in an error message (default: the path).

    Raises:
        DataFileError: not an image Pillow can decode (corrupt, truncated, another format), one line naming it.
    """
    from PIL import Image

    label = name if name is not None else str(source)
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as img:
            img.load()  # decode now: a truncated file fails here
            if img.mode in _WIDE:
                arr = np.asarray(img, dtype=np.float64) * (255.0 / _WIDE[img.mode])
                return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L").convert("RGB")
            if img.mode == "P" and "transparency" in img.info:
                img = img.convert("RGBA")
            return img.convert("RGB")
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, ValueError, ... on bad files
        raise DataFileError(label, f"not a readable image ({type(e).__name__}: {_without_reprs(e)})") from e


_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _without_reprs(e: BaseException) -> str:
    """``e``'s message without object reprs (Pillow names the in-memory buffer it read: ``<_io.BytesIO object at
    0x7f...>``; the file is named by the error itself)."""
    return _OBJECT_REPR.sub("", str(e)).strip() or type(e).__name__


def _to_tensor(img: Any) -> Tensor:
    """PIL RGB → uint8 ``(3, H, W)``."""
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()


_JPEG_MAGIC = b"\xff\xd8\xff"


def decode_image(source: Union[PathLike, bytes], name: Optional[str] = None) -> Tensor:
    """Decode one image into uint8 ``(3, H, W)`` RGB: what the streams hand their transform.

    JPEG files are decoded by ``torchvision.io.decode_jpeg`` straight into a tensor (libjpeg-turbo, the same
    pixels as Pillow's, without Pillow's copies: about 40 % less time on a 256² JPEG) where torchvision still
    has it; everything else, and a JPEG that it refuses, goes through :func:`decode_rgb` (whose conversions and
    errors apply).

    Raises:
        DataFileError: not a decodable image, one line naming it.
    """
    label = name if name is not None else str(source)
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        try:
            data = Path(source).read_bytes()
        except OSError as e:
            raise DataFileError(label, f"cannot be read ({type(e).__name__}: {e})") from None
    decoder = _jpeg_decoder() if data[:3] == _JPEG_MAGIC else None
    if decoder is not None:
        try:
            return decoder(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        except RuntimeError:
            pass  # Pillow decodes it or names the problem
    return _to_tensor(decode_rgb(data, name=label))


@functools.lru_cache(maxsize=None)
def _jpeg_decoder() -> Optional[Callable[[Tensor], Tensor]]:
    """torchvision's JPEG decoding operator (to RGB, no EXIF rotation, as Pillow's default), or ``None`` where
    it is missing. Called as the operator that ``torchvision.io.decode_jpeg`` wraps: the wrapper warns on every
    call that torchvision 0.29 deprecates its image codecs in favour of TorchCodec; when they are gone, Pillow
    decodes JPEGs too."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from torchvision.io import image as tv_image

            if not tv_image._has_image_ops():
                return None
            op = torch.ops.image.decode_jpeg
            rgb = int(tv_image.ImageReadMode.RGB.value)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return lambda data: op(data, rgb, False)


class _Failure:
    """A :class:`DataFileError` raised in a DataLoader worker, carried to the main process as a value.

    DataLoader re-raises a worker's exception as a ``RuntimeError`` holding the worker's traceback, which would
    turn the one-line error into many; the loaders of this module raise the original instead.
    """

    def __init__(self, error: DataFileError) -> None:
        self.error = error


def _failed(error: DataFileError) -> "_Failure":
    """``error`` as a value in a worker of :func:`make_loader` (the caller raises it otherwise)."""
    if get_worker_info() is None:
        raise error
    return _Failure(error)


def _seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (numpy's SeedSequence: stable across versions and platforms)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(1, np.uint64)[0]
               >> np.uint64(1))


@contextlib.contextmanager
def _sample_rng(seed: Optional[int]) -> Iterator[None]:
    """Run a transform under torch CPU seed ``seed``; in the main process the caller's RNG state is restored.

    Seeds the CPU generator only (``torch.manual_seed`` also queues seeds for every accelerator, with a stack
    trace each: about 30 times slower, for generators the CPU transforms never draw from).
    """
    if seed is None:
        yield
        return
    if get_worker_info() is None:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
    else:
        torch.default_generator.manual_seed(seed)
        yield


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

    Attributes:
        classes: class names, label order. labels: int64 ``(N,)``. root: the folder. ignored: non-image files.
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

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def path(self, index: int) -> Path:
        """The file of sample ``index``."""
        return self.root / os.fsdecode(self._files[index])

    def __getitem__(self, key: Union[int, Tuple[int, int]]) -> Optional[Tuple[Any, Tensor]]:
        index, seed = key if isinstance(key, tuple) else (key, None)
        try:
            img = decode_image(self.path(index))
        except DataFileError as e:
            if self.skip_corrupt:
                return None
            e = DataFileError(e.path, f"{e.reason}; {SKIP_HINT}")
            if self._defer_errors:
                return _failed(e)  # type: ignore[return-value]
            raise e from None
        with _sample_rng(seed):
            image = self.transform(img) if self.transform is not None else img
        return image, torch.tensor(self.labels[index], dtype=torch.int64)

    def subset(self, indices: Sequence[int], transform: Optional[Callable[[Any], Any]] = None) -> "ImageFolderStream":
        """The samples ``indices`` (in that order) as a new stream, with ``transform`` (default: this one's)."""
        idx = np.asarray(indices, dtype=np.int64)
        return ImageFolderStream(self.root, transform if transform is not None else self.transform,
                                 classes=self.classes, skip_corrupt=self.skip_corrupt,
                                 files=[os.fsdecode(f) for f in self._files[idx]], labels=self.labels[idx])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r}, n={len(self)}, classes={len(self.classes)})"


# ----------------------------------------------------------------------------------------------------------
# shards
# ----------------------------------------------------------------------------------------------------------


def read_manifest(path: PathLike) -> Dict[str, Any]:
    """Read ``shards.json`` (a file, or a directory holding one).

    Format: ``{"format": "ropekit-shards", "version": 1, "classes": [...], "splits": {"train": {"shards":
    [{"file": "train-000000.tar", "count": 1000}, ...]}, "val": {...}}}``; file names relative to the manifest.

    Raises:
        FileNotFoundError: no manifest. DataFileError: not such a manifest.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / MANIFEST_NAME
    if not p.is_file():
        raise FileNotFoundError(f"shards: no manifest {p} (write shards with `ropekit data convert`)")
    try:
        m = json.loads(p.read_text())
        ok = m.get("format") == "ropekit-shards" and isinstance(m.get("splits"), dict) and all(
            isinstance(s.get("shards"), list) for s in m["splits"].values())
    except (ValueError, AttributeError) as e:
        raise DataFileError(p, f"not a shard manifest ({type(e).__name__}: {e})") from None
    if not ok:
        raise DataFileError(p, "not a shard manifest (expected format 'ropekit-shards' with splits)")
    m["_dir"] = str(p.parent)
    return m


def _count_tar(path: Path) -> int:
    """Samples of a tar as WebDataset groups them: runs of consecutive files with the same key (the name up to
    the first dot of its last component), meta files ``__*__`` left out."""
    import re
    import tarfile

    from webdataset.tariterators import base_plus_ext

    try:
        with tarfile.open(path, "r:*") as tf:
            keys = [base_plus_ext(m.name)[0] for m in tf.getmembers()
                    if m.isreg() and not re.match(r"__[^/]*__($|/)", m.name)]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataFileError(path, f"not a readable tar shard ({type(e).__name__}: {e})") from None
    return sum(1 for i, k in enumerate(keys) if k is not None and (i == 0 or k != keys[i - 1]))


def _resolve_shards(source: Any, split: str) -> Tuple[List[Path], List[int], Optional[List[str]]]:
    """(shard paths, sample counts, class names or None) of a manifest, a directory, a pattern or a list."""
    if isinstance(source, (str, os.PathLike)) and (Path(source).is_dir() or str(source).endswith(".json")):
        m = read_manifest(source)
        if split not in m["splits"]:
            raise ValueError(f"shards {source}: no split {split!r} in the manifest (it has "
                             f"{', '.join(sorted(m['splits']))})")
        entries = m["splits"][split]["shards"]
        paths = [Path(m["_dir"]) / e["file"] for e in entries]
        counts = [int(e["count"]) for e in entries]
        classes = m.get("classes")
    else:
        if isinstance(source, (str, os.PathLike)):
            from webdataset.shardlists import expand_urls  # brace patterns: train-{000000..000009}.tar

            urls = expand_urls(str(source))
        else:
            urls = [str(u) for u in source]
        paths = [Path(u).expanduser() for u in urls]
        counts = []
        classes = None
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"shards: missing shard {missing[0]}"
                                + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    if not paths:
        raise FileNotFoundError(f"shards: no shard in {source}")
    if not counts:
        counts = [_count_tar(p) for p in paths]
    return paths, counts, classes


@dataclass(frozen=True)
class _EpochPlan:
    """Which worker reads which shards, and the global batch order, of one epoch of one rank."""

    worker_shards: Tuple[Tuple[int, ...], ...]  # shard indices per worker, in reading order
    order: Tuple[Tuple[int, int], ...]  # global batch b -> (worker, that worker's batch index)


def _plan_epoch(counts: Sequence[int], *, seed: int, epoch: int, rank: int, world_size: int, workers: int,
                batch_size: int, drop_last: bool, shuffle: bool) -> _EpochPlan:
    n_shards = len(counts)
    order = np.random.default_rng([seed, epoch]).permutation(n_shards) if shuffle else np.arange(n_shards)
    workers = max(1, workers)

    def batches_of(r: int) -> List[int]:
        mine = order[r::world_size]
        per = [sum(counts[i] for i in mine[w::workers]) for w in range(workers)]
        return [n // batch_size if drop_last else -(-n // batch_size) for n in per]

    own = batches_of(rank)
    total = min(sum(batches_of(r)) for r in range(world_size)) if drop_last else sum(own)
    seq: List[Tuple[int, int]] = []
    left = list(own)
    nxt = [0] * workers
    while len(seq) < total:  # round robin over the workers that still have batches (what a DataLoader does)
        for w in range(workers):
            if left[w] and len(seq) < total:
                seq.append((w, nxt[w]))
                nxt[w] += 1
                left[w] -= 1
    mine = order[rank::world_size]
    return _EpochPlan(tuple(tuple(int(i) for i in mine[w::workers]) for w in range(workers)), tuple(seq))


class ShardStream(IterableDataset):
    """Iterable dataset over WebDataset tar shards, decoding each sample as it streams by.

    Args:
        source: a manifest (``shards.json`` or the directory holding it), a brace pattern
            (``"out/train-{000000..000099}.tar"``), or a list of tar paths; without a manifest the samples of
            each shard are counted by listing the tar once.
        transform: callable uint8 ``(3, H_in, W_in)`` RGB tensor → sample; ``None`` gives that tensor.
        split: which split of a manifest (``"train"`` or ``"val"``).
        shuffle_buffer: samples (encoded bytes, not decoded) in each reader's shuffle buffer.
        skip_corrupt: leave undecodable samples, and samples without an image or label entry, out of their batch
            (counted) instead of raising.

    Iterate it through :func:`make_loader`, which sets the epoch and yields batches. Per epoch: the shard list
    is permuted by ``(seed, epoch)``; rank ``r`` takes shards ``r, r + world_size, ...`` of it, and its DataLoader
    worker ``w`` every ``num_workers``-th of those (so no sample is read twice, and each reader streams whole
    shards); each reader shuffles its samples through a buffer seeded by ``(seed, epoch, its first shard)`` and
    batches them; the loader interleaves the readers' batches round robin. So the order depends on
    ``num_workers`` (the same number must be used to resume exactly). Dropped with ``drop_last=True``: each
    reader's last incomplete batch, and the batches of a rank beyond the fewest any rank has, so every rank
    runs the same number of steps. A shard count of at least ``world_size * num_workers`` keeps every reader busy.

    Attributes:
        shards: the tar paths. counts: samples per shard. classes: class names (from the manifest) or ``None``.
    """

    def __init__(self, source: Any, transform: Optional[Callable[[Any], Any]] = None, *, split: str = "train",
                 shuffle_buffer: int = 1000, skip_corrupt: bool = False) -> None:
        super().__init__()
        self.shards, self.counts, classes = _resolve_shards(source, split)
        self.classes: Optional[List[str]] = list(classes) if classes is not None else None
        self.transform = transform
        self.shuffle_buffer = max(1, int(shuffle_buffer))
        self.skip_corrupt = bool(skip_corrupt)
        self._epoch: Optional[Dict[str, Any]] = None

    def __len__(self) -> int:
        """Samples in all shards."""
        return int(sum(self.counts))

    # -- set by make_loader before a DataLoader copies the dataset into its workers
    def _configure(self, **epoch: Any) -> _EpochPlan:
        self._epoch = dict(epoch)
        self._epoch["plan"] = _plan_epoch(self.counts, **{k: epoch[k] for k in (
            "seed", "epoch", "rank", "world_size", "workers", "batch_size", "drop_last", "shuffle")})
        return self._epoch["plan"]

    def shard_samples(self, shard: int) -> Iterator[Tuple[int, int, Dict[str, Any]]]:
        """``(shard, position, raw sample)`` of one shard, checked against its count."""
        import tarfile

        from webdataset.tariterators import group_by_keys, tar_file_iterator

        path = self.shards[shard]
        n = 0
        try:
            with open(path, "rb") as f:
                files = ({**x, "__url__": str(path)} for x in tar_file_iterator(f))
                for sample in group_by_keys(files):
                    yield shard, n, sample
                    n += 1
        except (tarfile.TarError, OSError, EOFError) as e:
            raise DataFileError(path, f"not a readable tar shard ({type(e).__name__}: {e})") from None
        except ValueError as e:
            raise DataFileError(path, " ".join(str(a) for a in e.args if a is not None)) from None
        if n != self.counts[shard]:
            raise DataFileError(path, f"holds {n} samples, the manifest says {self.counts[shard]} "
                                      "(rewrite the manifest with `ropekit data convert`)")

    def _decode(self, shard: int, pos: int, raw: Dict[str, Any], seed: int) -> Optional[Tuple[Any, Tensor]]:
        where = f"{self.shards[shard]}[{raw.get('__key__')}]"
        try:
            key = next((k for k in IMAGE_KEYS if k in raw), None)
            if key is None:
                raise DataFileError(where, f"sample has no image entry ({'/'.join(IMAGE_KEYS[:4])}/...); it has "
                                           f"{', '.join(sorted(k for k in raw if not k.startswith('__')))}")
            label = shard_label(raw, where, len(self.classes) if self.classes else None)
            img = decode_image(raw[key], name=where)
        except DataFileError as e:
            if self.skip_corrupt:
                return None
            return _failed(DataFileError(e.path, f"{e.reason}; {SKIP_HINT}"))  # type: ignore[return-value]
        with _sample_rng(seed):
            image = self.transform(img) if self.transform is not None else img
        return image, torch.tensor(label, dtype=torch.int64)  # type: ignore[return-value]

    def _worker_batches(self, worker: int) -> Iterator[Tuple[int, int, Any]]:
        cfg = self._epoch
        if cfg is None:
            raise RuntimeError("iterate a ShardStream through ropekit.data.make_loader (it sets the epoch)")
        plan: _EpochPlan = cfg["plan"]
        mine = [j for w, j in plan.order if w == worker]
        skip = sum(1 for w, _ in plan.order[:cfg["start_batch"]] if w == worker)
        if len(mine) <= skip:
            return
        shards = plan.worker_shards[worker]
        bs = cfg["batch_size"]
        base = {s: _seed(cfg["seed"], cfg["epoch"], s) for s in shards}
        stream = (x for s in shards for x in self.shard_samples(s))
        if cfg["shuffle"]:
            rng = np.random.default_rng([cfg["seed"], cfg["epoch"], shards[0] if shards else 0, 7])
            stream = _buffer_shuffle(stream, self.shuffle_buffer, rng)
        batch: List[Any] = []
        j = 0
        try:
            for i, (s, pos, raw) in enumerate(stream):
                if i < skip * bs:
                    continue  # before the start batch: not decoded
                batch.append(self._decode(s, pos, raw, (base[s] + pos) & 0x7FFFFFFFFFFFFFFF))
                if len(batch) == bs:
                    yield worker, skip + j, _collate(batch)
                    j += 1
                    batch = []
                    if skip + j >= len(mine):
                        return
        except DataFileError as e:  # a truncated tar, or a count that disagrees with the manifest
            yield worker, skip + j, (None, None, 0, _failed(e))
            return
        if batch and skip + j < len(mine):
            yield worker, skip + j, _collate(batch)

    def __iter__(self) -> Iterator[Tuple[int, int, Any]]:
        info = get_worker_info()
        return self._worker_batches(info.id if info is not None else 0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shards={len(self.shards)}, n={len(self)})"


def shard_label(raw: Dict[str, Any], where: str, num_classes: Optional[int] = None) -> int:
    """The label of a shard sample (its ``.cls`` entry, decimal text), checked: an integer in ``[0, num_classes)``
    (``num_classes``: the manifest's class count; ``None``: only ``>= 0``).

    Raises:
        DataFileError: no ``.cls`` entry, not an integer, or out of range; one line naming ``where``
            (``<shard>[<key>]``).
    """
    if "cls" not in raw:
        raise DataFileError(where, "sample has no label entry (.cls)")
    text = bytes(raw["cls"])
    try:
        label = int(text.decode().strip())
    except (ValueError, UnicodeDecodeError):
        raise DataFileError(where, f"label entry .cls is not an integer: {text[:20]!r}") from None
    if label < 0 or (num_classes is not None and label >= num_classes):
        bound = f"0..{num_classes - 1} (the manifest names {num_classes} classes)" if num_classes else ">= 0"
        raise DataFileError(where, f"label {label} (.cls) is outside {bound}")
    return label


def _buffer_shuffle(stream: Iterator[Any], size: int, rng: np.random.Generator) -> Iterator[Any]:
    """Shuffle a stream through a buffer of ``size`` items (each output drawn uniformly from the buffer)."""
    buf: List[Any] = []
    for x in stream:
        if len(buf) < size:
            buf.append(x)
            continue
        k = int(rng.integers(size))
        yield buf[k]
        buf[k] = x
    for k in rng.permutation(len(buf)):
        yield buf[k]


# ----------------------------------------------------------------------------------------------------------
# loader
# ----------------------------------------------------------------------------------------------------------


def _collate(items: Sequence[Any]) -> Tuple[Any, Any, int, Optional[_Failure]]:
    """``(images, labels, skipped, failure)``: default collate of the samples that are not ``None`` (skipped) and,
    if a sample is a :class:`_Failure`, that failure for the main process to raise."""
    failure = next((x for x in items if isinstance(x, _Failure)), None)
    if failure is not None:
        return None, None, 0, failure
    kept = [x for x in items if x is not None]
    skipped = len(items) - len(kept)
    if not kept:
        return None, None, skipped, None
    images, labels = default_collate(kept)
    return images, labels, skipped, None


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
        self._plan: Optional[_EpochPlan] = None
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
        gen = torch.Generator().manual_seed(_seed(kw["seed"], epoch, kw["rank"], 3))  # workers' base seed
        if self._shards:
            self._plan = self.dataset._configure(
                seed=kw["seed"], epoch=self.epoch, rank=kw["rank"], world_size=kw["world_size"],
                workers=self._loader_kw["num_workers"], batch_size=kw["batch_size"], drop_last=kw["drop_last"],
                shuffle=kw["shuffle"], start_batch=self.start_batch)
            self._loader = DataLoader(self.dataset, batch_size=None, generator=gen, **self._loader_kw)
        else:
            self._sampler.epoch, self._sampler.start = self.epoch, self.start_batch * kw["batch_size"]
            if self._loader is None:
                self._loader = DataLoader(self.dataset, batch_size=kw["batch_size"], sampler=self._sampler,
                                          drop_last=kw["drop_last"], collate_fn=_collate, generator=gen,
                                          **self._loader_kw)
        return self

    def __len__(self) -> int:
        if self._shards:
            return len(self._plan.order)  # type: ignore[union-attr]
        n = len(self._sampler.indices())
        b = self._kw["batch_size"]
        return n // b if self._kw["drop_last"] else -(-n // b)

    def _raw(self) -> Iterator[Tuple[Any, Any, int, Optional[_Failure]]]:
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
        ``image_size``, ``class_names``).

    Raises:
        ValueError: unknown name, bad option, or fewer than two classes. FileNotFoundError, DataFileError: as
        the streams raise them.
    """
    from .transforms import IMAGENET_MEAN, IMAGENET_STD, build_eval_transform, build_train_transform

    key = _STREAMS.get(canonical_name(name))
    if key is None:
        raise ValueError(f"unknown stream {name!r}; known streams: {', '.join(list_streams())}")
    hw = as_size(image_size)
    given = mean is not None or std is not None
    own = train_transform is None and eval_transform is None  # info records the statistics of our transforms
    m = tuple(mean) if mean is not None else IMAGENET_MEAN
    s = tuple(std) if std is not None else IMAGENET_STD
    if train_transform is None:
        train_transform = build_train_transform(hw, scale=scale, ratio=ratio, hflip=hflip, auto_augment=auto_augment,
                                                random_erasing=random_erasing, mean=m, std=s,
                                                interpolation=interpolation)
    if eval_transform is None:
        eval_transform = build_eval_transform(hw, crop_pct=crop_pct, mean=m, std=s, interpolation=interpolation)
    root_p = Path(root).expanduser()
    if key == "shards":
        train: Any = ShardStream(root_p, train_transform, split="train", shuffle_buffer=shuffle_buffer,
                                 skip_corrupt=skip_corrupt)
        val: Any = ShardStream(root_p, eval_transform, split="val", skip_corrupt=skip_corrupt)
        classes = train.classes or []
        num_classes = len(classes) if classes else None
    elif (root_p / "train").is_dir() and (root_p / "val").is_dir():
        train = ImageFolderStream(root_p / "train", train_transform, skip_corrupt=skip_corrupt)
        val = ImageFolderStream(root_p / "val", eval_transform, classes=train.classes, skip_corrupt=skip_corrupt,
                                allow_empty=True)
        classes, num_classes = train.classes, len(train.classes)
    else:
        full = ImageFolderStream(root_p, None, skip_corrupt=skip_corrupt)
        tr, te = stratified_split(full.labels, test_fraction, split_seed)
        train, val = full.subset(np.sort(tr), train_transform), full.subset(np.sort(te), eval_transform)
        classes, num_classes = full.classes, len(full.classes)
    if num_classes is None:
        raise ValueError(f"shards {root_p}: the manifest names no classes")
    if num_classes < 2:
        raise ValueError(f"{canonical_name(name)} {root_p} has {num_classes} class; classification needs at least 2 "
                         f"classes, one sub-folder of images each")
    stats = own or given
    info = DatasetInfo(key, num_classes, 3, hw, "image", class_names=tuple(classes), mean=m if stats else None,
                       std=s if stats else None)
    return train, val, info
