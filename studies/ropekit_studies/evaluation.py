"""Evaluation helpers shared by the studies: logits under coordinate offsets, patch shuffling, pixel shifts.

Shape legend: ``N`` examples, ``B`` batch, ``C`` channels, ``T, H, W`` frames / pixels, ``K`` classes,
``c`` coordinate dimension, ``p`` patch size, ``tt`` tubelet length, ``g`` the token grid.

Offsets and shifts are given in *patch units* (one unit = one patch, or one tubelet along time) and converted
to the model's coordinate units with :func:`ropekit.nn.patch_units` (the identity for ``coords="grid"``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ropekit.nn import VisionTransformer, patch_units

__all__ = ["predict", "accuracy", "mean_loss", "token_grid", "coord_scale", "random_offsets", "shuffle_patches",
           "shift_images", "pad_or_crop", "background_value", "has_coordinate_path",
           "is_offset_invariant", "summarize_logit_change"]


@torch.no_grad()
def predict(model: VisionTransformer, images: Tensor, *, offsets: Optional[Tensor] = None,
            batch_size: int = 250) -> Tensor:
    """Logits ``(N, K)`` (float64) of ``images`` ``(N, ...)``; ``offsets``: ``(N, c)`` or ``(c,)`` coordinate shifts."""
    model.eval()
    if offsets is not None and offsets.dim() == 1:
        # one shift for every image, passed per example: the model's (c,) form broadcasts to (1, M, c)
        # per-example coordinates, which the encodings reject for batches larger than one
        offsets = offsets.expand(images.shape[0], -1)
    out = []
    for i in range(0, images.shape[0], batch_size):
        x = images[i:i + batch_size]
        off = offsets[i:i + batch_size] if offsets is not None else None
        out.append(model(x, coord_offset=off).double())
    return torch.cat(out)


def accuracy(logits: Tensor, labels: Tensor) -> float:
    return float((logits.argmax(-1) == labels).double().mean())


def mean_loss(logits: Tensor, labels: Tensor) -> float:
    return float(F.cross_entropy(logits.double(), labels))


def token_grid(model: VisionTransformer, sample_shape: Sequence[int]) -> Tuple[int, ...]:
    """The token grid of one input of shape ``(C, H, W)`` or ``(C, T, H, W)``."""
    cfg = model.cfg
    p = cfg.patch_size
    if cfg.modality == "video":
        _, t, h, w = sample_shape
        return (t // cfg.tubelet_size, h // p, w // p)
    h, w = sample_shape[-2:]
    return (h // p, w // p)


def coord_scale(model: VisionTransformer, sample_shape: Sequence[int]) -> Tensor:
    """Coordinate units per patch along each coordinate axis, ``(c,)`` (the depth axis of RGB-D: 1)."""
    units = patch_units(token_grid(model, sample_shape), model.cfg.coords)
    units = units + [1.0] * (model.coord_dim - len(units))
    return torch.tensor(units, dtype=torch.float32)


def random_offsets(n: int, coord_dim: int, rho: float, seed: int) -> Tensor:
    """One offset per example drawn from ``N(0, rho^2 I)``: ``(n, c)`` (patch units), seeded."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(n, coord_dim, generator=g) * float(rho)


def has_coordinate_path(model: VisionTransformer) -> bool:
    """``False`` for ``none`` / ``absolute`` models, which take no token coordinates (offsets do nothing)."""
    return model.cfg.rotary is not None


def is_offset_invariant(model: VisionTransformer) -> bool:
    """Whether theory says the logits cannot change under a global coordinate offset: a commuting rotary
    encoding with mean pooling or a centroid CLS token."""
    if not has_coordinate_path(model):
        return False
    return all(bool(pe.commuting) for pe in model.encodings) and model.cfg.cls in ("none", "centroid")


