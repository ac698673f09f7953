"""A diffusion policy on a ViT (RGB, 2-D encoding) or ViTD (RGB-D, 3-D encoding) encoder.

Shape legend: ``B`` batch, ``H`` chunk length (``PolicyConfig.horizon``), ``A = 4`` action dimension,
``S = 11`` state dimension, ``C`` colour channels (3), ``Hi, Wi`` image pixels, ``M`` patch tokens,
``D`` encoder width, ``Q`` pooling queries, ``E`` conditioning width.

Action space
------------
The environment (:mod:`ropekit.robot.env`) takes ``a = [x, y, z, g]``: the **absolute** target position of
the suction tip in the world frame (metres; clipped to the workspace and above the table) and the gripper
command (suction on if ``g > 0.5``). The expert moves at most 5 cm per step.

The policy predicts a **chunk** of the next ``H`` actions ``a_t .. a_{t+H-1}`` from one observation (the front
RGB or RGB-D image and the 11-d state). With ``action_mode="relative"`` (default) the position part is
expressed relative to the current tip position, ``a_{t+k}[:3] - tip_t`` (translation-equivariant targets;
converted back to absolute targets before they reach the env); with ``"absolute"`` it is the env's action
itself. Each of the four dimensions is then mapped to ``[-1, 1]`` by the min/max over the demonstrations
(:class:`Normalizer`, stored with the policy; ``g`` in {0, 1} becomes {-1, 1}). The state is standardised
(mean / std over the demonstrations). At run time (:class:`PolicyRunner`) the first ``n_action_steps``
actions of a sampled chunk are executed, then the policy re-plans (receding horizon).

Model
-----
``image (B, C[+1], Hi, Wi)`` -> :class:`~ropekit.nn.VisionTransformer` tokens ``(B, M, D)`` (its public
``forward_features``) -> ``Q`` learned queries cross-attend to the tokens (plus the token mean) and a state
MLP -> conditioning ``(B, E)`` -> :class:`ChunkDenoiser`, a residual MLP over the flattened chunk with
FiLM conditioning on (diffusion timestep, conditioning). Trained with DDPM (:mod:`.diffusion`), sampled
with a few DDIM steps.

The 2-D policy uses ``modality="image"``: RGB only, patch coordinates ``(y, x)``. The 3-D policy uses
``modality="rgbd"``: RGB-D, coordinates ``(y, x, z)`` with ``z`` a learnable linear function of the patch's
mean depth (depth is not an image channel). :func:`init_from_2d` loads a 2-D policy into a 3-D one
so that the first forward pass is the same (see its docstring).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from ..nn import VisionTransformer, ViTConfig, vit_config
from ..nn.depth import DepthLift
from .diffusion import DiffusionSchedule, timestep_embedding
from .env import ACTION_DIM, STATE_DIM, STATE_SLICES

__all__ = ["PolicyConfig", "Normalizer", "ChunkDenoiser", "DiffusionPolicy", "PolicyRunner", "init_from_2d",
           "images_from_obs", "ACTION_MODES", "MODALITIES"]

ACTION_MODES = ("relative", "absolute")
MODALITIES = ("image", "rgbd")
_RGB_MEAN, _RGB_STD = 0.5, 0.25
_AUX_UNIT_M = 0.1  # the auxiliary head predicts the target's offset from the tip in units of 10 cm


@dataclass
class PolicyConfig:
    """Everything that defines a :class:`DiffusionPolicy` (saved with its checkpoint).

    Encoder:
        modality: ``"image"`` (RGB, 2-D coordinates) or ``"rgbd"`` (RGB-D, 3-D coordinates via the depth lift).
        pe: a ``create_pe`` name; ``pe_options`` its options (Circulant-STRING, block size 16, by default).
        vit_size, vit_overrides: :func:`ropekit.nn.vit_config` size and field overrides (patch size, depth, ...).
        image_size: square input size (pixels) the policy was trained on.
        depth_scale_init: initial scale of the depth lift (1 from scratch; 0 when fine-tuning from 2-D).
    Actions:
        horizon: chunk length ``H``; n_action_steps: actions executed before re-planning (``<= H``);
        action_mode: ``"relative"`` (positions relative to the current tip) or ``"absolute"``.
    Head:
        num_queries: ``Q`` attention-pooling queries; cond_dim: ``E``; hidden_dim, num_blocks: denoiser MLP.
        keypoints: also give the head each query's *expected patch position* -- its attention weights over
            the patches times their ``(y, x)`` grid positions, scaled to [-1, 1] (a spatial soft-argmax). A
            rotary encoding acts only inside attention, so without this the pooled features carry no
            absolute image position, and a fixed-camera policy must find the target's location from
            relations between tokens alone.
        aux_weight: weight of an auxiliary training loss (0: off): a linear head on the conditioning predicts the
            target object's position relative to the tip (world frame, in units of 10 cm), supervised by the
            demos' privileged target positions. It only shapes training; the policy never sees the target's
            position when it acts.
    Diffusion:
        num_train_timesteps: ``T``; num_inference_steps: DDIM steps; prediction: ``"epsilon"`` or ``"sample"``.
    """

    modality: str = "image"
    pe: str = "circulant"
    pe_options: Dict[str, Any] = field(default_factory=lambda: {"block_size": 16})
    vit_size: str = "tiny"
    vit_overrides: Dict[str, Any] = field(default_factory=lambda: {"depth": 4, "patch_size": 8})
    image_size: int = 64
    depth_scale_init: float = 1.0
    horizon: int = 8
    n_action_steps: int = 4
    action_mode: str = "relative"
    num_queries: int = 4
    keypoints: bool = False
    aux_weight: float = 0.0
    cond_dim: int = 256
    hidden_dim: int = 256
    num_blocks: int = 3
    num_train_timesteps: int = 100
    num_inference_steps: int = 10
    prediction: str = "epsilon"

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"modality must be one of {MODALITIES}, got {self.modality!r}")
        if self.action_mode not in ACTION_MODES:
            raise ValueError(f"action_mode must be one of {ACTION_MODES}, got {self.action_mode!r}")
        if not 1 <= self.n_action_steps <= self.horizon:
            raise ValueError(f"n_action_steps must be in [1, horizon={self.horizon}], got {self.n_action_steps}")

    @property
    def in_chans(self) -> int:
        """Channels of the image tensor the policy takes: 3 (RGB) or 4 (RGB then metric depth)."""
        return 3 if self.modality == "image" else 4

    def vit_config(self) -> ViTConfig:
        """The encoder's :class:`ViTConfig` (no classification head: ``forward_features`` gives the tokens)."""
        extra = {"depth_input": "coord", "depth_scale_init": self.depth_scale_init} if self.modality == "rgbd" else {}
        return vit_config(self.vit_size, **{**self.vit_overrides, "num_classes": 0, "in_chans": 3,
                                            "image_size": (self.image_size, self.image_size),
                                            "modality": self.modality, "pe": self.pe,
                                            "pe_options": dict(self.pe_options), **extra})

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PolicyConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown PolicyConfig field(s): {', '.join(unknown)}")
        return cls(**d)


