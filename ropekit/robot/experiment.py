"""The robot study: a 2-D policy (RGB) against a 3-D STRING policy (RGB-D), in and out of distribution.

Stages (each skipped when its output already exists in the folder, so an interrupted run resumes):

1. ``demos.npz`` -- scripted-expert demonstrations in the training distribution.
2. ``policies/2d`` -- a policy on RGB with a 2-D encoding, trained from scratch.
3. ``policies/3d`` -- an RGB-D policy with the 3-D encoding (Circulant-STRING by default) whose weights start
   from ``policies/2d`` (:func:`~ropekit.robot.policy.init_from_2d`: the depth lift at zero, so it starts
   equal to the 2-D policy), fine-tuned for ``finetune_steps``.
4. ``policies/2d_ft`` (``control=True``) -- the 2-D policy fine-tuned on RGB with the same schedule: the 3-D
   policy has had more training steps than ``2d``, and this control has the same number, so a difference
   between ``3d`` and ``2d_ft`` is the depth, not the extra steps.
5. Evaluation: every policy on every condition (``in_distribution``, ``ood_table_height``,
   ``ood_large_distractors``, ``ood_light``) over the same ``eval_episodes`` episode seeds (disjoint from the
   demos'); success = the target lifted above the success height within ``max_steps`` steps.
   Each result is cached in ``<run>/eval_<condition>.json`` (reused while the checkpoint and settings match).
6. Reports, in the layout of the other ``ropekit experiment`` studies: ``robot.csv`` / ``robot.json`` (every
   number, per-episode outcomes), ``table.md`` (success rates with 95 % Wilson intervals), ``robot.png``
   (bars with binomial error bars), ``config.json`` (the settings and a key per trained run), plus
   ``training.png`` (loss curves), ``rollouts.png`` (an image strip of one rollout per policy and condition)
   and ``rollout_<policy>.gif``.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import math
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..train.metrics import atomic_write_text
from .demos import _default_start_method, collect_demos, episode_seeds, load_demos, rollout
from .env import PickConfig, PickEnv

__all__ = ["CONDITIONS", "RobotExperimentConfig", "run_experiment", "run_study", "evaluate_policy",
           "depth_diagnostics", "wilson_interval", "add_arguments", "run"]

CONDITIONS = ("in_distribution", "ood_table_height", "ood_large_distractors", "ood_light")
PathLike = Union[str, Path]
LABELS = {"2d": "2-D (RGB)", "2d_ft": "2-D (RGB), fine-tuned", "3d": "3-D STRING (RGB-D)"}


@dataclass
class RobotExperimentConfig:
    """Settings of :func:`run_experiment` (saved in ``config.json`` of the output folder).

    ``policy``: :class:`~ropekit.robot.policy.PolicyConfig` overrides shared by every policy (``modality``
    and ``pe`` are set per policy from ``pe_2d`` / ``pe_3d``). ``train`` and ``finetune``:
    :class:`~ropekit.robot.train.PolicyTrainConfig` overrides of the 2-D training and of both fine-tunings.
    ``env``: :class:`~ropekit.robot.env.PickConfig` overrides applied to every condition (demos and evaluation).
    """

    demo_episodes: int = 300
    demo_noise: float = 0.005
    demo_seed: int = 0
    pe_2d: str = "circulant"
    pe_3d: str = "circulant"
    policy: Dict[str, Any] = field(default_factory=dict)
    train: Dict[str, Any] = field(default_factory=lambda: {"steps": 2000})
    finetune: Dict[str, Any] = field(default_factory=lambda: {"steps": 800, "warmup_steps": 50})
    control: bool = True
    env: Dict[str, Any] = field(default_factory=dict)
    conditions: Tuple[str, ...] = CONDITIONS
    eval_episodes: int = 100
    eval_seed: int = 1000
    workers: int = 2
    frame_size: int = 128
    strip_frames: int = 8
    progress: bool = True
    quick: bool = False

    @classmethod
    def quick_preset(cls, **overrides: Any) -> "RobotExperimentConfig":
        """A few-second end-to-end run for CI: tiny encoder, a handful of demos, steps and episodes."""
        base = dict(
            quick=True, demo_episodes=3, workers=1, eval_episodes=2, frame_size=64, strip_frames=4,
            policy={"vit_overrides": {"depth": 1, "patch_size": 16, "embed_dim": 48, "num_heads": 1},
                    "pe_options": {"block_size": 8}, "hidden_dim": 64, "cond_dim": 64, "num_blocks": 1,
                    "num_inference_steps": 2},
            train={"steps": 4, "batch_size": 8, "warmup_steps": 1, "noise_samples": 1, "log_every": 2,
                   "only_successful": False},  # 6-step demos rarely succeed
            finetune={"steps": 2, "batch_size": 8, "warmup_steps": 1, "noise_samples": 1, "log_every": 1},
            env={"max_steps": 6, "image_size": 32},
        )
        return cls(**{**base, **overrides})

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------------------


def wilson_interval(successes: int, n: int, z: float = 1.96) -> Tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % for ``z = 1.96``); ``(0, 1)`` when ``n = 0``."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def env_config(condition: str, image_size: int, overrides: Optional[Mapping[str, Any]] = None) -> PickConfig:
    """The :class:`PickConfig` of a condition as evaluated: stop at the first success, the policy's image size."""
    return PickConfig.preset(condition, **{"terminate_on_success": True, **(overrides or {}),
                                           "image_size": image_size})


