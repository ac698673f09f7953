"""Image transforms for training and evaluation on real images: torchvision transforms v2 pipelines.

Shape legend: ``C`` colour channels (3), ``H, W`` the output size.

* :func:`build_train_transform` -- the ImageNet training recipe: RandomResizedCrop, horizontal flip, optional
  RandAugment / TrivialAugment, conversion to float, normalisation, optional random erasing.
* :func:`build_eval_transform` -- resize the short side to ``size / crop_pct``, centre crop ``size``, normalise.

Both take a PIL image or a uint8 tensor ``(C, H_in, W_in)`` (a float tensor in [0, 1] works too) and return
float32 ``(C, H, W)`` normalised with ``mean`` / ``std``. With ``rgbd=True`` they take ``(rgb, depth)``: ``rgb``
as above, ``depth`` float ``(H_in, W_in)`` or ``(1, H_in, W_in)`` metres (0 or NaN invalid), and return float32
``(4, H, W)``: the normalised RGB, then depth in metres, unnormalised. Every geometric step (crop, resize,
flip) is applied to depth identically, with nearest-neighbour interpolation, so no depth value is invented by
blending an edge. Depth is carried as a ``tv_tensors.Mask`` subclass whose resize kernels sample the source pixel
under each output pixel's centre (``"nearest-exact"``, as the image's resize is centred): v2's own mask resize
(``"nearest"``, ``floor(i * scale)``) would shift depth against the image by up to ``(scale - 1) / 2`` source
pixels when shrinking by ``scale``;
colour steps (the colour operations of RandAugment, normalisation, random erasing) touch RGB only. In RGB-D mode
the augmentation policy is restricted to its colour operations, since its shears, rotations and translations
would move RGB without depth (v2's policies refuse a mask).

Randomness comes from torch's global generator, so ``torch.manual_seed`` before a call fixes the draw (the
streaming datasets seed it per sample; see :mod:`ropekit.data.streaming`).
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "build_train_transform", "build_eval_transform", "parse_auto_augment"]

#: ImageNet per-channel mean and std of RGB in [0, 1] (the values timm and torchvision use).
IMAGENET_MEAN: Tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: Tuple[float, float, float] = (0.229, 0.224, 0.225)

SizeArg = Union[int, Sequence[int]]
_INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
_COLOUR_OPS = ("Identity", "Brightness", "Color", "Contrast", "Sharpness", "Posterize", "Solarize", "AutoContrast",
               "Equalize")


def _v2():
    from torchvision.transforms import v2  # local: torchvision is needed only when a transform is built

    return v2


def _size(size: SizeArg) -> Tuple[int, int]:
    hw = (int(size), int(size)) if isinstance(size, int) else tuple(int(s) for s in size)
    if len(hw) != 2 or min(hw) <= 0:
        raise ValueError(f"size must be a positive int or (H, W), got {size!r}")
    return hw  # type: ignore[return-value]


def _interpolation(name: str) -> Any:
    from torchvision.transforms import InterpolationMode

    if str(name).lower() not in _INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {_INTERPOLATIONS}, got {name!r}")
    return InterpolationMode(str(name).lower())


def parse_auto_augment(spec: Optional[str]) -> Optional[Dict[str, Any]]:
    """Read an augmentation policy name: ``None`` / ``"none"``, ``"randaugment"`` (2 ops, magnitude 9),
    ``"trivialaugment"``, or timm's ``"rand-m9-n2-mstd0.5"`` style (``m`` magnitude 0..30, ``n`` ops; ``mstd`` and
    ``inc`` are accepted and ignored with a warning, as torchvision's RandAugment draws no magnitude noise).

    Returns:
        ``None`` or ``{"policy": "rand", "num_ops": n, "magnitude": m}`` / ``{"policy": "trivial"}``.
    """
    if spec is None or str(spec).strip().lower() in ("", "none", "off"):
        return None
    s = str(spec).strip().lower()
    if s in ("trivialaugment", "trivial", "ta-wide"):
        return {"policy": "trivial"}
    if s in ("randaugment", "rand"):
        return {"policy": "rand", "num_ops": 2, "magnitude": 9}
    parts = s.split("-")
    if parts[0] != "rand":
        raise ValueError(f"auto_augment must be None, 'randaugment', 'trivialaugment' or 'rand-m9-n2' style, "
                         f"got {spec!r}")
    out: Dict[str, Any] = {"policy": "rand", "num_ops": 2, "magnitude": 9}
    ignored = []
    for part in parts[1:]:
        m = re.fullmatch(r"(m|n|mstd|inc|mmax)([0-9.]+)", part)
        if m is None:
            raise ValueError(f"auto_augment {spec!r}: cannot read {part!r} (expected m<int>, n<int>, mstd<float>)")
        key, value = m.groups()
        if key == "m":
            out["magnitude"] = int(float(value))
        elif key == "n":
            out["num_ops"] = int(float(value))
        else:
            ignored.append(part)
    if not 0 <= out["magnitude"] <= 30 or out["num_ops"] < 1:
        raise ValueError(f"auto_augment {spec!r}: magnitude must be in 0..30 and n >= 1")
    if ignored:
        warnings.warn(f"auto_augment {spec!r}: {', '.join(ignored)} ignored (torchvision's RandAugment uses a "
                      "fixed magnitude)", stacklevel=3)
    return out


def _augment_policy(spec: Optional[str], interpolation: Any, colour_only: bool) -> Optional[Callable]:
    v2 = _v2()
    p = parse_auto_augment(spec)
    if p is None:
        return None
    if p["policy"] == "trivial":
        cls = v2.TrivialAugmentWide
        kw: Dict[str, Any] = {}
    else:
        cls = v2.RandAugment
        kw = {"num_ops": p["num_ops"], "magnitude": p["magnitude"]}
    if colour_only:
        space = {k: v for k, v in cls._AUGMENTATION_SPACE.items() if k in _COLOUR_OPS}
        cls = type(f"Colour{cls.__name__}", (cls,), {"_AUGMENTATION_SPACE": space})
    # the policy's shears and rotations on tensors support nearest and bilinear only
    from torchvision.transforms import InterpolationMode

    if interpolation == InterpolationMode.BICUBIC:
        interpolation = InterpolationMode.BILINEAR
    return cls(interpolation=interpolation, **kw)


def _stats(mean: Sequence[float], std: Sequence[float]) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    mean, std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"mean and std must be 3 values each (std > 0), got {mean} and {std}")
    return mean, std


@functools.lru_cache(maxsize=None)
def _depth_type() -> type:
    """A ``tv_tensors.Mask`` subclass for depth maps, with resize kernels that use ``"nearest-exact"`` (registered
    once, through torchvision's public ``register_kernel``); flips, crops and pads are the mask's (exact copies)."""
    from torchvision import tv_tensors
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    class Depth(tv_tensors.Mask):
        pass

    def resize(depth: Tensor, size: Any, interpolation: Any = None, max_size: Any = None,
               antialias: Any = True) -> Tensor:
        out = TF.resize_image(depth.as_subclass(Tensor), size, interpolation=InterpolationMode.NEAREST_EXACT,
                              max_size=max_size)
        return tv_tensors.wrap(out, like=depth)

    def resized_crop(depth: Tensor, top: int, left: int, height: int, width: int, size: Any, interpolation: Any = None,
                     antialias: Any = True) -> Tensor:
        out = TF.crop_image(depth.as_subclass(Tensor), top, left, height, width)  # (1, h, w), zero-padded outside
        out = TF.resize_image(out, size, interpolation=InterpolationMode.NEAREST_EXACT)
        return tv_tensors.wrap(out, like=depth)

    TF.register_kernel(TF.resize, Depth)(resize)
    TF.register_kernel(TF.resized_crop, Depth)(resized_crop)
    return Depth


class _RGBDTransform:
    """``(rgb, depth) -> (4, H, W)``: ``geometric`` applied jointly (depth as a Mask), ``colour`` to RGB only."""

    def __init__(self, geometric: Callable, colour: Callable) -> None:
        self.geometric = geometric
        self.colour = colour

    def __call__(self, sample: Any) -> Tensor:
        v2 = _v2()
        if isinstance(sample, Tensor):  # an in-memory (4, H, W) sample: RGB in [0, 1], then depth
            rgb, depth = sample[:3], sample[3]
        else:
            rgb, depth = sample
        depth = torch.as_tensor(depth, dtype=torch.float32)
        if depth.ndim == 2:
            depth = depth[None]
        if depth.ndim != 3 or depth.shape[0] != 1:
            raise ValueError(f"depth must be (H, W) or (1, H, W), got shape {tuple(depth.shape)}")
        image = v2.functional.to_image(rgb)
        if tuple(image.shape[-2:]) != tuple(depth.shape[-2:]):
            raise ValueError(f"RGB {tuple(image.shape[-2:])} and depth {tuple(depth.shape[-2:])} differ in size")
        image, mask = self.geometric(image, _depth_type()(depth))
        return torch.cat([self.colour(image), mask.as_subclass(Tensor).float()], dim=0)  # (3+1, H, W)


def build_train_transform(
    size: SizeArg,
    *,
    scale: Tuple[float, float] = (0.08, 1.0),
    ratio: Tuple[float, float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    auto_augment: Optional[str] = None,
    random_erasing: float = 0.0,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    interpolation: str = "bicubic",
    rgbd: bool = False,
) -> Callable[[Any], Tensor]:
    """The training transform: RandomResizedCrop(size, scale, ratio) → flip → [policy] → float → normalise →
    [random erasing].

    Args:
        size: output ``H = W`` (int) or ``(H, W)``.
        scale, ratio: RandomResizedCrop's area fraction and aspect-ratio ranges.
        hflip: probability of a horizontal flip (0 disables).
        auto_augment: ``None``, ``"randaugment"``, ``"trivialaugment"`` or ``"rand-m9-n2-mstd0.5"`` style (see
            :func:`parse_auto_augment`).
        random_erasing: probability of erasing one random rectangle (after normalisation, value 0; 0 disables).
        mean, std: per-channel statistics of RGB in [0, 1] (default ImageNet's).
        interpolation: of the crop's resize: ``"bicubic"`` (default), ``"bilinear"`` or ``"nearest"``;
            antialiased. The policy's shears and rotations use bilinear in place of bicubic.
        rgbd: take ``(rgb, depth)`` and return ``(4, H, W)`` (see the module docstring).

    Returns:
        a callable: PIL image or uint8 ``(3, H_in, W_in)`` tensor → float32 ``(3, H, W)``; with ``rgbd``,
        ``(rgb, depth)`` or a float ``(4, H_in, W_in)`` tensor → float32 ``(4, H, W)``.
    """
    v2 = _v2()
    hw = _size(size)
    mean, std = _stats(mean, std)
    interp = _interpolation(interpolation)
    if not 0.0 <= hflip <= 1.0 or not 0.0 <= random_erasing <= 1.0:
        raise ValueError(f"hflip and random_erasing are probabilities, got {hflip} and {random_erasing}")
    if not 0 < scale[0] <= scale[1] <= 1 or not 0 < ratio[0] <= ratio[1]:
        raise ValueError(f"scale must satisfy 0 < lo <= hi <= 1 and ratio 0 < lo <= hi, got {scale}, {ratio}")
    geometric = [v2.RandomResizedCrop(hw, scale=tuple(scale), ratio=tuple(ratio), interpolation=interp,
                                      antialias=True)]
    if hflip > 0:
        geometric.append(v2.RandomHorizontalFlip(hflip))
    policy = _augment_policy(auto_augment, interp, colour_only=rgbd)
    colour = [policy] if policy is not None else []
    colour += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    if random_erasing > 0:
        colour.append(v2.RandomErasing(random_erasing, value=0))
    if rgbd:
        return _RGBDTransform(v2.Compose(geometric), v2.Compose(colour))
    return v2.Compose([v2.ToImage(), *geometric, *colour])


def build_eval_transform(
    size: SizeArg,
    *,
    crop_pct: float = 0.875,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    interpolation: str = "bicubic",
    rgbd: bool = False,
) -> Callable[[Any], Tensor]:
    """The evaluation transform: resize the short side to ``size / crop_pct`` → centre crop ``size`` → float →
    normalise.

    Args:
        size: output ``H = W`` (int) or ``(H, W)``; the resize target is ``int(H / crop_pct)`` (for ``(H, W)``,
            both sides scaled by ``1 / crop_pct``).
        crop_pct: in ``(0, 1]``; 0.875 gives the classic 256 → 224.
        mean, std, interpolation, rgbd: as in :func:`build_train_transform`.

    Returns:
        a callable with the input and output of :func:`build_train_transform`'s.
    """
    v2 = _v2()
    hw = _size(size)
    mean, std = _stats(mean, std)
    if not 0.0 < crop_pct <= 1.0:
        raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
    interp = _interpolation(interpolation)
    if hw[0] == hw[1]:
        resize: Any = int(hw[0] / crop_pct)  # short side
    else:
        resize = [int(hw[0] / crop_pct), int(hw[1] / crop_pct)]
    geometric = v2.Compose([v2.Resize(resize, interpolation=interp, antialias=True), v2.CenterCrop(hw)])
    colour = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])
    if rgbd:
        return _RGBDTransform(geometric, colour)
    return v2.Compose([v2.ToImage(), geometric, colour])
