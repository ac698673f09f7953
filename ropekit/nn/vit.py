"""Vision Transformer for images, RGB-D images (ViTD) and video, with any rotary position encoding.

Shape legend: ``B`` batch, ``C`` colour channels, ``T, H, W`` frames / pixels, ``M`` patch (or tubelet)
tokens, ``P0`` prefix tokens (0 or 1 CLS), ``N = P0 + M``, ``D`` width, ``c`` coordinate dimension
(2 for images, 3 for RGB-D patches ``(y, x, z)`` and video tubelets ``(t, y, x)``), ``K`` classes.

Inputs: ``"image"`` ``(B, C, H, W)``; ``"rgbd"`` ``(B, C + 1, H, W)`` with the last channel metric depth
(0 / NaN invalid); ``"video"`` ``(B, C, T, H, W)``. Any size works at forward time (the token grid and the
coordinates are computed from the input); sizes are cropped to a multiple of the patch size.

Build a model from a :class:`ViTConfig`::

    cfg = vit_config("tiny", num_classes=10, in_chans=1, image_size=(28, 28), pe="cayley")
    model = VisionTransformer(cfg)
    logits = model(images)                            # (B, K)
    logits = model(images, coord_offset=offset)       # offset (B, c): a global coordinate shift per image
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..encodings import PositionEncoding, create_pe, list_pes
from .attention import Attention
from .coords import COORD_MODES, centroid, grid_coords, jitter_coords, patch_units
from .depth import DepthLift, valid_depth_mask
from .embed import LearnedPosEmbed, PatchEmbed, SinCosPosEmbed, TubeletEmbed

__all__ = ["ViTConfig", "VIT_SIZES", "ABSOLUTE_PES", "vit_config", "VisionTransformer", "Block", "Mlp", "DropPath"]

#: Width, depth, heads and MLP ratio of the named sizes. ``tiny`` is sized for CPU training (head_dim 48:
#: a multiple of 6, so every encoding splits evenly over 2 or 3 axes, and 6 blocks of 8 for ComRoPE-AP);
#: ``small`` and ``base`` are the ViT-S/16 and ViT-B/16 shapes.
VIT_SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(embed_dim=96, depth=6, num_heads=2, mlp_ratio=2.0),
    "small": dict(embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),
    "base": dict(embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),
}

#: ``pe`` names that mean "no rotary encoding, an absolute embedding instead".
ABSOLUTE_PES = {"absolute": "learned", "sincos": "sincos"}

MODALITIES = ("image", "rgbd", "video")
CLS_MODES = ("none", "unrotated", "centroid")
SHARING = ("model", "layer", "head")
APE_KINDS = ("none", "learned", "sincos")
DEPTH_INPUTS = ("auto", "coord", "channel", "ignore")


@dataclass
class ViTConfig:
    """Everything that defines a :class:`VisionTransformer` (saved with every run and checkpoint).

    Data shape:
        num_classes: ``K`` (``0``: no head, ``forward`` returns pooled features).
        in_chans: colour channels ``C`` (RGB-D: without the depth channel).
        image_size: ``(H, W)`` of training images -- only sizes the learned APE table; any size is accepted.
        modality: ``"image"``, ``"rgbd"`` or ``"video"``.
        num_frames: ``T`` of training clips (video; sizes the learned APE table).
    Backbone:
        patch_size, tubelet_size (video frames per token), embed_dim, depth, num_heads, mlp_ratio, qkv_bias,
        drop_rate, attn_drop_rate, drop_path_rate.
    Position:
        pe: a ``create_pe`` name (``none, axial, mixed, cayley, circulant, tensor, string, liere, liere-commute,
            comrope-ap, comrope-ld, relaxed``), or ``"absolute"`` (learned APE, no rotary encoding) or
            ``"sincos"`` (fixed 2-D/3-D sinusoidal APE, no rotary encoding).
        pe_options: keyword options of the encoding (``ropekit.pe_options(pe)``), e.g. ``{"block_size": 8}``.
        pe_sharing: ``"model"`` (one encoding module reused by every layer), ``"layer"`` (one per layer) or
            ``"head"`` (one per layer with parameters per head; same as ``"layer"`` + ``per_head=True``).
        per_head: separate encoding parameters per head.
        ape: absolute embedding added to the patch embeddings besides the rotary one (``"none"``,
            ``"learned"``, ``"sincos"``).
        cls: ``"none"`` (mean pooling over patch tokens -- a commuting encoding then makes the model exactly
            invariant to a global coordinate offset), ``"unrotated"`` (a CLS token left unrotated, pooled by
            it; CLS-patch logits then depend on absolute coordinates) or ``"centroid"`` (the CLS token is given
            the centroid of the patch coordinates, so offset invariance is kept).
        coords: ``"grid"`` (integer patch indices) or ``"normalized"`` (centres in ``[0, 1]``).
        jitter: position jitter sigma in patches (training only; 0 disables).
    RGB-D:
        depth_input: ``"coord"`` (z = learnable linear function of the patch's mean valid depth, a 3-D
            encoding), ``"channel"`` (depth as an extra input channel, invalid pixels as 0), ``"ignore"``
            (an RGB ViT), or ``"auto"``: ``"coord"`` with a rotary encoding, ``"channel"`` without.
        depth_scale_init: initial ``a`` of ``z = a * depth + b`` (1: from scratch; 0: fine-tuning a 2-D model).
    """

    num_classes: int = 10
    in_chans: int = 1
    image_size: Tuple[int, int] = (28, 28)
    modality: str = "image"
    num_frames: Optional[int] = None
    patch_size: int = 4
    tubelet_size: int = 2
    embed_dim: int = 96
    depth: int = 6
    num_heads: int = 2
    mlp_ratio: float = 2.0
    qkv_bias: bool = True
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    pe: str = "cayley"
    pe_options: Dict[str, Any] = field(default_factory=dict)
    pe_sharing: str = "model"
    per_head: bool = False
    ape: str = "none"
    cls: str = "none"
    coords: str = "grid"
    jitter: float = 0.0
    depth_input: str = "auto"
    depth_scale_init: float = 1.0

    # ------------------------------------------------------------------ derived
    @property
    def rotary(self) -> Optional[str]:
        """The ``create_pe`` name, or ``None`` without a rotary encoding (``none``, ``absolute``, ``sincos``)."""
        name = self.pe.lower().replace("_", "-")
        return None if name in ABSOLUTE_PES or name == "none" else name

    @property
    def ape_kind(self) -> str:
        name = self.pe.lower().replace("_", "-")
        return ABSOLUTE_PES[name] if name in ABSOLUTE_PES and self.ape == "none" else self.ape

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def coord_dim(self) -> int:
        if self.modality == "video" or (self.modality == "rgbd" and self.resolved_depth_input == "coord"):
            return 3
        return 2

    @property
    def resolved_depth_input(self) -> Optional[str]:
        if self.modality != "rgbd":
            return None
        if self.depth_input == "auto":
            return "coord" if self.rotary is not None else "channel"
        return self.depth_input

    def validate(self) -> "ViTConfig":
        """Raise ``ValueError`` (one line, naming the accepted values) on an inconsistent configuration."""
        def one_of(what: str, value: Any, allowed: Sequence[str]) -> None:
            if value not in allowed:
                raise ValueError(f"{what} must be one of {', '.join(allowed)}; got {value!r}")

        one_of("modality", self.modality, MODALITIES)
        one_of("cls", self.cls, CLS_MODES)
        one_of("pe_sharing", self.pe_sharing, SHARING)
        one_of("ape", self.ape, APE_KINDS)
        one_of("coords", self.coords, COORD_MODES)
        one_of("depth_input", self.depth_input, DEPTH_INPUTS)
        name = self.pe.lower().replace("_", "-")
        known = list_pes() + list(ABSOLUTE_PES)
        if name not in known:
            raise ValueError(f"unknown position encoding {self.pe!r}; known: {', '.join(known)}")
        if self.embed_dim <= 0 or self.num_heads <= 0 or self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim={self.embed_dim} must be a positive multiple of num_heads={self.num_heads}")
        if self.depth < 1 or self.patch_size < 1 or self.tubelet_size < 1:
            raise ValueError("depth, patch_size and tubelet_size must be >= 1")
        if self.jitter < 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        if self.modality == "rgbd" and self.resolved_depth_input == "coord" and self.rotary is None:
            raise ValueError(f"depth_input='coord' needs a rotary encoding; pe={self.pe!r} has no coordinate path "
                             f"(use depth_input='channel')")
        if self.rotary is None and self.pe_options:
            raise ValueError(f"pe={self.pe!r} takes no encoding options, got {sorted(self.pe_options)}")
        return self

    def resolved(self) -> "ViTConfig":
        """A validated copy with the automatic choices made explicit (``depth_input``, head sharing)."""
        self.validate()
        changes: Dict[str, Any] = {"image_size": tuple(int(s) for s in self.image_size),
                                   "pe": self.pe.lower().replace("_", "-")}
        if self.modality == "rgbd":
            changes["depth_input"] = self.resolved_depth_input
        if self.pe_sharing == "head":
            changes["per_head"] = True
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["image_size"] = list(d["image_size"])
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ViTConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ViTConfig field(s): {', '.join(unknown)}")
        d = dict(d)
        if "image_size" in d:
            s = d["image_size"]
            d["image_size"] = (int(s), int(s)) if isinstance(s, (int, float)) else tuple(int(v) for v in s)
        return cls(**d)


def vit_config(size: str = "tiny", **overrides: Any) -> ViTConfig:
    """A :class:`ViTConfig` of the named size (``tiny``, ``small``, ``base``) with ``overrides`` applied."""
    if size not in VIT_SIZES:
        raise ValueError(f"unknown model size {size!r}; known: {', '.join(VIT_SIZES)}")
    return ViTConfig(**{**VIT_SIZES[size], **overrides})


class DropPath(nn.Module):
    """Stochastic depth: drop the residual branch per example with probability ``p`` (training only)."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.dim() - 1))).bernoulli_(1.0 - self.p)  # (B, 1, 1)
        return x * keep / (1.0 - self.p)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x)) ; x + mlp(norm(x))``."""

    def __init__(self, dim: int, num_heads: int, pe: Optional[PositionEncoding], mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, pe, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)

    def forward(self, x: Tensor, coords: Optional[Tensor], num_prefix_tokens: int = 0) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), coords, num_prefix_tokens))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def build_encodings(cfg: ViTConfig, coord_dim: int) -> List[Optional[PositionEncoding]]:
    """One encoding per layer, following ``cfg.pe_sharing`` (the same object repeated for ``"model"``)."""
    name = cfg.rotary
    if name is None:
        return [None] * cfg.depth
    options = dict(cfg.pe_options)
    if cfg.per_head or cfg.pe_sharing == "head":
        options["per_head"] = True

    def make() -> PositionEncoding:
        return create_pe(name, head_dim=cfg.head_dim, coord_dim=coord_dim, num_heads=cfg.num_heads, **options)

    if cfg.pe_sharing == "model":
        pe = make()
        return [pe] * cfg.depth
    return [make() for _ in range(cfg.depth)]


class VisionTransformer(nn.Module):
    """ViT / ViTD / video ViT. See the module docstring for shapes and :class:`ViTConfig` for the options.

    The encodings are wired into the attention layers here (``pe_sharing="model"`` passes one module to every
    layer, so its parameters appear once in ``parameters()`` and under every layer's name in ``state_dict``).
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        cfg = cfg.resolved()
        self.cfg = cfg
        dim = cfg.embed_dim
        self.num_prefix_tokens = 0 if cfg.cls == "none" else 1
        self.depth_lift: Optional[DepthLift] = None
        if cfg.modality == "video":
            self.patch_embed: nn.Module = TubeletEmbed(cfg.tubelet_size, cfg.patch_size, cfg.in_chans, dim)
        else:
            extra = 1 if cfg.modality == "rgbd" and cfg.depth_input == "channel" else 0
            self.patch_embed = PatchEmbed(cfg.patch_size, cfg.in_chans + extra, dim)
            if cfg.modality == "rgbd" and cfg.depth_input == "coord":
                self.depth_lift = DepthLift(cfg.depth_scale_init)
        self.coord_dim = cfg.coord_dim

        self.ape: Optional[nn.Module] = None
        if cfg.ape_kind == "learned":
            self.ape = LearnedPosEmbed(dim, self._train_grid())
        elif cfg.ape_kind == "sincos":
            self.ape = SinCosPosEmbed(dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if self.num_prefix_tokens else None

        encodings = build_encodings(cfg, self.coord_dim)
        dpr = torch.linspace(0, cfg.drop_path_rate, cfg.depth).tolist()
        self.blocks = nn.ModuleList([
            Block(dim, cfg.num_heads, encodings[i], cfg.mlp_ratio, cfg.qkv_bias, cfg.drop_rate, cfg.attn_drop_rate,
                  dpr[i]) for i in range(cfg.depth)
        ])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self._init_weights()

    # ------------------------------------------------------------------ construction helpers
    def _train_grid(self) -> Tuple[int, ...]:
        cfg = self.cfg
        h, w = cfg.image_size
        grid: Tuple[int, ...] = (h // cfg.patch_size, w // cfg.patch_size)
        if cfg.modality == "video":
            if not cfg.num_frames:
                raise ValueError("a learned absolute embedding for video needs num_frames")
            grid = (cfg.num_frames // cfg.tubelet_size,) + grid
        if min(grid) < 1:
            raise ValueError(f"image_size {cfg.image_size} is smaller than the patch size {cfg.patch_size}")
        return grid

    def _init_weights(self) -> None:
        """Xavier-uniform linear layers (q, k and v each as its own ``D x D`` matrix) and patch embedding, as MAE
        and timm's "jax" scheme do; zero biases; a small normal head. (The common ``trunc_normal(0.02)`` makes
        q^T k tiny in narrow models, so attention -- the only place positions enter -- stays uniform for hundreds
        of steps: on MNIST with the tiny model it learned ~3x slower.)"""
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if name.endswith("attn.qkv"):
                    bound = math.sqrt(6.0 / (m.weight.shape[0] // 3 + m.weight.shape[1]))
                    nn.init.uniform_(m.weight, -bound, bound)
                elif m is self.head:
                    nn.init.trunc_normal_(m.weight, std=0.02)
                else:
                    nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        w = self.patch_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=0.02)

    @property
    def encodings(self) -> List[PositionEncoding]:
        """The distinct encoding modules (one when shared by the model, one per layer otherwise)."""
        seen: Dict[int, PositionEncoding] = {}
        for blk in self.blocks:
            pe = blk.attn.pe
            if pe is not None and id(pe) not in seen:
                seen[id(pe)] = pe
        return list(seen.values())

    def no_weight_decay(self) -> set:
        """Parameter names (as in ``named_parameters()``) to exclude from weight decay: the encodings' learnable
        parameters, the depth lift, the CLS token and the absolute embedding. (The optimiser builder also
        excludes every 1-D parameter: norms and biases.)"""
        names = set()
        for mname, m in self.named_modules():
            if isinstance(m, (PositionEncoding, DepthLift)):
                names |= {f"{mname}.{n}" for n in m.no_weight_decay()}
            elif isinstance(m, LearnedPosEmbed):
                names.add(f"{mname}.table")
        if self.cls_token is not None:
            names.add("cls_token")
        return names

    # ------------------------------------------------------------------ forward
    def embed(self, x: Tensor, coord_offset: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor], int]:
        """Tokens and coordinates before the blocks.

        Args:
            x: ``(B, C, H, W)``, ``(B, C + 1, H, W)`` (RGB-D) or ``(B, C, T, H, W)`` (video).
            coord_offset: optional ``(B, c)`` (or ``(c,)``) added to every patch coordinate (coordinate units).

        Returns:
            ``(tokens (B, N, D), coords (M', c) or (B, M', c) or None, num_prefix_tokens)`` with ``M' = M``,
            or ``M + 1`` for a centroid CLS token (which then has ``num_prefix_tokens = 0``).
        """
        cfg = self.cfg
        b = x.shape[0]
        z = None
        if cfg.modality == "rgbd":
            if x.dim() != 4 or x.shape[1] != cfg.in_chans + 1:
                raise ValueError(f"RGB-D input must be (B, {cfg.in_chans + 1}, H, W) (colour then depth), "
                                 f"got {tuple(x.shape)}")
            rgb, depth = x[:, :cfg.in_chans], x[:, cfg.in_chans]  # (B, C, H, W), (B, H, W)
            if cfg.depth_input == "channel":
                depth = torch.where(valid_depth_mask(depth), depth, torch.zeros_like(depth))
                tokens, grid = self.patch_embed(torch.cat([rgb, depth[:, None]], dim=1))
            else:
                tokens, grid = self.patch_embed(rgb)
                if self.depth_lift is not None:
                    z = self.depth_lift(depth.float(), cfg.patch_size)  # (B, M)
        else:
            tokens, grid = self.patch_embed(x)  # (B, M, D)
        if self.ape is not None:
            ape = self.ape(grid, device=x.device) if isinstance(self.ape, SinCosPosEmbed) else self.ape(grid)
            tokens = tokens + ape.to(tokens.dtype)  # (B, M, D)

        coords = None
        if cfg.rotary is not None:
            coords = grid_coords(grid, cfg.coords, device=x.device)  # (M, 2) or (M, 3)
            unit = patch_units(grid, cfg.coords)
            if z is not None:
                coords = torch.cat([coords.expand(b, -1, -1), z.unsqueeze(-1).to(coords.dtype)], dim=-1)  # (B, M, 3)
                unit = unit + [0.0]  # z is not jittered
            if self.training and cfg.jitter > 0:
                coords = jitter_coords(coords, b, cfg.jitter, unit)  # (B, M, c)
            if coord_offset is not None:
                off = torch.as_tensor(coord_offset, dtype=coords.dtype, device=coords.device)
                if off.dim() == 1:
                    off = off.unsqueeze(0)
                if off.dim() != 2 or off.shape[-1] != self.coord_dim or off.shape[0] not in (1, b):
                    raise ValueError(f"coord_offset must be ({b}, {self.coord_dim}) or ({self.coord_dim},), "
                                     f"got {tuple(off.shape)}")
                coords = coords + off.expand(b, -1).unsqueeze(1)  # (B, M, c)
            if cfg.cls == "centroid":
                coords = torch.cat([centroid(coords), coords], dim=-2)  # (.., 1 + M, c)

        num_prefix = 0
        if self.cls_token is not None:
            tokens = torch.cat([self.cls_token.expand(b, -1, -1).to(tokens.dtype), tokens], dim=1)  # (B, N, D)
            num_prefix = 1 if cfg.cls == "unrotated" else 0
        return tokens, coords, num_prefix

    def forward_features(self, x: Tensor, coord_offset: Optional[Tensor] = None) -> Tensor:
        """All normalised tokens ``(B, N, D)`` (CLS first when there is one)."""
        tokens, coords, num_prefix = self.embed(x, coord_offset)
        for blk in self.blocks:
            tokens = blk(tokens, coords, num_prefix)
        return self.norm(tokens)

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        """Pool ``(B, N, D)`` features (CLS token, or the mean of the patch tokens) and classify: ``(B, K)``."""
        pooled = features[:, 0] if self.cls_token is not None else features.mean(dim=1)  # (B, D)
        return pooled if pre_logits else self.head(pooled)

    def forward(self, x: Tensor, coord_offset: Optional[Tensor] = None) -> Tensor:
        """Logits ``(B, K)`` (pooled features ``(B, D)`` when ``num_classes == 0``)."""
        return self.forward_head(self.forward_features(x, coord_offset))
