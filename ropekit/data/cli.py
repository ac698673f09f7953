"""``ropekit data``: list, inspect, generate, convert and check datasets; render the RGB-D scene sets.

* ``ropekit data list`` -- the dataset names ``load_dataset`` accepts, and the streamed ones ``open_stream`` does;
* ``ropekit data info NAME|PATH [--root PATH] [--json]`` -- for a dataset name: sizes, classes, sample shape and
  pixel statistics; for a folder or shard directory: its layout, classes and samples per class (nothing decoded);
* ``ropekit data check PATH [--json]`` -- decode every image of a folder or of shards; counts per class and the
  unreadable files by name; exit code 1 if there is any;
* ``ropekit data convert FOLDER OUT --shard-size N`` -- write an image folder as WebDataset tar shards plus
  ``shards.json`` (the encoded bytes are copied, not re-encoded); an RGB-D folder (``0001.png`` with
  ``0001.depth.npy`` beside it) as RGB-D shards; ``ropekit data convert rgbd-digits OUT`` (an RGB-D data set's
  name) writes that data set's train and test splits as RGB-D shards (8-bit PNG colour, float32 depth);
* ``ropekit data make-fake FOLDER --classes 4 --per-class 24 --size 64`` -- write a folder of generated JPEGs;
* ``ropekit data make-scenes --n 20000 --size 64`` -- render (or load from cache) the pybullet RGB-D scenes of
  the detection study (``ropekit.detection.scenes``; needs ``pybullet``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="<action>")
    sub.add_parser("list", help="list the dataset names")
    info = sub.add_parser("info", help="describe a dataset (by name) or a folder / shard directory (by path)")
    info.add_argument("name", help="dataset name (see `ropekit data list`) or a path")
    info.add_argument("--root", default=None, help="path for user data (imagefolder, cifar10/100, mnist-idx)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    check = sub.add_parser("check", help="decode every image of a folder or shards; exit 1 if any is unreadable")
    check.add_argument("path", help="an image folder (root/<class>/<image>, or with train/ and val/) or a shard "
                                    "directory (with shards.json)")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.add_argument("--no-progress", action="store_true", help="no progress bar")
    conv = sub.add_parser("convert", help="write an image folder (or an RGB-D data set) as WebDataset tar shards "
                                          "and shards.json")
    conv.add_argument("folder", help="root/<class>/<image>, or root/train/<class>/... with root/val/...; RGB-D: "
                                     "each image with <stem>.depth.npy (float (H, W) metres) beside it; or the "
                                     "name of an RGB-D data set (rgbd-digits, captioned-scenes)")
    conv.add_argument("out", help="output directory")
    conv.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    conv.add_argument("--val-fraction", type=float, default=0.2,
                      help="fraction of each class written to the val split of a flat folder (0: train only)")
    conv.add_argument("--split-seed", type=int, default=0, help="seed of that split and of the sample order")
    conv.add_argument("--skip-corrupt", action="store_true", help="leave out files that are not images")
    conv.add_argument("--image-size", type=int, default=None, help="image side of a generated data set")
    conv.add_argument("--overwrite", action="store_true",
                      help="replace an earlier conversion in OUT (otherwise OUT must be empty)")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    fake = sub.add_parser("make-fake", help="write a folder of generated JPEG images (class = shape and colour)")
    fake.add_argument("folder", help="output directory")
    fake.add_argument("--classes", type=int, default=4)
    fake.add_argument("--per-class", type=int, default=24, help="training images per class")
    fake.add_argument("--val-per-class", type=int, default=0,
                      help="also write root/val with this many per class (then training images go to root/train)")
    fake.add_argument("--size", type=int, default=64, help="image side in pixels")
    fake.add_argument("--seed", type=int, default=0)
    fake.add_argument("--format", choices=("jpg", "png"), default="jpg")
    fake.add_argument("--no-progress", action="store_true", help="no progress bar")
    scenes = sub.add_parser("make-scenes", help="render the RGB-D detection scenes (cached as npz shards)",
                            add_help=False)
    scenes.add_argument("scene_args", nargs=argparse.REMAINDER, help="options of make-scenes (--help for them)")


def _bar(total: int, desc: str, off: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="img", disable=off or None, file=sys.stderr)


def _print(record: Dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(record))
        return
    for key, value in record.items():
        if isinstance(value, dict):
            print(f"{key:>12}:")
            for k, v in value.items():
                print(f"{'':>14}{k}: {_readable(v)}")
        else:
            print(f"{key:>12}: {_readable(value)}")


def _readable(value: Any, inner: bool = False) -> str:
    """A value of a record as text for people: ``{"samples": 16, "per_class": [8, 8]}`` -> ``samples 16, per class
    [8 8]``; long lists cut after 20 items with their length."""
    if isinstance(value, dict):
        return ", ".join(f"{str(k).replace('_', ' ')} {_readable(v, True)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items = [_readable(v, True) for v in value[:20]] + ([f"... ({len(value)} in all)"] if len(value) > 20 else [])
        return f"[{' '.join(items)}]" if inner else ", ".join(items)
    return str(value)


def _with_bar(total: int, desc: str, off: bool, work: Callable[[Callable[[int], None]], Any]) -> Any:
    bar = _bar(total, desc, off)
    try:
        return work(bar.update)
    finally:
        bar.close()


def run(args: argparse.Namespace) -> Optional[int]:
    from . import list_datasets, load_dataset
    from .shards import check_data, describe_data, write_shards
    from .streaming import list_streams

    action = getattr(args, "data_command", None)
    if action in (None, "list"):
        print("\n".join(list_datasets() + [f"{s} (streamed: open_stream)" for s in list_streams()]))
        return 0
    if action == "make-scenes":
        from ..detection.scenes import make_scenes_main  # pybullet is imported (or named missing) when rendering

        return make_scenes_main(args.scene_args)
    if action == "make-fake":
        from .fake import write_fake_image_folder

        total = args.classes * (args.per_class + args.val_per_class)
        counts = _with_bar(total, "make-fake", args.no_progress, lambda up: write_fake_image_folder(
            args.folder, classes=args.classes, per_class=args.per_class, size=args.size, seed=args.seed,
            image_format=args.format, val_per_class=args.val_per_class, progress=up))
        print(f"wrote {counts['train']} training" + (f" and {counts['val']} validation" if counts["val"] else "")
              + f" images of {args.classes} classes to {args.folder}")
        return 0
    if action == "convert" and not Path(args.folder).expanduser().exists() and args.folder in list_datasets():
        from .shards import write_dataset_shards

        data = load_dataset(args.folder, image_size=args.image_size, split_seed=args.split_seed)
        m = _with_bar(len(data[0]) + len(data[1]), "convert", args.no_progress, lambda up: write_dataset_shards(
            data, args.out, shard_size=args.shard_size, seed=args.split_seed, overwrite=args.overwrite, progress=up))
        parts = [f"{split}: {s['count']} samples in {len(s['shards'])} shards" for split, s in m["splits"].items()]
        print(f"{args.out}: " + "; ".join(parts) + f" (RGB-D); manifest {Path(args.out) / 'shards.json'}")
        return 0
    if action == "convert":
        total = sum(s["samples"] for s in describe_data(args.folder)["splits"].values())
        m = _with_bar(total, "convert", args.no_progress, lambda up: write_shards(
            args.folder, args.out, shard_size=args.shard_size, val_fraction=args.val_fraction,
            split_seed=args.split_seed, skip_corrupt=args.skip_corrupt, overwrite=args.overwrite, progress=up))
        parts = [f"{split}: {s['count']} samples in {len(s['shards'])} shards" for split, s in m["splits"].items()]
        print(f"{args.out}: " + "; ".join(parts) + (" (RGB-D)" if m["depth"] else "")
              + f"; manifest {Path(args.out) / 'shards.json'}"
              + (f"; skipped {len(m['skipped'])} unreadable file(s), first {m['skipped'][0]}" if m["skipped"] else ""))
        return 0
    if action == "check":
        total = sum(s["samples"] for s in describe_data(args.path)["splits"].values())
        rec = _with_bar(total, "check", args.no_progress, lambda up: check_data(args.path, progress=up))
        if args.json:
            print(json.dumps(rec))
        else:
            _print({k: v for k, v in rec.items() if k != "bad"}, False)
            print(f"{'bad':>12}: {len(rec['bad'])}")
            for line in rec["bad"]:
                print(f"  {line}")
        return 1 if rec["bad"] else 0
    # info: a path describes the folder / shards; otherwise a dataset name
    if args.root is None and (Path(args.name).expanduser().exists() or "/" in args.name):
        _print(describe_data(args.name), args.json)
        return 0
    train, test, info = load_dataset(args.name, root=args.root)
    x = train.images
    finite = x[x == x]
    record = {
        "name": info.name, "kind": info.kind, "num_classes": info.num_classes, "in_chans": info.in_chans,
        "sample_shape": list(train[0][0].shape), "train": len(train), "test": len(test),
        "pixel_min": float(finite.min()), "pixel_max": float(finite.max()), "pixel_mean": float(finite.mean()),
    }
    _print(record, args.json)
    return 0
