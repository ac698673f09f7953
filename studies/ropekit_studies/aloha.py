"""The ALOHA study: diffusion policies whose ViT encoder differs only in its position encoding.

For each task and encoder variant (:data:`~.policy.ENCODINGS`: learned APE, axial RoPE, mixed RoPE,
Cayley-STRING on RGB with ``(y, x)`` coordinates, and Cayley-STRING on RGB-D with depth as the third
coordinate) and each training seed, a policy is trained on the same cached scripted demonstrations and
evaluated on fixed, held-out object-pose seeds. The scripted expert, replayed on those same seeds, gives the
ceiling.

Each policy trains in one call of ``ropekit.robot.train.train_policy`` (one warm-up and cosine schedule);
after each of the first ``segments - 1`` equal parts of it, the EMA policy so far is evaluated on
``curve_episodes`` seeds -- the success-vs-training-step curve. The last point, after training, uses
``eval_episodes`` seeds: the table's number.

The presets (:data:`PRESETS`) state every policy and training field (:func:`missing_fields` is empty for
each), so a changed default elsewhere cannot change what a documented command trains.

Outputs in ``out``: ``config.json`` (the full configuration and the command), ``results.json`` (every
evaluation), ``curves.csv``, ``table.md``, ``success.png`` (success vs step, mean over seeds, one panel per
task), and per policy ``runs/<task>/<encoding>-s<seed>/``: ``checkpoint.pt``, ``curve.json`` (the points
evaluated so far), ``train/`` (``metrics.csv``; the training state while it runs) and ``result.json`` once
it is done. Running the same command again continues an interrupted study: finished policies are read back,
an interrupted one resumes from its last training state (bit for bit), and a folder of other settings is
refused.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import io
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ropekit.robot.aloha.policy import encoding_label


__all__ = ["AlohaExperimentConfig", "run_experiment", "run_study", "robot_command", "missing_fields", "PRESETS"]

PathLike = Union[str, Path]


@dataclass
class AlohaExperimentConfig:
    """Everything the study depends on (saved next to its outputs).

    Args:
        tasks: ``transfer_cube`` and/or ``insertion``.
        encodings: labels of :data:`~.policy.ENCODINGS`.
        seeds: training seeds (one policy per encoding and seed).
        demos, demo_seed, frame_stride, image_hw, fovy, episode_steps: the demo set
            (:class:`~.expert.DemoConfig`); ``image_hw`` and ``fovy`` are also the policies' camera.
        policy: :class:`~.policy.AlohaPolicyConfig` fields (besides ``pe``/``modality``/``image_hw``/``fovy``).
        train: :class:`~ropekit.robot.train.PolicyTrainConfig` fields; ``train["steps"]`` is the total.
        segments: evaluation points along training (the curve).
        curve_episodes, eval_episodes: evaluation seeds per curve point / for the final number.
        eval_seed: first evaluation object-pose seed (far from the demo seeds: held-out poses).
        eval_parallel: episodes simulated in lockstep (one policy batch per re-planning step).
        eval_steps: steps per evaluation episode (``None``: ``episode_steps``; shorter only for smoke tests).
        expert_episodes: scripted-expert replays on the evaluation seeds (the ceiling).
        demo_depth: record depth even when no RGB-D encoder is trained (so that studies split across
            processes share one cached demo set).
        save_checkpoints: write each policy's ``checkpoint.pt``.
        cache_dir: demo-set cache (``None``: ``~/.cache/ropekit/aloha``).
    """

    tasks: List[str] = field(default_factory=lambda: ["transfer_cube"])
    encodings: List[str] = field(default_factory=lambda: ["ViT (learned APE)", "RoPE (axial)", "RoPE (mixed)",
                                                          "Cayley-STRING", "Cayley-STRING RGB-D"])
    seeds: List[int] = field(default_factory=lambda: [0, 1])
    demos: int = 2000
    demo_seed: int = 0
    frame_stride: int = 4
    image_hw: Tuple[int, int] = (48, 64)
    fovy: Optional[float] = 50.0
    episode_steps: int = 400
    policy: Dict[str, Any] = field(default_factory=lambda: _policy())
    train: Dict[str, Any] = field(default_factory=lambda: _train())
    segments: int = 3
    curve_episodes: int = 20
    eval_episodes: int = 50
    eval_seed: int = 100_000
    eval_parallel: int = 10
    eval_steps: Optional[int] = None
    expert_episodes: int = 50
    demo_depth: bool = True
    save_checkpoints: bool = True
    cache_dir: Optional[str] = None
    threads: int = 1
    progress: bool = True

    def __post_init__(self) -> None:
        from ropekit.robot.aloha.policy import ENCODINGS
        from ropekit.robot.aloha.sim import task_spec

        self.tasks = [task_spec(t).name for t in self.tasks]
        unknown = [e for e in self.encodings if e not in ENCODINGS]
        if unknown:
            raise ValueError(f"unknown encoding(s) {unknown}; known: {', '.join(ENCODINGS)}")
        self.image_hw = (int(self.image_hw[0]), int(self.image_hw[1]))
        if self.segments < 1 or self.train.get("steps", 1) < self.segments:
            raise ValueError(f"need 1 <= segments <= train steps, got {self.segments} and {self.train.get('steps')}")

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["image_hw"] = list(self.image_hw)
        return d

    def curve_steps(self) -> List[int]:
        """Training steps after which the curve is evaluated (``segments - 1`` points; the last is the end)."""
        total = int(self.train.get("steps", 1500))
        return [round(total * k / self.segments) for k in range(1, self.segments)]

    def eval_seeds(self) -> List[int]:
        """The held-out object-pose seeds of the final evaluation (the curve uses the first ``curve_episodes``)."""
        return list(range(self.eval_seed, self.eval_seed + self.eval_episodes))

    def demo_config(self, task: str) -> Any:
        """The :class:`~.expert.DemoConfig` of ``task``'s demo set (with depth when any row or ``demo_depth``
        needs it)."""
        from ropekit.robot.aloha.expert import DemoConfig
        from ropekit.robot.aloha.policy import ENCODINGS

        depth = self.demo_depth or any(ENCODINGS[e][0] == "rgbd" for e in self.encodings)
        return DemoConfig(task=task, episodes=self.demos, seed=self.demo_seed, episode_steps=self.episode_steps,
                          image_hw=self.image_hw, fovy=self.fovy, depth=depth, frame_stride=self.frame_stride)

    def run_configs(self, label: str, seed: int) -> Tuple[Any, Any]:
        """``(AlohaPolicyConfig, PolicyTrainConfig)`` of the encoder row ``label`` at training seed ``seed``."""
        from ropekit.robot.train import PolicyTrainConfig
        from ropekit.robot.aloha.policy import ENCODINGS, AlohaPolicyConfig

        modality, pe, pe_options = ENCODINGS[label]
        pcfg = AlohaPolicyConfig(**{**copy.deepcopy(self.policy), "pe": pe, "pe_options": dict(pe_options),
                                    "modality": modality, "image_hw": self.image_hw, "fovy": self.fovy})
        return pcfg, PolicyTrainConfig(**{**self.train, "seed": seed * 1000, "num_threads": int(self.threads)})


#: Policy fields each encoder row sets itself (``image_size`` is unused: the camera is ``image_hw``).
PER_RUN_POLICY = frozenset({"modality", "pe", "pe_options", "image_hw", "fovy", "image_size"})


def _backbone(**changes: Any) -> Dict[str, Any]:
    """Every encoder field: 8-px patches (6x8 tokens at 48x64), width 96, 3 blocks of 3 heads, MLP ratio 2,
    no class token (the head pools with its own queries), grid coordinates, no jitter."""
    b = dict(patch_size=8, tubelet_size=2, embed_dim=96, depth=3, num_heads=3, mlp_ratio=2.0, qkv_bias=True,
             drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0, pe_sharing="auto", per_head=False,
             pe_fold_train=True, ape="none", cls="none", coords="grid", jitter=0.0,
             coord_augment=[0.0, 1.0, 1.0], num_kv_heads=None, resolution_scaling={})
    b.update(changes)
    return b


def _policy(**changes: Any) -> Dict[str, Any]:
    """Every head field: 16-step chunks of absolute joint targets of which 8 are executed, 4 pooling queries
    with their expected patch positions (keypoints), FiLM residual MLP of width 256, DDPM with 100 steps
    predicting the clean chunk, 8 DDIM steps. The RGB-D lift starts at 8 coordinate units per metre: through the
    50-degree camera an 8-px patch spans ~0.12 m of the table (0.8 m away), so z then moves like y and x.
    The object loss (weight 1; a head on the image features predicts where the objects are in each frame)
    teaches the encoder to find them: without it every encoder's policy reached for the cube blind (success
    2-16 %); with the cube's position given, 100 %."""
    p = dict(vit_size="tiny", vit_overrides=_backbone(), depth_scale_init=8.0, horizon=16, n_action_steps=8,
             action_mode="absolute", num_queries=4, keypoints=True, aux_weight=1.0, cond_dim=192, hidden_dim=256,
             num_blocks=3, num_train_timesteps=100, num_inference_steps=8, prediction="sample")
    p.update(changes)
    return p


