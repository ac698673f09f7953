"""Convert an image folder to WebDataset tar shards, and check a folder or shards for unreadable images.

* :func:`write_shards` -- ``root/<class>/<image>`` (or ``root/train/...`` + ``root/val/...``) → ``out/train-000000
  .tar, ...``, ``out/val-000000.tar, ...`` and the manifest ``out/shards.json`` (see
  :func:`ropekit.data.streaming.read_manifest`). Each sample is ``<key>.<ext>`` -- the file's encoded bytes,
  unchanged (``.jpeg`` stored as ``.jpg``) -- and ``<key>.cls``, the label as decimal text, written with
  ``webdataset.TarWriter``. Samples are written in a seeded random order, so that every shard mixes the classes.
* :func:`check_data` -- decode every image of a folder or of shards; counts per class and the unreadable files.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .._optional import require
from ._common import DataFileError, PathLike, stratified_split
from .decode import decode_image
from .shard_stream import IMAGE_KEYS, MANIFEST_NAME, ShardStream, read_manifest, shard_label
from .streaming import scan_image_folder

__all__ = ["write_shards", "check_data", "describe_data"]

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


def write_shards(
    folder: PathLike,
    out: PathLike,
    *,
    shard_size: int = 1000,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    skip_corrupt: bool = False,
    progress: Progress = None,
) -> Dict[str, Any]:
    """Write ``folder``'s images as tar shards of ``shard_size`` samples and the manifest ``shards.json``.

    Args:
        folder: ``root/<class>/<image>`` (then ``val_fraction`` of each class, chosen by ``split_seed``, goes to
            the ``val`` split; 0 writes ``train`` only) or ``root/train/<class>/...`` with ``root/val/...``.
        out: output directory (created).
        shard_size: samples per shard (the last shard of a split may hold fewer).
        val_fraction, split_seed: the stratified split of a flat folder.
        skip_corrupt: leave out files Pillow cannot identify (counted in the manifest's ``skipped``) instead of
            stopping with an error naming the first. Only the header is checked here (the bytes are copied, not
            decoded); ``ropekit data check`` decodes every image.
        progress: called with 1 after each sample.

    Returns:
        the manifest written (a dict).
    """
    wds = require("webdataset", "train", "writing WebDataset shards")
    from PIL import Image

    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    folder, out = Path(folder).expanduser(), Path(out).expanduser()
    classes, splits = _splits_of(folder, val_fraction, split_seed)
    out.mkdir(parents=True, exist_ok=True)
    manifest: Dict[str, Any] = {"format": "ropekit-shards", "version": 1, "classes": classes,
                                "source": str(folder), "shard_size": shard_size, "splits": {}, "skipped": []}
    for split, (root, files, labels) in splits.items():
        order = np.random.default_rng([split_seed, len(files), 5]).permutation(len(files))
        entries: List[Dict[str, Any]] = []
        writer: Any = None
        for n, i in enumerate(order.tolist()):
            path = root / files[i]
            try:
                with Image.open(path) as im:
                    im.verify()  # header (and PNG checksums); no full decode
            except Exception as e:  # noqa: BLE001 - whatever Pillow raises on a non-image
                if not skip_corrupt:
                    raise DataFileError(path, f"not a readable image ({type(e).__name__}: {e}); pass "
                                              "--skip-corrupt to leave such files out") from None
                manifest["skipped"].append(str(path))
                continue
            if writer is None or entries[-1]["count"] == shard_size:
                if writer is not None:
                    writer.close()
                name = f"{split}-{len(entries):06d}.tar"
                writer = wds.TarWriter(str(out / name))
                entries.append({"file": name, "count": 0})
            ext = os.path.splitext(files[i])[1].lower().lstrip(".")
            ext = "jpg" if ext == "jpeg" else ext
            writer.write({"__key__": f"{split}_{n:08d}", ext: path.read_bytes(), "cls": str(int(labels[i]))})
            entries[-1]["count"] += 1
            if progress is not None:
                progress(1)
        if writer is not None:
            writer.close()
        manifest["splits"][split] = {"shards": entries, "count": sum(e["count"] for e in entries)}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
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
                            decode_image(raw[key], name=where)
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
            for f in files:
                try:
                    decode_image(root / f)
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
