"""A timm ``Eva`` model's own rotary embedding in ropekit's terms: reading its frequencies (:func:`read_timm_rope`),
deciding whether a ropekit encoding can hold it exactly (:func:`plan_keep_rope`), setting an encoding to it
(:func:`keep_rope_`) and checking the result against timm's own rotation (:func:`check_keeps_rope`); used by
``apply_pe(..., init_identity=True)``.

Shape legend: ``L`` layers, ``Hs`` heads with their own frequencies, ``d`` head dimension.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

from .._optional import require
from ..encodings import PositionEncoding, create_pe
from ..encodings.rope import MixedRoPE

require("timm", "timm", "ropekit.integrations.timm")
from timm.layers.pos_embed_sincos import apply_rot_embed_cat as _apply_rot_embed_cat  # noqa: E402

from . import timm_grid  # noqa: E402
from .timm_grid import GridCoordinates, TimmGrid  # noqa: E402

__all__ = ["CannotKeep", "TimmRope", "read_timm_rope", "check_grid_supported", "keep_rope_", "timm_rotation",
           "check_keeps_rope", "warn_rope_removed", "plan_keep_rope"]


class CannotKeep(Exception):
    """The model's own rotary embedding cannot be reproduced by the requested encoding (the message says why)."""


@dataclass
class TimmRope:
    """An ``Eva`` model's rotary embedding in ropekit's terms.

    ``freqs`` ``(L, Hs, 2, d/2)``: frequencies of interleaved pair ``n`` along ``(row, col)``, per layer (``L`` 1 when
    every layer has the same) and per head (``Hs`` 1 when every head has the same); ``perm`` ``(d,)`` or ``None``:
    the channel order that turns timm's pairs into interleaved ones; ``grid``: the coordinates (see
    :class:`TimmGrid`).
    """

    freqs: Tensor
    perm: Optional[Tensor]
    grid: TimmGrid


def read_timm_rope(model: nn.Module, head_dim: int) -> TimmRope:
    """Read timm's rotary embedding ``model.rope`` (``RotaryEmbeddingCat``: EVA02, timm's SBB and Perception Encoder
    ViTs; ``RotaryEmbeddingDinoV3``: DINOv3; ``RotaryEmbeddingMixed``: rope-vit's RoPE-Mixed) as ropekit
    frequencies.

    Raises:
        CannotKeep: another kind of rotary embedding (timm's multimodal RoPE) or an unsupported option.
    """
    rope = model.rope
    kind = type(rope).__name__
    indexing = getattr(rope, "grid_indexing", "ij")
    if indexing not in ("ij", "xy"):
        raise CannotKeep(f"unknown grid indexing {indexing!r}")
    half = bool(getattr(model.blocks[0].attn, "rotate_half", False))
    d2 = head_dim // 2
    perm = torch.stack([torch.arange(d2), torch.arange(d2) + d2], -1).reshape(-1) if half else None
    aug = dict(shift=getattr(rope, "shift_coords", None), jitter=getattr(rope, "jitter_coords", None),
               rescale=getattr(rope, "rescale_coords", None))
    first, second = (0, 1) if indexing == "ij" else (1, 0)  # timm's first coordinate channel is the row for "ij"
    nb = head_dim // 4
    if kind in ("RotaryEmbeddingCat", "RotaryEmbeddingDinoV3"):
        if kind == "RotaryEmbeddingCat":
            grid_type = getattr(rope, "grid_type", None) or ("pixel" if getattr(rope, "in_pixels", True) else "index")
            bands = getattr(rope, "bands", None)
            if bands is None:  # older timm keeps only the cached table when the grid is fixed: rebuild the bands
                if grid_type != "index":
                    raise CannotKeep("its rotary embedding keeps only a cached table, not its frequency bands")
                from timm.layers.pos_embed_sincos import freq_bands
                bands = freq_bands(nb, temperature=float(rope.temperature), step=1)
            bands = bands.detach().float().cpu()  # angle = coordinate * band
            ref = getattr(rope, "ref_feat_shape", None)
        else:  # DINOv3: angle = 2 pi coordinate / period, coordinates the patch centres in [-1, 1]
            grid_type, ref = "centered", None
            bands = (2 * torch.pi / rope.periods.detach().double().cpu()).float()
        if bands.numel() != nb or 4 * nb != head_dim:
            raise CannotKeep(f"{bands.numel()} frequency bands for head_dim {head_dim} (expected head_dim / 4)")
        freqs = torch.zeros(2, d2)
        freqs[first, :nb] = bands  # timm's angles: (channel 0 bands, channel 1 bands)
        freqs[second, nb:] = bands
        grid = TimmGrid(grid_type, None if ref is None else [int(r) for r in ref],
                        float(getattr(rope, "grid_offset", 0.0) or 0.0), indexing,
                        str(getattr(rope, "normalize_coords", None) or "separate"), **aug)
        check_grid_supported(grid)
        return TimmRope(freqs[None, None], perm, grid)
    if kind == "RotaryEmbeddingMixed":
        f = rope.freqs.detach().float().cpu()  # (2, L, H, d/2): multiplies (t_x, t_y), timm's channels 0 and 1
        freqs = torch.zeros(f.shape[1], f.shape[2], 2, f.shape[3])
        freqs[:, :, first] = f[0]
        freqs[:, :, second] = f[1]
        grid = TimmGrid("index", None, 0.0, indexing, **aug)
        check_grid_supported(grid)
        return TimmRope(freqs, perm, grid)
    raise CannotKeep(f"its rotary embedding {kind} is not one ropekit reproduces (RotaryEmbeddingCat, "
                      f"RotaryEmbeddingMixed and RotaryEmbeddingDinoV3 are)")