def _train(**changes: Any) -> Dict[str, Any]:
    """Every optimisation field except the per-run ``seed`` and the hardware's ``num_threads``."""
    t = dict(steps=6000, batch_size=64, lr=1e-3, min_lr=1e-5, warmup_steps=100, weight_decay=1e-4,
             depth_lr_mult=10.0, noise_samples=2, shift=0, grad_clip=1.0, ema_decay=0.995, only_successful=True,
             log_every=50)
    t.update(changes)
    return t


def missing_fields(cfg: AlohaExperimentConfig) -> List[str]:
    """Policy, encoder and training fields ``cfg`` leaves to a default (empty for every preset)."""
    from .recipes.robot import backbone_fields
    from ropekit.robot.train import PolicyTrainConfig
    from ropekit.robot.aloha.policy import AlohaPolicyConfig

    policy = {f.name for f in dataclasses.fields(AlohaPolicyConfig)} - PER_RUN_POLICY
    train = {f.name for f in dataclasses.fields(PolicyTrainConfig)} - {"seed", "num_threads"}
    backbone = backbone_fields() - set(cfg.policy.get("vit_overrides", {}))
    return ([f"policy.{k}" for k in sorted(policy - set(cfg.policy))]
            + [f"policy.vit_overrides.{k}" for k in sorted(backbone)]
            + [f"train.{k}" for k in sorted(train - set(cfg.train))])


