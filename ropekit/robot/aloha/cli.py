"""``ropekit robot aloha collect | train | eval | experiment``.

::

    ropekit robot aloha collect --task transfer_cube --episodes 50 [--depth]
    ropekit robot aloha train --task transfer_cube --pe cayley --out runs/aloha/cayley
    ropekit robot aloha eval runs/aloha/cayley --task transfer_cube --episodes 50
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
from typing import Any, List, Sequence, Union

__all__ = ["add_arguments", "experiment_config", "parse_command", "compare_with_committed", "run"]


def _list(text: str) -> List[str]:
    return [t for t in text.split(",") if t]


def _hw(text: str):
    parts = text.lower().replace("x", ",").split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"image size must be HxW (e.g. 48x64), got {text!r}")
    return int(parts[0]), int(parts[1])


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="transfer_cube", help="transfer_cube or insertion")
    p.add_argument("--episodes", type=int, default=50, help="successful demos to keep")
    p.add_argument("--seed", type=int, default=0, help="first object-pose seed of the demos")
    p.add_argument("--image-size", type=_hw, default=(48, 64), metavar="HxW", help="rendered size (default 48x64)")
    p.add_argument("--camera", default="top", help="camera the policy sees (default top)")
    p.add_argument("--fovy", type=float, default=None,
                   help="the camera's vertical field of view in degrees (default: the scene's, 78 for top)")
    p.add_argument("--depth", action="store_true", help="also record depth (needed by RGB-D policies)")
    p.add_argument("--frame-stride", type=int, default=2, help="render every k-th step (training examples)")
    p.add_argument("--cache-dir", default=None, help="demo-set cache (default ~/.cache/ropekit/aloha)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes simulating demos side by side (the set does not depend on it)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="aloha_command", metavar="<collect|train|eval|experiment|merge>",
                                required=True)

    p = sub.add_parser("collect", help="scripted-expert demos (replayed, successes only), cached by config")
    _demo_args(p)

    p = sub.add_parser("train", help="train one diffusion policy on a (cached) demo set")
    _demo_args(p)
    p.add_argument("--out", required=True, help="run folder (config.json, metrics.csv, checkpoint.pt)")
    p.add_argument("--pe", default="cayley", help="encoder: absolute, axial, mixed, cayley, cayley-rgbd")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--train-seed", type=int, default=0)
    p.add_argument("--aux-weight", type=float, default=1.0,
                   help="weight of the object-position loss (training only; 0: off; default 1)")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("eval", help="success rate of trained policies on fixed held-out seeds")
    p.add_argument("runs", nargs="+", help="run folders or checkpoint files")
    p.add_argument("--task", default="transfer_cube")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--eval-seed", type=int, default=100_000, help="first evaluation object-pose seed")
    p.add_argument("--episode-steps", type=int, default=400)
    p.add_argument("--parallel", type=int, default=10, help="episodes simulated in lockstep")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("experiment", help="every encoder x seed on the same demos: table, curves, plot")
    p.add_argument("--preset", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: sized for 2 CPU cores (< 1 hour, transfer-cube); gpu: larger images, model and "
                        "schedule, both tasks (about 30-35 minutes on one H100, estimated from a measured "
                        "1500-step run)")
    p.add_argument("--quick", action="store_true", help="tiny settings (seconds; for tests)")
    p.add_argument("--out", default="runs/aloha", help="output folder")
    p.add_argument("--tasks", type=_list, default=None, help="comma-separated tasks")
    p.add_argument("--pe", type=_list, default=None,
                   help="comma-separated encoders: absolute, axial, mixed, cayley, cayley-rgbd")
    p.add_argument("--seeds", type=lambda t: [int(x) for x in _list(t)], default=None)
    p.add_argument("--steps", type=int, default=None, help="training steps per policy")
    p.add_argument("--aux-weight", type=float, default=None,
                   help="weight of the object-position loss (default: the preset's, 1; 0: off)")
    p.add_argument("--demos", type=int, default=None)
    p.add_argument("--eval-episodes", type=int, default=None)
    p.add_argument("--device", default="cpu", help="torch device for training (cpu, cuda)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--demo-depth", action="store_true",
                   help="record depth even without an RGB-D encoder (one demo set for split runs)")
    p.add_argument("--no-checkpoints", action="store_true", help="do not write the policies' checkpoints")
    p.add_argument("--workers", type=int, default=1, help="processes collecting a missing demo set")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("merge", help="pool the results of experiment runs made apart (e.g. one per seed)")
    p.add_argument("dirs", nargs="+",
                   help="experiment output folders (a folder written by merge contributes its parts)")
    p.add_argument("--out", required=True)


def run(args: Any) -> int:
    return {"collect": _collect, "train": _train, "eval": _eval, "experiment": _experiment,
            "merge": _merge}[args.aloha_command](args)


def _merge(args: Any) -> int:
    from .experiment import merge_results

    merge_results(args.dirs, args.out)
    print((Path(args.out) / "table.md").read_text())
    return 0


def _demo_config(args: Any, depth: bool = False):
    from .expert import DemoConfig

    return DemoConfig(task=args.task, episodes=args.episodes, seed=args.seed, cameras=(args.camera,),
                      image_hw=args.image_size, fovy=args.fovy, depth=args.depth or depth,
                      frame_stride=args.frame_stride)


def _collect(args: Any) -> int:
    from .expert import load_or_collect

    demos, path, cached = load_or_collect(_demo_config(args), args.cache_dir, progress=True, workers=args.workers)
    print(f"{len(demos['episode_seed'])} demos ({int(demos['attempts'])} attempts, failed seeds "
          f"{demos['failed_seeds'].tolist()}) {'from the cache' if cached else 'collected'}: {path}")
    return 0


def _train(args: Any) -> int:
    from ..train import PolicyTrainConfig, train_policy
    from .experiment import encoding_label
    from .expert import load_or_collect
    from .policy import ENCODINGS, AlohaChunks, AlohaPolicy, AlohaPolicyConfig, save_aloha_policy

    modality, pe, options = ENCODINGS[encoding_label(args.pe)]
    demos, path, _ = load_or_collect(_demo_config(args, depth=modality == "rgbd"), args.cache_dir, progress=True,
                                     workers=args.workers)
    cfg = AlohaPolicyConfig(pe=pe, pe_options=dict(options), modality=modality, image_hw=args.image_size,
                            fovy=args.fovy, aux_weight=args.aux_weight)
    policy = AlohaPolicy(cfg)
    # no image shift: the object loss ties pixels to positions (the study presets train without it too)
    tc = PolicyTrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.train_seed, shift=0)
    rows = train_policy(policy, AlohaChunks(demos, cfg), tc, None, progress=not args.no_progress)
    out = Path(args.out)
    save_aloha_policy(policy, out / "checkpoint.pt", train_config=tc.to_dict(), history=rows, demos=str(path),
                      task=args.task)
    print(f"policy saved to {out / 'checkpoint.pt'} (final loss {rows[-1]['loss']:.4f})")
    return 0


def _eval(args: Any) -> int:
    from .policy import evaluate_policy, load_aloha_policy

    seeds = list(range(args.eval_seed, args.eval_seed + args.episodes))
    results = {}
    for r in args.runs:
        ev = evaluate_policy(load_aloha_policy(r), args.task, seeds, args.episode_steps, parallel=args.parallel,
                             progress=not args.no_progress)
        results[str(r)] = ev
        print(f"{r}: success {ev['success_rate']:.2f} over {len(seeds)} episodes ({ev['seconds']:.0f} s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


def experiment_config(args: Any):
    """The :class:`~.experiment.AlohaExperimentConfig` that ``ropekit robot aloha experiment`` with the parsed
    ``args`` runs: the preset, then the options given on the command line."""
    from .experiment import PRESETS, encoding_label

    cfg = PRESETS["quick" if args.quick else args.preset]()
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
    add_arguments(parser)
    return parser.parse_args(words[3:])


def _experiment(args: Any) -> int:
    from .experiment import run_experiment

    cfg = experiment_config(args)
    command = "ropekit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    doc = run_experiment(cfg, args.out, command=command, device=args.device, workers=args.workers)
    print((Path(args.out) / "table.md").read_text())
    print(f"results in {args.out} ({doc['timings_s']['total'] / 60:.1f} min)")
    return 0


def compare_with_committed(folder: Union[str, Path], extra_args: Sequence[str] = ()) -> List[str]:
    """Differences between a committed study folder and what its recorded commands train at this version.

    ``folder``'s ``config.json`` is one study's (its ``command`` and ``config``) or a merge of several
    (``merged``: one such record per part). Each part's command is parsed as ``ropekit robot aloha experiment``
    parses it, and the configuration it resolves to now is compared field by field with the recorded one
    (``threads``, ``progress`` and ``cache_dir`` are the machine's, not the recipe's, and are not compared).
    ``extra_args`` are appended to every recorded command: options that were the preset's default when the
    study ran and that its ``commands.sh`` now states (e.g. ``--aux-weight 0`` for the study made before the
    object loss). One line per difference; empty when every part is what its command trains now.
    """
    from ..recipes import with_later_backbone

    doc = json.loads((Path(folder) / "config.json").read_text())
    machine = {"threads", "progress", "cache_dir"}
    diffs: List[str] = []
    for i, part in enumerate(doc.get("merged", [doc])):
        where = f"{Path(folder).name} part {i}"
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
