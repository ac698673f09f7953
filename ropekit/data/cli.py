"""``ropekit data``: list and inspect the datasets, and render the RGB-D scene sets.

* ``ropekit data list`` -- the dataset names ``load_dataset`` accepts;
* ``ropekit data info NAME [--root PATH]`` -- sizes, classes, sample shape and pixel statistics of one;
* ``ropekit data make-scenes --n 20000 --size 64`` -- render (or load from cache) the pybullet RGB-D scenes of
  the detection study (``ropekit.detection.scenes``; needs ``pybullet``).
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="<action>")
    sub.add_parser("list", help="list the dataset names")
    info = sub.add_parser("info", help="describe one dataset")
    info.add_argument("name", help="dataset name (see `ropekit data list`)")
    info.add_argument("--root", default=None, help="path for user data (imagefolder, cifar10/100, mnist-idx)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    scenes = sub.add_parser("make-scenes", help="render the RGB-D detection scenes (cached as npz shards)",
                            add_help=False)
    scenes.add_argument("scene_args", nargs=argparse.REMAINDER, help="options of make-scenes (--help for them)")


def run(args: argparse.Namespace) -> Optional[int]:
    from . import list_datasets, load_dataset

    action = getattr(args, "data_command", None)
    if action in (None, "list"):
        print("\n".join(list_datasets()))
        return 0
    if action == "make-scenes":
        from ..detection.scenes import make_scenes_main  # pybullet is imported (or named missing) when rendering

        return make_scenes_main(args.scene_args)
    train, test, info = load_dataset(args.name, root=args.root)
    x = train.images
    finite = x[x == x]
    record = {
        "name": info.name, "kind": info.kind, "num_classes": info.num_classes, "in_chans": info.in_chans,
        "sample_shape": list(train[0][0].shape), "train": len(train), "test": len(test),
        "pixel_min": float(finite.min()), "pixel_max": float(finite.max()), "pixel_mean": float(finite.mean()),
    }
    if args.json:
        print(json.dumps(record))
    else:
        for key, value in record.items():
            print(f"{key:>12}: {value}")
    return 0