def _cpu() -> AlohaExperimentConfig:
    # 2000 demos and 6000 steps: with 20 or 200 demos the policies acted blind (the README's diagnosis), and the
    # KUKA pick study needed both 10x its demos and 3x its steps before its policies followed the target.
    return AlohaExperimentConfig()


def _quick() -> AlohaExperimentConfig:
    return AlohaExperimentConfig(
        encodings=["ViT (learned APE)", "Cayley-STRING"], seeds=[0], demos=1, frame_stride=8, image_hw=(24, 32),
        fovy=None, episode_steps=400,
        policy=_policy(vit_overrides=_backbone(depth=1, embed_dim=32, num_heads=2), cond_dim=32, hidden_dim=32,
                       num_blocks=1, num_inference_steps=2),
        train=_train(steps=4, batch_size=8, warmup_steps=1, shift=1, noise_samples=1, log_every=2),
        segments=2, curve_episodes=1, eval_episodes=2, eval_parallel=2, eval_steps=24, expert_episodes=1,
        demo_depth=False, progress=False)


def _gpu() -> AlohaExperimentConfig:
    # Both tasks, 96x128 camera (12x16 tokens: a patch spans half as much, so 16 units per metre), width 192
    # with 4 blocks of 4 heads, the CPU recipe's demos and steps at twice the batch. Sized for about 30 minutes
    # on one GPU -- an estimate, not measured.
    return AlohaExperimentConfig(
        tasks=["transfer_cube", "insertion"], frame_stride=2, image_hw=(96, 128),
        policy=_policy(vit_overrides=_backbone(depth=4, embed_dim=192, num_heads=4, mlp_ratio=4.0), cond_dim=256,
                       hidden_dim=512, num_blocks=4, num_inference_steps=10, depth_scale_init=16.0),
        train=_train(batch_size=128, warmup_steps=300, noise_samples=4, log_every=100),
        eval_parallel=25, threads=2)


