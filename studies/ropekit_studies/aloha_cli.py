"""``ropekit robot aloha experiment`` and ``ropekit robot aloha merge``: the ALOHA study's commands, added to
``ropekit robot aloha`` through the ``ropekit.commands`` entry points of the ``ropekit-studies`` distribution.

::

    ropekit robot aloha experiment --preset cpu --out runs/aloha   # or --preset gpu / --quick
    ropekit robot aloha merge runs/aloha-s0 runs/aloha-s1 --out runs/aloha   # pool runs made apart
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

from ropekit.robot.aloha.policy import encoding_label

from . import aloha as study  # (through the module: tests replace its runner)
from .recipes.robot import with_later_backbone

__all__ = ["ExperimentCommand", "MergeCommand", "experiment_config", "parse_command", "compare_commands"]


def _list(text: str) -> List[str]:
    return [t for t in text.split(",") if t]


def add_experiment_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ropekit robot aloha experiment``."""
    parser.add_argument("--preset", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: sized for 2 CPU cores (< 1 hour, transfer-cube); gpu: larger images, model and "
                        "schedule, both tasks (about 30-35 minutes on one H100, estimated from a measured "
                        "1500-step run)")
    parser.add_argument("--quick", action="store_true", help="tiny settings (seconds; for tests)")
    parser.add_argument("--out", default="runs/aloha", help="output folder")
    parser.add_argument("--tasks", type=_list, default=None, help="comma-separated tasks")
    parser.add_argument("--pe", type=_list, default=None,
                   help="comma-separated encoders: absolute, axial, mixed, cayley, cayley-rgbd")
    parser.add_argument("--seeds", type=lambda t: [int(x) for x in _list(t)], default=None)
    parser.add_argument("--steps", type=int, default=None, help="training steps per policy")
    parser.add_argument("--aux-weight", type=float, default=None,
                   help="weight of the object-position loss (default: the preset's, 1; 0: off)")
    parser.add_argument("--demos", type=int, default=None)
    parser.add_argument("--eval-episodes", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="torch device for training (cpu, cuda)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--demo-depth", action="store_true",
                   help="record depth even without an RGB-D encoder (one demo set for split runs)")
    parser.add_argument("--no-checkpoints", action="store_true", help="do not write the policies' checkpoints")
    parser.add_argument("--workers", type=int, default=1, help="processes collecting a missing demo set")
    parser.add_argument("--no-progress", action="store_true")


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``ropekit robot aloha merge``."""
    parser.add_argument("dirs", nargs="+",
                   help="experiment output folders (a folder written by merge contributes its parts)")
    parser.add_argument("--out", required=True)


def run_merge_command(args: Any) -> int:
    study.merge_results(args.dirs, args.out)
    print((Path(args.out) / "table.md").read_text())
    return 0


def experiment_config(args: Any):
    """The :class:`~ropekit_studies.aloha.AlohaExperimentConfig` that ``ropekit robot aloha experiment`` with the parsed
    ``args`` runs: the preset, then the options given on the command line."""
    cfg = study.PRESETS["quick" if args.quick else args.preset]()
    changes: dict = {"progress": not args.no_progress, "save_checkpoints": not args.no_checkpoints}
    if args.demo_depth:
        changes["demo_depth"] = True
    if args.tasks:
        changes["tasks"] = args.tasks
    if args.pe:
        changes["encodings"] = [encoding_label(p) for p in args.pe]
    if args.steps:
        changes["train"] = {**cfg.train, "steps": args.steps}
    if args.aux_weight is not None:
        changes["policy"] = {**cfg.policy, "aux_weight": args.aux_weight}
    given = {"seeds": args.seeds, "demos": args.demos, "eval_episodes": args.eval_episodes,
             "threads": args.threads, "cache_dir": args.cache_dir}
    changes.update({k: v for k, v in given.items() if v})
    return dataclasses.replace(cfg, **changes)


def parse_command(command: str) -> Any:
    """Parse a recorded ``ropekit robot aloha ...`` command line (as ``config.json`` stores it) into its arguments.

    Raises:
        ValueError: ``command`` is not a ``ropekit robot aloha`` command.
    """
    words = shlex.split(command)
    if words[:3] != ["ropekit", "robot", "aloha"]:
        raise ValueError(f"not a 'ropekit robot aloha' command: {command!r}")
    parser = argparse.ArgumentParser(prog="ropekit robot aloha")
    sub = parser.add_subparsers(dest="aloha_command", required=True)
    ExperimentCommand.add_arguments(sub.add_parser("experiment"))
    MergeCommand.add_arguments(sub.add_parser("merge"))
    if len(words) > 3 and words[3] not in ("experiment", "merge"):
        return argparse.Namespace(aloha_command=words[3])  # another aloha command (collect, train, eval)
    return parser.parse_args(words[3:])


def run_experiment_command(args: Any) -> int:
    cfg = experiment_config(args)
    command = "ropekit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    doc = study.run_experiment(cfg, args.out, command=command, device=args.device, workers=args.workers)
    print((Path(args.out) / "table.md").read_text())
    print(f"results in {args.out} ({doc['timings_s']['total'] / 60:.1f} min)")
    return 0


def compare_commands(doc: Dict[str, Any], folder: str, extra_args: Sequence[str] = ()) -> List[str]:
    """Differences between a committed ALOHA study's ``config.json`` (``doc``, of the folder named ``folder``) and
    what its recorded commands train at this version (the ALOHA study's part of
    :func:`ropekit_studies.recipes.compare_with_committed`, which reads the folder).

    ``doc`` is one study's (its ``command`` and ``config``) or a merge of several
    (``merged``: one such record per part). Each part's command is parsed as ``ropekit robot aloha experiment``
    parses it, and the configuration it resolves to now is compared field by field with the recorded one
    (``threads``, ``progress`` and ``cache_dir`` are the machine's, not the recipe's, and are not compared).
    ``extra_args`` are appended to every recorded command: options that were the preset's default when the
    study ran and that its ``commands.sh`` now states (e.g. ``--aux-weight 0`` for the study made before the
    object loss). One line per difference; empty when every part is what its command trains now.
    """
    machine = {"threads", "progress", "cache_dir"}
    diffs: List[str] = []
    for i, part in enumerate(doc.get("merged", [doc])):
        where = f"{folder} part {i}"
        try:
            args = parse_command(part["command"] + "".join(f" {shlex.quote(a)}" for a in extra_args))
        except (ValueError, SystemExit, KeyError):
            diffs.append(f"{where}: no parsable 'ropekit robot aloha experiment' command recorded")
            continue
        if args.aloha_command != "experiment":
            diffs.append(f"{where}: recorded command is 'aloha {args.aloha_command}', not 'aloha experiment'")
            continue
        now = json.loads(json.dumps(experiment_config(args).to_dict()))
        got = with_later_backbone(part.get("config") or {})
        for key in sorted((set(now) | set(got)) - machine):
            a, b = got.get(key, "<missing>"), now.get(key, "<missing>")
            if isinstance(a, dict) and isinstance(b, dict):
                diffs += [f"{where}: {key}.{k}: committed {a.get(k, '<missing>')!r}, now {b.get(k, '<missing>')!r}"
                          for k in sorted(set(a) | set(b)) if a.get(k, "<missing>") != b.get(k, "<missing>")]
            elif a != b:
                diffs.append(f"{where}: {key}: committed {a!r}, now {b!r}")
    return diffs


class ExperimentCommand:
    """every encoder x seed on the same demos: table, curves, plot"""

    add_arguments = staticmethod(add_experiment_arguments)
    run = staticmethod(run_experiment_command)


class MergeCommand:
    """pool the results of experiment runs made apart (e.g. one per seed)"""

    add_arguments = staticmethod(add_merge_arguments)
    run = staticmethod(run_merge_command)
