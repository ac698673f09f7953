"""Imitation training of :class:`~ropekit.robot.policy.DiffusionPolicy` on scripted demonstrations.

Shape legend: ``N`` examples (demo steps), ``B`` batch, ``H`` chunk length, ``A = 4`` action dimension,
``S = 11`` state dimension, ``Hi, Wi`` image pixels.

A run folder holds ``config.json`` (policy, training and data settings), ``metrics.csv`` (step, loss, lr,
elapsed seconds) and ``checkpoint.pt`` (the policy's config and weights, the EMA weights when EMA is on)::

    policy = DiffusionPolicy(PolicyConfig(modality="image"))
    data = DemoChunks(load_demos("demos.npz"), policy.config)
    train_policy(policy, data, PolicyTrainConfig(steps=1500), out_dir="runs/robot/2d")
    policy = load_policy("runs/robot/2d")
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ..nn.depth import DepthLift
from ..train.checkpoint import atomic_save
from ..train.metrics import atomic_write_text
from ..train.trainer import build_optimizer, random_shift
from .policy import DiffusionPolicy, PolicyConfig, images_from_obs

__all__ = ["PolicyTrainConfig", "DemoChunks", "train_policy", "save_policy", "load_policy", "CHECKPOINT"]

CHECKPOINT = "checkpoint.pt"
_FORMAT = "ropekit-robot-policy"
PathLike = Union[str, Path]


@dataclass
class PolicyTrainConfig:
    """Optimisation settings of :func:`train_policy`.

    steps, batch_size: optimiser steps and examples per step. lr, min_lr, warmup_steps: AdamW learning rate,
    linear warm-up then cosine decay to ``min_lr``. weight_decay: not applied to norms, biases, encodings,
    the depth lift or the pooling queries. depth_lr_mult: learning-rate factor of the depth lift
    ``z = a * depth + b``. Starting from ``a = 0`` (fine-tuning from 2-D) it must grow to a few coordinate
    units per metre (one 8-pixel patch of the 64-pixel camera spans ~0.14 m at 1 m) before the ``z`` axis
    changes any rotation. Its gradient at ``a = 0`` is weak and changes sign, so ``a`` barely moves: in the
    committed run (``docs/results/robot``) it ended at -0.02 with 10x and at 0.08 with 100x (the default)
    over 800 steps. The learned ``a`` is logged as ``depth_scale``.
    noise_samples: ``(t, noise)`` draws per encoded example. shift: random image shift (pixels, zero fill;
    depth 0 is invalid and masked). ema_decay: exponential moving average of the weights
    (``0``: off), warmed up as ``min(decay, (1 + k) / (10 + k))``; the saved policy holds the EMA weights.
    only_successful: train on successful demo episodes only. num_threads: torch CPU threads.
    """

    steps: int = 1500
    batch_size: int = 64
    lr: float = 5e-4
    min_lr: float = 1e-5
    warmup_steps: int = 100
    weight_decay: float = 1e-4
    depth_lr_mult: float = 100.0
    noise_samples: int = 4
    shift: int = 4
    grad_clip: float = 1.0
    ema_decay: float = 0.995
    only_successful: bool = True
    seed: int = 0
    num_threads: int = 1
    log_every: int = 25

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


class DemoChunks:
    """Training examples from a demo file (:func:`ropekit.robot.load_demos`): each demo step with the chunk
    of its next ``H`` expert actions (the episode's last action repeats past its end).

    Attributes: ``rgb (N, Hi, Wi, 3)`` uint8, ``depth (N, Hi, Wi)`` float32 or ``None`` (RGB policies),
    ``state (N, S)``, ``actions (N, H, A)`` env actions; ``episodes`` the episode indices kept.
    """

    def __init__(self, demos: Mapping[str, Any], config: PolicyConfig, only_successful: bool = True) -> None:
        episode = np.asarray(demos["episode"])
        keep = np.flatnonzero(demos["episode_success"]) if only_successful else np.unique(episode)
        if len(keep) == 0:
            raise ValueError("no successful demo episode to train on")
        rows = np.flatnonzero(np.isin(episode, keep))  # (N,)
        lengths = np.asarray(demos["episode_length"])
        step = np.asarray(demos["step"])[rows]
        last = rows - step + lengths[episode[rows]] - 1  # (N,) row of each episode's last step
        ahead = np.minimum(rows[:, None] + np.arange(config.horizon)[None], last[:, None])  # (N, H)
        self.episodes = keep
        self.rgb = torch.from_numpy(np.ascontiguousarray(demos["rgb"][rows]))
        self.depth = torch.from_numpy(np.ascontiguousarray(demos["depth"][rows])) if config.modality == "rgbd" else None
        self.state = torch.from_numpy(np.asarray(demos["state"][rows], dtype=np.float32))
        self.actions = torch.from_numpy(np.asarray(demos["action"], dtype=np.float32)[ahead])  # (N, H, A)

    def __len__(self) -> int:
        return len(self.state)

    def batch(self, index: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(images (B, 3|4, Hi, Wi), state (B, S), actions (B, H, A))`` for example indices ``(B,)``."""
        depth = self.depth[index] if self.depth is not None else None
        return images_from_obs(self.rgb[index], depth), self.state[index], self.actions[index]


def _optimizer(policy: DiffusionPolicy, cfg: PolicyTrainConfig) -> torch.optim.Optimizer:
    """The project's AdamW groups (:func:`ropekit.train.build_optimizer`), with the depth lift moved to a group
    of its own at ``lr * depth_lr_mult``."""
    opt = build_optimizer(policy, cfg)
    lift = [p for m in policy.modules() if isinstance(m, DepthLift) for p in m.parameters()]
    if lift and cfg.depth_lr_mult != 1.0:
        ids = {id(p) for p in lift}
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        opt.add_param_group({"params": lift, "lr": cfg.lr * cfg.depth_lr_mult, "weight_decay": 0.0})
    return opt


def _lr_factor(step: int, cfg: PolicyTrainConfig) -> float:
    warm = min(cfg.warmup_steps, cfg.steps - 1)
    if step < warm:
        return (step + 1) / (warm + 1)
    floor = min(1.0, cfg.min_lr / cfg.lr)
    t = (step - warm) / max(1, cfg.steps - warm)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def train_policy(policy: DiffusionPolicy, data: DemoChunks, cfg: PolicyTrainConfig,
                 out_dir: Optional[PathLike] = None, fit_normalizers: bool = True, progress: bool = True,
                 extra_config: Optional[Dict[str, Any]] = None) -> List[Dict[str, float]]:
    """Train ``policy`` in place by DDPM imitation of ``data``; return the logged rows.

    Args:
        fit_normalizers: fit the action/state statistics on ``data`` first (``False`` when fine-tuning: the
            statistics come with the initial weights).
        out_dir: if given, write ``config.json``, ``metrics.csv`` and ``checkpoint.pt`` there.
        extra_config: more entries for ``config.json`` (e.g. where the demos and the initial weights came from).
    """
    from tqdm.auto import tqdm

    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    if fit_normalizers:
        policy.fit_normalizers(data.actions, data.state)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.json", json.dumps(
            {"policy": policy.config.to_dict(), "train": cfg.to_dict(), "examples": len(data),
             "episodes": len(data.episodes), **(extra_config or {})}, indent=2))
    policy.train()
    opt = _optimizer(policy, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    params = [p for p in policy.parameters() if p.requires_grad]
    ema = [p.detach().clone() for p in params] if cfg.ema_decay > 0 else None
    rows: List[Dict[str, float]] = []
    t0, running, count = time.time(), 0.0, 0
    bar = tqdm(range(cfg.steps), desc=f"train {policy.config.modality}", unit="step", disable=not progress)
    for step in bar:
        index = torch.randint(0, len(data), (cfg.batch_size,), generator=gen)
        images, state, actions = data.batch(index)
        images = random_shift(images, cfg.shift)
        loss = policy.loss(images, state, actions, cfg.noise_samples, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        if ema is not None:
            decay = min(cfg.ema_decay, (1 + step) / (10 + step))
            with torch.no_grad():
                for e, p in zip(ema, params):
                    e.lerp_(p, 1 - decay)
        running, count = running + loss.item(), count + 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            row = {"step": step + 1, "loss": running / count, "lr": opt.param_groups[0]["lr"],
                   "elapsed": time.time() - t0}
            if policy.encoder.depth_lift is not None:
                row["depth_scale"] = policy.encoder.depth_lift.scale.item()
            rows.append(row)
            bar.set_postfix(loss=f"{running / count:.4f}")
            running, count = 0.0, 0
            if out is not None:
                _write_csv(out / "metrics.csv", rows)
    bar.close()
    if ema is not None:
        with torch.no_grad():
            for p, e in zip(params, ema):
                p.copy_(e)
    policy.eval()
    if out is not None:
        save_policy(policy, out / CHECKPOINT, train_config=cfg.to_dict(), history=rows)
    return rows


def _write_csv(path: Path, rows: List[Dict[str, float]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def save_policy(policy: DiffusionPolicy, path: PathLike, **extra: Any) -> Path:
    """Write ``{format, policy_config, state_dict, **extra}`` atomically to ``path``."""
    return atomic_save({"format": _FORMAT, "version": 1, "policy_config": policy.config.to_dict(),
                        "state_dict": policy.state_dict(), **extra}, path)


def load_policy(path: PathLike) -> DiffusionPolicy:
    """Rebuild a policy from a checkpoint file or a run folder holding ``checkpoint.pt`` (in eval mode)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(f"no policy checkpoint at {path}")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a ropekit robot policy checkpoint")
    policy = DiffusionPolicy(PolicyConfig.from_dict(ckpt["policy_config"]))
    policy.load_state_dict(ckpt["state_dict"])
    return policy.eval()