PRESETS = {"cpu": _cpu, "quick": _quick, "gpu": _gpu}


def _slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def expert_ceiling(task: str, seeds: Sequence[int], episode_steps: int = 400) -> Dict[str, Any]:
    """Success of the scripted expert (end-effector script, then joint replay) on ``seeds``, no rendering,
    and its closest approach to the object (``reach_gap``, metres: the reference for the policies')."""
    from ropekit.robot.aloha.expert import expert_episode
    from ropekit.robot.aloha.sim import AlohaSim

    t0 = time.time()
    replay, ee = AlohaSim(task, cameras=()), AlohaSim(task, mode="ee", cameras=())
    runs = [expert_episode(task, s, episode_steps, replay=replay, ee_sim=ee) for s in seeds]
    ok = [bool(r["success"]) for r in runs]
    return {"success": ok, "success_rate": float(np.mean(ok)), "seeds": [int(s) for s in seeds],
            "reach_gap": [float(r["reach_gap"]) for r in runs], "seconds": time.time() - t0}


class _OnDevice:
    """A chunk set whose batches land on ``device`` (``train_policy`` feeds batches to the policy as they come)."""

    def __init__(self, data: Any, device: torch.device) -> None:
        self.data, self.device = data, device
        self.episodes, self.state, self.actions = data.episodes, data.state, data.actions
        self.object_pos = getattr(data, "object_pos", None)  # (N, 6) on the CPU: train_policy moves each batch

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, index: torch.Tensor):
        return tuple(t.to(self.device, non_blocking=True) for t in self.data.batch(index))


def run_experiment(cfg: AlohaExperimentConfig, out: PathLike, command: Optional[str] = None,
                   device: str = "cpu", workers: int = 1) -> Dict[str, Any]:
    """Run the study described by ``cfg``; write its outputs into ``out``; return the results document.

    ``workers``: processes that collect a missing demo set side by side (the set does not depend on it)."""
    from ropekit.robot.aloha.expert import load_or_collect
    from ropekit.train.metrics import atomic_write_text

    t_start = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(cfg.threads))
    dev = torch.device(device)
    command = command or "ropekit " + " ".join(sys.argv[1:])
    atomic_write_text(out / "config.json", json.dumps({"command": command, "device": device,
                                                        "config": cfg.to_dict()}, indent=2))
    doc: Dict[str, Any] = {"command": command, "device": device, "tasks": {}, "timings_s": {}}
    curve_steps, eval_seeds = cfg.curve_steps(), cfg.eval_seeds()
    for task in cfg.tasks:
        tdoc: Dict[str, Any] = {"policies": {}}
        doc["tasks"][task] = tdoc
        t0 = time.time()
        dcfg = cfg.demo_config(task)
        demos, path, cached = load_or_collect(dcfg, cfg.cache_dir, progress=cfg.progress, workers=workers)
        tdoc["demos"] = {"path": str(path), "cached": cached, "kept": int(len(demos["episode_seed"])),
                         "attempts": int(demos["attempts"]), "failed_seeds": demos["failed_seeds"].tolist(),
                         "collect_seconds": float(demos["seconds"]), "key": dcfg.key()}
        doc["timings_s"][f"{task}/demos"] = time.time() - t0
        t0 = time.time()
        tdoc["expert"] = expert_ceiling(task, eval_seeds[:cfg.expert_episodes], cfg.episode_steps)
        doc["timings_s"][f"{task}/expert"] = time.time() - t0
        for seed, label in [(s, e) for s in cfg.seeds for e in cfg.encodings]:  # every encoder once first
            pcfg, tcfg = cfg.run_configs(label, seed)
            run_dir = out / "runs" / task / f"{_slug(label)}-s{seed}"
            identity = {"policy": pcfg.to_dict(), "train": {**tcfg.to_dict(), "num_threads": None},
                        "demos": dcfg.key(), "eval_seeds": eval_seeds, "curve_steps": curve_steps,
                        "curve_episodes": cfg.curve_episodes, "eval_steps": cfg.eval_steps or cfg.episode_steps,
                        "eval_parallel": cfg.eval_parallel}
            record = _finished(run_dir, identity)
            if record is None:
                record = _train_and_evaluate(cfg, task, label, seed, pcfg, tcfg, demos, dev, run_dir, identity,
                                             eval_seeds, curve_steps, t_start)
            tdoc["policies"].setdefault(label, []).append(record)
            doc["timings_s"][f"{task}/{label}/s{seed}"] = record["seconds"]
            _write_reports(cfg, doc, out)
    doc["timings_s"]["total"] = time.time() - t_start
    _write_reports(cfg, doc, out)
    return doc


