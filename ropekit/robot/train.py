"""Imitation training of :class:`~ropekit.robot.policy.DiffusionPolicy` on scripted demonstrations.

Shape legend: ``N`` examples (demo steps), ``B`` batch, ``H`` chunk length, ``A = 4`` action dimension,
``S = 11`` state dimension, ``Hi, Wi`` image pixels.

A run folder holds ``config.json`` (policy, training and data settings), ``metrics.csv`` (step, loss, lr,
elapsed seconds), ``curves.png``, ``train_state.pt`` (everything needed to resume) and ``checkpoint.pt`` (the
policy's config and weights, the EMA weights when EMA is on)::

    policy = DiffusionPolicy(PolicyConfig(modality="image"))
    data = DemoChunks(load_demos("demos.npz"), policy.config)
    train_policy(policy, data, PolicyTrainConfig(steps=1500), out_dir="runs/robot/2d")
    policy = load_policy("runs/robot/2d")
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from ..nn.depth import DepthLift
from ..train import engine
from ..train.augment import random_shift
from ..train.checkpoint import atomic_save
from ..train.distributed import init_distributed
from .demos import load_demos
from .policy import DiffusionPolicy, PolicyConfig, images_from_obs

__all__ = ["PolicyTrainConfig", "DemoChunks", "PolicyTask", "PolicyTaskConfig", "build_policy_task", "new_policy", "train_policy", "save_policy", "load_policy",
           "CHECKPOINT", "TRAIN_STATE"]

CHECKPOINT = "checkpoint.pt"
TRAIN_STATE = "train_state.pt"  # the engine's training checkpoint (optimiser, RNG, EMA), for resuming
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
    earlier run (``docs/results/robot/earlier``) it ended at -0.02 with 10x and at 0.08 with 100x over 800
    steps; the robot study's recipes therefore start ``a`` at a metric scale instead. The learned ``a`` is
    logged as ``depth_scale``.
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
        # (N, 3) the target object's position before each step (privileged; for auxiliary losses only)
        self.object_pos = (torch.from_numpy(np.asarray(demos["target"], dtype=np.float32)[rows])
                           if "target" in demos else None)

    def __len__(self) -> int:
        return len(self.state)

    def batch(self, index: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(images (B, 3|4, Hi, Wi), state (B, S), actions (B, H, A))`` for example indices ``(B,)``."""
        depth = self.depth[index] if self.depth is not None else None
        return images_from_obs(self.rgb[index], depth), self.state[index], self.actions[index]


def _optimizer(policy: DiffusionPolicy, cfg: PolicyTrainConfig) -> torch.optim.Optimizer:
    """The project's AdamW groups (:func:`ropekit.train.engine.build_optimizer`), with the depth lift moved to a
    group of its own at ``lr * depth_lr_mult``."""
    opt = engine.build_optimizer(policy, cfg.lr, cfg.weight_decay)
    lift = [p for m in policy.modules() if isinstance(m, DepthLift) for p in m.parameters()]
    if lift and cfg.depth_lr_mult != 1.0:
        ids = {id(p) for p in lift}
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        opt.add_param_group({"params": lift, "lr": cfg.lr * cfg.depth_lr_mult, "weight_decay": 0.0})
    return opt


