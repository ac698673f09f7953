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
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._config_keys import known_keys
from ..coords.augment import augment_leading_axes, check_coord_augment
from ..encodings import PositionEncoding, create_pe, list_pes
from ..encodings.registry import RegistryView
from ..encodings.prepared import prepare_layers
from ..encodings.scaling import ResolutionScaling, ScaledEncoding
from ..encodings.ops.validation import check_finite
from .attention import Attention, PreparedPE
from .coords import COORD_MODES, centroid, grid_coords, jitter_coords, patch_units
from .depth import DepthLift, valid_depth_mask
from .embed import LearnedPosEmbed, PatchEmbed, SinCosPosEmbed, TubeletEmbed

__all__ = ["ViTConfig", "VIT_SIZES", "ABSOLUTE_PES", "PAPER_SHARING", "vit_config", "VisionTransformer", "Block", "Mlp",
           "DropPath"]

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
SHARING = ("auto", "model", "layer", "head")

#: How each encoding's parameters are shared when ``pe_sharing="auto"``: as its authors trained it (each class's
#: ``paper_sharing``, declared with ``register_pe``). ``"model"``: one set for every layer and head; ``"layer"``:
#: one set per layer, shared by its heads; ``"head"``: one set per layer and per head. RoPE-Mixed learns its
#: frequencies per layer and head (Heo et al.); LieRE and LieRE-Commute keep one set for the whole model (LieRE's
#: authors found it best); the STRING family (cayley, circulant, general and relaxed STRING, the tensor product)
#: has one set per layer, shared by the heads (STRING's authors found sharing across heads slightly better).
#: ComRoPE and axial RoPE (whose frequencies are fixed unless ``learnable_freqs``) keep one set for the model.
#: See docs/presets.md.
PAPER_SHARING: Mapping[str, str] = RegistryView("paper_sharing")
APE_KINDS = ("none", "learned", "sincos")
#: Fields renamed since configurations were first saved: old name -> new name (saved runs stay loadable).
RENAMED: Dict[str, str] = {}
DEPTH_INPUTS = ("auto", "coord", "channel", "both", "ignore")