def _finished(run_dir: Path, identity: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The record of a policy this study already trained and evaluated in ``run_dir`` (``None``: not yet).

    Raises:
        ValueError: ``run_dir`` holds a policy of other settings.
    """
    path = run_dir / "result.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if saved.get("identity") != identity:
        raise ValueError(f"{run_dir} holds a policy trained or evaluated with other settings; choose another --out "
                         f"or remove that folder")
    return saved["record"]


def _train_and_evaluate(cfg: AlohaExperimentConfig, task: str, label: str, seed: int, pcfg: Any, tcfg: Any,
                        demos: Dict[str, np.ndarray], dev: torch.device, run_dir: Path, identity: Dict[str, Any],
                        eval_seeds: List[int], curve_steps: List[int], t_start: float) -> Dict[str, Any]:
    """Train one policy (resuming from ``run_dir/train`` after an interruption), evaluate it along the way and
    at the end; write ``run_dir/result.json`` (which marks it done) and return its record."""
    from ropekit.train.metrics import atomic_write_text
    from ropekit.robot.train import train_policy
    from ropekit.robot.aloha.policy import AlohaChunks, AlohaPolicy, evaluate_policy, save_aloha_policy

    t0 = time.time()
    torch.manual_seed(seed)
    policy = AlohaPolicy(pcfg)
    data = AlohaChunks(demos, pcfg)
    if dev.type != "cpu":
        policy.fit_normalizers(data.actions, data.state, data.object_pos)
        policy.to(dev)
        feed: Any = _OnDevice(data, dev)
    else:
        feed = data
    curve_path = run_dir / "curve.json"  # the points evaluated so far survive an interruption
    curve: List[Dict[str, Any]] = json.loads(curve_path.read_text()) if curve_path.exists() else []

    def evaluate(step: int, snapshot: Any, episodes: int) -> Dict[str, Any]:
        ev = evaluate_policy(snapshot, task, eval_seeds[:episodes], cfg.eval_steps or cfg.episode_steps,
                             parallel=cfg.eval_parallel, seed=seed, progress=cfg.progress)
        curve[:] = [c for c in curve if c["step"] != step] + [
            {"step": step, "episodes": episodes, "success_rate": ev["success_rate"],
             "mean_max_reward": float(np.mean(ev["max_reward"]))}]
        atomic_write_text(curve_path, json.dumps(curve, indent=2))
        print(f"[aloha] {task} {label} s{seed} step {step}: success {ev['success_rate']:.2f} "
              f"({episodes} episodes, {ev['seconds']:.0f} s; {time.time() - t_start:.0f} s in)",
              file=sys.stderr, flush=True)
        return ev

    run_dir.mkdir(parents=True, exist_ok=True)
    history = train_policy(policy, feed, tcfg, out_dir=run_dir / "train", fit_normalizers=dev.type == "cpu",
                           progress=cfg.progress, snapshot_at=curve_steps,
                           on_snapshot=lambda step, snap: evaluate(step, snap, cfg.curve_episodes))
    ev = evaluate(int(tcfg.steps), policy, cfg.eval_episodes)
    if cfg.save_checkpoints:
        save_aloha_policy(policy.cpu(), run_dir / "checkpoint.pt", history=history, curve=curve)
    record = {"seed": seed, "final": {k: ev[k] for k in ("success_rate", "success", "max_reward", "success_step",
                                                          "reach_gap", "seconds")},
              "curve": sorted(curve, key=lambda c: c["step"]), "final_loss": history[-1]["loss"] if history else None,
              "seconds": time.time() - t0}
    atomic_write_text(run_dir / "result.json", json.dumps({"identity": identity, "record": record}, indent=2))
    for name in ("train_state.pt", "checkpoint.pt"):  # done: the record (and checkpoint.pt above) is what stays
        (run_dir / "train" / name).unlink(missing_ok=True)
    return record


def merge_results(dirs: Sequence[PathLike], out: PathLike) -> Dict[str, Any]:
    """Merge the ``results.json`` of studies run apart (e.g. one process per seed) into ``out``'s reports.

    The demo set and expert ceiling are taken from the first folder that has them; policy runs are pooled. A
    folder that is itself a merge contributes its parts (their commands, configurations and sources), so runs
    finished later can be added to a committed merge without the parts it was made from.
    """
    from ropekit.train.metrics import atomic_write_text

    totals = ("total", "total (longest part)")
    docs = [json.loads((Path(d) / "results.json").read_text()) for d in dirs]
    merged: Dict[str, Any] = {"command": [], "device": docs[0].get("device"), "tasks": {}, "timings_s": {},
                              "merged_from": []}
    cfgs: List[Any] = []
    for folder, d in zip(dirs, docs):
        part_of_merge = "merged_from" in d
        merged["command"].extend(d.get("command") if part_of_merge else [d.get("command")])
        merged["merged_from"].extend(d["merged_from"] if part_of_merge else [str(folder)])
        merged["timings_s"].update({k: v for k, v in d["timings_s"].items() if k not in totals})
        for task, tdoc in d["tasks"].items():
            into = merged["tasks"].setdefault(task, {k: v for k, v in tdoc.items() if k != "policies"})
            into.setdefault("policies", {})
            for label, runs in tdoc["policies"].items():
                into["policies"].setdefault(label, []).extend(runs)
        cfg_path = Path(folder) / "config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text())
            cfgs.extend(cfg["merged"] if "merged" in cfg else [cfg])
    merged["timings_s"]["total (longest part)"] = max(d["timings_s"].get(k, 0.0) for d in docs for k in totals)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.json", json.dumps({"merged": cfgs}, indent=2))
    _write_reports(None, merged, out)
    return merged


def summary_rows(doc: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per task and encoding: mean and per-seed final success, mean max reward, median closest
    approach of the right gripper to its object (``reach_cm``; ``None`` for results recorded without it) and
    the expert's (ceiling and ``expert_reach_cm``)."""
    def median_cm(gaps: List[float]) -> Optional[float]:
        return float(np.median(gaps) * 100) if gaps else None

    rows = []
    for task, tdoc in doc["tasks"].items():
        for label, runs in tdoc["policies"].items():
            rates = [r["final"]["success_rate"] for r in runs]
            gaps = [g for r in runs for g in r["final"].get("reach_gap", [])]
            rows.append({"task": task, "encoding": label, "success": float(np.mean(rates)),
                         "per_seed": rates, "episodes": len(runs[0]["final"]["success"]),
                         "max_reward": float(np.mean([np.mean(r["final"]["max_reward"]) for r in runs])),
                         "reach_cm": median_cm(gaps),
                         "expert_reach_cm": median_cm(tdoc["expert"].get("reach_gap", [])),
                         "expert": tdoc["expert"]["success_rate"], "seconds": sum(r["seconds"] for r in runs)})
    return rows


def _table(doc: Dict[str, Any]) -> str:
    def cm(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.1f}"

    lines = ["| task | encoder | success (mean over seeds) | per seed | mean max reward (0-4) | "
             "closest approach, median cm (expert) | expert ceiling | train + eval time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary_rows(doc):
        lines.append(f"| {r['task']} | {r['encoding']} | {r['success']:.2f} ({r['episodes']} episodes each) | "
                     f"{', '.join(f'{x:.2f}' for x in r['per_seed'])} | {r['max_reward']:.2f} | "
                     f"{cm(r['reach_cm'])} ({cm(r['expert_reach_cm'])}) | "
                     f"{r['expert']:.2f} | {r['seconds'] / 60:.1f} min |")
    return "\n".join(lines + _paired_lines(doc)) + "\n"


#: The row every other encoder is compared with: the paper's "ViT".
BASELINE = "ViT (learned APE)"


def _paired_lines(doc: Dict[str, Any]) -> List[str]:
    """Markdown lines: per task, each encoder's final success minus the learned-APE policy's, paired by training
    seed (percentage points; mean and sample standard deviation over the seeds), and the two-proportion z of the
    pooled episodes ("-" where both are at 0 or both at 1). Empty when no task has the APE row beside another encoder
    on the same seeds."""
    from .robot import pooled_z

    rows = []
    for task, tdoc in doc["tasks"].items():
        by_seed = {label: {r["seed"]: r["final"]["success"] for r in runs} for label, runs in tdoc["policies"].items()}
        base = by_seed.get(BASELINE)
        if not base:
            continue
        for label, runs in by_seed.items():
            seeds = sorted(set(runs) & set(base))
            if label == BASELINE or not seeds:
                continue
            diffs = [100 * (np.mean(runs[s]) - np.mean(base[s])) for s in seeds]
            sd = f"{np.std(diffs, ddof=1):.1f}" if len(diffs) > 1 else "-"
            k1, n1 = sum(int(np.sum(runs[s])) for s in seeds), sum(len(runs[s]) for s in seeds)
            k2, n2 = sum(int(np.sum(base[s])) for s in seeds), sum(len(base[s]) for s in seeds)
            z = pooled_z(k1, n1, k2, n2)
            rows.append(f"| {task} | {label} | {', '.join(f'{d:+.0f}' for d in diffs)} | {np.mean(diffs):+.1f} ± {sd} "
                        f"| {'-' if np.isnan(z) else f'{z:+.2f}'} |")
    if not rows:
        return []
    return ["", f"Final success minus the {BASELINE} policy's, paired by training seed (percentage points; mean ± "
            "sample standard deviation over the seeds), and the two-proportion z of the pooled episodes (which "
            "ignores the spread between seeds):", "", "| task | encoder | per seed | mean ± sd | pooled z |",
            "|---|---|---|---|---|", *rows]


def _write_reports(cfg: Optional[AlohaExperimentConfig], doc: Dict[str, Any], out: Path) -> None:
    from ropekit.train.metrics import atomic_write_text

    atomic_write_text(out / "results.json", json.dumps(doc, indent=2))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["task", "encoding", "seed", "step", "episodes", "success_rate", "mean_max_reward"])
    for task, tdoc in doc["tasks"].items():
        for label, runs in tdoc["policies"].items():
            for r in runs:
                for c in r["curve"]:
                    w.writerow([task, label, r["seed"], c["step"], c["episodes"], c["success_rate"],
                                c["mean_max_reward"]])
    atomic_write_text(out / "curves.csv", buf.getvalue())
    atomic_write_text(out / "table.md", _table(doc))
    try:
        _plot(doc, out / "success.png")
    except ImportError:  # matplotlib is optional
        pass


def _plot(doc: Dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ropekit.robot.aloha.policy import ENCODINGS

    tasks = list(doc["tasks"])
    labels = list(ENCODINGS) + sorted({lb for t in tasks for lb in doc["tasks"][t]["policies"]} - set(ENCODINGS))
    colour = {lb: f"C{i}" for i, lb in enumerate(labels)}  # one colour per encoder in every panel
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(5.5 * max(1, len(tasks)), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        tdoc = doc["tasks"][task]
        for label, runs in sorted(tdoc["policies"].items(), key=lambda kv: labels.index(kv[0])):
            steps = [c["step"] for c in runs[0]["curve"]]
            rates = np.array([[c["success_rate"] for c in r["curve"]] for r in runs if len(r["curve"]) == len(steps)])
            ax.plot(steps, rates.mean(0), marker="o", label=label, color=colour[label])
        if "expert" in tdoc:
            ax.axhline(tdoc["expert"]["success_rate"], color="k", ls="--", lw=1, label="scripted expert")
        ax.set_title(task)
        ax.set_xlabel("training step")
        ax.set_ylabel("success rate")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def robot_command(exp_cfg: Any, out: PathLike) -> str:
    """The ``ropekit robot aloha experiment`` command that ``ropekit experiment aloha`` with ``exp_cfg`` stands for:
    ``--quick``, ``--seeds``, ``--pe``, ``--threads`` and ``--no-progress`` carried over, ``--out`` the study's
    folder. ``ropekit robot aloha experiment`` is the one command of the ALOHA study; ``ropekit experiment aloha``
    is an alias of it (the same configuration, the same recorded command)."""
    import shlex

    words = ["ropekit", "robot", "aloha", "experiment", "--out", str(out)]
    if exp_cfg.quick:
        words.append("--quick")
    if exp_cfg.seeds and not exp_cfg.quick:
        words += ["--seeds", ",".join(str(int(s)) for s in exp_cfg.seeds)]
    if exp_cfg.pes:
        words += ["--pe", ",".join(str(p) for p in exp_cfg.pes)]
    if getattr(exp_cfg, "threads", None):
        words += ["--threads", str(int(exp_cfg.threads))]
    if not exp_cfg.progress:
        words.append("--no-progress")
    return " ".join(shlex.quote(w) for w in words)


def run_study(exp_cfg: Any, out: PathLike, **options: Any):
    """The ``aloha`` entry of ``ropekit experiment``: an alias of ``ropekit robot aloha experiment`` (see
    :func:`robot_command`): the CPU preset (``--quick``: the tiny one), with ``--seeds``, ``--pe`` (encoder labels or
    create_pe names: absolute, axial, mixed, cayley, cayley-rgbd), ``--threads`` and ``--no-progress`` taken from the
    shared options. The configuration is the one that command runs (tests/test_one_command.py holds them equal),
    and the command is what the results record, so both spellings write the same results."""
    from .common import StudyResult

    if options:
        raise ValueError(f"experiment aloha takes no option {', '.join(sorted(options))}")
    cfg = PRESETS["quick" if exp_cfg.quick else "cpu"]()
    changes: Dict[str, Any] = {"progress": bool(exp_cfg.progress)}
    if exp_cfg.seeds and not exp_cfg.quick:
        changes["seeds"] = [int(s) for s in exp_cfg.seeds]
    if exp_cfg.pes:
        changes["encodings"] = [encoding_label(p) for p in exp_cfg.pes]
    if getattr(exp_cfg, "threads", None):
        changes["threads"] = int(exp_cfg.threads)
    cfg = dataclasses.replace(cfg, **changes)
    doc = run_experiment(cfg, out, command=robot_command(exp_cfg, out))
    out = Path(out)
    files = sorted(p for p in out.iterdir() if p.is_file())
    return StudyResult("aloha", out, files, (out / "table.md").read_text(), {"rows": summary_rows(doc)})