class PolicyTask:
    """DDPM imitation of demo chunks by a :class:`DiffusionPolicy`, for :func:`ropekit.train.engine.fit`.

    An epoch is ``cfg.log_every`` steps (one metrics row each). Each step draws ``batch_size / world_size``
    examples and the diffusion ``(t, noise)`` pairs from the task's own generator (seeded by ``cfg.seed``, and per
    rank under DDP), the image shift from the global torch RNG; the EMA of the weights is updated after every step.
    Generator and EMA are saved with every checkpoint.
    """

    name = "policy"

    def __init__(self, policy: DiffusionPolicy, data: DemoChunks, cfg: PolicyTrainConfig, rank: int = 0,
                 world_size: int = 1) -> None:
        self.model, self.data, self.cfg = policy, data, cfg
        self.name = f"train {getattr(getattr(policy, 'config', None), 'modality', 'policy')}"
        self.gen = torch.Generator().manual_seed(cfg.seed + 1_000_003 * rank)
        self.per_rank_bs = max(1, cfg.batch_size // world_size)
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.ema = [p.detach().clone() for p in self.params] if cfg.ema_decay > 0 else None
        self.epochs = math.ceil(cfg.steps / cfg.log_every)

    def epoch_batches(self, epoch: int, ctx: Any) -> List[int]:
        lo, hi = epoch * self.cfg.log_every, min((epoch + 1) * self.cfg.log_every, self.cfg.steps)
        return list(range(lo, hi))  # (the examples are drawn from the task's generator at each step)

    def loss(self, model: nn.Module, step: int, device: torch.device) -> Tuple[Tensor, Dict[str, float]]:
        index = torch.randint(0, len(self.data), (self.per_rank_bs,), generator=self.gen)
        images, state, actions = self.data.batch(index)
        images = random_shift(images, self.cfg.shift)
        pos = None
        if getattr(self.model, "aux_head", None) is not None:
            if self.data.object_pos is None:
                raise ValueError("the policy has an auxiliary loss, but the demos hold no target positions: "
                                 "collect them again with this version")
            pos = self.data.object_pos[index].to(device)
        loss = model.loss(images.to(device), state.to(device), actions.to(device), self.cfg.noise_samples, self.gen,
                          object_pos=pos)
        return loss, {"loss": loss.detach(), "count": 1.0}

    def after_step(self, step: int) -> None:
        if self.ema is None:
            return
        decay = min(self.cfg.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(self.ema, self.params):
                e.lerp_(p, 1 - decay)

    def epoch_row(self, epoch: int, sums: Dict[str, float], info: Dict[str, Any], ctx: Any) -> Dict[str, float]:
        loss, count = ctx.all_reduce_sum([sums.get("loss", 0.0), sums.get("count", 0.0)])
        row = {"step": info["global_step"], "loss": loss / max(count, 1.0), "lr": info["lr"],
               "elapsed": info["elapsed"]}
        lift = getattr(getattr(self.model, "encoder", None), "depth_lift", None)
        if lift is not None:
            row["depth_scale"] = lift.scale.item()
        return row

    def compile_targets(self) -> List[nn.Module]:
        """The networks ``loss`` runs (the policy's own ``forward`` is not on the training path)."""
        found = [getattr(self.model, n, None) for n in ("encoder", "denoiser")]
        return [m for m in found if isinstance(m, nn.Module)] or [self.model]

    def state_dict(self) -> Dict[str, Any]:
        return {"generator": self.gen.get_state(), "ema": list(self.ema) if self.ema is not None else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.gen.set_state(state["generator"])
        if self.ema is not None and state.get("ema") is not None:
            for e, v in zip(self.ema, state["ema"]):
                e.copy_(v)

    def ema_copy(self) -> DiffusionPolicy:
        """A copy of the policy holding the EMA weights, in eval mode and without gradients (the policy that
        would be saved if training stopped now); the training weights are not touched."""
        snap = copy.deepcopy(self.model)
        self._put_ema([p for p in snap.parameters() if p.requires_grad])  # (the order of self.params)
        for p in snap.parameters():
            p.grad = None
            p.requires_grad_(False)
        return snap.eval()

    def copy_ema(self) -> None:
        """Put the EMA weights into the policy (the saved policy holds them)."""
        self._put_ema(self.params)

    def _put_ema(self, params: List[nn.Parameter]) -> None:
        """Copy the EMA weights into ``params`` (the trained parameters, in ``self.params``' order)."""
        if self.ema is not None:
            with torch.no_grad():
                for p, e in zip(params, self.ema):
                    p.copy_(e)


@dataclass
class PolicyTaskConfig:
    """What builds a :class:`PolicyTask`: ``demos``, the path of a demo file
    (:func:`~ropekit.robot.collect_demos`), the policy and its training settings."""

    demos: str
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    train: PolicyTrainConfig = field(default_factory=PolicyTrainConfig)


def build_policy_task(cfg: PolicyTaskConfig) -> PolicyTask:
    """The :class:`PolicyTask` of ``cfg``: its demonstrations loaded, its policy built (seeded by
    ``cfg.train.seed``) with the action and state statistics fitted on them."""
    data = DemoChunks(load_demos(cfg.demos), cfg.policy, cfg.train.only_successful)
    return policy_task(DiffusionPolicy, cfg.policy, data, cfg.train)


def new_policy(modality: str, fields: Mapping[str, Any], init_from: Optional[PathLike] = None,
               depth_scale_init: Optional[float] = None) -> Tuple[DiffusionPolicy, bool]:
    """The policy a run starts from, and whether its action / state statistics are still to be fitted.

    From scratch: ``PolicyConfig`` of ``modality`` and ``fields`` (other ``PolicyConfig`` fields), its depth lift
    at ``depth_scale_init`` (default 1). With ``init_from`` (a run folder or checkpoint): the same modality
    continues that policy; an ``image`` policy into ``rgbd`` keeps its head and chunking, its encoder widened to
    3-D with ``fields["pe"]`` and the depth lift at ``depth_scale_init`` (default 0, so that it starts equal to
    the 2-D one).

    Raises:
        ValueError: ``fields`` with ``init_from`` besides ``pe``, or another modality change than image -> rgbd.
    """
    from .policy import init_from_2d

    if init_from is None:
        cfg = PolicyConfig.from_dict({**fields, "modality": modality,
                                      "depth_scale_init": 1.0 if depth_scale_init is None else depth_scale_init})
        return DiffusionPolicy(cfg), True
    extra = sorted(set(fields) - {"pe"})
    if extra:
        raise ValueError(f"{', '.join(extra)} change a policy trained from scratch; with init_from the policy is "
                         f"the base run's")
    base = load_policy(init_from)
    if base.config.modality == modality:
        return base, False  # continue training
    if (base.config.modality, modality) != ("image", "rgbd"):
        raise ValueError(f"init_from a {base.config.modality} policy into modality {modality}: only the same "
                         f"modality or image -> rgbd is supported")
    scale = 0.0 if depth_scale_init is None else depth_scale_init
    cfg = PolicyConfig(**{**base.config.to_dict(), "modality": "rgbd", "pe": fields.get("pe", base.config.pe),
                          "depth_scale_init": scale})
    policy = DiffusionPolicy(cfg)
    init_from_2d(policy, base.state_dict(), depth_scale=scale)
    return policy, False


def policy_task(policy_class: Callable[[Any], DiffusionPolicy], config: PolicyConfig, data: Any,
                train: PolicyTrainConfig) -> PolicyTask:
    """A :class:`PolicyTask` training a new ``policy_class(config)`` (seeded by ``train.seed``) on the demo chunks
    ``data`` (a :class:`DemoChunks` or one with its interface), with the statistics fitted on them."""
    torch.manual_seed(train.seed)
    policy = policy_class(config)
    policy.fit_normalizers(data.actions, data.state, getattr(data, "object_pos", None))
    return PolicyTask(policy, data, train)


def train_policy(policy: DiffusionPolicy, data: DemoChunks, cfg: PolicyTrainConfig,
                 out_dir: Optional[PathLike] = None, fit_normalizers: bool = True, progress: bool = True,
                 extra_config: Optional[Dict[str, Any]] = None, *, resume: Optional[bool] = None,
                 options: Optional[engine.EngineOptions] = None, snapshot_at: Sequence[int] = (),
                 on_snapshot: Optional[Callable[[int, DiffusionPolicy], None]] = None) -> List[Dict[str, float]]:
    """Train ``policy`` in place by DDPM imitation of ``data``; return the logged rows.

    The loop is the shared engine (:func:`ropekit.train.engine.fit`): under ``torchrun`` the batch is split over
    the processes (DDP), ``options`` choose device, precision and ``torch.compile``, and with ``out_dir`` the
    training state is checkpointed after every ``log_every`` steps and on Ctrl-C (``train_state.pt``), so that an
    interrupted run continues bit for bit.

    Args:
        fit_normalizers: fit the action/state statistics on ``data`` first (``False`` when fine-tuning: the
            statistics come with the initial weights).
        out_dir: if given, write ``config.json``, ``metrics.csv``, ``train_state.pt`` and, at the end,
            ``checkpoint.pt`` (the policy, with the EMA weights) there.
        extra_config: more entries for ``config.json`` (e.g. where the demos and the initial weights came from).
        resume: continue from ``out_dir/train_state.pt``; ``None`` (default): when that file exists and was written
            with the same settings (other settings raise ``ValueError``).
        options: engine options (default: CPU, fp32, ``cfg.num_threads`` threads, the bar if ``progress``).
        snapshot_at, on_snapshot: after each of the steps ``snapshot_at`` (counted from 1),
            ``on_snapshot(step, policy)`` is called with a copy of the policy holding the EMA weights so far
            (e.g. to evaluate it: a success-vs-step curve within one learning-rate schedule). The copy is on the
            training device; the callback runs on every process and must not touch the training RNGs.

    Raises:
        KeyboardInterrupt: Ctrl-C (after saving the training state when ``out_dir`` is given).
        NonFiniteLossError: the loss became NaN / Inf.
    """
    out = Path(out_dir) if out_dir is not None else None
    state_path = out / TRAIN_STATE if out is not None else None
    if resume is None:
        resume = state_path is not None and state_path.exists()
    if resume:
        if state_path is None:
            raise ValueError("resume needs out_dir")
        from ..train.checkpoint import load_checkpoint

        saved = load_checkpoint(state_path).get("policy_train_config", {})
        now = cfg.to_dict()
        diff = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in sorted(now.items())
                if k != "num_threads" and saved.get(k) != v]
        if diff:
            raise ValueError(f"{out} holds the training state of another run ({'; '.join(diff)}); choose another "
                             f"out_dir or remove {state_path}")
    opts = options or engine.EngineOptions(device="cpu", threads=cfg.num_threads, progress=progress,
                                           tensorboard=False)
    ctx = init_distributed(opts.device)
    try:
        torch.manual_seed(cfg.seed)
        if fit_normalizers and not resume:
            policy.fit_normalizers(data.actions, data.state, getattr(data, "object_pos", None))
        task = PolicyTask(policy, data, cfg, ctx.rank, ctx.world_size)
        schedule = engine.Schedule(lr=cfg.lr, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps,
                                   min_lr=cfg.min_lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
        config = {"policy": policy.config.to_dict(), "train": cfg.to_dict(), "examples": len(data),
                  "episodes": len(data.episodes), **(extra_config or {})}

        def fresh_start(c: Any) -> None:
            torch.manual_seed(cfg.seed + 1_000_003 * c.rank)  # (rank 0: as a single process)

        at = {int(k) for k in snapshot_at}

        def on_step(step: int) -> bool:
            if on_snapshot is not None and step in at:
                on_snapshot(step, task.ema_copy())
            return False

        res = engine.fit(task, engine.FitOptions(
            schedule, task.epochs, execution=opts, run_dir=out, checkpoint_name=TRAIN_STATE, resume=bool(resume),
            ctx=ctx, quiet=not progress, config_doc=config, on_step=on_step,
            checkpoint_extra={"policy_config": policy.config.to_dict(), "policy_train_config": cfg.to_dict()},
            optimizer=_optimizer(policy, cfg), fresh_start=fresh_start))
        if res.interrupted:
            raise KeyboardInterrupt(f"policy training interrupted; continue it by training into {out} again")
        task.copy_ema()
        policy.to("cpu")
        policy.eval()
        if out is not None and ctx.is_main:
            save_policy(policy, out / CHECKPOINT, train_config=cfg.to_dict(), history=res.history)
        ctx.barrier()
        return res.history
    finally:
        ctx.close()


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