def evaluate_policy(policy: Any, condition: str, episodes: int, seed: int = 1000,
                    env_overrides: Optional[Mapping[str, Any]] = None, progress: bool = False,
                    sample_seed: int = 0) -> Dict[str, Any]:
    """Success of ``policy`` (a :class:`DiffusionPolicy` or a run folder) on ``episodes`` episodes of a condition.

    Episode ``i`` uses env seed ``episode_seeds(seed, episodes)[i]`` and diffusion seed ``sample_seed + i``, so
    every policy and condition sees the same scenes. Returns counts, the rate, its 95 % Wilson interval, the
    mean step of first success and the per-episode outcomes.
    """
    import torch
    from tqdm.auto import tqdm

    from .policy import PolicyRunner
    from .train import load_policy

    torch.set_num_threads(1)
    if not hasattr(policy, "config"):
        policy = load_policy(policy)
    seeds = episode_seeds(seed, episodes)
    outcomes, first = [], []
    with PickEnv(env_config(condition, policy.config.image_size, env_overrides)) as env:
        for i in tqdm(range(episodes), desc=condition, unit="ep", disable=not progress):
            res = rollout(env, PolicyRunner(policy, seed=sample_seed + i), seed=int(seeds[i]))
            outcomes.append(bool(res.success))
            if res.first_success_step is not None:
                first.append(res.first_success_step)
    k = int(sum(outcomes))
    lo, hi = wilson_interval(k, episodes)
    return {"condition": condition, "episodes": episodes, "successes": k, "success_rate": k / episodes,
            "ci95_low": lo, "ci95_high": hi, "mean_steps_to_success": float(np.mean(first)) if first else None,
            "outcomes": outcomes}


def _eval_job(args: Tuple[str, str, str, int, int, Dict[str, Any]]) -> Dict[str, Any]:
    """Evaluate one (policy, condition); the result is kept in ``<run>/eval_<condition>.json`` and reused
    while the run's checkpoint and the evaluation settings are unchanged."""
    name, run_dir, condition, episodes, seed, overrides = args
    from .train import CHECKPOINT

    ckpt = Path(run_dir) / CHECKPOINT
    cache = Path(run_dir) / f"eval_{condition}.json"
    key = {"episodes": episodes, "seed": seed, "env": overrides,
           "checkpoint_sha256": hashlib.sha256(ckpt.read_bytes()).hexdigest() if ckpt.exists() else None}
    if cache.exists():
        hit = json.loads(cache.read_text())
        if hit.get("key") == key:
            return hit["result"]
    result = {"policy": name, **evaluate_policy(run_dir, condition, episodes, seed, overrides)}
    if ckpt.exists():
        atomic_write_text(cache, json.dumps({"key": key, "result": result}))
    return result