def shuffle_patches(x: Tensor, patch_size: int, *, tubelet_size: Optional[int] = None,
                    generator: Optional[torch.Generator] = None) -> Tensor:
    """Permute the patches (tubelets for video, so frames move too) of every example, pixels included.

    The coordinate grid is unchanged (the model still assigns coordinates by position), so a model that uses
    position sees a scrambled input; a model without position information sees the same bag of tokens.

    Args:
        x: ``(B, C, H, W)`` or ``(B, C, T, H, W)``; sizes are cropped to a multiple of the patch (tubelet).
        patch_size: ``p``; tubelet_size: ``tt`` (video).

    Returns:
        the shuffled inputs, same shape as the cropped ``x`` (one independent permutation per example).
    """
    p = int(patch_size)
    if x.dim() == 4:
        b, c, h, w = x.shape
        gh, gw = h // p, w // p
        x = x[..., :gh * p, :gw * p]
        tok = x.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c, p, p)  # (B, M, C, p, p)
        perm = torch.argsort(torch.rand(b, gh * gw, generator=generator), dim=1)  # (B, M)
        tok = tok[torch.arange(b)[:, None], perm]
        return tok.reshape(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, gh * p, gw * p)
    if x.dim() == 5:
        tt = int(tubelet_size or 1)
        b, c, t, h, w = x.shape
        gt, gh, gw = t // tt, h // p, w // p
        x = x[:, :, :gt * tt, :gh * p, :gw * p]
        tok = x.reshape(b, c, gt, tt, gh, p, gw, p).permute(0, 2, 4, 6, 1, 3, 5, 7)  # (B, gt, gh, gw, C, tt, p, p)
        tok = tok.reshape(b, gt * gh * gw, c, tt, p, p)
        perm = torch.argsort(torch.rand(b, gt * gh * gw, generator=generator), dim=1)
        tok = tok[torch.arange(b)[:, None], perm]
        tok = tok.reshape(b, gt, gh, gw, c, tt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)  # (B, C, gt, tt, gh, p, gw, p)
        return tok.reshape(b, c, gt * tt, gh * p, gw * p)
    raise ValueError(f"expected (B, C, H, W) or (B, C, T, H, W), got {tuple(x.shape)}")


def _shift_axis(x: Tensor, shift: float, dim: int) -> Tensor:
    """``out[i] = x[i - shift]`` along ``dim``: linear between the two integer shifts, zero outside."""
    lo = int(torch.floor(torch.tensor(float(shift))))
    frac = float(shift) - lo

    def integer(s: int) -> Tensor:
        n = x.shape[dim]
        out = torch.zeros_like(x)
        if abs(s) >= n:
            return out
        src = x.narrow(dim, max(0, -s), n - abs(s))
        out.narrow(dim, max(0, s), n - abs(s)).copy_(src)
        return out

    if frac == 0.0:
        return integer(lo)
    return (1.0 - frac) * integer(lo) + frac * integer(lo + 1)


def shift_images(x: Tensor, dy: float, dx: float) -> Tensor:
    """Translate images ``(B, C, H, W)`` (or clips ``(B, C, T, H, W)``, every frame) by ``(dy, dx)`` pixels:
    ``out[..., i, j] = x[..., i - dy, j - dx]``, bilinear for fractional shifts (separable linear
    interpolation between the neighbouring integer shifts), zero fill at the border. Integer shifts are exact."""
    if dy == 0 and dx == 0:
        return x
    return _shift_axis(_shift_axis(x, dy, x.dim() - 2), dx, x.dim() - 1)


def pad_or_crop(x: Tensor, size: Sequence[int], align: int = 1) -> Tensor:
    """Place ``x`` (``(..., H, W)``) centred on a zero canvas of ``size = (H', W')``, cropping centrally when
    smaller: the content keeps its pixel scale (unlike resizing), only the field of view changes.

    ``align``: the pad / crop offsets are rounded down to multiples of it (the patch size keeps the content on
    the same patch boundaries as in training)."""
    h, w = x.shape[-2:]
    nh, nw = int(size[0]), int(size[1])
    out = x.new_zeros(*x.shape[:-2], nh, nw)
    a = max(1, int(align))
    sh, sw = max(0, (h - nh) // 2) // a * a, max(0, (w - nw) // 2) // a * a  # crop offsets in x
    dh, dw = max(0, (nh - h) // 2) // a * a, max(0, (nw - w) // 2) // a * a  # paste offsets in out
    ch, cw = min(h, nh), min(w, nw)
    out[..., dh:dh + ch, dw:dw + cw] = x[..., sh:sh + ch, sw:sw + cw]
    return out


def background_value(info: Any, channels: int) -> Tensor:
    """The value of an empty (black) pixel in a dataset's tensors, ``(C,)``: ``-mean / std`` per channel when the
    dataset is normalised (``info.mean`` / ``info.std`` set), else 0. Padding or shifting normalised images must
    fill with it, not with 0 (which is the mean colour there)."""
    mean, std = getattr(info, "mean", None), getattr(info, "std", None)
    if mean is None or std is None:
        return torch.zeros(channels)
    return -torch.tensor(mean, dtype=torch.float32)[:channels] / torch.tensor(std, dtype=torch.float32)[:channels]


def summarize_logit_change(reference: Tensor, changed: Tensor) -> Dict[str, float]:
    """``max |changed - reference|`` over all logits, and the mean per-example L2 norm of the change."""
    diff = (changed - reference).abs()
    return {"max_abs": float(diff.max()) if diff.numel() else 0.0,
            "mean_l2": float(torch.linalg.vector_norm(changed - reference, dim=-1).mean())}
