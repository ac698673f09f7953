"""Convert an image folder to WebDataset tar shards, and check a folder or shards for unreadable images.

* :func:`write_shards` -- ``root/<class>/<image>`` (or ``root/train/...`` + ``root/val/...``) → ``out/train-000000
  .tar, ...``, ``out/val-000000.tar, ...`` and the manifest ``out/shards.json`` (see
  :func:`ropekit.data.streaming.read_manifest`). Each sample is ``<key>.<ext>`` -- the file's encoded bytes,
  unchanged (``.jpeg`` stored as ``.jpg``) -- and ``<key>.cls``, the label as decimal text, written with
  ``webdataset.TarWriter``. Samples are written in a seeded random order, so that every shard mixes the classes.
  An RGB-D folder -- each image with its depth map beside it, ``<class>/0001.png`` + ``<class>/0001.depth.npy``
  (a numeric ``(H, W)`` NumPy array of metres, 0 or NaN invalid) -- gives RGB-D shards: ``<key>.depth.npy`` too.
* :func:`write_dataset_shards` -- an in-memory RGB-D data set (``rgbd-digits``, ``captioned-scenes``) as RGB-D
  shards: ``<key>.png`` (8-bit RGB), ``<key>.depth.npy`` (float32 metres, bit for bit), ``<key>.cls``.
* :func:`check_data` -- decode every image (and depth map) of a folder or of shards; counts per class and the
  unreadable files.
"""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from .._io import atomic_write
from .._optional import require
from ._common import DataFileError, PathLike, stratified_split
from .decode import DEPTH_KEY, decode_depth, decode_image, depth_path, has_depth_beside, read_depth_beside
from .shard_stream import IMAGE_KEYS, MANIFEST_NAME, ShardStream, read_manifest, shard_label
from .streaming import scan_image_folder

__all__ = ["write_shards", "write_dataset_shards", "check_data", "describe_data"]

Progress = Optional[Callable[[int], None]]


def _splits_of(folder: Path, val_fraction: float, split_seed: int) -> Tuple[List[str], Dict[str, Any]]:
    """Class names and ``{split: (root, files, labels)}`` of a flat folder or a train/val folder."""
    if (folder / "train").is_dir() and (folder / "val").is_dir():
        files, labels, classes, _ = scan_image_folder(folder / "train")
        vfiles, vlabels, _, _ = scan_image_folder(folder / "val", classes=classes, allow_empty=True)
        return classes, {"train": (folder / "train", files, labels), "val": (folder / "val", vfiles, vlabels)}
    files, labels, classes, _ = scan_image_folder(folder)
    if val_fraction <= 0:
        return classes, {"train": (folder, files, labels)}
    tr, te = stratified_split(labels, val_fraction, split_seed)
    pick = lambda idx: [files[i] for i in np.sort(idx)]  # noqa: E731
    return classes, {"train": (folder, pick(tr), labels[np.sort(tr)]),
                     "val": (folder, pick(te), labels[np.sort(te)])}


#: The files a conversion writes besides the manifest (and atomic_write's temporary manifests).
_SHARD_FILE = re.compile(r"^((train|val)-\d{6}\.tar|\." + re.escape(MANIFEST_NAME) + r"\.tmp-.*)$")


def _prepare_out(out: Path, overwrite: bool, source: Optional[Path] = None) -> None:
    """Make ``out`` an empty folder for a conversion, or refuse in one line.

    ``out`` may hold nothing but an earlier conversion's manifest and shards, which are deleted, the manifest first
    (a conversion cut short is never read back as the earlier, complete one); a complete conversion (one with its
    manifest) only with ``overwrite``. ``source``: the folder converted, which ``out`` must not be or lie in.
    """
    if source is not None:
        src, dst = source.resolve(), out.resolve()
        if dst == src or src in dst.parents:
            raise ValueError(f"{out} is the folder it converts ({source}) or inside it: write the shards elsewhere")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file; the shards are written into a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    others = [e for e in entries if e != MANIFEST_NAME and not _SHARD_FILE.match(e)]
    if others:
        raise FileExistsError(f"{out} is not empty ({len(entries)} entries, first {others[0]}): choose an empty "
                              f"folder (--overwrite replaces an earlier conversion's shards only)")
    if MANIFEST_NAME in entries and not overwrite:  # (shards without one: a conversion cut short, replaced)
        raise FileExistsError(f"{out} holds the shards of an earlier conversion: pass --overwrite to replace them, "
                              f"or choose an empty folder")
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for e in entries:
        (out / e).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


