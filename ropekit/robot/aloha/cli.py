"""``ropekit robot aloha collect | train | eval`` (``experiment`` and ``merge``: the ``ropekit-studies``
distribution's, :mod:`ropekit_studies.aloha_cli`).

::

    ropekit robot aloha collect --task transfer_cube --episodes 50 [--depth]
    ropekit robot aloha train --task transfer_cube --pe cayley --out runs/aloha/cayley
    ropekit robot aloha eval runs/aloha/cayley --task transfer_cube --episodes 50
    ropekit robot aloha experiment --preset cpu --out runs/aloha   # or --preset gpu / --quick
    ropekit robot aloha merge runs/aloha-s0 runs/aloha-s1 --out runs/aloha   # pool runs made apart
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]


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

    from ...cli import add_plugin_parsers  # the studies add experiment and merge (ropekit-studies)

    add_plugin_parsers(sub, "robot.aloha", {
        "experiment": "every encoder x seed on the same demos: table, curves, plot",
        "merge": "pool the results of experiment runs made apart (e.g. one per seed)"})


def run(args: Any) -> int:
    own = {"collect": _collect, "train": _train, "eval": _eval}
    if args.aloha_command in own:
        return own[args.aloha_command](args)
    from ...cli import run_plugin

    return int(run_plugin(args) or 0)


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
    from .expert import load_or_collect
    from .policy import ENCODINGS, AlohaChunks, AlohaPolicy, AlohaPolicyConfig, encoding_label, save_aloha_policy

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
