"""WebDataset tar shards as a map-style data set: ``ds[i]`` reads and decodes sample ``i`` by its byte offsets.

:class:`ShardSource` is what the native-resolution loader (:mod:`ropekit.data.native`) reads shards through: it plans
its own order of indices, so it needs random access, which the streaming :class:`~ropekit.data.shard_stream.
ShardStream` does not give. On construction each shard's tar headers are read once (no image is decoded) into an
in-memory index: for every sample the offset and size of its image entry, of its optional depth entry, and its
label (the ``.cls`` entry, read then); nothing is cached on disk. ``ds[i]`` then seeks to the image's bytes and
decodes them with :func:`ropekit.data.decode.decode_image`, the decoder of the folder source, so a folder and the
shards ``ropekit data convert`` writes from it give the same images.

Samples: ``<key>.<image ext>`` (``jpg``, ``png``, ...), ``<key>.cls`` (the label as decimal text) and, for RGB-D
shards, ``<key>.depth.npy``: metric depth, a float ``(H, W)`` NumPy array of the image's size (``0`` or NaN marks
an invalid pixel). Either every sample of a split has a depth entry or none has. Shards must be uncompressed tars
(random access; ``ropekit data convert`` writes them so).

Files are opened lazily, in the process that reads them (a DataLoader worker opens its own), at most
:data:`OPEN_SHARDS` at a time; a pickled or forked copy opens its own handles, so the data set is worker safe.

Shape legend: ``H, W`` an image's size.
"""

from __future__ import annotations

import os
import tarfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ._common import DataFileError, PathLike
from .decode import DEPTH_KEY, decode_depth, decode_image
from .shard_stream import IMAGE_KEYS, resolve_shards
from .worker import WorkerFailure, failed_in_worker

__all__ = ["ShardSource", "DEPTH_KEY", "OPEN_SHARDS"]

#: Shard files a process keeps open at once (least recently used closed first).
OPEN_SHARDS = 16

def _index_shard(path: Path, count: Optional[int], num_classes: Optional[int]) -> Dict[str, np.ndarray]:
    """The index of one shard: per sample (in tar order) ``image`` (offset, size), ``depth`` (offset, size; -1 when
    absent), ``ext`` (index into :data:`IMAGE_KEYS`), ``label``, and ``key`` (bytes)."""
    from .shard_stream import shard_label, tar_entries

    rows: List[Dict[str, Any]] = []
    size = path.stat().st_size
    try:
        with tarfile.open(path, "r:") as tf:
            last: Optional[str] = None
            for m, key, ext in tar_entries(tf):
                if key is None:
                    continue
                if key != last:
                    rows.append({"__key__": key})
                    last = key
                if ext in rows[-1]:
                    raise DataFileError(f"{path}[{key}]", f"sample has two {ext!r} entries")
                if m.offset_data + m.size > size:
                    raise DataFileError(path, f"truncated: entry {m.name} ends past the end of the file")
                rows[-1][ext] = (m.offset_data, m.size)
            labels = []
            for r in rows:
                where = f"{path}[{r['__key__']}]"
                if "cls" not in r:
                    raise DataFileError(where, "sample has no label entry (.cls)")
                off, n = r["cls"]
                tf.fileobj.seek(off)
                labels.append(shard_label({"cls": tf.fileobj.read(n)}, where, num_classes))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataFileError(path, f"not a readable uncompressed tar shard ({type(e).__name__}: {e})") from None
    if count is not None and len(rows) != count:
        raise DataFileError(path, f"holds {len(rows)} samples, the manifest says {count} "
                                  "(rewrite the manifest with `ropekit data convert`)")
    image = np.zeros((len(rows), 2), dtype=np.int64)
    depth = np.full((len(rows), 2), -1, dtype=np.int64)
    ext_of = np.zeros(len(rows), dtype=np.int16)
    for i, r in enumerate(rows):
        k = next((j for j, e in enumerate(IMAGE_KEYS) if e in r), None)
        if k is None:
            raise DataFileError(f"{path}[{r['__key__']}]", f"sample has no image entry ({'/'.join(IMAGE_KEYS[:4])}"
                                f"/...); it has {', '.join(sorted(e for e in r if not e.startswith('__')))}")
        image[i], ext_of[i] = r[IMAGE_KEYS[k]], k
        if DEPTH_KEY in r:
            depth[i] = r[DEPTH_KEY]
    return {"image": image, "depth": depth, "ext": ext_of, "label": np.asarray(labels, dtype=np.int64),
            "key": np.asarray([r["__key__"].encode() for r in rows], dtype=bytes)}


class _ShardIndexes(Dataset):
    """``ds[s]``: the index of shard ``s`` (built in a DataLoader worker; a bad shard's error as a value)."""

    def __init__(self, paths: List[Path], counts: List[Optional[int]], num_classes: Optional[int]) -> None:
        self.paths, self.counts, self.num_classes = paths, counts, num_classes

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, s: int) -> Any:
        try:
            return _index_shard(self.paths[s], self.counts[s], self.num_classes)
        except DataFileError as e:
            return failed_in_worker(e)