def _map(fn, jobs: Sequence[Any], workers: int, progress: bool, desc: str) -> List[Any]:
    """``[fn(j) for j in jobs]``, in ``workers`` processes (forkserver, like demo collection) when ``> 1``."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), desc=desc, disable=not progress)
    out: List[Any] = []
    try:
        if workers <= 1:
            for j in jobs:
                out.append(fn(j))
                bar.update(1)
        else:
            method = _default_start_method()
            ctx = mp.get_context(method)
            if method == "forkserver":
                ctx.set_forkserver_preload([__name__])
            with ctx.Pool(min(workers, len(jobs))) as pool:
                for r in pool.imap(fn, jobs):
                    out.append(r)
                    bar.update(1)
    finally:
        bar.close()
    return out


# ---------------------------------------------------------------------------------------------------------
# the study
# ---------------------------------------------------------------------------------------------------------


def _policy_config(cfg: RobotExperimentConfig, modality: str, pe: str, image_size: int, **extra: Any):
    from .policy import PolicyConfig

    return PolicyConfig(**{**cfg.policy, "modality": modality, "pe": pe, "image_size": image_size, **extra})


def _train_stage(cfg: RobotExperimentConfig, out: Path, demos: Mapping[str, Any]) -> Dict[str, Path]:
    from .policy import DiffusionPolicy, init_from_2d
    from .train import CHECKPOINT, DemoChunks, PolicyTrainConfig, load_policy, train_policy

    image_size = int(demos["config"].image_size)
    runs = {"2d": out / "policies" / "2d"}
    if cfg.control:
        runs["2d_ft"] = out / "policies" / "2d_ft"
    runs["3d"] = out / "policies" / "3d"
    source = {"demos": str(out / "demos.npz")}
    if not (runs["2d"] / CHECKPOINT).exists():
        _say("training 2d")
        policy = DiffusionPolicy(_policy_config(cfg, "image", cfg.pe_2d, image_size))
        tc = PolicyTrainConfig(**cfg.train)
        train_policy(policy, DemoChunks(demos, policy.config, tc.only_successful), tc, runs["2d"],
                     progress=cfg.progress, extra_config=source)
    ft = PolicyTrainConfig(**{**cfg.train, **cfg.finetune})
    for name, modality, pe in (("3d", "rgbd", cfg.pe_3d), ("2d_ft", "image", cfg.pe_2d)):
        if name not in runs or (runs[name] / CHECKPOINT).exists():
            continue
        base = load_policy(runs["2d"])
        if modality == "rgbd":
            policy = DiffusionPolicy(_policy_config(cfg, "rgbd", pe, image_size, depth_scale_init=0.0))
            init_from_2d(policy, base.state_dict())
        else:
            policy = base
        _say(f"fine-tuning {name} from {runs['2d']}")
        data = DemoChunks(demos, policy.config, ft.only_successful)
        train_policy(policy, data, ft, runs[name], fit_normalizers=False,
                     progress=cfg.progress, extra_config={**source, "init_from": str(runs["2d"])})
    return runs


def _say(msg: str) -> None:
    print(f"[robot {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_experiment(cfg: RobotExperimentConfig, out_dir: PathLike) -> Dict[str, Any]:
    """Run (or resume) the study into ``out_dir``; return the document written to ``robot.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.json", json.dumps({"experiment": cfg.to_dict(), "runs": []}, indent=2))
    t0 = time.time()
    timings: Dict[str, float] = {}
    demo_path = out / "demos.npz"
    if not demo_path.exists():
        collect_demos(cfg.demo_episodes, PickConfig.in_distribution(**{"terminate_on_success": True, **cfg.env}),
                      seed=cfg.demo_seed, workers=cfg.workers, out=demo_path, progress=cfg.progress,
                      noise=cfg.demo_noise)
    demos = load_demos(demo_path)
    timings["demos"] = time.time() - t0
    _say(f"demos: {len(demos['episode_success'])} episodes, {len(demos['state'])} steps ({timings['demos']:.0f} s)")
    runs = _train_stage(cfg, out, demos)
    timings["train"] = time.time() - t0 - timings["demos"]
    _say(f"policies trained ({timings['train']:.0f} s); evaluating")

    jobs = [(name, str(path), cond, cfg.eval_episodes, cfg.eval_seed, dict(cfg.env))
            for name, path in runs.items() for cond in cfg.conditions]
    rows = _map(_eval_job, jobs, cfg.workers, cfg.progress, "evaluate")
    timings["eval"] = time.time() - t0 - timings["demos"] - timings["train"]
    _say(f"evaluated ({timings['eval']:.0f} s); writing reports")
    doc = {
        "study": "robot",
        "rows": rows,
        "summary": {"demos": {"episodes": int(len(demos["episode_success"])),
                              "expert_success_rate": float(np.mean(demos["episode_success"])),
                              "steps": int(len(demos["state"]))},
                    "timings_s": timings},
    }
    if "3d" in runs:
        doc["summary"]["depth_lift"] = depth_diagnostics(runs, demos)
    write_reports(out, doc, runs)
    _rollout_media(cfg, out, runs)
    timings["total"] = time.time() - t0
    atomic_write_text(out / "robot.json", json.dumps(doc, indent=2))
    atomic_write_text(out / "config.json", json.dumps({"experiment": cfg.to_dict(), "runs": [
        {"name": name, "dir": str(path.relative_to(out)), "key": _run_key(path)} for name, path in runs.items()
    ]}, indent=2))
    return doc


