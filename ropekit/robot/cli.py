"""``ropekit robot collect | train | eval | experiment`` (registered in :mod:`ropekit.cli`; ``experiment`` is the
``ropekit-studies`` distribution's, :mod:`ropekit_studies.robot`).

::

    ropekit robot collect --out runs/robot/demos.npz --episodes 300
    ropekit robot train --demos runs/robot/demos.npz --out runs/robot/2d --modality image
    ropekit robot train --demos runs/robot/demos.npz --out runs/robot/3d --modality rgbd --init-from runs/robot/2d
    ropekit robot eval runs/robot/2d runs/robot/3d --episodes 50
    ropekit robot experiment --out runs/robot [--quick]
    ropekit robot diagnose tolerance --axis z --offsets -0.02 0 0.02     (how precise a policy must be)
    ropekit robot diagnose grasp runs/robot/2d --episodes 100            (where a policy's tip went)
    ropekit robot diagnose depth-shuffle runs/robot/3d --demos runs/robot/demos.npz   (does it read depth)
    ropekit robot aloha collect|train|eval|experiment ...   (bimanual ALOHA; needs ropekit[aloha])
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from .env import PickConfig

__all__ = ["add_arguments", "run"]

_PRESETS = ("in_distribution", "ood_table_height", "ood_large_distractors", "ood_light")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="robot_command", metavar="<collect|train|eval|experiment|diagnose|aloha>",
                                required=True)

    p = sub.add_parser("collect", help="record scripted-expert demonstrations (.npz)")
    p.add_argument("--out", required=True, help="output .npz file")
    p.add_argument("--episodes", type=int, default=300)
    p.add_argument("--noise", type=float, default=0.005, help="std (m) of the expert's action noise")
    p.add_argument("--clean-labels", action="store_true",
                   help="execute the noisy actions, record the expert's noise-free ones (DART)")
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
    p.add_argument("--set", dest="policy_set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a PolicyConfig field of a policy from scratch, e.g. --set keypoints=true --set aux_weight=1 "
                        "(repeatable; values are YAML/JSON)")
    p.add_argument("--train-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a PolicyTrainConfig field, e.g. --train-set shift=0 (repeatable; values are YAML/JSON)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
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

    from ..cli import add_plugin_parsers  # the study (ropekit-studies) adds experiment

    add_plugin_parsers(sub, "robot", {"experiment": "the whole 2-D vs 3-D STRING study, with reports"})

    p = sub.add_parser("diagnose", help="measurements that explain a policy's failures")
    dsub = p.add_subparsers(dest="diagnose_command", metavar="<tolerance|grasp|chunks|depth-shuffle>", required=True)
    d = dsub.add_parser("tolerance", help="the scripted expert's success with a wrong belief of the target position")
    d.add_argument("--axis", choices=("x", "y", "z"), default="z")
    d.add_argument("--offsets", type=float, nargs="+", default=[-0.03, -0.02, -0.01, 0.0, 0.01, 0.02, 0.03],
                   help="belief errors (m); positive z: the target is believed higher than it is")
    d.add_argument("--episodes", type=int, default=40)
    d.add_argument("--press-depth", type=float, default=None,
                   help="how far below the top face the expert presses (m; default: the expert's)")
    d.add_argument("--suction-height", type=float, default=None,
                   help="suction switched on this far above the top face (m; default: the expert's)")
    d.add_argument("--out", default=None, help="write the rows as JSON here")
    d = dsub.add_parser("grasp", help="where a trained policy's tip went, and the failure kinds")
    d.add_argument("run", help="run folder")
    d.add_argument("--episodes", type=int, default=100)
    d.add_argument("--condition", choices=_PRESETS, default="in_distribution")
    d.add_argument("--seed", type=int, default=1000, help="evaluation seed (as `ropekit robot eval`)")
    d.add_argument("--out", default=None, help="write the rows and the summary as JSON here")
    d = dsub.add_parser("chunks", help="per episode step: do the predicted chunks follow the target? (held-out demos)")
    d.add_argument("run", help="run folder")
    d.add_argument("--demos", required=True, help="demos the policy did not train on (`ropekit robot collect`)")
    d.add_argument("--steps", type=int, nargs="+", default=[0, 2, 4, 8], help="episode steps to look at")
    d.add_argument("--out", default=None, help="write the rows as JSON here")
    d = dsub.add_parser("depth-shuffle", help="how much an RGB-D policy's actions change when depth patches move")
    d.add_argument("run", help="RGB-D run folder")
    d.add_argument("--demos", required=True, help=".npz written by `ropekit robot collect`")
    d.add_argument("--every", type=int, default=16, help="use every n-th demo observation")

    from .aloha import cli as aloha_cli  # imports no simulator package until a command runs

    p = sub.add_parser("aloha", help="bimanual ALOHA tasks in MuJoCo: demos, diffusion policies, encoder study")
    aloha_cli.add_arguments(p)


def run(args: Any) -> int:
    if args.robot_command == "aloha":
        from .aloha import cli as aloha_cli

        return aloha_cli.run(args)
    own = {"collect": _collect, "train": _train, "eval": _eval, "diagnose": _diagnose}
    if args.robot_command in own:
        return own[args.robot_command](args)
    from ..cli import run_plugin

    return int(run_plugin(args) or 0)


def _collect(args: Any) -> int:
    from .demos import collect_demos

    cfg = PickConfig.preset(args.preset, image_size=args.image_size, max_steps=args.max_steps,
                            terminate_on_success=not args.full_episodes)
    data = collect_demos(args.episodes, cfg, seed=args.seed, workers=args.workers, out=args.out, noise=args.noise,
                         clean_labels=args.clean_labels)
    print(f"{args.episodes} episodes, {len(data['state'])} steps, expert success "
          f"{data['episode_success'].mean():.0%} -> {args.out}")
    return 0


def _train(args: Any) -> int:
    from ..classification.config import parse_key_values
    from .demos import load_demos
    from .train import DemoChunks, PolicyTrainConfig, new_policy, train_policy

    demos = load_demos(args.demos)
    train_set = parse_key_values(args.train_set, "--train-set")
    unknown = sorted(set(train_set) - {f.name for f in dataclasses.fields(PolicyTrainConfig)})
    if unknown:
        raise ValueError(f"unknown PolicyTrainConfig field(s) in --train-set: {', '.join(unknown)}")
    tc = PolicyTrainConfig(**{"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
                              "warmup_steps": args.warmup_steps, "seed": args.seed,
                              "only_successful": not args.all_episodes, "num_threads": args.threads,
                              **train_set})
    extra = parse_key_values(args.policy_set, "--set")
    if extra and args.init_from:
        raise ValueError("--set changes a policy trained from scratch; with --init-from the policy is the base run's")
    fields = {"pe": args.pe} if args.init_from else {
        "pe": args.pe, "image_size": int(demos["config"].image_size), "horizon": args.horizon,
        "n_action_steps": args.n_action_steps, **extra}
    policy, fresh = new_policy(args.modality, fields, args.init_from, args.depth_scale_init)
    train_policy(policy, DemoChunks(demos, policy.config, tc.only_successful), tc, args.out,
                 fit_normalizers=fresh, progress=not args.no_progress,
                 extra_config={"demos": str(args.demos), "init_from": args.init_from})
    print(f"policy saved to {Path(args.out) / 'checkpoint.pt'}")
    return 0


def _eval(args: Any) -> int:
    from .evaluate import evaluate_run, format_rate, map_jobs
    from .train import load_policy

    for run in args.runs:  # (a missing or foreign checkpoint: one line before any worker starts)
        load_policy(run)
    jobs = [(Path(r).name, str(r), c, args.episodes, args.seed, {"max_steps": args.max_steps})
            for r in args.runs for c in args.conditions]
    rows = map_jobs(evaluate_run, jobs, args.workers, not args.no_progress, "evaluate")
    for r in rows:
        print(f"{r['policy']:>12}  {r['condition']:<22} {format_rate(r)}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


def _diagnose(args: Any) -> int:
    from . import diagnose

    if args.diagnose_command == "tolerance":
        kw = {k: v for k, v in (("press_depth", args.press_depth), ("suction_height", args.suction_height))
              if v is not None}
        result: Any = diagnose.expert_tolerance(args.offsets, args.axis, args.episodes, expert_kwargs=kw)
        for r in result:
            print(f"{r['axis']} {r['offset_m'] * 1000:+7.1f} mm  success {r['success_rate']:.2f}  "
                  f"({r['episodes']} episodes, {r['mean_steps']:.1f} steps)")
        result = {"expert_kwargs": kw, "rows": result}
    elif args.diagnose_command == "grasp":
        rows = diagnose.grasp_errors(args.run, args.episodes, args.condition, args.seed)
        summary = diagnose.summarize_grasp_errors(rows)
        print(json.dumps(summary, indent=2))
        result = {"summary": summary, "rows": rows}
    elif args.diagnose_command == "chunks":
        from .demos import load_demos

        result = diagnose.chunk_tracking(args.run, load_demos(args.demos), args.steps)
        for r in result:
            aux = (f"  aux target error {r['aux_err_mm']:.0f} mm (corr x {r['aux_corr_x']:.2f})"
                   if "aux_err_mm" in r else "")
            print(f"step {r['step']:>2} ({r['observations']} obs): chunk end corr x {r['corr_x']:.2f} "
                  f"y {r['corr_y']:.2f}, error {r['err_mm']:.0f} mm{aux}")
    else:
        from .demos import load_demos

        result = diagnose.depth_shuffle_effect(args.run, load_demos(args.demos), args.every)
        print(json.dumps(result, indent=2))
    if getattr(args, "out", None):
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0
