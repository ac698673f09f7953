"""A per-token 3-D box detector on a ViT (RGB) or ViTD (RGB-D) backbone.

Every patch token of the backbone makes one prediction: class logits over ``C + 1`` classes (the last is
"no object") from a linear class head, and an absolute box 12-vector ``[t (3), r1 (3), r2 (3), s (3)]`` in the
camera frame (:mod:`ropekit.detection.boxes`) from a 3-layer MLP with GELU.  Training matches the ``M``
predictions of an image to its objects with the Hungarian algorithm (:func:`~ropekit.detection.detection_loss`).

Shape legend: ``B`` images, ``H, W`` pixels, ``M`` patch tokens (= predictions per image), ``D`` backbone width,
``C`` object classes, ``I`` intrinsics features (4, or 0 with ``intrinsics="none"``).

Inputs.  ``x (B, 4, H, W)``: RGB in ``[0, 1]`` then metric depth (metres, 0 = invalid), as
:class:`~ropekit.detection.SceneDataset` gives it.  An RGB model (``input="rgb"``) drops the depth channel.  An
RGB-D model (ViTD) hands it to the backbone in one of three ways (:data:`INPUTS`):

* ``"rgbd"`` -- the STRING paper's ViTD: depth is a fourth input channel of the patch embedding *and*, with a
  rotary encoding, the third coordinate ``z`` (a learnable linear function of the patch's mean valid depth) of a
  3-D encoding of ``(y, x, z)``.  Encodings without a coordinate path (``pe="none"``, ``"absolute"``) get the
  channel only.
* ``"rgbd-channel"`` -- depth as an input channel only (2-D encoding of ``(y, x)``), any encoding.
* ``"rgbd-coord"`` -- depth as a coordinate only (rotary encodings).  A commuting encoding sees coordinate
  differences only, so this model is blind to absolute distance.

Camera intrinsics.  The scenes' field of view varies (45°–70° vertical), so the same image patch can be a
different metric offset from the optical axis (``x = (u − c_x) z / f``) and the same pixel extent a different
metric size.  The *backbone* never sees ``K``: its position encoding uses patch-grid coordinates (the patch's
pixel position divided by the patch size), exactly as for classification -- normalised pixel coordinates
only.  ``K`` enters the box head in two ways, both identical for every encoding:

* ``intrinsics="focal"`` (default): four per-image numbers, ``[W / (2 f_x), H / (2 f_y), (c_x − (W − 1)/2) /
  f_x, (c_y − (H − 1)/2) / f_y]`` (the half field of view as tangents and the principal point offset; the last
  two are 0 for the generated scenes), concatenated to every token's features.  They are the same for all
  tokens of an image, so they carry no position; they let the head turn pixel extents into metres.
  ``intrinsics="none"``: the head sees the features only.
* ``box_param="ray"`` (default): the head predicts ``[Δx, Δy, z, r1, r2, s]`` and the box centre is
  ``(r_x z + Δx, r_y z + Δy, z)`` with ``(r_x, r_y, 1) = K⁻¹ (u, v, 1)`` the viewing ray of the token's patch
  centre -- each token's default box sits on its own line of sight (the 3-D analogue of OWL-ViT's box bias),
  which makes the Hungarian matching spatially consistent from the first step.  This is a fixed
  reparametrisation, not an input: the features of a model without a position encoding still carry no
  position, so it cannot reason about where things are, but its default boxes are spread over the image.
  ``box_param="direct"``: the head's output is the 12-vector as is (then a model without a position
  encoding cannot localise at all).

The output is in both cases the absolute 12-vector in the camera frame.  The box head's last bias starts at
the mean training box (:meth:`Detector3D.init_box_prior`), so the first predictions sit at the mean depth
with a plausible size and orientation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from torch import Tensor, nn

from ..nn import ViTConfig, VisionTransformer, vit_config

__all__ = ["INPUTS", "INTRINSICS", "BOX_PARAMS", "DetectorConfig", "detector_config", "depth_input_of",
           "is_rotary", "Detector3D", "intrinsics_features", "token_rays", "BoxHead"]

#: ``rgb`` (ViT on colour), ``rgbd`` (ViTD: depth as an input channel and, with a rotary encoding, as the third
#: coordinate), ``rgbd-channel`` (depth as an input channel only), ``rgbd-coord`` (depth as a coordinate only;
#: rotary encodings).
INPUTS = ("rgb", "rgbd", "rgbd-channel", "rgbd-coord")
INTRINSICS = ("focal", "none")
#: ``ray``: the head predicts the box centre's depth and its lateral offset from the token's viewing ray;
#: ``direct``: the head's output is the 12-vector itself.
BOX_PARAMS = ("ray", "direct")
NUM_INTRINSICS = 4


@dataclass
class DetectorConfig:
    """Everything that defines a :class:`Detector3D` (saved with each run).

    Args:
        vit: the backbone (``num_classes`` is ignored: the backbone is built without a classifier).
        num_classes: object classes ``C`` (the class head has ``C + 1`` outputs).
        input: one of :data:`INPUTS`; must agree with ``vit.modality`` (``"image"`` for ``rgb``).
        intrinsics: ``"focal"`` (the box head sees the per-image intrinsics features) or ``"none"``.
        head_hidden: width of the box MLP's two hidden layers (0: the backbone width).
        box_param: ``"ray"`` (centre = the token's viewing ray at the predicted depth + a predicted offset) or
            ``"direct"`` (the head outputs the 12-vector as is).  See the module docstring.
    """

    vit: ViTConfig = field(default_factory=ViTConfig)
    num_classes: int = 4
    input: str = "rgbd"
    intrinsics: str = "focal"
    head_hidden: int = 0
    box_param: str = "ray"

    def validate(self) -> "DetectorConfig":
        if self.input not in INPUTS:
            raise ValueError(f"input must be one of {', '.join(INPUTS)}; got {self.input!r}")
        if self.intrinsics not in INTRINSICS:
            raise ValueError(f"intrinsics must be one of {', '.join(INTRINSICS)}; got {self.intrinsics!r}")
        if self.box_param not in BOX_PARAMS:
            raise ValueError(f"box_param must be one of {', '.join(BOX_PARAMS)}; got {self.box_param!r}")
        want = "image" if self.input == "rgb" else "rgbd"
        if self.vit.modality != want:
            raise ValueError(f"input={self.input!r} needs a backbone with modality={want!r}, got {self.vit.modality!r}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        return self

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["vit"] = self.vit.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DetectorConfig":
        d = dict(d)
        d["vit"] = ViTConfig.from_dict(d["vit"])
        return cls(**d)


def detector_config(pe: str = "cayley", input: str = "rgbd", *, size: str = "tiny", num_classes: int = 4,
                    image_size: int = 64, patch_size: int = 8, intrinsics: str = "focal", head_hidden: int = 0,
                    box_param: str = "ray", depth_scale_init: float = 5.0, **vit_overrides: Any) -> DetectorConfig:
    """A :class:`DetectorConfig` for encoding ``pe`` and input ``input`` on a named ViT size.

    ``depth_scale_init`` is the initial ``a`` of the ViTD lift ``z = a · depth + b`` in coordinate units per
    metre.  With grid coordinates one unit is one patch; a patch of 8 pixels at the scenes' typical depth
    (≈1.3 m, f ≈ 55 px at 64×64) spans ≈0.2 m, so ``a = 5`` makes the three axes roughly isotropic in metres.
    ``vit_overrides`` go to :func:`ropekit.nn.vit_config` (e.g. ``depth=4``).
    """
    if input not in INPUTS:
        raise ValueError(f"input must be one of {', '.join(INPUTS)}; got {input!r}")
    modality = "image" if input == "rgb" else "rgbd"
    extra: Dict[str, Any] = {"cls": "none", "depth_input": depth_input_of(pe, input) or "auto",
                             "depth_scale_init": depth_scale_init}  # (both unused by an RGB backbone)
    vit = vit_config(size, num_classes=0, in_chans=3, image_size=(image_size, image_size), num_frames=None,
                     patch_size=patch_size, pe=pe, modality=modality, **{**extra, **vit_overrides})
    return DetectorConfig(vit=vit, num_classes=num_classes, input=input, intrinsics=intrinsics,
                          head_hidden=head_hidden, box_param=box_param).validate()


def depth_input_of(pe: str, input: str) -> Optional[str]:
    """The backbone's ``depth_input`` for encoding ``pe`` and detector input ``input`` (``None`` for ``rgb``):
    ``rgbd`` is ``"both"`` with a rotary encoding and ``"channel"`` without one (``none``, ``absolute``,
    ``sincos``); ``rgbd-channel`` is ``"channel"``, ``rgbd-coord`` ``"coord"``.

    Raises:
        ValueError: unknown ``input``.
    """
    if input not in INPUTS:
        raise ValueError(f"input must be one of {', '.join(INPUTS)}; got {input!r}")
    if input == "rgb":
        return None
    if input == "rgbd":
        return "both" if is_rotary(pe) else "channel"
    return {"rgbd-channel": "channel", "rgbd-coord": "coord"}[input]


def is_rotary(pe: str) -> bool:
    """Whether ``pe`` names a rotary encoding (one with a coordinate path), as opposed to none / an APE."""
    return ViTConfig(pe=pe).rotary is not None


def intrinsics_features(K: Tensor, height: int, width: int) -> Tensor:
    """Per-image intrinsics features ``(B, 4)`` from ``K (B, 3, 3)``: the half field of view as tangents
    ``W / (2 f_x)``, ``H / (2 f_y)`` and the principal point's offset from the image centre over the focal
    length, ``(c_x − (W − 1)/2) / f_x``, ``(c_y − (H − 1)/2) / f_y`` (OpenCV pixel centres at integers)."""
    fx, fy = K[:, 0, 0], K[:, 1, 1]  # (B,)
    cx, cy = K[:, 0, 2], K[:, 1, 2]
    return torch.stack([width / (2 * fx), height / (2 * fy), (cx - (width - 1) / 2) / fx,
                        (cy - (height - 1) / 2) / fy], dim=-1)  # (B, 4)


def token_rays(K: Tensor, height: int, width: int, patch_size: int) -> Tensor:
    """Viewing rays of the patch centres, ``(B, M, 2)``: ``((u − c_x)/f_x, (v − c_y)/f_y)`` for the centre
    ``(u, v)`` of each patch in row-major token order (a ray ``(r_x, r_y, 1)`` scaled by the depth ``z`` is
    the camera-frame point seen there).  Pixel centres are at integers, so the patch covering columns
    ``p·j … p·j + p − 1`` has ``u = p·j + (p − 1)/2``; a bottom/right remainder is cropped as the patch
    embedding does."""
    gh, gw = height // patch_size, width // patch_size
    dev, dt = K.device, K.dtype
    u = torch.arange(gw, device=dev, dtype=dt) * patch_size + (patch_size - 1) / 2  # (gw,)
    v = torch.arange(gh, device=dev, dtype=dt) * patch_size + (patch_size - 1) / 2  # (gh,)
    vv, uu = torch.meshgrid(v, u, indexing="ij")  # (gh, gw)
    rx = (uu.reshape(1, -1) - K[:, 0, 2:3]) / K[:, 0, 0:1]  # (B, M)
    ry = (vv.reshape(1, -1) - K[:, 1, 2:3]) / K[:, 1, 1:2]  # (B, M)
    return torch.stack([rx, ry], dim=-1)  # (B, M, 2)


class BoxHead(nn.Module):
    """3-layer MLP with GELU: ``(..., in) -> (..., 12)``."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int = 12) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out_dim)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


class Detector3D(nn.Module):
    """ViT / ViTD backbone + per-token class and box heads (see the module docstring).

    >>> model = Detector3D(detector_config("cayley", "rgbd"))
    >>> out = model(x, K)          # x (B, 4, H, W), K (B, 3, 3)   # doctest: +SKIP
    >>> out["logits"].shape, out["boxes"].shape                  # (B, M, C + 1), (B, M, 12)
    """

    def __init__(self, cfg: DetectorConfig) -> None:
        super().__init__()
        cfg = dataclasses.replace(cfg, vit=dataclasses.replace(cfg.vit, num_classes=0)).validate()
        self.backbone = VisionTransformer(cfg.vit)
        self.cfg = dataclasses.replace(cfg, vit=self.backbone.cfg)  # resolved backbone config
        dim = cfg.vit.embed_dim
        self.num_intrinsics = NUM_INTRINSICS if cfg.intrinsics == "focal" else 0
        self.class_head = nn.Linear(dim, cfg.num_classes + 1)
        self.box_head = BoxHead(dim + self.num_intrinsics, cfg.head_hidden or dim)
        for m in (self.class_head, *self.box_head.modules()):
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    @property
    def num_classes(self) -> int:
        return self.cfg.num_classes

    @torch.no_grad()
    def init_box_prior(self, mean_box: Tensor) -> None:
        """Start every token's box at ``mean_box (12,)`` (e.g. the mean training box): the box head's output
        bias is set to it (with ``box_param="ray"`` the lateral entries are offsets from the token's ray and
        start at 0, so each token's first box sits on its own ray at the mean depth)."""
        bias = torch.as_tensor(mean_box, dtype=self.box_head.fc3.bias.dtype).clone()
        if self.cfg.box_param == "ray":
            bias[0:2] = 0.0
        self.box_head.fc3.bias.copy_(bias)

    def no_weight_decay(self) -> set:
        """Backbone parameters excluded from weight decay (encodings, depth lift), with their names here."""
        return {f"backbone.{n}" for n in self.backbone.no_weight_decay()}

    def backbone_input(self, x: Tensor) -> Tensor:
        """The backbone's input: ``(B, 3, H, W)`` for RGB (a depth channel is dropped), ``(B, 4, H, W)`` RGB-D."""
        if x.dim() != 4 or x.shape[1] not in (3, 4):
            raise ValueError(f"expected images (B, 3 or 4, H, W) (RGB then depth), got {tuple(x.shape)}")
        if self.cfg.input == "rgb":
            return x[:, :3]
        if x.shape[1] != 4:
            raise ValueError(f"an RGB-D detector needs (B, 4, H, W) input (RGB then depth), got {tuple(x.shape)}")
        return x

    def forward(self, x: Tensor, K: Optional[Tensor] = None) -> Dict[str, Tensor]:
        """Per-token predictions.

        Args:
            x: ``(B, 4, H, W)`` RGB then depth (``(B, 3, H, W)`` is accepted by an RGB model).
            K: ``(B, 3, 3)`` intrinsics of the images (required with ``intrinsics="focal"`` or
                ``box_param="ray"``).

        Returns:
            ``{"logits": (B, M, C + 1), "boxes": (B, M, 12)}`` (camera-frame boxes).
        """
        inp = self.backbone_input(x)
        if K is None and (self.num_intrinsics or self.cfg.box_param == "ray"):
            raise ValueError("this detector uses the camera intrinsics (intrinsics='focal' or box_param='ray'): "
                             "pass K (B, 3, 3)")
        feats = self.backbone.forward_features(inp)  # (B, M, D) -- mean-pooling config: patch tokens only
        logits = self.class_head(feats)  # (B, M, C + 1)
        head_in = feats
        if self.num_intrinsics:
            intr = intrinsics_features(K.to(feats.dtype), x.shape[-2], x.shape[-1])  # (B, I)
            head_in = torch.cat([feats, intr[:, None, :].expand(-1, feats.shape[1], -1)], dim=-1)  # (B, M, D + I)
        raw = self.box_head(head_in)  # (B, M, 12)
        raw = raw.to(torch.promote_types(raw.dtype, torch.float32))  # box geometry in fp32 (or fp64) under autocast
        if self.cfg.box_param == "direct":
            return {"logits": logits, "boxes": raw}
        rays = token_rays(K.to(raw.dtype), x.shape[-2], x.shape[-1], self.cfg.vit.patch_size)  # (B, M, 2)
        z = raw[..., 2:3]  # (B, M, 1)
        center_xy = rays * z + raw[..., 0:2]  # (B, M, 2): on the token's ray at depth z, plus an offset
        return {"logits": logits, "boxes": torch.cat([center_xy, raw[..., 2:]], dim=-1)}