def depth_diagnostics(runs: Mapping[str, Path], demos: Mapping[str, Any], every: int = 16) -> Dict[str, Any]:
    """How much the 3-D policy uses depth: its learned lift ``z = a * depth + b``, the range of ``z`` over the
    patches of every ``every``-th demo image (x and y advance by 1 per patch), and -- when the fine-tuned 2-D
    control exists -- the mean and largest difference (mm) between the two policies' predicted tip targets on
    those observations (same diffusion noise)."""
    import torch

    from .train import DemoChunks, load_policy

    p3 = load_policy(runs["3d"])
    lift = p3.encoder.depth_lift
    data3 = DemoChunks(demos, p3.config, only_successful=False)
    index = torch.arange(0, len(data3), every)
    images, state, _ = data3.batch(index)
    with torch.no_grad():
        z = lift(images[:, 3], p3.encoder.cfg.patch_size)  # (B, M)
    out: Dict[str, Any] = {"scale": lift.scale.item(), "bias": lift.bias.item(), "observations": len(index),
                           "z_min": z.min().item(), "z_max": z.max().item()}
    if "2d_ft" in runs:
        p2 = load_policy(runs["2d_ft"])
        a3 = p3.predict(images, state, torch.Generator().manual_seed(0))
        a2 = p2.predict(images[:, :3], state, torch.Generator().manual_seed(0))
        diff = (a3[..., :3] - a2[..., :3]).abs() * 1000  # (B, H, 3) mm
        out.update(action_diff_to_control_mm_mean=diff.mean().item(), action_diff_to_control_mm_max=diff.max().item(),
                   gripper_disagreement=(a3[..., 3] != a2[..., 3]).float().mean().item())
    return out


def _run_key(run_dir: Path) -> str:
    """16 hex digits of the SHA-256 of a run's ``config.json`` (policy, training and data settings)."""
    return hashlib.sha256((run_dir / "config.json").read_bytes()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------------------------


def _pct(r: Mapping[str, Any]) -> str:
    return (f"{r['successes']}/{r['episodes']} = {100 * r['success_rate']:.0f} % "
            f"[{100 * r['ci95_low']:.0f}, {100 * r['ci95_high']:.0f}]")


def write_reports(out: Path, doc: Mapping[str, Any], runs: Mapping[str, Path]) -> None:
    """``robot.csv``, ``robot.json``, ``table.md``, ``robot.png`` (success rates) and ``training.png``."""
    rows = doc["rows"]
    cols = ["policy", "condition", "episodes", "successes", "success_rate", "ci95_low", "ci95_high",
            "mean_steps_to_success"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: (f"{r[k]:.4f}" if isinstance(r[k], float) else r[k]) for k in cols})
    atomic_write_text(out / "robot.csv", buf.getvalue())
    atomic_write_text(out / "robot.json", json.dumps(doc, indent=2))

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    conditions = list(dict.fromkeys(r["condition"] for r in rows))
    table = {(r["policy"], r["condition"]): r for r in rows}
    lines = ["| policy | " + " | ".join(conditions) + " |", "|---|" + "---|" * len(conditions)]
    for p in policies:
        lines.append(f"| {LABELS.get(p, p)} | " + " | ".join(_pct(table[p, c]) for c in conditions) + " |")
    text = "Success rate, successes/episodes = rate [95 % Wilson interval].\n\n" + "\n".join(lines) + "\n"
    lift = doc["summary"].get("depth_lift")
    if lift:
        text += (f"\n3-D policy depth lift: z = {lift['scale']:.4f} * depth + {lift['bias']:.4f} "
                 f"(z over the demo patches in [{lift['z_min']:.3f}, {lift['z_max']:.3f}]; x, y: 1 per patch)")
        if "action_diff_to_control_mm_mean" in lift:
            text += (f"; its tip targets differ from the fine-tuned 2-D control's by "
                     f"{lift['action_diff_to_control_mm_mean']:.3g} mm on average "
                     f"(max {lift['action_diff_to_control_mm_max']:.3g} mm) on {lift['observations']} "
                     f"demo observations")
        text += ".\n"
    atomic_write_text(out / "table.md", text)
    _plot_success(out / "robot.png", rows, policies, conditions)
    _plot_training(out / "training.png", runs)


