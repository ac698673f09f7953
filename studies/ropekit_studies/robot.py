"""The robot study: 2-D policies (RGB) against 3-D STRING policies (RGB-D), in and out of distribution.

The recipe of a preset (:mod:`ropekit_studies.recipes.robot`) states every setting. Stages (each skipped when its
output already exists in the folder, so an interrupted run resumes):

1. ``demos.npz`` -- scripted-expert demonstrations in the training distribution.
2. ``tolerance.json`` -- how precise a policy must be: the expert's success with a wrong belief of the
   target's height, for the recipe's grasp strategy and for closing on the top face
   (:func:`~ropekit.robot.diagnose.expert_tolerance`).
3. Per training seed, under ``policies/s<seed>/``: ``2d`` (RGB, 2-D encoding, from scratch); ``3d`` (RGB-D,
   the 3-D encoding, weights from ``2d`` by :func:`~ropekit.robot.policy.init_from_2d`, the depth lift
   ``z = a * depth + b`` started at the recipe's ``depth_scale``, then fine-tuned); ``2d_ft`` (``2d``
   fine-tuned on RGB on the same schedule, so ``3d`` vs ``2d_ft`` isolates the depth); ``3d_scratch`` (RGB-D
   from scratch for as many steps as ``3d`` had in all). Independent runs train side by side in ``workers``
   processes.
4. Evaluation: every policy on every condition over the same ``eval_episodes`` episode seeds (disjoint from
   the demos') and diffusion seeds; success = the target lifted above the success height within the
   episode. Each episode also records where the tip went (:func:`~ropekit.robot.diagnose.grasp_errors`), so
   failures are counted by kind. Results are cached in ``<run>/eval_<condition>.json``.
5. Depth use of every RGB-D policy: its learned lift, and how much its actions move when the depth patches
   of an image are shuffled (:func:`~ropekit.robot.diagnose.depth_shuffle_effect`).
6. Reports: ``robot.csv`` / ``robot.json`` (every number, per-episode outcomes), ``table.md`` (success over
   all seeds with 95 % Wilson intervals, per-seed rates, failure kinds, depth use, the tolerance table),
   ``robot.png``, ``training.png``, ``rollouts.png`` and ``rollout_<policy>.gif`` (seed 0), and
   ``config.json`` (preset, recipe, a key per trained run).
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import hashlib
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ropekit.train.metrics import atomic_write_text
from ropekit.robot.demos import collect_demos, episode_seeds, load_demos, rollout
from ropekit.robot.env import PickConfig, PickEnv, env_config
from ropekit.robot.evaluate import evaluate_policy, evaluate_run, format_rate, map_jobs, pooled_z, wilson_interval

__all__ = ["CONDITIONS", "RobotExperimentConfig", "run_experiment", "run_study", "compare_recipe",
           "evaluate_policy", "depth_diagnostics", "wilson_interval", "add_arguments", "run"]

CONDITIONS = ("in_distribution", "ood_table_height", "ood_large_distractors", "ood_light")
PathLike = Union[str, Path]
LABELS = {"2d": "2-D (RGB)", "2d_ft": "2-D (RGB), fine-tuned", "3d": "3-D STRING (RGB-D), from 2-D",
          "3d_scratch": "3-D STRING (RGB-D), from scratch"}
#: One colour per policy, the same in every plot.
COLOURS = {arm: f"C{i}" for i, arm in enumerate(LABELS)}


@dataclass
class RobotExperimentConfig:
    """A robot study: the preset's pinned ``recipe`` (:mod:`ropekit_studies.recipes.robot`, saved in ``config.json``)
    and how to run it -- ``device`` of the training, ``workers`` processes with ``threads`` torch threads each,
    the media sizes and the progress bars."""

    preset: str = "default"
    recipe: Dict[str, Any] = field(default_factory=lambda: _recipe("default"))
    device: str = "cpu"
    workers: int = 2
    threads: int = 1
    frame_size: int = 128
    strip_frames: int = 8
    progress: bool = True

    @classmethod
    def from_preset(cls, preset: str, **changes: Any) -> "RobotExperimentConfig":
        base: Dict[str, Any] = {"preset": preset, "recipe": _recipe(preset)}
        if preset == "quick":
            base.update(workers=1, frame_size=64, strip_frames=4)
        return cls(**{**base, **changes})

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _recipe(preset: str) -> Dict[str, Any]:
    from .recipes.robot import recipe

    return recipe(preset)


# ---------------------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------


def planned_runs(r: Mapping[str, Any]) -> List[Tuple[str, int]]:
    """``(arm, seed)`` of every policy a recipe trains, seed by seed in the order of :data:`recipes.ARMS`."""
    from .recipes.robot import ARMS

    return [(arm, int(seed)) for seed in r["seeds"] for arm in ARMS if arm in r["arms"]]


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / "policies" / f"s{seed}" / arm


def arm_settings(r: Mapping[str, Any], arm: str, seed: int, image_size: int) -> Dict[str, Any]:
    """The complete policy and training settings of one run: ``{"policy": PolicyConfig dict, "train":
    PolicyTrainConfig dict (without num_threads), "init_from": arm or None}``."""
    rgbd = arm.startswith("3d")
    policy = {**copy.deepcopy(r["policy"]), "modality": "rgbd" if rgbd else "image",
              "pe": r["pe_3d"] if rgbd else r["pe_2d"], "pe_options": dict(r["pe_options"]),
              "depth_scale_init": float(r["depth_scale"]) if rgbd else 1.0, "image_size": int(image_size)}
    train = {**r["train"], "seed": int(seed)}
    if arm in ("3d", "2d_ft"):
        train.update(r["finetune"])
    elif arm == "3d_scratch":
        train["steps"] = int(r["train"]["steps"]) + int(r["finetune"].get("steps", r["train"]["steps"]))
    return {"policy": policy, "train": train, "init_from": "2d" if arm in ("3d", "2d_ft") else None}


def _train_job(args: Tuple[str, int, str, Dict[str, Any], str, int, bool]) -> str:
    """Train one run of the study (in a worker process); returns its folder."""
    arm, seed, out, settings, device, threads, progress = args
    import torch

    from ropekit.train import engine
    from ropekit.robot.demos import load_demos
    from ropekit.robot.policy import DiffusionPolicy, PolicyConfig, init_from_2d
    from ropekit.robot.train import CHECKPOINT, DemoChunks, PolicyTrainConfig, load_policy, train_policy

    torch.set_num_threads(threads)
    out_p = Path(out)
    folder = run_dir(out_p, arm, seed)
    if (folder / CHECKPOINT).exists():
        return str(folder)
    demos = load_demos(out_p / "demos.npz")
    cfg = PolicyConfig(**settings["policy"])
    tc = PolicyTrainConfig(**{**settings["train"], "num_threads": threads})
    fit = True
    if settings["init_from"] is not None:
        base = load_policy(run_dir(out_p, settings["init_from"], seed))
        if cfg.modality == "rgbd":
            policy = DiffusionPolicy(cfg)
            init_from_2d(policy, base.state_dict(), depth_scale=cfg.depth_scale_init)
        else:
            policy = base
        fit = False
    else:
        policy = DiffusionPolicy(cfg)
    _say(f"training s{seed}/{arm} ({tc.steps} steps)")
    opts = engine.EngineOptions(device=device, threads=threads, progress=progress, tensorboard=False)
    train_policy(policy, DemoChunks(demos, cfg, tc.only_successful), tc, folder, fit_normalizers=fit,
                 progress=progress, options=opts,
                 extra_config={"demos": "demos.npz", "arm": arm,
                               "init_from": str(run_dir(Path("."), settings["init_from"], seed))
                               if settings["init_from"] else None})
    return str(folder)


def _train_stage(cfg: RobotExperimentConfig, out: Path, image_size: int) -> Dict[Tuple[str, int], Path]:
    """Train every planned run: first those from scratch, then the fine-tunings, each group side by side."""
    r = cfg.recipe
    runs = planned_runs(r)
    settings = {(arm, seed): arm_settings(r, arm, seed, image_size) for arm, seed in runs}
    progress = cfg.progress and cfg.workers <= 1
    for group in ([k for k in runs if settings[k]["init_from"] is None],
                  [k for k in runs if settings[k]["init_from"] is not None]):
        jobs = [(arm, seed, str(out), settings[arm, seed], cfg.device, cfg.threads, progress) for arm, seed in group]
        map_jobs(_train_job, jobs, cfg.workers, cfg.progress and not progress, "train")
    return {k: run_dir(out, *k) for k in runs}


def _say(msg: str) -> None:
    print(f"[robot {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _tolerance_stage(r: Mapping[str, Any], out: Path, quick: bool) -> Dict[str, Any]:
    """``tolerance.json``: the expert's success against its belief error in height, for the recipe's grasp and
    for closing on the top face (``press_depth = suction_height = 0``)."""
    from ropekit.robot.diagnose import expert_tolerance

    path = out / "tolerance.json"
    expert = dict(r["demos"]["expert"])
    key = {"expert": expert, "env": r["env"]}
    if path.exists():
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            return doc
    offsets = [0.0, 0.02] if quick else [-0.03, -0.02, -0.01, 0.0, 0.01, 0.015, 0.02, 0.03, 0.04]
    episodes = 2 if quick else 40
    env = {k: v for k, v in r["env"].items() if k != "image_size"}
    doc = {"key": key, "strategies": {
        "recipe": expert_tolerance(offsets, "z", episodes, expert_kwargs=expert, env_overrides=env),
        "close_on_top": expert_tolerance(offsets, "z", episodes, env_overrides=env,
                                         expert_kwargs={**expert, "press_depth": 0.0, "suction_height": 0.0}),
    }}
    atomic_write_text(path, json.dumps(doc, indent=2))
    return doc


def run_experiment(cfg: RobotExperimentConfig, out_dir: PathLike) -> Dict[str, Any]:
    """Run (or resume) the study into ``out_dir``; return the document written to ``robot.json``."""
    from .recipes.robot import check_recipe

    r = check_recipe(cfg.recipe)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.json", json.dumps({"study": "robot", **cfg.to_dict(), "runs": []}, indent=2))
    t0 = time.time()
    timings: Dict[str, float] = {}
    demo_path = out / "demos.npz"
    d = r["demos"]
    if not demo_path.exists():
        collect_demos(d["episodes"], PickConfig.in_distribution(**{"terminate_on_success": True, **r["env"]}),
                      seed=d["seed"], workers=cfg.workers, out=demo_path, progress=cfg.progress, noise=d["noise"],
                      clean_labels=bool(d["clean_labels"]), expert_kwargs=dict(d["expert"]))
    demos = load_demos(demo_path)
    timings["demos"] = time.time() - t0
    _say(f"demos: {len(demos['episode_success'])} episodes, {len(demos['state'])} steps ({timings['demos']:.0f} s)")
    tolerance = _tolerance_stage(r, out, quick=cfg.preset == "quick")
    timings["tolerance"] = time.time() - t0 - sum(timings.values())
    runs = _train_stage(cfg, out, int(demos["config"].image_size))
    timings["train"] = time.time() - t0 - sum(timings.values())
    _say(f"policies trained ({timings['train']:.0f} s); evaluating")
    keys = [(arm, seed, cond) for arm, seed in runs for cond in r["conditions"]]
    jobs = [(arm, str(runs[arm, seed]), cond, r["eval_episodes"], r["eval_seed"], dict(r["env"]))
            for arm, seed, cond in keys]
    results = map_jobs(evaluate_run, jobs, cfg.workers, cfg.progress, "evaluate")
    rows = [{**res, "policy": arm, "seed": seed} for (arm, seed, _), res in zip(keys, results)]
    timings["eval"] = time.time() - t0 - sum(timings.values())
    _say(f"evaluated ({timings['eval']:.0f} s); writing reports")
    doc = {
        "study": "robot",
        "preset": cfg.preset,
        "rows": rows,
        "summary": {"demos": {"episodes": int(len(demos["episode_success"])),
                              "expert_success_rate": float(np.mean(demos["episode_success"])),
                              "steps": int(len(demos["state"]))},
                    "aggregate": aggregate(rows),
                    "depth_use": depth_diagnostics(runs, demos),
                    "tolerance": tolerance["strategies"],
                    "timings_s": timings},
    }
    write_reports(out, doc, runs)
    _rollout_media(cfg, out, {arm: path for (arm, seed), path in runs.items() if seed == r["seeds"][0]})
    timings["total"] = time.time() - t0
    atomic_write_text(out / "robot.json", json.dumps(doc, indent=2))
    image_size = int(demos["config"].image_size)
    atomic_write_text(out / "config.json", json.dumps({"study": "robot", **cfg.to_dict(), "runs": [
        {"name": f"s{seed}/{arm}", "dir": str(path.relative_to(out)), "key": _run_key(path),
         "settings": arm_settings(r, arm, seed, image_size)}
        for (arm, seed), path in runs.items()]}, indent=2))
    return doc


def aggregate(rows: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Per (policy, condition): successes and episodes pooled over the seeds with the Wilson interval, the
    per-seed rates, their mean and standard deviation, and the failure kinds summed over the seeds."""
    groups: Dict[Tuple[str, str], List[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["policy"], row["condition"]), []).append(row)
    out = []
    for (policy, cond), rs in groups.items():
        k, n = sum(x["successes"] for x in rs), sum(x["episodes"] for x in rs)
        lo, hi = wilson_interval(k, n)
        rates = [x["success_rate"] for x in rs]
        kinds = {key: sum(x["failures"][key] for x in rs) for key in rs[0]["failures"] if key.startswith("fail_")}
        out.append({"policy": policy, "condition": cond, "seeds": [x["seed"] for x in rs], "successes": k,
                    "episodes": n, "success_rate": k / n, "ci95_low": lo, "ci95_high": hi, "seed_rates": rates,
                    "seed_mean": float(np.mean(rates)),
                    "seed_std": float(np.std(rates, ddof=1)) if len(rs) > 1 else 0.0, **kinds})
    return out