@dataclass
class ViTConfig:
    """Everything that defines a :class:`VisionTransformer` (saved with every run and checkpoint).

    Data shape:
        num_classes: ``K`` (``0``: no head, ``forward`` returns pooled features).
        in_chans: colour channels ``C`` (RGB-D: without the depth channel).
        image_size: ``(H, W)`` of training images (an ``int`` means a square) -- only sizes the learned APE table;
            any size is accepted.
        modality: ``"image"``, ``"rgbd"`` or ``"video"``.
        num_frames: ``T`` of training clips (video; sizes the learned APE table).
    Backbone:
        patch_size, tubelet_size (video frames per token), embed_dim, depth, num_heads, mlp_ratio, qkv_bias,
        drop_rate, attn_drop_rate, drop_path_rate.
        num_kv_heads: key/value heads of every attention layer (a divisor of ``num_heads``; ``None``: as many as
            query heads; ``1``: multi-query attention). The encoding stays per query head: each query head rotates
            its group's shared key with its own encoding (``ropekit.nn.attention``'s module docstring says what
            that computes, and why a per-head basis is then not absorbed by the key projection).
    Position:
        pe: a ``create_pe`` name (``none, axial, mixed, cayley, circulant, tensor, string, liere, liere-commute,
            comrope-ap, comrope-ld, relaxed``), or ``"absolute"`` (learned APE, no rotary encoding) or
            ``"sincos"`` (fixed 2-D/3-D sinusoidal APE, no rotary encoding).
        pe_options: keyword options of the encoding (``ropekit.pe_options(pe)``), e.g. ``{"block_size": 8}``;
            ``{"backend": "torch"}`` (or ``"triton"``) pins the execution path of the rotation (default
            ``"auto"``: the fused Triton kernels on CUDA where they work; see ``PositionEncoding.set_conventions``).
        pe_sharing: ``"auto"`` (as the encoding's paper trained it, see ``PAPER_SHARING``: mixed per layer and
            head, liere one set for the model, the STRING family per layer shared by heads), ``"model"`` (one
            encoding module reused by every layer), ``"layer"`` (one per layer) or ``"head"`` (one per layer with
            parameters per head; same as ``"layer"`` + ``per_head=True``).
        per_head: separate encoding parameters per head.
        pe_fold_train: for commuting encodings (all but liere with ``c >= 2``, relaxed and tensor), merge the
            encoding's learned basis into the attention's q/k projection at every forward pass and rotate the
            tokens by plain RoPE (same logits and gradients, RoPE's per-token cost, ComRoPE at coinciding
            frequencies and at ``init="zero"`` included); ``False`` applies the encoding to every token.
        ape: absolute embedding added to the patch embeddings besides the rotary one (``"none"``,
            ``"learned"``, ``"sincos"``).
        cls: ``"none"`` (mean pooling over patch tokens -- a commuting encoding then makes the model exactly
            invariant to a global coordinate offset), ``"unrotated"`` (a CLS token left unrotated, pooled by
            it; CLS-patch logits then depend on absolute coordinates) or ``"centroid"`` (the CLS token is given
            the centroid of the patch coordinates, so offset invariance is kept).
        coords: ``"grid"`` (integer patch indices) or ``"normalized"`` (centres in ``[0, 1]``).
        jitter: position jitter sigma in patches (training only; 0 disables). Like ``coord_augment``, it moves the
            rotary encoding's coordinates, so a model without one refuses it.
        coord_augment: ``(shift, jitter, rescale)`` coordinate augmentation in training, as DINOv3 and timm's
            NaFlexViT: per image a uniform shift in ``[-shift, shift]`` per axis, a log-uniform per-axis scale in
            ``[1/jitter, jitter]`` and a log-uniform global scale in ``[1/rescale, rescale]`` of the patch
            coordinates (``ropekit.coords.augment``; never at evaluation; a depth coordinate is left as it is).
            ``(0, 1, 1)`` (default) disables it.
    RGB-D:
        depth_input: ``"coord"`` (z = learnable linear function of the patch's mean valid depth, a 3-D
            encoding), ``"channel"`` (depth as an extra input channel, invalid pixels as 0), ``"both"`` (depth
            as an input channel *and* as the third coordinate -- the STRING paper's ViTD), ``"ignore"``
            (an RGB ViT), or ``"auto"``: ``"coord"`` with a rotary encoding, ``"channel"`` without.
        depth_scale_init: initial ``a`` of ``z = a * depth + b`` (1: from scratch; 0: fine-tuning a 2-D model).
    Resolution:
        resolution_scaling: the fields of a ``ropekit.encodings.scaling.ResolutionScaling`` (``method``, ``scale``,
            ``train_extent``, ...): every encoding is wrapped in a ``ScaledEncoding`` applying that method to its
            RoPE form -- a model fine-tuned or evaluated at another resolution than it was trained at. ``{}``
            (default): none. The wrapped encodings keep their parameters' names, so a checkpoint loads into the
            model with or without the scaling. Needs grid coordinates and an encoding with a RoPE form.
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
    num_kv_heads: Optional[int] = None
    pe: str = "cayley"
    pe_options: Dict[str, Any] = field(default_factory=dict)
    pe_sharing: str = "auto"
    per_head: bool = False
    pe_fold_train: bool = True
    ape: str = "none"
    cls: str = "none"
    coords: str = "grid"
    jitter: float = 0.0
    coord_augment: Tuple[float, float, float] = (0.0, 1.0, 1.0)
    depth_input: str = "auto"
    depth_scale_init: float = 1.0
    resolution_scaling: Dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived
    @property
    def rotary(self) -> Optional[str]:
        """The ``create_pe`` name, or ``None`` without a rotary encoding (``none``, ``absolute``, ``sincos``)."""
        name = self.pe.lower().replace("_", "-")
        return None if name in ABSOLUTE_PES or name == "none" else name

    @property
    def coord_augmenting(self) -> bool:
        """Whether ``coord_augment`` changes anything (a rotary encoding and not ``(0, 1, 1)``)."""
        return self.rotary is not None and tuple(float(v) for v in self.coord_augment) != (0.0, 1.0, 1.0)

    @property
    def ape_kind(self) -> str:
        name = self.pe.lower().replace("_", "-")
        return ABSOLUTE_PES[name] if name in ABSOLUTE_PES and self.ape == "none" else self.ape

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def coord_dim(self) -> int:
        if self.modality == "video" or self.depth_as_coord:
            return 3
        return 2

    @property
    def depth_as_coord(self) -> bool:
        """RGB-D with depth as the third coordinate (``depth_input`` ``"coord"`` or ``"both"``)."""
        return self.modality == "rgbd" and self.resolved_depth_input in ("coord", "both")

    @property
    def depth_as_channel(self) -> bool:
        """RGB-D with depth as an extra input channel (``depth_input`` ``"channel"`` or ``"both"``)."""
        return self.modality == "rgbd" and self.resolved_depth_input in ("channel", "both")

    @property
    def resolved_depth_input(self) -> Optional[str]:
        if self.modality != "rgbd":
            return None
        if self.depth_input == "auto":
            return "coord" if self.rotary is not None else "channel"
        return self.depth_input

    def __post_init__(self) -> None:
        size = self.image_size
        if isinstance(size, numbers.Real) and not isinstance(size, bool):
            size = (size, size)  # timm's img_size=224: a square
        if isinstance(size, (list, tuple)):  # (numpy integers as Python ones; anything else left to validate)
            size = tuple(int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v for v in size)
        self.image_size = size

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
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must be a positive divisor of "
                             f"num_heads={self.num_heads}")
        if self.depth < 1 or self.patch_size < 1 or self.tubelet_size < 1:
            raise ValueError("depth, patch_size and tubelet_size must be >= 1")
        size = self.image_size
        if not (isinstance(size, tuple) and len(size) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
            raise ValueError(f"image_size must be a positive int or (H, W) of positive ints; got {size!r}")
        if self.jitter < 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        check_coord_augment(self.coord_augment)
        if self.rotary is None and (self.jitter > 0 or tuple(float(v) for v in self.coord_augment) != (0.0, 1.0, 1.0)):
            what = "jitter" if self.jitter > 0 else "coord_augment"
            raise ValueError(f"{what} moves the coordinates of a rotary encoding; pe={self.pe!r} has none, so it "
                             f"would do nothing")
        if self.depth_as_coord and self.rotary is None:
            raise ValueError(f"depth_input={self.resolved_depth_input!r} needs a rotary encoding; pe={self.pe!r} has "
                             f"no coordinate path (use depth_input='channel')")
        if self.rotary is None and self.pe_options:
            raise ValueError(f"pe={self.pe!r} takes no encoding options, got {sorted(self.pe_options)}")
        if self.resolution_scaling:
            ResolutionScaling.from_dict(dict(self.resolution_scaling))
            if self.rotary is None:
                raise ValueError(f"resolution_scaling acts on a rotary encoding's frequencies; pe={self.pe!r} has none")
            if self.coords != "grid":
                raise ValueError(f"resolution_scaling acts on grid coordinates; coords={self.coords!r} has the same "
                                 f"extent at every resolution (nothing to scale)")
        return self

    def resolved(self) -> "ViTConfig":
        """A validated copy with the automatic choices made explicit (``depth_input``, head sharing)."""
        self.validate()
        changes: Dict[str, Any] = {"image_size": tuple(int(s) for s in self.image_size),
                                   "pe": self.pe.lower().replace("_", "-")}
        changes["coord_augment"] = check_coord_augment(self.coord_augment)
        if self.resolution_scaling:  # every field stated, as JSON values
            changes["resolution_scaling"] = ResolutionScaling.from_dict(dict(self.resolution_scaling)).to_dict()
        if self.modality == "rgbd":
            changes["depth_input"] = self.resolved_depth_input
        sharing = self.pe_sharing
        if sharing == "auto":
            sharing = PAPER_SHARING.get(self.rotary or "none", "model")
            changes["pe_sharing"] = sharing
        if sharing == "head":
            changes["per_head"] = True
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["image_size"] = list(d["image_size"])
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any], *, source: str = "ViTConfig", strict: bool = True) -> "ViTConfig":
        """Build from a mapping (``to_dict``'s). Fields renamed since a configuration was saved are mapped to their
        new names (:data:`RENAMED`). Unknown fields raise ``ValueError`` naming them (``strict``: the user's own
        options), or -- loading a saved run or checkpoint (``strict=False``), perhaps written by a newer ropekit --
        give one warning naming them and are ignored. ``source`` starts the messages."""
        d = known_keys(d, [f.name for f in dataclasses.fields(cls)], RENAMED, source=source, strict=strict,
                       what="field")
        if "image_size" in d:
            s = d["image_size"]
            d["image_size"] = (int(s), int(s)) if isinstance(s, (int, float)) else tuple(int(v) for v in s)
        return cls(**d)


def vit_config(size: str = "tiny", **overrides: Any) -> ViTConfig:
    """A :class:`ViTConfig` of the named size (``tiny``, ``small``, ``base``) with ``overrides`` applied.

    Raises:
        ValueError: an unknown size, or an override that is no ``ViTConfig`` field (every such name listed).
    """
    if size not in VIT_SIZES:
        raise ValueError(f"unknown model size {size!r}; known: {', '.join(VIT_SIZES)}")
    overrides = known_keys(overrides, [f.name for f in dataclasses.fields(ViTConfig)], RENAMED, source="vit_config",
                           strict=True, what="field")
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
                 qkv_bias: bool = True, drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 fold: bool = True, num_kv_heads: Optional[int] = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, pe, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop, fold=fold,
                              num_kv_heads=num_kv_heads)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)

    def forward(self, x: Tensor, coords: Optional[Tensor], num_prefix_tokens: int = 0,
                pe_state: Optional[PreparedPE] = None, attn_mask: Optional[Any] = None) -> Tensor:
        """``(B, N, D) -> (B, N, D)``; ``pe_state`` and ``attn_mask`` as :meth:`Attention.forward`."""
        x = x + self.drop_path(self.attn(self.norm1(x), coords, num_prefix_tokens, pe_state, attn_mask))
        return x + self.drop_path(self.mlp(self.norm2(x)))

    def reset_parameters(self) -> None:
        """Re-initialise the norms and linear layers (PyTorch's defaults; the ViT applies its own scheme after)."""
        for m in (self.norm1, self.attn.qkv, self.attn.proj, self.norm2, self.mlp.fc1, self.mlp.fc2):
            m.reset_parameters()

    def no_weight_decay(self) -> set:
        """Names (relative to this block) of its encoding's learnable parameters."""
        return {f"attn.{n}" for n in self.attn.no_weight_decay()}


def init_linear_layers(model: nn.Module, head: Optional[nn.Module] = None) -> None:
    """Initialise every ``nn.Linear`` of ``model``: xavier-uniform, q, k and v of an ``attn.qkv`` each as its own
    ``D x D`` matrix; ``head`` (if given) trunc-normal(0.02); zero biases."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            if name.endswith("attn.qkv"):
                bound = math.sqrt(6.0 / (m.weight.shape[1] + m.weight.shape[1]))  # also with fewer k/v heads
                nn.init.uniform_(m.weight, -bound, bound)
            elif head is not None and m is head:
                nn.init.trunc_normal_(m.weight, std=0.02)
            else:
                nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def build_encodings(cfg: ViTConfig, coord_dim: int) -> List[Optional[PositionEncoding]]:
    """One encoding per layer, following ``cfg.pe_sharing`` (the same object repeated for ``"model"``)."""
    name = cfg.rotary
    if name is None:
        return [None] * cfg.depth
    options = dict(cfg.pe_options)
    sharing = cfg.pe_sharing if cfg.pe_sharing != "auto" else PAPER_SHARING.get(name, "model")
    if cfg.per_head or sharing == "head":
        options["per_head"] = True

    def make() -> PositionEncoding:
        return create_pe(name, head_dim=cfg.head_dim, coord_dim=coord_dim, num_heads=cfg.num_heads, **options)

    if cfg.resolution_scaling:
        plain = make
        scaling = ResolutionScaling.from_dict(dict(cfg.resolution_scaling))

        def make() -> PositionEncoding:
            pe = plain()
            if pe.rope_kind is None or not pe.is_rotation:
                raise ValueError(f"resolution_scaling acts on a RoPE form; {name} with these options has none")
            return ScaledEncoding(pe, scaling)

    if sharing == "model":
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
            self.patch_embed = PatchEmbed(cfg.patch_size, cfg.in_chans + int(cfg.depth_as_channel), dim)
            if cfg.depth_as_coord:
                self.depth_lift = DepthLift(cfg.depth_scale_init)
        self.coord_dim = cfg.coord_dim

        self.ape: Optional[nn.Module] = None
        if cfg.ape_kind == "learned":
            self.ape = LearnedPosEmbed(dim, self._train_grid())
        elif cfg.ape_kind == "sincos":
            self.ape = SinCosPosEmbed(dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if self.num_prefix_tokens else None

        encodings = build_encodings(cfg, self.coord_dim)
        fold = cfg.pe_fold_train
        dpr = [cfg.drop_path_rate * i / max(cfg.depth - 1, 1) for i in range(cfg.depth)]  # no tensor: meta-safe
        self.blocks = nn.ModuleList([
            Block(dim, cfg.num_heads, encodings[i], cfg.mlp_ratio, cfg.qkv_bias, cfg.drop_rate, cfg.attn_drop_rate,
                  dpr[i], fold=fold, num_kv_heads=cfg.num_kv_heads) for i in range(cfg.depth)
        ])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self._reset_own_parameters()

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

    def reset_parameters(self) -> None:
        """Initialise every parameter, in a fixed order, from the current random state.

        Linear layers xavier-uniform (q, k and v each as its own ``D x D`` matrix) and the patch embedding, as MAE
        and timm's "jax" scheme do; zero biases; a small normal head; norms at ones/zeros; the CLS token and a
        learned absolute table normal(0.02); the depth lift at its ``depth_scale_init``; each encoding by its own
        ``reset_parameters()`` (which also rebuilds derived buffers). (The common ``trunc_normal(0.02)`` for
        linear layers makes q^T k tiny in narrow models, so attention -- the only place positions enter -- stays
        uniform for hundreds of steps: on MNIST with the tiny model it learned ~3x slower.)

        A model built on the meta device, then ``to_empty(device=...)``, then ``reset_parameters()`` equals an
        eager build re-initialised from the same seed: ``torch.manual_seed(s); model.reset_parameters()``.

        Raises:
            NotImplementedError: from an encoding that cannot re-initialise itself.
        """
        for pe in self.encodings:
            pe.reset_parameters()
        self._reset_own_parameters()

    def _reset_own_parameters(self) -> None:
        """Everything but the encodings (which initialise themselves when built): see :meth:`reset_parameters`."""
        self.patch_embed.reset_parameters()
        if self.depth_lift is not None:
            self.depth_lift.reset_parameters()
        if self.ape is not None and hasattr(self.ape, "reset_parameters"):
            self.ape.reset_parameters()
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=0.02)
        for blk in self.blocks:
            blk.reset_parameters()
        self.norm.reset_parameters()
        init_linear_layers(self, head=self.head)

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
            coord_offset: optional ``(B, c)`` (or ``(c,)``) added to every patch coordinate (coordinate units);
                NaN or infinite entries raise ``ValueError`` naming their count (on an accelerator, from
                ``ropekit.encodings.check_deferred_coords()``, see ``ropekit.encodings.check_coords``).

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
            if cfg.depth_as_channel:
                masked = torch.where(valid_depth_mask(depth), depth, torch.zeros_like(depth))
                tokens, grid = self.patch_embed(torch.cat([rgb, masked[:, None]], dim=1))
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
            if self.training and cfg.coord_augmenting:
                coords = augment_leading_axes(coords, cfg.coord_augment, b, axes=len(grid))  # (B, M, c)
            if coord_offset is not None:
                off = torch.as_tensor(coord_offset, dtype=coords.dtype, device=coords.device)
                if off.dim() == 1:
                    off = off.unsqueeze(0)
                if off.dim() != 2 or off.shape[-1] != self.coord_dim or off.shape[0] not in (1, b):
                    raise ValueError(f"coord_offset must be ({b}, {self.coord_dim}) or ({self.coord_dim},), "
                                     f"got {tuple(off.shape)}")
                check_finite(off, "coord_offset")
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
        states = self.prepare_encodings(coords, num_prefix, tokens.dtype)
        for blk, state in zip(self.blocks, states):
            tokens = blk(tokens, coords, num_prefix, state)
        return self.norm(tokens)

    def prepare_encodings(self, coords: Optional[Tensor], num_prefix_tokens: int = 0,
                          dtype: Optional[torch.dtype] = None) -> Tuple[Optional[PreparedPE], ...]:
        """Every block's encoding state for this forward pass, one per block in order (``None`` for a block
        without an encoding), computed together (``encodings.prepared.prepare_layers``): an encoding shared by
        several layers once; the folded forms, merged projections and angle tables of per-layer encodings in
        batched products."""
        return prepare_layers([blk.attn for blk in self.blocks], coords, num_prefix_tokens, dtype)

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        """Pool ``(B, N, D)`` features (CLS token, or the mean of the patch tokens) and classify: ``(B, K)``."""
        pooled = features[:, 0] if self.cls_token is not None else features.mean(dim=1)  # (B, D)
        return pooled if pre_logits else self.head(pooled)

    def forward(self, x: Tensor, coord_offset: Optional[Tensor] = None) -> Tensor:
        """Logits ``(B, K)`` (pooled features ``(B, D)`` when ``num_classes == 0``).

        ``x`` may also be a packed batch (``ropekit.nn.packing.PackedBatch``) or a timm NaFlex dict (``patches``,
        ``patch_coord``, ``patch_valid``): then one row of logits per image (``ropekit.nn.packing.packed_forward``)."""
        if not isinstance(x, Tensor):
            from .packing import packed_forward_any

            return packed_forward_any(self, x, coord_offset)
        return self.forward_head(self.forward_features(x, coord_offset))
