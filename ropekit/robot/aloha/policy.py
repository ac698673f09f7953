"""Diffusion policies for the ALOHA tasks: the KUKA policy's ViT encoder, pooling and diffusion head, with
14-D joint actions and 14-D proprioception.

Shape legend: ``B`` batch, ``H`` chunk length, ``A = 14`` joint action / proprioception dimension,
``Hi, Wi`` image pixels (rectangular: the top camera's 3:4), ``E`` episodes, ``N`` examples.

The policy sees the top camera's RGB (``modality="image"``, patch coordinates ``(y, x)``) or RGB-D
(``modality="rgbd"``, coordinates ``(y, x, z)`` with ``z`` a learned linear function of the patch's mean depth)
and the current joint positions ``qpos``; it predicts a chunk of the next ``H`` absolute joint targets
(each dimension min/max-normalised over the demonstrations), executes the first ``n_action_steps`` of it and
re-plans. The variable of the study is the encoder's position encoding (``PolicyConfig.pe``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from ...nn import ViTConfig
from ..policy import ChunkDenoiser, DiffusionPolicy, Normalizer, PolicyConfig, images_from_obs
from ..train import PolicyTask, PolicyTrainConfig, policy_task
from .expert import load_demo_set
from .sim import ACTION_DIM, AlohaSim, task_spec

__all__ = ["encoding_label", "AlohaPolicyConfig", "AlohaPolicy", "AlohaChunks", "AlohaTaskConfig", "build_aloha_task",
           "evaluate_policy", "save_aloha_policy", "load_aloha_policy", "ENCODINGS"]

PathLike = Union[str, Path]
OBJECT_TARGETS = 6  # the auxiliary loss's target: where each arm's object is (xyz, right then left)
_FORMAT = "ropekit-aloha-policy"

#: The study's encoder variants: label -> (modality, create_pe name, options).
ENCODINGS: Dict[str, Tuple[str, str, Dict[str, Any]]] = {
    "ViT (learned APE)": ("image", "absolute", {}),
    "RoPE (axial)": ("image", "axial", {}),
    "RoPE (mixed)": ("image", "mixed", {}),
    "Cayley-STRING": ("image", "cayley", {}),
    "Cayley-STRING RGB-D": ("rgbd", "cayley", {}),
}


#: Short names of :data:`ENCODINGS`' labels, as the command line takes them.
_PE_LABELS = {"absolute": "ViT (learned APE)", "vit": "ViT (learned APE)", "ape": "ViT (learned APE)",
              "axial": "RoPE (axial)", "mixed": "RoPE (mixed)", "cayley": "Cayley-STRING",
              "cayley-rgbd": "Cayley-STRING RGB-D", "rgbd": "Cayley-STRING RGB-D"}


def encoding_label(name: str) -> str:
    """An :data:`ENCODINGS` label from a label or a short name (absolute, axial, mixed, cayley,
    cayley-rgbd)."""
    if name in ENCODINGS:
        return name
    key = name.lower().replace("_", "-")
    if key not in _PE_LABELS:
        raise ValueError(f"unknown ALOHA encoder {name!r}; known: {', '.join(_PE_LABELS)} or {list(ENCODINGS)}")
    return _PE_LABELS[key]


@dataclass
class AlohaPolicyConfig(PolicyConfig):
    """:class:`~ropekit.robot.policy.PolicyConfig` for ALOHA: a rectangular image ``image_hw`` seen through a
    camera of vertical field of view ``fovy`` degrees (``None``: the scene's), 14-D joint targets, and chunking
    sized for 50 Hz control (16 predicted, 8 executed).

    ``action_mode``: ``"absolute"`` predicts the joint targets themselves; ``"relative"`` predicts them minus
    the current joint positions (each dimension min/max-normalised over the demonstrations either way). The
    part of a chunk that depends on where the object is (a few hundredths of a radian at the first chunk)
    is a far larger share of the relative targets' range than of the absolute ones'.

    ``aux_weight`` (> 0: on) adds a training-only loss: a head on the *image features alone* (the pooled tokens,
    their mean and the keypoints; not the joint state) predicts where each arm's object is in the frame (the
    demos' ``object_pos``: 6 numbers, standardised over the demonstrations). Told where the cube is, the policy
    succeeds every time; the loss teaches the encoder to find it. Kept away from the joint state, the head cannot
    lower the loss by reading the arm's pose once the object is held; a head on the whole conditioning that
    predicted the object's starting position succeeded for some training seeds only. The policy never receives
    the position when it acts."""

    pe: str = "cayley"
    pe_options: Dict[str, Any] = field(default_factory=dict)
    vit_overrides: Dict[str, Any] = field(default_factory=lambda: {"depth": 4, "patch_size": 8})
    image_hw: Tuple[int, int] = (48, 64)
    fovy: Optional[float] = None
    horizon: int = 16
    n_action_steps: int = 8
    action_mode: str = "absolute"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.image_hw = (int(self.image_hw[0]), int(self.image_hw[1]))
        if self.action_mode not in ("absolute", "relative"):
            raise ValueError(f"ALOHA action_mode must be 'absolute' or 'relative', got {self.action_mode!r}")

    def vit_config(self) -> ViTConfig:
        return dataclasses.replace(super().vit_config(), image_size=self.image_hw)

    def to_dict(self) -> Dict[str, Any]:
        d = super().to_dict()
        d["image_hw"] = list(self.image_hw)
        return d


class AlohaPolicy(DiffusionPolicy):
    """:class:`~ropekit.robot.policy.DiffusionPolicy` with 14-D proprioception and 14-D joint-target chunks.

    ``images (B, 3|4, Hi, Wi)``, ``state (B, 14)`` (qpos) -> chunks ``(B, H, 14)``.
    """

    def __init__(self, config: AlohaPolicyConfig) -> None:
        super().__init__(config)
        c = config
        self.state_mlp = nn.Sequential(nn.Linear(ACTION_DIM, 128), nn.SiLU(), nn.Linear(128, 128))
        self.denoiser = ChunkDenoiser(c.horizon, ACTION_DIM, c.cond_dim, c.hidden_dim, c.num_blocks)
        self.action_norm = Normalizer(ACTION_DIM)
        self.state_norm = Normalizer(ACTION_DIM)
        feat = self.image_feature_dim()
        self.aux_head = (nn.Sequential(nn.LayerNorm(feat), nn.Linear(feat, OBJECT_TARGETS)) if c.aux_weight > 0
                         else None)
        self.object_norm = Normalizer(OBJECT_TARGETS) if c.aux_weight > 0 else None

    def chunk_targets(self, actions: Tensor, state: Tensor) -> Tensor:
        """Joint targets ``(B, H, 14)`` -> the policy's targets (minus ``state (B, 14)`` when relative)."""
        return actions if self.config.action_mode == "absolute" else actions - state.unsqueeze(1)

    def loss(self, images: Tensor, state: Tensor, actions: Tensor, noise_samples: int = 1,
             generator: Optional[torch.Generator] = None, object_pos: Optional[Tensor] = None) -> Tensor:
        """The loss of :class:`DiffusionPolicy`; a ``generator`` on another device than the batch (the
        training loop's CPU generator with a policy on a GPU) is replaced by the device's global RNG."""
        if generator is not None and generator.device != images.device:
            generator = None
        return super().loss(images, state, actions, noise_samples, generator, object_pos)

    def chunk_to_env(self, targets: Tensor, state: Tensor) -> Tensor:
        return targets if self.config.action_mode == "absolute" else targets + state.unsqueeze(1)

    def fit_normalizers(self, actions: Tensor, state: Tensor, object_pos: Optional[Tensor] = None) -> None:
        """Min/max of the policy's targets for ``actions (N, H, 14)`` to ``[-1, 1]``; mean/std of ``state (N, 14)``
        and, for the auxiliary loss, of the object positions ``object_pos (N, 6)``.

        Raises:
            ValueError: the policy has an auxiliary loss and ``object_pos`` is missing.
        """
        self.action_norm.fit_minmax(self.chunk_targets(actions, state).reshape(-1, ACTION_DIM))
        self.state_norm.fit_meanstd(state)
        if self.object_norm is not None:
            if object_pos is None:
                raise ValueError("this policy has an auxiliary loss (aux_weight > 0): pass the object positions")
            self.object_norm.fit_meanstd(object_pos)

    def aux_input(self, cond: Tensor, image_features: Tensor) -> Tensor:
        """The auxiliary head reads the image features ``(B, F)`` only (not the joint state)."""
        return image_features

    def aux_target(self, object_pos: Tensor, state: Tensor) -> Tensor:
        """The auxiliary head's target: object positions ``(B, 6)`` standardised per coordinate -> ``(B, 6)``."""
        return self.object_norm.normalize(object_pos)

    @torch.no_grad()
    def aux_position(self, images: Tensor, state: Tensor) -> Tensor:
        """The auxiliary head's estimate of where the objects are ``(B, 6)`` (metres; right arm's object, then the
        left's) in ``images`` (``state (B, 14)`` is not read by the head).

        Raises:
            ValueError: the policy has no auxiliary head (``aux_weight == 0``).
        """
        if self.aux_head is None:
            raise ValueError("this policy has no auxiliary head (aux_weight == 0)")
        cond, feats = self.encode_parts(images, state)
        return self.object_norm.unnormalize(self.aux_head(self.aux_input(cond, feats)))

    @torch.no_grad()
    def predict(self, images: Tensor, state: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
        """Joint-target chunks ``(B, H, 14)`` (radians; grippers in [0, 1] units)."""
        return self.chunk_to_env(self.action_norm.unnormalize(self.sample(images, state, generator)), state)


class AlohaChunks:
    """Training examples from a demo set (:mod:`.expert`): each rendered step with its image, ``qpos`` and the
    next ``H`` joint targets (the episode's last target repeats past its end).

    Same interface as :class:`ropekit.robot.train.DemoChunks` (what ``train_policy`` reads): ``rgb (N, Hi, Wi,
    3)`` uint8, ``depth (N, Hi, Wi)`` or ``None``, ``state (N, 14)``, ``actions (N, H, 14)``, ``object_pos (N,
    6)`` (where each arm's object is in the frame, for the auxiliary loss; ``None`` when the demos lack it),
    ``episodes``, ``len()``, ``batch(index)``.
    """

    def __init__(self, demos: Mapping[str, Any], config: PolicyConfig, episodes: Optional[int] = None) -> None:
        if config.modality == "rgbd" and "depth" not in demos:
            raise ValueError("an RGB-D policy needs a demo set recorded with depth=True")
        rows = np.asarray(demos["frame_row"])  # (F,)
        episode = np.asarray(demos["episode"])
        keep = np.arange(len(demos["episode_length"]))
        frames = np.arange(len(rows))
        if episodes is not None:
            keep = keep[:episodes]
            frames = frames[np.isin(episode[rows], keep)]
            rows = rows[frames]
        lengths = np.asarray(demos["episode_length"])
        step = np.asarray(demos["step"])[rows]
        last = rows - step + lengths[episode[rows]] - 1  # (N,)
        ahead = np.minimum(rows[:, None] + np.arange(config.horizon)[None], last[:, None])  # (N, H)
        self.episodes = keep
        take = slice(None) if episodes is None else frames  # every frame: share the arrays, no copy
        self.rgb = torch.from_numpy(np.ascontiguousarray(demos["rgb"][take]))
        self.depth = (torch.from_numpy(np.ascontiguousarray(demos["depth"][take]))
                      if config.modality == "rgbd" else None)
        self.state = torch.from_numpy(np.asarray(demos["qpos"], dtype=np.float32)[rows])
        self.actions = torch.from_numpy(np.asarray(demos["action"], dtype=np.float32)[ahead])  # (N, H, 14)
        self.object_pos: Optional[Tensor] = None
        if "object_pos" in demos:
            self.object_pos = torch.from_numpy(np.asarray(demos["object_pos"], dtype=np.float32)[rows])  # (N, 6)
        elif config.aux_weight > 0:
            raise ValueError("the auxiliary loss needs the demos' object positions: load the set with "
                             "load_or_collect (it replays older sets once to find them)")

    def __len__(self) -> int:
        return len(self.state)

    def batch(self, index: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(images (B, 3|4, Hi, Wi), state (B, 14), actions (B, H, 14))`` for example indices ``(B,)``."""
        depth = self.depth[index] if self.depth is not None else None
        return images_from_obs(self.rgb[index], depth), self.state[index], self.actions[index]


@dataclass
class AlohaTaskConfig:
    """What builds the ALOHA :class:`~ropekit.robot.train.PolicyTask`: ``demos``, the path of a demo set
    (:func:`~ropekit.robot.aloha.expert.save_demo_set`), the policy, its training settings and ``episodes``, how
    many of the set's episodes to train on (``None``: all)."""

    demos: str
    policy: AlohaPolicyConfig = field(default_factory=AlohaPolicyConfig)
    train: PolicyTrainConfig = field(default_factory=PolicyTrainConfig)
    episodes: Optional[int] = None


def build_aloha_task(cfg: AlohaTaskConfig) -> PolicyTask:
    """The :class:`~ropekit.robot.train.PolicyTask` of ``cfg``: its demo set loaded, an :class:`AlohaPolicy`
    built (seeded by ``cfg.train.seed``) with the statistics fitted on the demonstrations."""
    data = AlohaChunks(load_demo_set(cfg.demos), cfg.policy, cfg.episodes)
    return policy_task(AlohaPolicy, cfg.policy, data, cfg.train)


@torch.no_grad()
def evaluate_policy(policy: AlohaPolicy, task: str, seeds: Sequence[int], episode_steps: int = 400,
                    camera: str = "top", parallel: int = 10, seed: int = 0, progress: bool = False
                    ) -> Dict[str, Any]:
    """Roll ``policy`` out once per object-pose seed; an episode succeeds when the reward reaches 4.

    Episodes run ``parallel`` at a time in lockstep, so the policy sees one batch per re-planning step; images
    are rendered only when the policy re-plans (every ``n_action_steps`` steps). An episode stops at its first
    success.

    Returns:
        ``{"success": [bool] per seed, "success_rate", "max_reward": [int], "success_step": [int or -1],
        "reach_gap": [float] (the right gripper's closest approach to its object, metres: a policy that does
        not locate the object in the image stops short of it or beside it), "seeds", "errors": {seed: message}
        (episodes ended by a physics error count as failures), "seconds"}``.
    """
    from tqdm.auto import tqdm

    t0 = time.time()
    policy.eval()
    device = next(policy.parameters()).device
    cfg = policy.config
    spec = task_spec(task)
    seeds = [int(s) for s in seeds]
    n_exec = cfg.n_action_steps
    depth = cfg.modality == "rgbd"
    sims = [AlohaSim(spec.name, cameras=(camera,), image_hw=cfg.image_hw, depth=depth, fovy=cfg.fovy)
            for _ in range(min(parallel, len(seeds)))]
    gen = torch.Generator(device=device).manual_seed(seed)
    max_reward = {s: 0 for s in seeds}
    success_step = {s: -1 for s in seeds}
    gap = {s: float("inf") for s in seeds}
    errors: Dict[int, str] = {}
    bar = tqdm(total=len(seeds), desc=f"eval {spec.name}", unit="ep", disable=not progress)
    for start in range(0, len(seeds), len(sims)):
        group = seeds[start:start + len(sims)]
        envs = sims[:len(group)]
        qpos = [e.reset(seed=s, render=False)["qpos"] for e, s in zip(envs, group)]
        for e, s in zip(envs, group):
            gap[s] = e.reach_gap()
        active = list(range(len(group)))
        chunks: Dict[int, np.ndarray] = {}
        for t in range(episode_steps):
            if not active:
                break
            if t % n_exec == 0:
                views = [envs[i].render(camera) for i in active]
                rgb = np.stack([v[0] for v in views])
                d = np.stack([v[1] for v in views]) if depth else None
                state = torch.from_numpy(np.stack([qpos[i] for i in active]))
                pred = policy.predict(images_from_obs(rgb, d).to(device), state.to(device), gen)
                pred = pred.float().cpu().numpy()  # (B, H, 14)
                chunks = {i: pred[j] for j, i in enumerate(active)}
            still = []
            for i in active:
                s = group[i]
                try:
                    obs, r = envs[i].step(chunks[i][t % n_exec].astype(np.float64), render=False)
                except Exception as exc:  # the physics diverged (e.g. dm_control's PhysicsError): a failure
                    errors[s] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    continue
                qpos[i] = obs["qpos"]
                max_reward[s] = max(max_reward[s], r)
                gap[s] = min(gap[s], envs[i].reach_gap())
                if r >= 4:
                    success_step[s] = t + 1
                else:
                    still.append(i)
            active = still
        bar.update(len(group))
    bar.close()
    success = [success_step[s] >= 0 for s in seeds]
    return {"success": success, "success_rate": float(np.mean(success)) if seeds else 0.0,
            "max_reward": [max_reward[s] for s in seeds], "success_step": [success_step[s] for s in seeds],
            "reach_gap": [gap[s] for s in seeds],
            "seeds": seeds, "errors": errors, "seconds": time.time() - t0}


def save_aloha_policy(policy: AlohaPolicy, path: PathLike, **extra: Any) -> Path:
    """Write the policy (config, weights, ``extra``) atomically to ``path``."""
    from ...train.checkpoint import atomic_save

    return atomic_save({"format": _FORMAT, "version": 1, "policy_config": policy.config.to_dict(),
                        "state_dict": policy.state_dict(), **extra}, path)


def load_aloha_policy(path: PathLike) -> AlohaPolicy:
    """Rebuild an ALOHA policy from a checkpoint file or a run folder holding ``checkpoint.pt`` (eval mode).

    Reads both :func:`save_aloha_policy` files and ``train_policy`` checkpoints of an :class:`AlohaPolicy`.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pt"
    if not path.exists():
        raise FileNotFoundError(f"no policy checkpoint at {path}")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or "policy_config" not in ckpt or "image_hw" not in ckpt["policy_config"]:
        raise ValueError(f"{path} is not a ropekit ALOHA policy checkpoint")
    policy = AlohaPolicy(AlohaPolicyConfig.from_dict(ckpt["policy_config"]))
    policy.load_state_dict(ckpt["state_dict"])
    return policy.eval()