class _SplitWriter:
    """One split's samples into ``<split>-000000.tar, ...``, ``shard_size`` samples each (``webdataset.TarWriter``)."""

    def __init__(self, wds: Any, out: Path, split: str, shard_size: int) -> None:
        self.wds, self.out, self.split, self.shard_size = wds, out, split, shard_size
        self.entries: List[Dict[str, Any]] = []
        self.writer: Any = None

    def write(self, sample: Dict[str, Any]) -> None:
        if self.writer is None or self.entries[-1]["count"] == self.shard_size:
            if self.writer is not None:
                self.writer.close()
            name = f"{self.split}-{len(self.entries):06d}.tar"
            self.writer = self.wds.TarWriter(str(self.out / name))
            self.entries.append({"file": name, "count": 0})
        self.writer.write(sample)
        self.entries[-1]["count"] += 1

    def close(self) -> Dict[str, Any]:
        if self.writer is not None:
            self.writer.close()
        return {"shards": self.entries, "count": sum(e["count"] for e in self.entries)}


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _folder_sample(path: Path, key: str, label: int, rgbd: bool, first: str,
                   skip_corrupt: bool) -> Optional[Dict[str, Any]]:
    """The shard sample of one image of a folder (and its depth map when ``rgbd``); ``None``: unreadable, skipped."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()  # header (and PNG checksums); no full decode
            width, height = im.size
    except Exception as e:  # noqa: BLE001 - whatever Pillow raises on a non-image
        if not skip_corrupt:
            raise DataFileError(path, f"not a readable image ({type(e).__name__}: {e}); pass "
                                      "--skip-corrupt to leave such files out") from None
        return None
    ext = path.suffix.lower().lstrip(".")
    ext = "jpg" if ext == "jpeg" else ext
    sample = {"__key__": key, ext: path.read_bytes(), "cls": str(label)}
    if rgbd:
        sample[DEPTH_KEY] = read_depth_beside(path, (height, width))[0]  # checked, then copied as it is
    elif has_depth_beside(path):
        raise DataFileError(depth_path(path), f"a depth map, but the folder's first image ({first}) has none: give "
                                              "every image a depth map or none")
    return sample


def write_shards(
    folder: PathLike,
    out: PathLike,
    *,
    shard_size: int = 1000,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    skip_corrupt: bool = False,
    overwrite: bool = False,
    progress: Progress = None,
) -> Dict[str, Any]:
    """Write ``folder``'s images as tar shards of ``shard_size`` samples and the manifest ``shards.json``.

    RGB-D folders: when the first image has a depth map beside it (``0001.png`` and ``0001.depth.npy``, a numeric
    ``(H, W)`` array of metres of the image's size, 0 or NaN invalid), every image must have one, and each sample
    gets a ``<key>.depth.npy`` entry (its bytes copied, after a check of its shape), which the shard readers hand on
    as the image's depth.

    Args:
        folder: ``root/<class>/<image>`` (then ``val_fraction`` of each class, chosen by ``split_seed``, goes to
            the ``val`` split; 0 writes ``train`` only) or ``root/train/<class>/...`` with ``root/val/...``.
        out: output directory (created; it must be empty, and not inside ``folder``).
        shard_size: samples per shard (the last shard of a split may hold fewer).
        val_fraction, split_seed: the stratified split of a flat folder.
        skip_corrupt: leave out files Pillow cannot identify (counted in the manifest's ``skipped``) instead of
            stopping with an error naming the first. Only the header is checked here (the bytes are copied, not
            decoded); ``ropekit data check`` decodes every image.
        overwrite: replace an earlier conversion in ``out`` (its manifest and shards; nothing else is deleted).
        progress: called with 1 after each sample.

    Returns:
        the manifest written (a dict; ``"depth"``: whether the samples carry depth).

    Raises:
        DataFileError: an unreadable image (without ``skip_corrupt``), a missing or malformed depth map in an RGB-D
            folder, or a depth map beside an image of a folder whose first image has none; one line naming it.
        FileExistsError: ``out`` is not empty (without ``overwrite``), or holds other files than shards.
        ValueError: ``out`` is ``folder`` or inside it.
    """
    wds = require("webdataset", "train", "writing WebDataset shards")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    folder, out = Path(folder).expanduser(), Path(out).expanduser()
    classes, splits = _splits_of(folder, val_fraction, split_seed)
    first_root, first_files, _ = next(iter(splits.values()))
    rgbd = has_depth_beside(first_root / first_files[0])
    _prepare_out(out, overwrite, folder)
    manifest: Dict[str, Any] = {"format": "ropekit-shards", "version": 1, "classes": classes,
                                "source": str(folder), "shard_size": shard_size, "depth": rgbd, "splits": {},
                                "skipped": []}
    for split, (root, files, labels) in splits.items():
        order = np.random.default_rng([split_seed, len(files), 5]).permutation(len(files))
        writer = _SplitWriter(wds, out, split, shard_size)
        try:
            for n, i in enumerate(order.tolist()):
                sample = _folder_sample(root / files[i], f"{split}_{n:08d}", int(labels[i]), rgbd, first_files[0],
                                        skip_corrupt)
                if sample is None:
                    manifest["skipped"].append(str(root / files[i]))
                    continue
                writer.write(sample)
                if progress is not None:
                    progress(1)
        finally:  # (a shard left open would be flushed into a closed file later)
            manifest["splits"][split] = writer.close()
    atomic_write(out / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
    return manifest


def write_dataset_shards(
    data: Tuple[Any, Any, Any],
    out: PathLike,
    *,
    shard_size: int = 1000,
    seed: int = 0,
    overwrite: bool = False,
    progress: Progress = None,
) -> Dict[str, Any]:
    """Write an in-memory RGB-D data set (``load_dataset("rgbd-digits")``, ``"captioned-scenes"``) as RGB-D tar
    shards: its training split as ``train``, its test split as ``val``.

    Each sample is ``<key>.png`` (the RGB channels, 8-bit: ``round(255 x)``, so within half a grey level of the
    in-memory float values and exactly what a PNG can hold), ``<key>.depth.npy`` (the depth channel, float32
    metres, bit for bit, zeros and NaNs of invalid pixels included) and ``<key>.cls``; samples in a random order
    seeded by ``seed``, as :func:`write_shards`.

    Args:
        data: ``(train, test, info)`` as :func:`ropekit.data.load_dataset` returns it (without ``normalize``);
            ``info.kind`` must be ``"rgbd"``.
        out: output directory (created; it must be empty).
        shard_size: samples per shard.
        seed: of the sample order.
        overwrite: replace an earlier conversion in ``out`` (as :func:`write_shards`).
        progress: called with 1 after each sample.

    Returns:
        the manifest written (``"source"`` names the data set).

    Raises:
        ValueError: not an RGB-D data set, or RGB values outside [0, 1] or not finite (one line).
        FileExistsError: ``out`` is not empty (without ``overwrite``), or holds other files than shards.
    """
    wds = require("webdataset", "train", "writing WebDataset shards")
    from PIL import Image

    train, test, info = data
    name = info.name
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if info.kind != "rgbd":
        raise ValueError(f"data set {name!r} is of kind {info.kind!r}; shards are written from RGB-D data sets "
                         f"(kind 'rgbd') or from an image folder")
    out = Path(out).expanduser()
    _prepare_out(out, overwrite)
    manifest: Dict[str, Any] = {
        "format": "ropekit-shards", "version": 1, "source": f"dataset {name}", "image_size": list(info.image_size),
        "classes": list(info.class_names) if info.class_names else [str(k) for k in range(info.num_classes)],
        "shard_size": shard_size, "depth": True, "splits": {}, "skipped": []}
    for split, ds in (("train", train), ("val", test)):
        images, labels = ds.images, ds.labels  # (N, 4, H, W) float32: RGB in [0, 1], then depth; (N,) int64
        rgb = images[:, :3]
        if not bool(torch.isfinite(rgb).all()) or float(rgb.min()) < 0.0 or float(rgb.max()) > 1.0:
            raise ValueError(f"data set {name!r}: RGB values must be finite and in [0, 1] to be written as PNG "
                             "(load it without normalize)")
        order = np.random.default_rng([seed, len(labels), 5]).permutation(len(labels))
        writer = _SplitWriter(wds, out, split, shard_size)
        for n, i in enumerate(order.tolist()):
            pixels = torch.round(rgb[i] * 255.0).to(torch.uint8).permute(1, 2, 0).numpy()  # (H, W, 3)
            png = io.BytesIO()
            Image.fromarray(pixels, "RGB").save(png, format="png")
            depth = images[i, 3].numpy().astype(np.float32)  # (H, W) metres
            writer.write({"__key__": f"{split}_{n:08d}", "png": png.getvalue(), DEPTH_KEY: _npy_bytes(depth),
                          "cls": str(int(labels[i]))})
            if progress is not None:
                progress(1)
        manifest["splits"][split] = writer.close()
    atomic_write(out / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
    return manifest


def _is_shards(path: Path) -> bool:
    return (path.is_dir() and (path / MANIFEST_NAME).is_file()) or path.suffix in (".json", ".tar")


def describe_data(path: PathLike) -> Dict[str, Any]:
    """What a folder or shard directory holds, without decoding: format, classes, samples per split and class.

    Shards' per-class counts need the labels, so they are read from the tars' ``.cls`` entries (no image is
    decoded).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no such file or directory: {path}")
    if _is_shards(path):
        m = read_manifest(path if path.suffix != ".tar" else path.parent)
        rec: Dict[str, Any] = {"path": str(path), "format": "shards", "classes": m.get("classes"), "splits": {}}
        for split in m["splits"]:
            stream = ShardStream(path, split=split)
            per = Counter()
            n_classes = len(m.get("classes") or []) or None
            for s in range(len(stream.shards)):
                for _, _, raw in stream.shard_samples(s):
                    try:
                        per[shard_label(raw, f"{stream.shards[s]}[{raw.get('__key__')}]", n_classes)] += 1
                    except DataFileError:
                        pass  # (counted by class only when valid; `check` names it)
            rec["splits"][split] = {"samples": len(stream), "shards": len(stream.shards),
                                    "per_class": [per.get(k, 0) for k in range(len(m.get("classes") or []))]}
        return rec
    layout = (path / "train").is_dir() and (path / "val").is_dir()
    roots = {"train": path / "train", "val": path / "val"} if layout else {"all": path}
    rec = {"path": str(path), "format": "folder", "splits": {}}
    classes = None
    for split, root in roots.items():
        files, labels, names, ignored = scan_image_folder(root, classes=classes, allow_empty=True)
        classes = classes or names
        rec["splits"][split] = {"samples": len(files), "non_image_files": ignored,
                                "per_class": np.bincount(labels, minlength=len(classes)).tolist()}
    rec["classes"] = classes
    return rec


def check_data(path: PathLike, *, progress: Progress = None) -> Dict[str, Any]:
    """Decode every image of a folder or of shards.

    Returns:
        ``describe_data``'s record plus ``"bad"``: a list of ``"<file>: <reason>"`` (for shards
        ``"<shard>[<key>]: ..."``; samples without image or label entries included), and ``"checked"``.
    """
    path = Path(path).expanduser()
    rec = describe_data(path)
    bad: List[str] = []
    checked = 0
    if rec["format"] == "shards":
        for split in rec["splits"]:
            stream = ShardStream(path, split=split)
            n_classes = len(rec.get("classes") or []) or None
            for s in range(len(stream.shards)):
                try:
                    for _, _, raw in stream.shard_samples(s):
                        where = f"{stream.shards[s]}[{raw.get('__key__')}]"
                        key = next((k for k in IMAGE_KEYS if k in raw), None)
                        try:
                            if key is None or "cls" not in raw:
                                raise DataFileError(where, "sample lacks its " + ("image" if key is None else
                                                                                  "label (.cls)") + " entry")
                            shard_label(raw, where, n_classes)
                            img = decode_image(raw[key], name=where)
                            if stream.depth:
                                if DEPTH_KEY not in raw:
                                    raise DataFileError(where, f"sample lacks its depth entry ({DEPTH_KEY})")
                                decode_depth(raw[DEPTH_KEY], name=where, shape=tuple(img.shape[-2:]))
                        except DataFileError as e:
                            bad.append(str(e))
                        checked += 1
                        if progress is not None:
                            progress(1)
                except DataFileError as e:  # a truncated tar or a count that disagrees with the manifest
                    bad.append(str(e))
    else:
        roots = [path / "train", path / "val"] if "train" in rec["splits"] else [path]
        for root in roots:
            files, _, _, _ = scan_image_folder(root, classes=rec["classes"], allow_empty=True)
            rgbd = bool(files) and has_depth_beside(root / files[0])
            for f in files:
                try:
                    img = decode_image(root / f)
                    if rgbd:
                        read_depth_beside(root / f, tuple(img.shape[-2:]))
                except DataFileError as e:
                    bad.append(str(e))
                checked += 1
                if progress is not None:
                    progress(1)
        empty = [f"{name}: class folder without images" for key, split in rec["splits"].items() if key != "val"
                 for name, n in zip(rec["classes"], split["per_class"]) if n == 0]
        bad.extend(empty)
    rec["checked"] = checked
    rec["bad"] = bad
    return rec