class Normalizer(nn.Module):
    """Per-dimension affine map ``x_n = (x - offset) / scale`` and back; ``offset``, ``scale`` ``(F,)``.

    Its buffers are data statistics (not derived caches), so they are saved with the policy.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("offset", torch.zeros(dim))
        self.register_buffer("scale", torch.ones(dim))

    @torch.no_grad()
    def fit_minmax(self, x: Tensor, min_range: float = 1e-3) -> "Normalizer":
        """Map ``[min, max]`` of ``x (N, F)`` onto ``[-1, 1]`` (ranges below ``min_range`` are widened)."""
        lo, hi = x.min(dim=0).values, x.max(dim=0).values
        self.offset.copy_((lo + hi) / 2)
        self.scale.copy_(((hi - lo) / 2).clamp_min(min_range / 2))
        return self

    @torch.no_grad()
    def fit_meanstd(self, x: Tensor, min_std: float = 1e-3) -> "Normalizer":
        """Standardise ``x (N, F)`` (standard deviations below ``min_std`` are raised to it)."""
        self.offset.copy_(x.mean(dim=0))
        self.scale.copy_(x.std(dim=0).clamp_min(min_std))
        return self

    def normalize(self, x: Tensor) -> Tensor:
        return (x - self.offset) / self.scale

    def unnormalize(self, x: Tensor) -> Tensor:
        return x * self.scale + self.offset


class _FiLMBlock(nn.Module):
    """``h + W2 SiLU(FiLM(W1 SiLU(LN(h))))`` with ``FiLM(u) = u * (1 + gamma) + beta`` from the conditioning."""

    def __init__(self, dim: int, cond_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim)
        self.film = nn.Linear(cond_dim, 2 * dim)
        self.fc2 = nn.Linear(dim, dim)
        self.act = nn.SiLU()
        nn.init.zeros_(self.fc2.weight)  # each block starts as the identity
        nn.init.zeros_(self.fc2.bias)

    def forward(self, h: Tensor, c: Tensor) -> Tensor:
        gamma, beta = self.film(c).chunk(2, dim=-1)  # (B, dim) each
        u = self.fc1(self.act(self.norm(h))) * (1 + gamma) + beta
        return h + self.fc2(self.act(u))


class ChunkDenoiser(nn.Module):
    """Residual MLP denoiser: ``(x_t (B, H, A), t (B,), cond (B, E)) -> (B, H, A)``."""

    def __init__(self, horizon: int, action_dim: int, cond_dim: int, hidden_dim: int = 256,
                 num_blocks: int = 3) -> None:
        super().__init__()
        self.horizon, self.action_dim = horizon, action_dim
        self.time_dim = 64
        self.time_mlp = nn.Sequential(nn.Linear(self.time_dim, cond_dim), nn.SiLU(), nn.Linear(cond_dim, cond_dim))
        self.inp = nn.Linear(horizon * action_dim, hidden_dim)
        self.blocks = nn.ModuleList([_FiLMBlock(hidden_dim, cond_dim) for _ in range(num_blocks)])
        self.out_norm = nn.LayerNorm(hidden_dim)
        self.out = nn.Linear(hidden_dim, horizon * action_dim)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor) -> Tensor:
        c = nn.functional.silu(cond + self.time_mlp(timestep_embedding(t, self.time_dim)))  # (B, E)
        h = self.inp(x.flatten(1))  # (B, hidden)
        for blk in self.blocks:
            h = blk(h, c)
        return self.out(self.out_norm(h)).view(-1, self.horizon, self.action_dim)  # (B, H, A)


def images_from_obs(rgb: Any, depth: Any = None) -> Tensor:
    """Env observations to the policy's image tensor.

    Args:
        rgb: ``(B, Hi, Wi, 3)`` or ``(Hi, Wi, 3)`` uint8 (array or tensor).
        depth: ``None`` (RGB policy) or ``(B, Hi, Wi)`` / ``(Hi, Wi)`` metric depth, metres.

    Returns:
        ``(B, 3, Hi, Wi)`` float32 colour standardised to about ``[-2, 2]``, with the raw depth appended as a
        fourth channel ``(B, 4, Hi, Wi)`` when ``depth`` is given (the ViTD depth lift takes metres).
    """
    rgb_t = torch.as_tensor(np.asarray(rgb) if not isinstance(rgb, Tensor) else rgb)
    if rgb_t.dim() == 3:
        rgb_t = rgb_t.unsqueeze(0)
    x = (rgb_t.permute(0, 3, 1, 2).float() / 255.0 - _RGB_MEAN) / _RGB_STD  # (B, 3, Hi, Wi)
    if depth is None:
        return x
    d = torch.as_tensor(np.asarray(depth) if not isinstance(depth, Tensor) else depth).float()
    if d.dim() == 2:
        d = d.unsqueeze(0)
    return torch.cat([x, d.unsqueeze(1)], dim=1)  # (B, 4, Hi, Wi)


class DiffusionPolicy(nn.Module):
    """Image (+ depth) and state -> a chunk of ``H`` future actions, by conditional diffusion.

    Main entry points: :meth:`forward` (the denoiser's prediction, for training), :meth:`loss`,
    :meth:`sample` (normalised chunks) and :meth:`predict` (env actions). Call :meth:`fit_normalizers` on the
    demonstrations before training.
    """

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = VisionTransformer(config.vit_config())
        d = self.encoder.cfg.embed_dim
        self.queries = nn.Parameter(torch.randn(1, config.num_queries, d) * 0.02)
        self.pool = nn.MultiheadAttention(d, num_heads=max(1, d // 32), batch_first=True)
        self.state_mlp = nn.Sequential(nn.Linear(STATE_DIM, 128), nn.SiLU(), nn.Linear(128, 128))
        feat_dim = (config.num_queries + 1) * d + 128 + (2 * config.num_queries if config.keypoints else 0)
        self.cond_proj = nn.Sequential(nn.LayerNorm(feat_dim), nn.Linear(feat_dim, config.cond_dim))
        self.denoiser = ChunkDenoiser(config.horizon, ACTION_DIM, config.cond_dim, config.hidden_dim,
                                      config.num_blocks)
        self.aux_head = nn.Linear(config.cond_dim, 3) if config.aux_weight > 0 else None
        self.schedule = DiffusionSchedule(config.num_train_timesteps, config.prediction)
        self.action_norm = Normalizer(ACTION_DIM)
        self.state_norm = Normalizer(STATE_DIM)

    # ------------------------------------------------------------------ statistics
    def chunk_targets(self, actions: Tensor, state: Tensor) -> Tensor:
        """Env actions ``(B, H, A)`` -> the policy's (unnormalised) targets: relative or absolute positions."""
        if self.config.action_mode == "absolute":
            return actions
        tip = state[:, STATE_SLICES["ee_pos"]].unsqueeze(1)  # (B, 1, 3)
        return torch.cat([actions[..., :3] - tip, actions[..., 3:]], dim=-1)

    def chunk_to_env(self, targets: Tensor, state: Tensor) -> Tensor:
        """Inverse of :meth:`chunk_targets`: unnormalised targets ``(B, H, A)`` -> env actions ``(B, H, A)``."""
        if self.config.action_mode == "absolute":
            return targets
        tip = state[:, STATE_SLICES["ee_pos"]].unsqueeze(1)  # (B, 1, 3)
        return torch.cat([targets[..., :3] + tip, targets[..., 3:]], dim=-1)

    def fit_normalizers(self, actions: Tensor, state: Tensor, object_pos: Optional[Tensor] = None) -> None:
        """Fit the action (min/max -> [-1, 1]) and state (mean/std) statistics on demonstration chunks
        ``actions (N, H, A)`` (env actions) and their states ``state (N, S)``. ``object_pos``: the auxiliary
        loss's object positions (unused here: this policy's auxiliary target has a fixed unit)."""
        self.action_norm.fit_minmax(self.chunk_targets(actions, state).reshape(-1, ACTION_DIM))
        self.state_norm.fit_meanstd(state)

    # ------------------------------------------------------------------ model
    def no_weight_decay(self) -> set:
        """The encoder's (encodings, depth lift, ...) plus the pooling queries."""
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()} | {"queries"}

    def encode(self, images: Tensor, state: Tensor) -> Tensor:
        """Conditioning ``(B, E)`` from ``images (B, 3 or 4, Hi, Wi)`` and raw ``state (B, S)``. Training and
        sampling both go through :meth:`encode_parts`: a subclass that changes the conditioning overrides that."""
        return self.encode_parts(images, state, image_features=False)[0]

    def encode_parts(self, images: Tensor, state: Tensor, image_features: bool = True
                     ) -> Tuple[Tensor, Optional[Tensor]]:
        """``(conditioning (B, E), image features (B, F) or None)``: the conditioning of :meth:`encode` and what
        it is made from apart from the state -- the pooled tokens, their mean and (with ``keypoints``) the
        queries' expected patch positions, ``F = (Q + 1) D (+ 2 Q)`` (``None`` unless ``image_features``)."""
        tokens = self.encoder.forward_features(images)  # (B, M, D)
        q = self.queries.expand(tokens.shape[0], -1, -1)  # (B, Q, D)
        pooled, weights = self.pool(q, tokens, tokens, need_weights=self.config.keypoints)  # (B, Q, D), (B, Q, M)
        s = self.state_mlp(self.state_norm.normalize(state))  # (B, 128)
        feats = [pooled.flatten(1), tokens.mean(dim=1), s]  # (B, Q D), (B, D), (B, 128)
        if self.config.keypoints:
            feats.append((weights @ self._patch_grid(images, tokens)).flatten(1))  # (B, Q, 2) -> (B, 2 Q)
        cond = self.cond_proj(torch.cat(feats, dim=-1))  # (B, E)
        return cond, torch.cat([f for f in feats if f is not s], dim=-1) if image_features else None

    def image_feature_dim(self) -> int:
        """``F`` of :meth:`encode_parts`."""
        q, d = self.config.num_queries, self.encoder.cfg.embed_dim
        return (q + 1) * d + (2 * q if self.config.keypoints else 0)

    def aux_input(self, cond: Tensor, image_features: Tensor) -> Tensor:
        """What the auxiliary head reads: here the conditioning ``(B, E)``."""
        return cond

    def _patch_grid(self, images: Tensor, tokens: Tensor) -> Tensor:
        """``(M, 2)`` patch-centre positions ``(y, x)`` in [-1, 1], row-major like the encoder's tokens."""
        p = self.encoder.cfg.patch_size
        gh, gw = images.shape[-2] // p, images.shape[-1] // p
        if gh * gw != tokens.shape[1]:
            raise ValueError(f"keypoints need one token per patch: {gh}x{gw} patches, {tokens.shape[1]} tokens")
        ys = torch.linspace(-1.0, 1.0, gh, device=tokens.device, dtype=tokens.dtype)
        xs = torch.linspace(-1.0, 1.0, gw, device=tokens.device, dtype=tokens.dtype)
        return torch.stack(torch.meshgrid(ys, xs, indexing="ij"), dim=-1).reshape(-1, 2)

    def forward(self, images: Tensor, state: Tensor, noisy_actions: Tensor, t: Tensor) -> Tensor:
        """Denoiser output ``(B, H, A)`` for normalised noisy chunks ``(B, H, A)`` at timesteps ``t (B,)``."""
        return self.denoiser(noisy_actions, t, self.encode(images, state))

    def loss(self, images: Tensor, state: Tensor, actions: Tensor, noise_samples: int = 1,
             generator: Optional[torch.Generator] = None, object_pos: Optional[Tensor] = None) -> Tensor:
        """DDPM loss (MSE on ``eps`` or ``x0``) for env action chunks ``actions (B, H, A)``, plus ``aux_weight``
        times the auxiliary loss when the policy has one (``object_pos (B, 3)``: the target's world position,
        required then).

        The encoder runs once per example; ``noise_samples`` draws of ``(t, noise)`` share it (the head is
        cheap), which gives the head more signal per encoder pass.
        """
        cond, image_features = self.encode_parts(images, state, self.aux_head is not None)  # (B, E), (B, F)
        aux = None
        if self.aux_head is not None:
            if object_pos is None:
                raise ValueError("this policy has an auxiliary loss (aux_weight > 0): pass object_pos (demos "
                                 "recorded with target positions)")
            aux = nn.functional.mse_loss(self.aux_head(self.aux_input(cond, image_features)),
                                         self.aux_target(object_pos, state))
        x0 = self.action_norm.normalize(self.chunk_targets(actions, state))  # (B, H, A)
        if noise_samples > 1:
            cond = cond.repeat_interleave(noise_samples, dim=0)  # (B K, E)
            x0 = x0.repeat_interleave(noise_samples, dim=0)  # (B K, H, A)
        t, x_t, target = self.schedule.training_pair(x0, generator)
        loss = nn.functional.mse_loss(self.denoiser(x_t, t, cond), target)
        return loss if aux is None else loss + self.config.aux_weight * aux

    def aux_target(self, object_pos: Tensor, state: Tensor) -> Tensor:
        """What the auxiliary head learns to output: the target's world position ``object_pos (B, 3)`` relative
        to the tip in raw ``state (B, S)``, in units of 10 cm -> ``(B, 3)``."""
        return (object_pos - state[:, STATE_SLICES["ee_pos"]]) / _AUX_UNIT_M

    @torch.no_grad()
    def aux_position(self, images: Tensor, state: Tensor) -> Tensor:
        """The auxiliary head's estimate of the target's world position ``(B, 3)`` (metres) from ``images``
        and raw ``state (B, S)``: the inverse of the auxiliary loss's target.

        Raises:
            ValueError: the policy has no auxiliary head (``aux_weight == 0``).
        """
        if self.aux_head is None:
            raise ValueError("this policy has no auxiliary head (aux_weight == 0)")
        rel = self.aux_head(self.encode(images, state))  # (B, 3)
        return rel * _AUX_UNIT_M + state[:, STATE_SLICES["ee_pos"]]

    @torch.no_grad()
    def sample(self, images: Tensor, state: Tensor, generator: Optional[torch.Generator] = None,
               num_steps: Optional[int] = None) -> Tensor:
        """Normalised action chunks ``(B, H, A)`` by DDIM (``num_steps`` defaults to the config's)."""
        cond = self.encode(images, state)  # (B, E)
        steps = num_steps or self.config.num_inference_steps
        shape = (images.shape[0], self.config.horizon, self.denoiser.action_dim)  # subclasses may widen A
        return self.schedule.sample(lambda x, t: self.denoiser(x, t, cond), shape, steps, generator, images.device)

    @torch.no_grad()
    def predict(self, images: Tensor, state: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
        """Env action chunks ``(B, H, A)``: absolute tip targets (m, world) and gripper commands in {0, 1}."""
        chunk = self.chunk_to_env(self.action_norm.unnormalize(self.sample(images, state, generator)), state)
        return torch.cat([chunk[..., :3], (chunk[..., 3:] > 0.5).to(chunk.dtype)], dim=-1)


class PolicyRunner:
    """``policy_fn(obs) -> action (4,)`` for :func:`ropekit.robot.rollout`: samples a chunk, executes its first
    ``n_action_steps`` actions, then re-plans. Deterministic given ``seed`` (reseeded by :meth:`reset`)."""

    def __init__(self, policy: DiffusionPolicy, seed: int = 0, n_action_steps: Optional[int] = None) -> None:
        self.policy = policy.eval()
        self.seed = int(seed)
        self.n_action_steps = int(n_action_steps or policy.config.n_action_steps)
        self._gen = torch.Generator().manual_seed(self.seed)
        self._queue: List[np.ndarray] = []

    def reset(self) -> None:
        self._gen = torch.Generator().manual_seed(self.seed)
        self._queue = []

    def __call__(self, obs: Mapping[str, np.ndarray]) -> np.ndarray:
        if not self._queue:
            depth = obs["depth"] if self.policy.config.modality == "rgbd" else None
            images = images_from_obs(obs["rgb"], depth)  # (1, 3 or 4, Hi, Wi)
            state = torch.as_tensor(np.asarray(obs["state"], dtype=np.float32)).unsqueeze(0)  # (1, S)
            chunk = self.policy.predict(images, state, self._gen)[0].numpy()  # (H, A)
            self._queue = list(chunk[: self.n_action_steps].astype(np.float64))
        return self._queue.pop(0)


@torch.no_grad()
def init_from_2d(policy3d: DiffusionPolicy, state2d: Mapping[str, Tensor], depth_scale: float = 0.0) -> List[str]:
    """Load a 2-D (RGB) policy's ``state_dict`` into an RGB-D policy with a 3-D encoding.

    Every tensor is copied. Encoding parameters that carry a coordinate axis (size 2 in the 2-D model, 3 in
    the 3-D one, e.g. Circulant-STRING's ``(heads, c, blocks, b)``) are copied into the ``y, x`` slices; the
    new ``z`` slice keeps its fresh initialisation, so it can learn. The depth lift ``z = a * depth + b`` is
    set to ``a = b = 0``: every patch then has ``z = 0``, the ``z`` generator contributes nothing, and the
    first forward pass equals the 2-D policy's (up to round-off). Both must use the same encoding and head.
    A non-zero ``depth_scale`` starts ``a`` there instead (the z axis is then active from the first step, and
    the first forward pass differs from the 2-D policy's).

    Returns:
        The names of the parameters that were widened along the coordinate axis.
    """
    if policy3d.config.modality != "rgbd":
        raise ValueError("init_from_2d loads into an RGB-D policy (modality='rgbd')")
    own = policy3d.state_dict()
    lifted = {n for n, m in policy3d.named_modules() if isinstance(m, DepthLift)}
    expected = {k for k in own if k.rpartition(".")[0] in lifted}
    missing = sorted(set(own) - set(state2d) - expected)
    unexpected = sorted(set(state2d) - set(own))
    if missing or unexpected:
        raise ValueError(f"the 2-D state does not match the 3-D policy: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]} (same encoding and head sizes needed)")
    widened = []
    for name, src in state2d.items():
        dst = own[name]
        if dst.shape == src.shape:
            dst.copy_(src)
            continue
        axes = [i for i, (a, b) in enumerate(zip(src.shape, dst.shape)) if a != b]
        if len(src.shape) != len(dst.shape) or len(axes) != 1 or (src.shape[axes[0]], dst.shape[axes[0]]) != (2, 3):
            raise ValueError(f"cannot widen {name} from {tuple(src.shape)} to {tuple(dst.shape)}: only a coordinate "
                             f"axis going from 2 to 3 can be")
        dst.narrow(axes[0], 0, 2).copy_(src)
        widened.append(name)
    for k in expected:
        own[k].fill_(depth_scale if k.endswith(".scale") else 0.0)
    return sorted(set(widened))
