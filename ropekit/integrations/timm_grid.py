"""The patch coordinates a timm model converted by :func:`ropekit.integrations.timm.apply_pe` hands its encodings:
:class:`TimmGrid` (how the model's own rotary embedding places the patches: offset, reference-grid rescaling,
DINOv3's normalisation, timm's coordinate augmentation) and :class:`GridCoordinates`, the module that replaces an
``Eva`` model's ``rope`` and returns those coordinates ``(gh * gw, 2)`` for the input's patch grid ``(gh, gw)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from .._optional import require
from ..nn.coords import grid_coords

require("timm", "timm", "ropekit.integrations.timm")

#: timm's own grid builder and coordinate augmentation (timm >= 1.0.31), or ``None`` (older timm: integer patch
#: indices only).
try:
    from timm.layers.pos_embed_sincos import _apply_coord_augs as apply_coord_augs
    from timm.layers.pos_embed_sincos import _build_grid as build_grid
except ImportError:  # pragma: no cover - depends on the timm version
    apply_coord_augs = build_grid = None

__all__ = ["GridCoordinates", "TimmGrid", "build_grid", "apply_coord_augs"]


class GridCoordinates(nn.Module):
    """Replaces an ``Eva`` model's ``rope``: ``get_embed(shape=(gh, gw))`` returns the patch coordinates
    ``(gh * gw, 2)`` (row-major, ``(row, col)``) that ``Eva`` then hands to every block.

    With ``mode="grid"`` the coordinate of row ``i`` is ``(i + offset) * ref[0] / gh`` (columns alike) when a
    reference grid ``ref_shape`` is given, else ``i + offset``: this is how timm's EVA rotary embedding places the
    patches (a fine-tuned EVA02 at another resolution keeps the coordinate range of its pre-training grid), so an
    encoding initialised from the model's own rotary embedding sees the same coordinates.

    ``timm_grid`` (a :class:`TimmGrid`, set when the encoding starts as the model's own rotary embedding) instead
    builds the coordinates with timm's own grid function -- integer indices, DINOv3's patch centres normalised to
    ``[-1, 1]`` per axis, or pixel grids, with timm's offset and reference grid -- and, in training mode, applies
    timm's coordinate augmentation (``rope_shift_coords``, ``rope_jitter_coords``, ``rope_rescale_coords``) with
    timm's random draws in timm's order, so the converted model trains on the coordinates the original would.
    """

    def __init__(self, mode: str, feat_shape: Sequence[int], offset: float = 0.0,
                 ref_shape: Optional[Sequence[int]] = None, timm_grid: Optional["TimmGrid"] = None,
                 extra_axes: int = 0) -> None:
        super().__init__()
        if mode != "grid" and (offset or ref_shape is not None or timm_grid is not None):
            raise ValueError("offset, ref_shape and timm_grid apply to mode='grid' only")
        self.mode = mode
        self.feat_shape = list(feat_shape)
        self.offset = float(offset)
        self.ref_shape = None if ref_shape is None else [int(r) for r in ref_shape]
        self.timm_grid = timm_grid
        self.extra_axes = int(extra_axes)
        self.pending_extra: Optional[Tensor] = None  # set by RopeEva.forward_features for one call
        self.register_buffer("_anchor", torch.empty(0), persistent=False)  # follows .to(device)

    def get_embed(self, shape: Optional[Sequence[int]] = None) -> Tensor:
        """``(M, 2 + extra_axes)``, or ``(B, M, 2 + extra_axes)`` with per-example extra coordinates."""
        coords = self._grid(self.feat_shape if shape is None else shape)  # (M, 2)
        if self.extra_axes == 0:
            return coords
        extra = self.pending_extra
        if extra is None:
            return torch.cat([coords, coords.new_zeros(coords.shape[0], self.extra_axes)], dim=-1)
        extra = extra.to(device=coords.device, dtype=coords.dtype)
        if extra.shape[-2:] != (coords.shape[0], self.extra_axes):
            raise ValueError(f"extra_coords must be (M, {self.extra_axes}) or (B, M, {self.extra_axes}) with "
                             f"M = {coords.shape[0]} patches, got {tuple(extra.shape)}")
        return torch.cat([coords.expand(*extra.shape[:-1], 2), extra], dim=-1)

    def _grid(self, grid: Sequence[int]) -> Tensor:
        if self.timm_grid is not None:
            return self.timm_grid.coords(grid, self.training, self._anchor.device)
        coords = grid_coords(grid, self.mode, device=self._anchor.device)  # (M, 2)
        if self.offset:
            coords = coords + self.offset
        if self.ref_shape is not None:
            scale = torch.tensor([r / int(g) for r, g in zip(self.ref_shape, grid)], device=coords.device)
            coords = coords * scale
        return coords

    def update_feat_shape(self, feat_shape: Sequence[int]) -> None:
        """Called by ``Eva.set_input_size``: the grid of a model without ``dynamic_img_size``."""
        self.feat_shape = list(feat_shape)

    def extra_repr(self) -> str:
        extra = f", offset={self.offset}" if self.offset else ""
        if self.ref_shape is not None:
            extra += f", ref_shape={tuple(self.ref_shape)}"
        if self.timm_grid is not None:
            extra += f", timm_grid={self.timm_grid}"
        if self.extra_axes:
            extra += f", extra_axes={self.extra_axes}"
        return f"mode={self.mode!r}, feat_shape={tuple(self.feat_shape)}{extra}"


@dataclass
class TimmGrid:
    """How a timm rotary embedding places the patches: the arguments of timm's grid builder
    (``grid_type`` ``"index"`` / ``"centered"`` / ``"pixel"``, ``ref_feat_shape``, ``grid_offset``,
    ``grid_indexing``, ``normalize_coords``) and its train-time augmentation (``shift``, ``jitter``, ``rescale``;
    ``None`` when off)."""

    grid_type: str = "index"
    ref_feat_shape: Optional[Sequence[int]] = None
    grid_offset: float = 0.0
    grid_indexing: str = "ij"
    normalize_coords: str = "separate"
    shift: Optional[float] = None
    jitter: Optional[float] = None
    rescale: Optional[float] = None

    @property
    def augments(self) -> bool:
        return self.shift is not None or self.jitter is not None or self.rescale is not None

    def coords(self, shape: Sequence[int], training: bool, device: torch.device) -> Tensor:
        """Patch coordinates ``(gh * gw, 2)`` float32, ``(row, col)``, as timm computes them for grid ``shape``
        (augmented when ``training``: one draw per call, like timm's ``get_embed``)."""
        if build_grid is None:  # older timm: integer indices (checked at conversion), as timm builds them
            coords = grid_coords(shape, "grid", device=device) + self.grid_offset  # (M, 2) = (row, col)
            if self.ref_feat_shape is not None:
                scale = [r / int(g) for r, g in zip(self.ref_feat_shape, shape)]  # (H, W) order for "ij" and "xy"
                coords = coords * torch.tensor(scale, device=device)
            return coords
        grid = build_grid([int(s) for s in shape], grid_type=self.grid_type,
                           ref_feat_shape=None if self.ref_feat_shape is None else list(self.ref_feat_shape),
                           grid_offset=self.grid_offset, grid_indexing=self.grid_indexing,
                           normalize_coords=self.normalize_coords)  # (gh, gw, 2), timm's channel order
        grid = grid.reshape(-1, 2)  # (M, 2)
        if training and self.augments:
            grid = apply_coord_augs(grid, self.shift, self.jitter, self.rescale)
        if self.grid_indexing == "xy":  # timm's first channel is then the column
            grid = grid.flip(-1)
        return grid.to(device)