def _as_is(x: Any) -> Any:
    return x


def _index_all(paths: List[Path], counts: List[Optional[int]], num_classes: Optional[int],
               workers: int) -> List[Dict[str, np.ndarray]]:
    ds = _ShardIndexes(paths, counts, num_classes)
    if workers <= 0 or len(paths) < 2:
        return [ds[s] for s in range(len(ds))]
    from torch.utils.data import DataLoader

    parts = []
    for part in DataLoader(ds, batch_size=None, num_workers=min(workers, len(paths)), collate_fn=_as_is):
        if isinstance(part, WorkerFailure):
            raise part.error
        parts.append(part)
    return parts


class ShardSource(Dataset):
    """Map-style data set over WebDataset tar shards (see the module docstring).

    Args:
        source: a manifest (``shards.json`` or the directory holding it), a brace pattern, or a list of tar paths.
        split: which split of a manifest.
        workers: processes that read the shards' headers in parallel when the index is built (0: this process).

    ``ds[i]`` returns ``(image, label)``: ``image`` uint8 ``(3, H, W)`` RGB, or for RGB-D shards the pair
    ``(rgb, depth)`` of uint8 ``(3, H, W)`` and float32 ``(1, H, W)`` metres; ``label`` an int64 scalar tensor.

    Attributes:
        shards: the tar paths. counts: samples per shard. classes: class names (from the manifest) or ``None``.
        labels: int64 ``(N,)``. depth: whether the samples carry depth (RGB-D).

    Raises:
        FileNotFoundError: no manifest, or a missing shard. DataFileError: a shard that is not an uncompressed tar,
            is truncated, disagrees with the manifest's count, or has a sample without image or label, or with a
            bad label; one line naming it. ValueError: some samples with depth and some without.
    """

    def __init__(self, source: Union[PathLike, List[PathLike]], *, split: str = "train", workers: int = 0) -> None:
        paths, counts, classes = resolve_shards(source, split)
        self.shards: List[Path] = list(paths)
        self.classes: Optional[List[str]] = list(classes) if classes is not None else None
        n_classes = len(self.classes) if self.classes else None
        parts = _index_all(self.shards, list(counts), n_classes, int(workers))
        self.counts: List[int] = [len(q["label"]) for q in parts]
        self._shard_of = np.concatenate([np.full(len(q["label"]), s, dtype=np.int32) for s, q in enumerate(parts)])
        self._image = np.concatenate([q["image"] for q in parts])
        self._depth = np.concatenate([q["depth"] for q in parts])
        self._ext = np.concatenate([q["ext"] for q in parts])
        self._keys = np.concatenate([q["key"] for q in parts])
        self.labels = np.concatenate([q["label"] for q in parts])
        has = self._depth[:, 0] >= 0
        if has.any() and not has.all():
            i = int(np.flatnonzero(~has)[0])
            raise ValueError(f"shards: {int(has.sum())} of {len(has)} samples carry depth ({DEPTH_KEY}) but not all; "
                             f"{self._where(i)} has none")
        self.depth = bool(has.any())
        self._handles: "OrderedDict[int, BinaryIO]" = OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def _where(self, index: int) -> str:
        return f"{self.shards[self._shard_of[index]]}[{self._keys[index].decode()}]"

    def _read(self, shard: int, offset: int, size: int) -> bytes:
        if os.getpid() != self._pid:  # a forked copy: the parent's handles share its file offsets
            self._handles, self._pid = OrderedDict(), os.getpid()
        f = self._handles.pop(shard, None)
        if f is None:
            f = open(self.shards[shard], "rb")
            while len(self._handles) >= OPEN_SHARDS:
                self._handles.popitem(last=False)[1].close()
        self._handles[shard] = f  # most recently used last
        f.seek(offset)
        data = f.read(size)
        if len(data) != size:
            raise DataFileError(self.shards[shard], f"truncated: {size} bytes at offset {offset} could not be read")
        return data

    def __getitem__(self, index: int) -> Tuple[Any, Tensor]:
        i = int(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"ShardSource index {index} is out of range for {len(self)} samples")
        i %= len(self)
        s = int(self._shard_of[i])
        where = self._where(i)
        rgb = decode_image(self._read(s, *self._image[i].tolist()), name=where)
        label = torch.tensor(self.labels[i], dtype=torch.int64)
        if not self.depth:
            return rgb, label
        depth = decode_depth(self._read(s, *self._depth[i].tolist()), name=where, shape=tuple(rgb.shape[-2:]))
        return (rgb, depth), label

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"], state["_pid"] = OrderedDict(), -1  # open files do not travel to another process
        return state

    def __del__(self) -> None:
        for f in getattr(self, "_handles", {}).values():
            try:
                f.close()
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shards={len(self.shards)}, n={len(self)}, depth={self.depth})"
