"""``ropekit robot collect | train | eval | experiment`` (registered in :mod:`ropekit.cli`).

::

    ropekit robot collect --out runs/robot/demos.npz --episodes 300
    ropekit robot train --demos runs/robot/demos.npz --out runs/robot/2d --modality image
    ropekit robot train --demos runs/robot/demos.npz --out runs/robot/3d --modality rgbd --init-from runs/robot/2d
    ropekit robot eval runs/robot/2d runs/robot/3d --episodes 50
    ropekit robot experiment --out runs/robot [--quick]
    ropekit robot aloha collect|train|eval|experiment ...   (bimanual ALOHA; needs ropekit[aloha])
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import experiment
from .env import PickConfig

__all__ = ["add_arguments", "run"]

_PRESETS = ("in_distribution", "ood_table_height", "ood_large_distractors", "ood_light")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="robot_command", metavar="<collect|train|eval|experiment|aloha>", required=True)

    p = sub.add_parser("collect", help="record scripted-expert demonstrations (.npz)")
    p.add_argument("--out", required=True, help="output .npz file")
    p.add_argument("--episodes", type=int, default=300)
    p.add_argument("--noise", type=float, default=0.005, help="std (m) of the expert's action noise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--preset", choices=_PRESETS, default="in_distribution")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--full-episodes", action="store_true",
                   help="keep stepping after the first success (default: stop there)")

    p = sub.add_parser("train", help="train a diffusion policy on demonstrations")
    p.add_argument("--demos", required=True, help=".npz written by `ropekit robot collect`")
    p.add_argument("--out", required=True, help="run folder (config.json, metrics.csv, checkpoint.pt)")
    p.add_argument("--modality", choices=("image", "rgbd"), default="image",
                   help="image: RGB with a 2-D encoding; rgbd: RGB-D with a 3-D encoding (depth lift)")
    p.add_argument("--pe", default="circulant", help="create_pe name of the encoder's encoding")
    p.add_argument("--init-from", default=None,
                   help="start from this run's weights (a 2-D run into --modality rgbd: depth lift at zero, "
                        "so the policy starts equal to the 2-D one)")
    p.add_argument("--depth-scale-init", type=float, default=None,
                   help="initial scale of the depth lift z = a * depth + b (default: 0 with --init-from, so the "
                        "RGB-D policy starts equal to the 2-D one; 1 from scratch)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--horizon", type=int, default=8, help="action chunk length (from scratch only)")
    p.add_argument("--n-action-steps", type=int, default=4,
                   help="actions executed before re-planning (from scratch only)")
    p.add_argument("--all-episodes", action="store_true", help="also train on failed demo episodes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("eval", help="success rate of trained policies in and out of distribution")
    p.add_argument("runs", nargs="+", help="run folders (or checkpoint files)")
    p.add_argument("--conditions", nargs="+", choices=_PRESETS, default=list(_PRESETS))
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--seed", type=int, default=1000, help="evaluation seed (episode seeds derive from it)")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("experiment", help="the whole 2-D vs 3-D STRING study, with reports")
    experiment.add_arguments(p)

    from .aloha import cli as aloha_cli  # imports no simulator package until a command runs

    p = sub.add_parser("aloha", help="bimanual ALOHA tasks in MuJoCo: demos, diffusion policies, encoder study")
    aloha_cli.add_arguments(p)


def run(args: Any) -> int:
    if args.robot_command == "aloha":
        from .aloha import cli as aloha_cli

        return aloha_cli.run(args)
    return {"collect": _collect, "train": _train, "eval": _eval, "experiment": experiment.run}[args.robot_command](args)


def _collect(args: Any) -> int:
    from .demos import collect_demos

    cfg = PickConfig.preset(args.preset, image_size=args.image_size, max_steps=args.max_steps,
                            terminate_on_success=not args.full_episodes)
    data = collect_demos(args.episodes, cfg, seed=args.seed, workers=args.workers, out=args.out, noise=args.noise)
    print(f"{args.episodes} episodes, {len(data['state'])} steps, expert success "
          f"{data['episode_success'].mean():.0%} -> {args.out}")
    return 0


def _train(args: Any) -> int:
    from .demos import load_demos
    from .policy import DiffusionPolicy, PolicyConfig, init_from_2d
    from .train import DemoChunks, PolicyTrainConfig, load_policy, train_policy

    demos = load_demos(args.demos)
    tc = PolicyTrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                           seed=args.seed, only_successful=not args.all_episodes)
    base = load_policy(args.init_from) if args.init_from else None
    if base is not None and base.config.modality == args.modality:
        policy = base  # continue training
    else:
        if base is not None and (base.config.modality, args.modality) != ("image", "rgbd"):
            raise ValueError(f"--init-from a {base.config.modality} policy into --modality {args.modality}: "
                             f"only the same modality or image -> rgbd is supported")
        if base is not None:  # the 2-D policy's head and chunking, its encoder widened to 3-D
            scale = 0.0 if args.depth_scale_init is None else args.depth_scale_init
            cfg = PolicyConfig(**{**base.config.to_dict(), "modality": "rgbd", "pe": args.pe,
                                  "depth_scale_init": scale})
        else:
            cfg = PolicyConfig(modality=args.modality, pe=args.pe, image_size=int(demos["config"].image_size),
                               horizon=args.horizon, n_action_steps=args.n_action_steps,
                               depth_scale_init=1.0 if args.depth_scale_init is None else args.depth_scale_init)
        policy = DiffusionPolicy(cfg)
        if base is not None:
            init_from_2d(policy, base.state_dict(), depth_scale=cfg.depth_scale_init)
    train_policy(policy, DemoChunks(demos, policy.config, tc.only_successful), tc, args.out,
                 fit_normalizers=base is None, progress=not args.no_progress,
                 extra_config={"demos": str(args.demos), "init_from": args.init_from})
    print(f"policy saved to {Path(args.out) / 'checkpoint.pt'}")
    return 0


def _eval(args: Any) -> int:
    jobs = [(Path(r).name, str(r), c, args.episodes, args.seed, {"max_steps": args.max_steps})
            for r in args.runs for c in args.conditions]
    rows = experiment._map(experiment._eval_job, jobs, args.workers, not args.no_progress, "evaluate")
    for r in rows:
        print(f"{r['policy']:>12}  {r['condition']:<22} {experiment._pct(r)}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0
