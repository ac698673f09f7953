"""WebDataset tar shards as a stream: the manifest ``shards.json`` that gives an epoch its length, the per-epoch plan
of which rank and worker reads which shard, and :class:`ShardStream` (one sample = ``<key>.jpg`` (or ``.png``,
...) plus ``<key>.cls``, the label as decimal text, and for RGB-D shards ``<key>.depth.npy``, the depth map), as
``ropekit data convert`` writes them.

Shape legend: ``C`` colour channels (3); ``H_in, W_in`` a decoded image's size.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from ._common import SKIP_HINT, DataFileError, PathLike
from .decode import DEPTH_KEY, decode_depth, decode_image
from .readers import IMAGE_EXTENSIONS
from .worker import collate_samples, failed_in_worker, mix_seed, sample_rng

__all__ = ["MANIFEST_NAME", "IMAGE_KEYS", "read_manifest", "resolve_shards", "EpochPlan", "plan_epoch", "ShardStream",
           "shard_label", "first_sample_entries", "tar_entries"]

#: Tar members that are not samples (WebDataset's ``__*__`` meta files).
_META = re.compile(r"__[^/]*__($|/)")

#: The manifest ``ropekit data convert`` writes beside the shards.
MANIFEST_NAME = "shards.json"
#: Sample keys that hold an encoded image in a shard (the file extension WebDataset writes).
IMAGE_KEYS = tuple(e.lstrip(".") for e in IMAGE_EXTENSIONS)


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


def tar_entries(tf: Any) -> Iterator[Tuple[Any, Optional[str], str]]:
    """``(member, key, ext)`` of each regular file of an open tar, in order, as WebDataset names them (``key`` the
    name up to the first dot of its last component, ``None`` where it has none); meta files ``__*__`` left out."""
    from webdataset.tariterators import base_plus_ext

    for m in tf:
        if m.isreg() and not _META.match(m.name):
            key, ext = base_plus_ext(m.name)
            yield m, key, ext


def _count_tar(path: Path) -> int:
    """Samples of a tar as WebDataset groups them: runs of consecutive files with the same key (:func:`tar_entries`)."""
    try:
        with tarfile.open(path, "r:*") as tf:
            keys = [key for _, key, _ in tar_entries(tf)]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataFileError(path, f"not a readable tar shard ({type(e).__name__}: {e})") from None
    return sum(1 for i, k in enumerate(keys) if k is not None and (i == 0 or k != keys[i - 1]))


def first_sample_entries(path: PathLike) -> List[str]:
    """The entry names (``"png"``, ``"cls"``, ``"depth.npy"``, ...) of the first sample of a tar shard, read from
    the tar headers up to the second sample (nothing decoded); ``[]`` for an empty shard."""
    first: Optional[str] = None
    exts: List[str] = []
    try:
        with tarfile.open(path, "r:*") as tf:
            for _, key, ext in tar_entries(tf):
                if key is None:
                    continue
                if first is not None and key != first:
                    break
                first = key
                exts.append(ext)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataFileError(path, f"not a readable tar shard ({type(e).__name__}: {e})") from None
    return exts


def resolve_shards(source: Any, split: str) -> Tuple[List[Path], List[int], Optional[List[str]]]:
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
class EpochPlan:
    """Which worker reads which shards, and the global batch order, of one epoch of one rank."""

    worker_shards: Tuple[Tuple[int, ...], ...]  # shard indices per worker, in reading order
    order: Tuple[Tuple[int, int], ...]  # global batch b -> (worker, that worker's batch index)


def plan_epoch(counts: Sequence[int], *, seed: int, epoch: int, rank: int, world_size: int, workers: int,
                batch_size: int, drop_last: bool, shuffle: bool) -> EpochPlan:
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
    return EpochPlan(tuple(tuple(int(i) for i in mine[w::workers]) for w in range(workers)), tuple(seq))


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

    RGB-D shards (samples with a ``depth.npy`` entry, :attr:`depth`): a sample's image is the pair ``(rgb, depth)``
    -- uint8 ``(3, H_in, W_in)`` and float32 ``(1, H_in, W_in)`` metres (0 or NaN: invalid) -- which the transform
    receives (:func:`ropekit.data.transforms.build_train_transform` with ``rgbd=True`` crops, resizes and flips both
    alike, depth with nearest, and returns float32 ``(4, H, W)``); without a transform batches are that pair,
    stacked (images of one size only). Whether the shards carry depth is read from the first sample's entries;
    every sample must then have one (else a :class:`DataFileError` naming it).

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
        depth: whether the samples carry depth (RGB-D).
    """

    def __init__(self, source: Any, transform: Optional[Callable[[Any], Any]] = None, *, split: str = "train",
                 shuffle_buffer: int = 1000, skip_corrupt: bool = False) -> None:
        super().__init__()
        self.shards, self.counts, classes = resolve_shards(source, split)
        self.classes: Optional[List[str]] = list(classes) if classes is not None else None
        self.transform = transform
        self.shuffle_buffer = max(1, int(shuffle_buffer))
        self.skip_corrupt = bool(skip_corrupt)
        self._epoch: Optional[Dict[str, Any]] = None
        first = next((s for s, c in enumerate(self.counts) if c > 0), None)
        self.depth = first is not None and DEPTH_KEY in first_sample_entries(self.shards[first])

    def __len__(self) -> int:
        """Samples in all shards."""
        return int(sum(self.counts))

    # -- set by make_loader before a DataLoader copies the dataset into its workers
    def configure(self, **epoch: Any) -> EpochPlan:
        self._epoch = dict(epoch)
        self._epoch["plan"] = plan_epoch(self.counts, **{k: epoch[k] for k in (
            "seed", "epoch", "rank", "world_size", "workers", "batch_size", "drop_last", "shuffle")})
        return self._epoch["plan"]

    def shard_samples(self, shard: int) -> Iterator[Tuple[int, int, Dict[str, Any]]]:
        """``(shard, position, raw sample)`` of shard ``shard`` (an index into :attr:`shards`), in tar order,
        checked against its count (a ``DataFileError`` at the end when they disagree)."""
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
            if self.depth and DEPTH_KEY not in raw:
                raise DataFileError(where, f"sample has no depth entry ({DEPTH_KEY}); the shards' first sample has one")
            img = decode_image(raw[key], name=where)
            if self.depth:
                img = (img, decode_depth(raw[DEPTH_KEY], name=where, shape=tuple(img.shape[-2:])))
        except DataFileError as e:
            if self.skip_corrupt:
                return None
            return failed_in_worker(DataFileError(e.path, f"{e.reason}; {SKIP_HINT}"))  # type: ignore[return-value]
        with sample_rng(seed):
            image = self.transform(img) if self.transform is not None else img
        return image, torch.tensor(label, dtype=torch.int64)  # type: ignore[return-value]

    def _worker_batches(self, worker: int) -> Iterator[Tuple[int, int, Any]]:
        cfg = self._epoch
        if cfg is None:
            raise RuntimeError("iterate a ShardStream through ropekit.data.make_loader (it sets the epoch)")
        plan: EpochPlan = cfg["plan"]
        mine = [j for w, j in plan.order if w == worker]
        skip = sum(1 for w, _ in plan.order[:cfg["start_batch"]] if w == worker)
        if len(mine) <= skip:
            return
        shards = plan.worker_shards[worker]
        bs = cfg["batch_size"]
        base = {s: mix_seed(cfg["seed"], cfg["epoch"], s) for s in shards}
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
                    yield worker, skip + j, collate_samples(batch)
                    j += 1
                    batch = []
                    if skip + j >= len(mine):
                        return
        except DataFileError as e:  # a truncated tar, or a count that disagrees with the manifest
            yield worker, skip + j, (None, None, 0, failed_in_worker(e))
            return
        if batch and skip + j < len(mine):
            yield worker, skip + j, collate_samples(batch)

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