def depth_diagnostics(runs: Mapping[Tuple[str, int], Path], demos: Mapping[str, Any],
                      every: int = 16) -> List[Dict[str, Any]]:
    """How much each RGB-D policy uses depth: its learned lift ``z = a * depth + b``, the range of ``z`` over the
    patches of every ``every``-th demo image (y and x advance by 1 per patch), the change of its tip targets when
    the depth patches are shuffled (:func:`~ropekit.robot.diagnose.depth_shuffle_effect`), and -- for ``3d``
    with its fine-tuned 2-D control -- the mean difference (mm) between the two policies' tip targets."""
    import torch

    from ropekit.robot.diagnose import depth_shuffle_effect
    from ropekit.robot.train import DemoChunks, load_policy

    out = []
    for (arm, seed), path in runs.items():
        if not arm.startswith("3d"):
            continue
        p3 = load_policy(path)
        lift = p3.encoder.depth_lift
        data3 = DemoChunks(demos, p3.config, only_successful=False)
        images, state, _ = data3.batch(torch.arange(0, len(data3), every))
        with torch.no_grad():
            z = lift(images[:, 3], p3.encoder.cfg.patch_size)  # (B, M)
        row: Dict[str, Any] = {"policy": arm, "seed": seed, "scale": lift.scale.item(), "bias": lift.bias.item(),
                               "observations": int(images.shape[0]), "z_min": z.min().item(),
                               "z_max": z.max().item(), **depth_shuffle_effect(p3, demos, every)}
        control = runs.get(("2d_ft", seed))
        if arm == "3d" and control is not None:
            p2 = load_policy(control)
            with torch.no_grad():
                a3 = p3.predict(images, state, torch.Generator().manual_seed(0))
                a2 = p2.predict(images[:, :3], state, torch.Generator().manual_seed(0))
            row["diff_to_control_mm_mean"] = ((a3[..., :3] - a2[..., :3]).norm(dim=-1) * 1000).mean().item()
        out.append(row)
    return out