def _plot_success(path: Path, rows: Sequence[Mapping[str, Any]], policies: List[str], conditions: List[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = {(r["policy"], r["condition"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(1.8 + 1.9 * len(conditions), 3.6))
    width = 0.8 / len(policies)
    x = np.arange(len(conditions))
    for i, p in enumerate(policies):
        rates = np.array([table[p, c]["success_rate"] for c in conditions])
        lo = rates - np.array([table[p, c]["ci95_low"] for c in conditions])
        hi = np.array([table[p, c]["ci95_high"] for c in conditions]) - rates
        ax.bar(x + (i - (len(policies) - 1) / 2) * width, rates, width, yerr=[lo, hi], capsize=3,
               label=LABELS.get(p, p))
    n = rows[0]["episodes"]
    ax.set_xticks(x, [c.replace("_", "\n") for c in conditions])
    ax.set_ylim(0, 1.2)
    ax.set_ylabel("success rate")
    ax.set_title(f"Pick success, {n} episodes per bar (95 % Wilson intervals)")
    ax.legend(fontsize=8, loc="upper center", ncol=len(policies))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_training(path: Path, runs: Mapping[str, Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    offset = 0
    for name in ("2d", "2d_ft", "3d"):
        f = runs.get(name, Path("/nonexistent")) / "metrics.csv"
        if not f.exists():
            continue
        with open(f, newline="") as fh:
            data = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(fh)]
        if name == "2d":
            offset = int(data[-1]["step"])
        start = 0 if name == "2d" else offset
        ax.plot([start + d["step"] for d in data], [d["loss"] for d in data], label=LABELS.get(name, name))
    ax.set_xlabel("optimiser step (fine-tunings start from the 2-D policy)")
    ax.set_ylabel("diffusion loss")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rollout_media(cfg: RobotExperimentConfig, out: Path, runs: Mapping[str, Path]) -> None:
    """``rollouts.png``: one row per (policy, condition) with ``strip_frames`` evenly spaced frames of the first
    evaluation episode (not selected for success; the outcome is written on the row), and one GIF per policy
    (in distribution)."""
    from PIL import Image, ImageDraw

    from .policy import PolicyRunner
    from .train import load_policy

    seed = int(episode_seeds(cfg.eval_seed, max(1, cfg.eval_episodes))[0])
    conditions = [c for c in ("in_distribution", "ood_table_height") if c in cfg.conditions] or list(cfg.conditions[:1])
    rows = []
    for name, path in runs.items():
        policy = load_policy(path)
        for cond in conditions:
            with PickEnv(env_config(cond, policy.config.image_size, cfg.env)) as env:
                res = rollout(env, PolicyRunner(policy, seed=0), seed=seed, record=True, frame_size=cfg.frame_size)
            frames = res.frames  # (T + 1, s, s, 3)
            if cond == conditions[0]:
                imgs = [Image.fromarray(f) for f in frames]
                imgs[0].save(out / f"rollout_{name}.gif", save_all=True, append_images=imgs[1:] + [imgs[-1]] * 4,
                             duration=150, loop=0)
            pick = np.linspace(0, len(frames) - 1, min(cfg.strip_frames, len(frames))).round().astype(int)
            outcome = "success" if res.success else "failure"
            label = f"{LABELS.get(name, name)} | {cond} | {outcome} | steps {res.num_steps}"
            rows.append((label, [frames[i] for i in pick], pick))
    s, pad, head = cfg.frame_size, 2, 14
    ncol = max(len(r[1]) for r in rows)
    sheet = Image.new("RGB", (ncol * (s + pad) + pad, len(rows) * (s + head + pad) + pad), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (label, frames, pick) in enumerate(rows):
        y = pad + i * (s + head + pad)
        draw.text((pad, y), label, fill="black")
        for j, (f, t) in enumerate(zip(frames, pick)):
            x = pad + j * (s + pad)
            sheet.paste(Image.fromarray(f), (x, y + head))
            draw.text((x + 2, y + head + 2), f"t={t}", fill="white")
    sheet.save(out / "rollouts.png")


# ---------------------------------------------------------------------------------------------------------
# command line (``ropekit robot experiment`` and the ``robot`` study of ``ropekit experiment``)
# ---------------------------------------------------------------------------------------------------------


def add_arguments(parser: Any) -> None:
    d = RobotExperimentConfig()
    parser.add_argument("--out", default="runs/robot", help="output folder (resumes what it already holds)")
    parser.add_argument("--quick", action="store_true", help="a tiny end-to-end run for CI (seconds)")
    parser.add_argument("--demos", type=int, default=None, help=f"demo episodes (default {d.demo_episodes})")
    parser.add_argument("--steps", type=int, default=None, help=f"2-D training steps (default {d.train['steps']})")
    parser.add_argument("--finetune-steps", type=int, default=None,
                        help=f"fine-tuning steps of the 3-D policy and of the 2-D control "
                             f"(default {d.finetune['steps']})")
    parser.add_argument("--episodes", type=int, default=None,
                        help=f"evaluation episodes per policy and condition (default {d.eval_episodes})")
    parser.add_argument("--pe-2d", default=None, help=f"encoding of the 2-D policy (default {d.pe_2d})")
    parser.add_argument("--pe-3d", default=None, help=f"encoding of the 3-D policy (default {d.pe_3d})")
    parser.add_argument("--no-control", action="store_true", help="skip the fine-tuned 2-D control policy")
    parser.add_argument("--workers", type=int, default=None, help=f"processes (default {d.workers})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def config_from_args(args: Any) -> RobotExperimentConfig:
    cfg = RobotExperimentConfig.quick_preset() if args.quick else RobotExperimentConfig()
    changes: Dict[str, Any] = {"progress": not args.no_progress}
    if args.demos is not None:
        changes["demo_episodes"] = args.demos
    if args.steps is not None:
        changes["train"] = {**cfg.train, "steps": args.steps}
    if args.finetune_steps is not None:
        changes["finetune"] = {**cfg.finetune, "steps": args.finetune_steps}
    if args.episodes is not None:
        changes["eval_episodes"] = args.episodes
    if args.pe_2d:
        changes["pe_2d"] = args.pe_2d
    if args.pe_3d:
        changes["pe_3d"] = args.pe_3d
    if args.no_control:
        changes["control"] = False
    if args.workers is not None:
        changes["workers"] = args.workers
    return dataclasses.replace(cfg, **changes)


def run_study(exp_cfg: Any, out: PathLike, **options: Any):
    """The ``robot`` entry of ``ropekit experiment`` (:mod:`ropekit.experiments.registry`).

    From the shared :class:`~ropekit.experiments.settings.ExperimentConfig` it takes ``quick`` (the preset),
    ``progress``, ``pes`` (one name: both policies' encoding; two: the 2-D then the 3-D policy's) and the first
    of ``seeds`` (demos and training; the study runs one seed -- its cost is the training, not the evaluation).
    The backbone and schedule of the classification studies do not apply; use ``ropekit robot experiment`` to
    change this study's own settings.
    """
    from ..experiments.common import StudyResult

    if options:
        raise ValueError(f"experiment robot takes no option {', '.join(sorted(options))}")
    cfg = RobotExperimentConfig.quick_preset() if exp_cfg.quick else RobotExperimentConfig()
    seed = int(exp_cfg.seeds[0]) if exp_cfg.seeds else 0
    changes: Dict[str, Any] = {"progress": bool(exp_cfg.progress), "demo_seed": seed,
                               "train": {**cfg.train, "seed": seed}}
    if exp_cfg.pes:
        if len(exp_cfg.pes) > 2:
            raise ValueError("experiment robot takes one encoding (both policies) or two (2-D, then 3-D) in --pe")
        changes["pe_2d"], changes["pe_3d"] = exp_cfg.pes[0], exp_cfg.pes[-1]
    cfg = dataclasses.replace(cfg, **changes)
    doc = run_experiment(cfg, out)
    out = Path(out)
    files = sorted(p for p in out.iterdir() if p.is_file())
    return StudyResult("robot", out, files, (out / "table.md").read_text(), doc["summary"])


def run(args: Any) -> int:
    doc = run_experiment(config_from_args(args), args.out)
    print((Path(args.out) / "table.md").read_text())
    print(f"results in {args.out} ({doc['summary']['timings_s']['total']:.0f} s)")
    return 0