def check_grid_supported(grid: TimmGrid) -> None:
    """Older timm (before 1.0.31) has no grid builder to reuse: only integer grids without augmentation."""
    if timm_grid.build_grid is None and (grid.grid_type != "index" or grid.augments):
        raise CannotKeep(f"its {grid.grid_type!r} coordinate grid or coordinate augmentation needs timm >= 1.0.31 "
                          f"to be reproduced")


def keep_rope_(pe: PositionEncoding, rope: TimmRope, layer: int) -> None:
    """Set ``pe`` to the model's own rotary embedding of block ``layer``: every parameter zero (no post-rotation),
    then the frequencies."""
    freqs = rope.freqs[layer if rope.freqs.shape[0] > 1 else 0]  # (Hs, 2, d/2)
    with torch.no_grad():
        for p in pe.parameters():
            p.zero_()
        target = pe.freq_param
        target.copy_(freqs.to(target).expand_as(target))


def timm_rotation(model: nn.Module, layer: int, grid: Sequence[int], x: Tensor) -> Tensor:
    """Block ``layer``'s rotation by timm's own rotary embedding applied to ``x`` ``(1, H, M, d)`` on ``grid``."""
    rope, attn = model.rope, model.blocks[layer].attn
    was = rope.training
    rope.eval()  # no train-time coordinate augmentation
    try:
        if type(rope).__name__ == "RotaryEmbeddingMixed":
            emb = rope.get_embed(shape=list(grid))[layer]  # (H, M, 2d)
        elif getattr(rope, "feat_shape", None) is not None:
            emb = rope.get_embed()  # (M, 2d), cached for the model's grid
        else:
            emb = rope.get_embed(shape=list(grid))
    finally:
        rope.train(was)
    x = x.to(emb.device)
    return _apply_rot_embed_cat(x, emb.float(), half=bool(getattr(attn, "rotate_half", False)))


def check_keeps_rope(model: nn.Module, pes: List[PositionEncoding], rope: TimmRope,
                      coords: GridCoordinates) -> Optional[str]:
    """``None`` if every block's encoding rotates probe queries as timm's rotary embedding does, else the reason."""
    grid = list(getattr(model.rope, "feat_shape", None) or model.patch_embed.grid_size)
    gen = torch.Generator().manual_seed(0)
    heads, d = pes[0].num_heads, pes[0].head_dim
    m = int(torch.tensor(grid).prod())
    x = torch.randn(1, heads, m, d, generator=gen)
    was = coords.training
    coords.eval()  # the coordinates without train-time augmentation
    r = coords.get_embed(grid).cpu()  # (M, 2)
    coords.train(was)
    perm = rope.perm
    for i, pe in enumerate(pes):
        with torch.no_grad():
            ref = timm_rotation(model, i, grid, x).cpu()
            xp = x if perm is None else x[..., perm]
            ref = ref if perm is None else ref[..., perm]
            got = copy.deepcopy(pe).float().cpu().rotate(xp, r)
            err = float((got - ref).abs().max())
        if not err <= 1e-4:
            return f"block {i}: the encoding differs from the model's rotary embedding by {err:.1e} on a probe"
    return None


def warn_rope_removed(model: nn.Module, name: str, reason: str) -> None:
    warnings.warn(f"apply_pe(init_identity=True) cannot keep this {type(model).__name__} model's own rotary position "
                  f"embedding as a {name!r} encoding: {reason}. The converted model does NOT compute what the original "
                  f"did: its rotary embedding is replaced by an identity {name!r} encoding.", UserWarning, stacklevel=3)


def plan_keep_rope(model: nn.Module, name: str, sharing: str, coords: str, prefix: str,
                    pe_opts: Dict[str, Any], coord_dim: int = 2) -> TimmRope:
    """The model's rotary embedding, if a ``name`` encoding with these options can hold it exactly.

    Raises:
        CannotKeep: with the reason it cannot.
    """
    attn = model.blocks[0].attn
    rope = read_timm_rope(model, attn.head_dim)
    probe = create_pe(name, head_dim=attn.head_dim, coord_dim=coord_dim, num_heads=attn.num_heads, **pe_opts)
    freq = getattr(probe, "freq_param", None)
    if not isinstance(probe, MixedRoPE) or not isinstance(freq, nn.Parameter) or \
            tuple(freq.shape[-2:]) != (coord_dim, attn.head_dim // 2):
        raise CannotKeep("only encodings with a learnable frequency for every pair and axis that start as plain "
                          "RoPE ('mixed', 'cayley') can start from it")
    if coords != "grid":
        raise CannotKeep(f"coords={coords!r} places the patches differently from the model's rotary embedding "
                          f"(use coords='grid')")
    if prefix != "unrotated":
        raise CannotKeep(f"prefix={prefix!r}: timm leaves the prefix tokens unrotated (use prefix='unrotated')")
    freqs = rope.freqs
    if freqs.shape[0] > 1 and all(torch.equal(f, freqs[0]) for f in freqs):
        freqs = freqs[:1]
    if freqs.shape[1] > 1 and all(torch.equal(freqs[:, h], freqs[:, 0]) for h in range(freqs.shape[1])):
        freqs = freqs[:, :1]
    if freqs.shape[1] > 1 and not probe.per_head:
        raise CannotKeep("its frequencies differ between heads (use sharing='head')")
    if freqs.shape[0] > 1 and sharing == "model":
        raise CannotKeep("its frequencies differ between blocks (use sharing='head' or 'layer')")
    if coord_dim > 2:  # the extra axes (depth, time) start at zero weight: the model starts as the 2-D one
        freqs = torch.cat([freqs, freqs.new_zeros(*freqs.shape[:2], coord_dim - 2, freqs.shape[-1])], dim=-2)
    rope.freqs = freqs
    return rope