def _run_key(run_dir: Path) -> str:
    """16 hex digits of the SHA-256 of a run's ``config.json`` (policy, training and data settings)."""
    return hashlib.sha256((run_dir / "config.json").read_bytes()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------------------------


#: The comparisons of the study: 3-D from 2-D against its fine-tuned 2-D control (the paper's protocol), 3-D from
#: scratch against 2-D, and 3-D from 2-D against the 2-D policy it started from.
PAIRS = (("3d", "2d_ft"), ("3d_scratch", "2d"), ("3d", "2d"))


def paired_verdicts(rows: Sequence[Mapping[str, Any]], policies: Sequence[str], conditions: Sequence[str], *,
                    resamples: int = 4000) -> Dict[Tuple[str, str, str], Any]:
    """The verdict of every comparison of :data:`PAIRS` and condition, by the one rule
    (:mod:`ropekit_studies.verdict`): the success difference (first − second, claimed positive) with its
    interval from a bootstrap over training seeds and then the episodes inside each seed
    (:func:`~ropekit_studies.verdict.bootstrap_interval`), every comparison of the study one Holm family;
    one seed is "not assessable". ``rows``: one per policy, seed and condition with ``successes`` and
    ``episodes`` (as ``robot.csv`` holds them; strings accepted). Returns ``{(first, second, condition):
    Verdict}`` (differences as fractions, not points)."""
    from .verdict import bootstrap_interval, judge

    cells = {(r["policy"], r["condition"], int(r["seed"])): (int(r["successes"]), int(r["episodes"])) for r in rows}
    diffs, pv, iv = {}, {}, {}
    for a_name, b_name in PAIRS:
        if a_name not in policies or b_name not in policies:
            continue
        for c in conditions:
            seeds = sorted(s for (p, cc, s) in cells if p == a_name and cc == c and (b_name, c, s) in cells)
            if not seeds:
                continue
            def episodes(name: str) -> List[List[float]]:  # one 1/0 outcome per episode, per seed
                return [[1.0] * cells[(name, c, s)][0] + [0.0] * (cells[(name, c, s)][1] - cells[(name, c, s)][0])
                        for s in seeds]

            boot = bootstrap_interval(episodes(a_name), per_seed_b=episodes(b_name), resamples=resamples, seed=0)
            key = (a_name, b_name, c)
            diffs[key], pv[key], iv[key] = boot["per_seed"], boot["p"], boot["intervals"]
    names = {f"{k[0]} - {k[1]} @ {k[2]}": k for k in diffs}
    out = judge({n: diffs[k] for n, k in names.items()}, {n: 1 for n in names},
                p_values={n: pv[k] for n, k in names.items()}, intervals={n: iv[k] for n, k in names.items()})
    return {k: out[n] for n, k in names.items()}


def _paired_lines(table: Mapping[Tuple[str, str], Mapping[str, Any]], policies: Sequence[str],
                  conditions: Sequence[str], verdicts: Optional[Mapping[Tuple[str, str, str], Any]] = None
                  ) -> List[str]:
    """Markdown lines: per pair of policies and condition, the success differences paired by training seed
    (percentage points; mean and sample standard deviation over the seeds), the pooled two-proportion z and,
    with ``verdicts`` (:func:`paired_verdicts`), the 95 % bootstrap interval and the verdict."""
    from .verdict import RULE

    lines = ["", "Differences in success, paired by training seed (percentage points; mean ± sample standard "
             "deviation over the seeds), and the two-proportion z of the pooled episodes (which ignores the "
             "spread between seeds)" + (
                 "; the 95 % interval resamples the seeds and then the episodes inside each seed, every "
                 f"comparison claimed positive and the table one Holm family. Verdicts: {RULE}:" if verdicts
                 else ":"), "",
             "| comparison | condition | per seed | mean ± sd | pooled z |" + (" 95 % interval | verdict |"
                                                                           if verdicts else ""),
             "|---|---|---|---|---|" + ("---|---|" if verdicts else "")]
    for a_name, b_name in PAIRS:
        if a_name not in policies or b_name not in policies:
            continue
        for c in conditions:
            a, b = table[a_name, c], table[b_name, c]
            if list(a["seeds"]) != list(b["seeds"]):
                continue
            diffs = [100 * (x - y) for x, y in zip(a["seed_rates"], b["seed_rates"])]
            sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else float("nan")
            z = pooled_z(a["successes"], a["episodes"], b["successes"], b["episodes"])
            line = (f"| {LABELS.get(a_name, a_name)} − {LABELS.get(b_name, b_name)} | {c} | "
                    + ", ".join(f"{d:+.0f}" for d in diffs) + f" | {np.mean(diffs):+.1f} ± {sd:.1f} | {z:+.2f} |")
            if verdicts:
                v = verdicts[(a_name, b_name, c)]
                ivl = "–" if v.n < 2 else f"[{100 * v.low95:+.1f}, {100 * v.high95:+.1f}]"
                mde = f" (MDE {100 * v.mde:.1f})" if v.word == "null" else ""
                line += f" {ivl} | {v.label}{mde} |"
            lines.append(line)
    return lines


def write_reports(out: Path, doc: Mapping[str, Any], runs: Mapping[Tuple[str, int], Path]) -> None:
    """``robot.csv`` (one row per policy, seed and condition), ``robot.json``, ``table.md``, ``robot.png``
    (success over the seeds) and ``training.png``."""
    rows = doc["rows"]
    cols = ["policy", "seed", "condition", "episodes", "successes", "success_rate", "ci95_low", "ci95_high",
            "mean_steps_to_success", "fail_off_target", "fail_too_high", "fail_suction_off", "fail_no_lift"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        flat = {**r, **{k: v for k, v in r["failures"].items() if k.startswith("fail_")}}
        writer.writerow({k: (f"{flat[k]:.4f}" if isinstance(flat[k], float) else flat[k]) for k in cols})
    atomic_write_text(out / "robot.csv", buf.getvalue())
    atomic_write_text(out / "robot.json", json.dumps(doc, indent=2))

    agg = doc["summary"]["aggregate"]
    policies = list(dict.fromkeys(a["policy"] for a in agg))
    conditions = list(dict.fromkeys(a["condition"] for a in agg))
    table = {(a["policy"], a["condition"]): a for a in agg}
    seeds = sorted({r["seed"] for r in rows})
    lines = [f"Success over {len(seeds)} training seed(s), all episodes pooled: successes/episodes = rate "
             f"[95 % Wilson interval]; below it the per-seed rates.", "",
             "| policy | " + " | ".join(conditions) + " |", "|---|" + "---|" * len(conditions)]
    for p in policies:
        cells = []
        for c in conditions:
            a = table[p, c]
            per_seed = ", ".join(f"{100 * x:.0f}" for x in a["seed_rates"])
            cells.append(f"{format_rate(a)}<br>seeds: {per_seed} %")
        lines.append(f"| {LABELS.get(p, p)} | " + " | ".join(cells) + " |")
    lines += _paired_lines(table, policies, conditions, paired_verdicts(rows, policies, conditions))
    lines += ["", "Failures by kind, summed over the seeds. The suction link never came within the 12 mm suction "
              "range of the target: *off target* (the tip was more than 6 cm away horizontally where it came "
              "closest; the expert still succeeds at 6 cm) or *too high* (horizontally close enough); or it came "
              "within range only with the suction off; or with the suction on, but the target was not lifted:", "",
              "| policy | condition | off target | too high | suction off | no lift |", "|---|---|---|---|---|---|"]
    for a in agg:
        lines.append(f"| {LABELS.get(a['policy'], a['policy'])} | {a['condition']} | {a['fail_off_target']} | "
                     f"{a['fail_too_high']} | {a['fail_suction_off']} | {a['fail_no_lift']} |")
    depth = doc["summary"].get("depth_use") or []
    if depth:
        lines += ["", "Depth use of the RGB-D policies (lift z = a * depth + b in coordinate units, y and x advance "
                  "by 1 per patch; shuffle: mean change of the predicted tip targets when the depth patches of an "
                  "image are permuted; control: mean distance to the fine-tuned 2-D control's tip targets):", "",
                  "| policy | seed | a (per m) | b | z range | shuffle (mm) | vs control (mm) |",
                  "|---|---|---|---|---|---|---|"]
        for d in depth:
            ctrl = d.get("diff_to_control_mm_mean")
            lines.append(f"| {LABELS.get(d['policy'], d['policy'])} | {d['seed']} | {d['scale']:.3f} "
                         f"| {d['bias']:.3f} | {d['z_min']:.2f} to {d['z_max']:.2f} "
                         f"| {d['shuffle_diff_mm_mean']:.2f} | " + (f"{ctrl:.2f}" if ctrl is not None else "-") + " |")
    tol = doc["summary"].get("tolerance")
    if tol:
        offsets = [t["offset_m"] for t in tol["recipe"]]
        lines += ["", "How precise a policy must be: the scripted expert's success when it believes the target is "
                  "higher (+) or lower (-) than it is, per grasp strategy "
                  f"({tol['recipe'][0]['episodes']} in-distribution scenes per cell):", "",
                  "| grasp | " + " | ".join(f"{1000 * o:+.0f} mm" for o in offsets) + " |",
                  "|---|" + "---|" * len(offsets)]
        names = {"recipe": "press 2 cm in, suction on from 3 cm above (the demos)",
                 "close_on_top": "close on the top face"}
        for key, rs in tol.items():
            lines.append(f"| {names.get(key, key)} | " + " | ".join(f"{t['success_rate']:.2f}" for t in rs) + " |")
    atomic_write_text(out / "table.md", "\n".join(lines) + "\n")
    _plot_success(out / "robot.png", agg, policies, conditions)
    _plot_training(out / "training.png", runs)


def _plot_success(path: Path, agg: Sequence[Mapping[str, Any]], policies: List[str], conditions: List[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = {(a["policy"], a["condition"]): a for a in agg}
    fig, ax = plt.subplots(figsize=(2.2 + 2.4 * len(conditions), 3.8))
    width = 0.8 / len(policies)
    x = np.arange(len(conditions))
    for i, p in enumerate(policies):
        xs = x + (i - (len(policies) - 1) / 2) * width
        rates = np.array([table[p, c]["success_rate"] for c in conditions])
        lo = rates - np.array([table[p, c]["ci95_low"] for c in conditions])
        hi = np.array([table[p, c]["ci95_high"] for c in conditions]) - rates
        ax.bar(xs, rates, width, yerr=[lo, hi], capsize=3, label=LABELS.get(p, p), color=COLOURS.get(p))
        for xi, c in zip(xs, conditions):  # one dot per training seed
            sr = table[p, c]["seed_rates"]
            ax.plot([xi] * len(sr), sr, "o", ms=3, color="black", alpha=0.6)
    n = agg[0]["episodes"]
    ax.set_xticks(x, [c.replace("_", "\n") for c in conditions])
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("success rate")
    ax.set_title(f"Pick success, {n} episodes per bar over the seeds (dots: one per seed; 95 % Wilson)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_training(path: Path, runs: Mapping[Tuple[str, int], Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    curves: Dict[Tuple[str, int], List[Dict[str, float]]] = {}
    for key, folder in runs.items():
        if (folder / "metrics.csv").exists():
            with open(folder / "metrics.csv", newline="") as fh:
                curves[key] = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(fh)]
    seen = set()
    for (arm, seed), data in curves.items():
        base = curves.get(("2d", seed)) if arm in ("3d", "2d_ft") else None  # fine-tunings go on from their 2-D run
        offset = int(base[-1]["step"]) if base else 0
        ax.plot([offset + d["step"] for d in data], [d["loss"] for d in data], color=COLOURS.get(arm), lw=1,
                alpha=0.8, label=None if arm in seen else LABELS.get(arm, arm))
        seen.add(arm)
    ax.set_xlabel("optimiser step (fine-tunings start where their 2-D policy ended)")
    ax.set_ylabel("diffusion loss")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rollout_media(cfg: RobotExperimentConfig, out: Path, runs: Mapping[str, Path]) -> None:
    """``rollouts.png``: one row per (policy, condition) with ``strip_frames`` evenly spaced frames of the first
    evaluation episode (not selected for success; the outcome is written on the row), and one GIF per policy
    (in distribution)."""
    from PIL import Image, ImageDraw

    from ropekit.robot.policy import PolicyRunner
    from ropekit.robot.train import load_policy

    r = cfg.recipe
    seed = int(episode_seeds(r["eval_seed"], max(1, r["eval_episodes"]))[0])
    conditions = ([c for c in ("in_distribution", "ood_table_height") if c in r["conditions"]]
                  or list(r["conditions"][:1]))
    rows = []
    for name, path in runs.items():
        policy = load_policy(path)
        for cond in conditions:
            with PickEnv(env_config(cond, policy.config.image_size, r["env"])) as env:
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
    from .recipes import PRESETS

    parser.add_argument("--out", default="runs/robot", help="output folder (resumes what it already holds)")
    parser.add_argument("--preset", choices=PRESETS, default="default",
                        help="pinned recipe: default (2-core CPU), gpu (one GPU), quick (seconds, for tests)")
    parser.add_argument("--quick", action="store_true", help="the same as --preset quick")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default: the recipe's)")
    parser.add_argument("--episodes", type=int, default=None,
                        help="evaluation episodes per policy, seed and condition (default: the recipe's)")
    parser.add_argument("--device", default=None, help="training device (default: cuda for --preset gpu, else cpu)")
    parser.add_argument("--workers", type=int, default=None, help="processes side by side (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def config_from_args(args: Any) -> RobotExperimentConfig:
    preset = "quick" if args.quick else args.preset
    cfg = RobotExperimentConfig.from_preset(preset, progress=not args.no_progress,
                                            device=args.device or ("cuda" if preset == "gpu" else "cpu"))
    if args.seeds is not None:
        cfg.recipe["seeds"] = [int(s) for s in args.seeds]
    if args.episodes is not None:
        cfg.recipe["eval_episodes"] = int(args.episodes)
    if args.workers is not None:
        cfg.workers = int(args.workers)
    if args.threads is not None:
        cfg.threads = int(args.threads)
    return cfg


def compare_recipe(doc: Dict[str, Any], where: str = "robot") -> List[str]:
    """Differences between a committed robot ``config.json`` (``doc``) and what its recorded preset resolves to
    now: the recipe field by field, the set of runs, and every recorded run's policy and training settings
    against :func:`arm_settings`. One line per difference; empty when the committed
    runs are what the documented command trains now."""
    from .recipes import PRESETS
    from .recipes.robot import recipe, with_later_backbone

    preset = doc.get("preset")
    if preset not in PRESETS:
        return [f"{where}: no known preset recorded (got {preset!r})"]
    now = json.loads(json.dumps(recipe(preset)))
    committed = with_later_backbone(doc.get("recipe") or {})
    # --seeds narrows the recipe's seeds; evaluation conditions are evaluation only, so a folder that evaluated a
    # subset of today's conditions (written before a condition joined the default evaluation) trained the same runs
    for key in ("seeds", "conditions"):
        got = committed.get(key)
        if isinstance(got, list) and got and set(got) <= set(now.get(key) or []):
            now[key] = got
    diffs = [f"{where}: recipe {k}: committed {committed.get(k, '<missing>')!r}, now {now.get(k, '<missing>')!r}"
             for k in sorted(set(committed) | set(now)) if committed.get(k, "<missing>") != now.get(k, "<missing>")]
    runs = doc.get("runs") or []
    if not runs:  # a study still running (or interrupted) records its runs at the end
        return diffs
    planned = {f"s{seed}/{arm}": (arm, seed) for arm, seed in planned_runs(now)}
    recorded = {run.get("name"): run for run in runs}
    diffs += [f"{where}: run {name} is missing" for name in sorted(set(planned) - set(recorded))]
    diffs += [f"{where}: run {name} is not part of the study" for name in sorted(set(recorded) - set(planned), key=str)]
    for name in sorted(set(planned) & set(recorded)):
        got = with_later_backbone(recorded[name].get("settings") or {})
        size = (got.get("policy") or {}).get("image_size", 0)
        want = json.loads(json.dumps(arm_settings(now, *planned[name], image_size=size)))
        diffs += [f"{where}: run {name} {k}: committed {got.get(k)!r}, now {want[k]!r}"
                  for k in sorted(want) if got.get(k) != want[k]]
    return diffs


def run_study(exp_cfg: Any, out: PathLike, **options: Any):
    """The ``robot`` entry of ``ropekit experiment`` (:mod:`ropekit_studies.registry`).

    The preset's pinned recipe (:mod:`ropekit_studies.recipes.robot`; ``exp_cfg.preset``), with ``progress`` and, when
    given, ``seeds`` and ``pes`` (one name: both policies' encoding; two: the 2-D then the 3-D policy's) of the
    shared :class:`~ropekit_studies.settings.ExperimentConfig`. The classification backbone and schedule
    do not apply; ``ropekit robot experiment`` takes this study's own flags.
    """
    from .common import StudyResult
    from .recipes import PRESETS
    from .settings import ExperimentConfig

    if options:
        raise ValueError(f"experiment robot takes no option {', '.join(sorted(options))}")
    preset = exp_cfg.preset if exp_cfg.preset in PRESETS else ("quick" if exp_cfg.quick else "default")
    cfg = RobotExperimentConfig.from_preset(preset, progress=bool(exp_cfg.progress),
                                            device="cuda" if preset == "gpu" else "cpu")
    if exp_cfg.seeds and preset != "quick" and list(exp_cfg.seeds) != ExperimentConfig().seeds:
        cfg.recipe["seeds"] = [int(s) for s in exp_cfg.seeds]
    if exp_cfg.pes:
        if len(exp_cfg.pes) > 2:
            raise ValueError("experiment robot takes one encoding (both policies) or two (2-D, then 3-D) in --pe")
        cfg.recipe["pe_2d"], cfg.recipe["pe_3d"] = exp_cfg.pes[0], exp_cfg.pes[-1]
    doc = run_experiment(cfg, out)
    out = Path(out)
    files = sorted(p for p in out.iterdir() if p.is_file())
    return StudyResult("robot", out, files, (out / "table.md").read_text(), doc["summary"])


def run(args: Any) -> int:
    doc = run_experiment(config_from_args(args), args.out)
    print((Path(args.out) / "table.md").read_text())
    print(f"results in {args.out} ({doc['summary']['timings_s']['total']:.0f} s)")
    return 0
