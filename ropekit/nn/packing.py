"""Packed sequences ("patch n' pack", NaViT; timm's NaFlexViT): the patch tokens of several images of any size and
aspect ratio in one sequence, each token with its own coordinates and segment id, attention block diagonal.

A rotary encoding acts on every token separately with its own coordinates, so packing changes nothing in the
encoding: a packed image's logits equal the image's alone (to float round-off) for every encoding and every path
(module, folded in training, folded for inference), with SDPA and a boolean mask, with FlexAttention, or with
FlashAttention's varlen kernel on CUDA.

Layout of a packed row (``B`` rows, ``S`` image slots per row, ``N`` patch tokens per row):

* ``S`` prefix slots first when the model has a CLS token -- slot ``s`` is the CLS token of the row's image ``s``
  (``"unrotated"``: the ``S`` slots are the layer's prefix tokens; ``"centroid"``: each slot gets the centroid of
  its image's coordinates) -- then the ``N`` patch tokens, image after image, padding last;
* ``segment_ids`` ``(B, N)``: the slot of each patch token's image, ``-1`` for padding; the slots' own segments
  are ``0 .. S-1`` (``-1`` for an unused slot). Attention: ``ropekit.nn.masks``.

:class:`PackedBatch` holds integer patch coordinates and each token's image grid (as NaFlexViT's ``patch_coord``),
and the model turns them into its convention (``"grid"`` or ``"normalized"``). :func:`patchify` cuts an image (RGB,
RGB-D, video clip) into patch vectors (channels last within a patch, as timm), :func:`pack` fills rows first-fit
under a token budget, :func:`from_naflex` reads timm's dict (``patches``, ``patch_coord``, ``patch_valid``; one
image per row), :func:`packed_forward` runs a :class:`~ropekit.nn.VisionTransformer` on a packed batch and returns
one row of logits per image.

Limits: absolute position embeddings (a table resized per grid) are not packed (``ValueError``); stochastic depth
drops a whole row (all its images) at once; FlexAttention runs without attention dropout.

Shape legend: ``I`` images, ``B`` rows, ``S`` slots, ``N`` patch tokens per row, ``F`` values per patch
(``prod(kernel) * channels``), ``k`` grid axes (2 for images, 3 for video), ``c`` coordinate dimension
(``k``, or 3 for RGB-D with depth as a coordinate), ``D`` width, ``K`` classes.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..coords.augment import augment_leading_axes
from .depth import patch_mean_depth, valid_depth_mask
from .masks import NO_VARLEN, flex_segment_mask, segment_mask, varlen_function, varlen_segments

__all__ = ["PatchedImage", "PackedBatch", "patchify", "pack", "from_naflex", "packed_embed", "packed_forward",
           "packed_forward_any", "ATTENTION_KINDS"]

#: How :func:`packed_forward` runs attention: ``"sdpa"`` (the default), ``"flex"``, ``"varlen"``, or ``"auto"`` (the
#: varlen kernel on CUDA in float16 / bfloat16 where one is installed, else SDPA); see :mod:`ropekit.nn.masks`.
ATTENTION_KINDS = ("auto", "sdpa", "flex", "varlen")


class PatchedImage(NamedTuple):
    """One image cut into patches (:func:`patchify`), possibly with tokens dropped.

    Attributes:
        patches: ``(M, F)``.
        patch_coord: ``(M, k)`` int64 grid indices.
        grid: ``k`` patches per axis of the whole image.
        depth: ``(M,)`` mean valid depth per patch (RGB-D), else ``None``.
        label: the image's label (any int), or ``-1``.
    """

    patches: Tensor
    patch_coord: Tensor
    grid: Tuple[int, ...]
    depth: Optional[Tensor] = None
    label: int = -1


class PackedBatch(NamedTuple):
    """Images packed into rows (:func:`pack`, :func:`from_naflex`).

    Attributes:
        patches: ``(B, N, F)``; zeros at padding.
        patch_coord: ``(B, N, k)`` int64 grid indices; zeros at padding.
        patch_grid: ``(B, N, k)`` int64, the grid of each token's image; ones at padding.
        segment_ids: ``(B, N)`` int64, each token's slot, ``-1`` at padding.
        image_index: ``(B, S)`` int64, the image (``0 .. I-1``) in each slot, ``-1`` for an unused slot.
        depth: ``(B, N)`` mean valid depth per patch (RGB-D), else ``None``.
        labels: ``(I,)`` int64.
    """

    patches: Tensor
    patch_coord: Tensor
    patch_grid: Tensor
    segment_ids: Tensor
    image_index: Tensor
    depth: Optional[Tensor] = None
    labels: Optional[Tensor] = None

    @property
    def num_images(self) -> int:
        return int(self.labels.numel()) if self.labels is not None else int((self.image_index >= 0).sum())

    def to(self, device: Any) -> "PackedBatch":
        return PackedBatch(*(t.to(device) if isinstance(t, Tensor) else t for t in self))


def patchify(image: Tensor, patch_size: int, *, tubelet_size: int = 1, depth: bool = False, label: int = -1,
             drop: float = 0.0, generator: Optional[torch.Generator] = None) -> PatchedImage:
    """Cut one image into non-overlapping patches, channels last within a patch (timm's order).

    Args:
        image: ``(C, H, W)``, ``(C + 1, H, W)`` with ``depth=True`` (metric depth last; 0 / NaN invalid), or a clip
            ``(C, T, H, W)``. The bottom/right (and last frames') remainder is cropped, as the patch embedding does.
        patch_size: ``p``.
        tubelet_size: frames per token for clips.
        depth: the last channel is depth: its patches are stored with invalid pixels as 0, and the mean valid depth
            per patch goes to ``depth`` (``ropekit.nn.depth.patch_mean_depth``, its fallbacks included).
        label: stored with the image.
        drop: fraction of tokens dropped at random (NaViT's token dropping; at least one token is kept).
        generator: for ``drop``.

    Returns:
        :class:`PatchedImage` with ``F = p * p * C'`` (``tubelet_size * p * p * C`` for clips).
    """
    if image.dim() not in (3, 4):
        raise ValueError(f"patchify needs (C, H, W) or (C, T, H, W), got {tuple(image.shape)}")
    if not 0.0 <= drop < 1.0:
        raise ValueError(f"token drop fraction must be in [0, 1), got {drop}")
    kernel = (tubelet_size, patch_size, patch_size) if image.dim() == 4 else (patch_size, patch_size)
    spatial = image.shape[1:]
    grid = tuple(s // k for s, k in zip(spatial, kernel))
    if min(grid) < 1:
        raise ValueError(f"image {tuple(spatial)} is smaller than the patch {kernel}")
    z = None
    if depth:
        if image.dim() != 3 or image.shape[0] < 2:
            raise ValueError(f"RGB-D patchify needs (C + 1, H, W), got {tuple(image.shape)}")
        d = image[-1]
        z = patch_mean_depth(d[None].float(), patch_size)[0]  # (M,)
        image = torch.cat([image[:-1], torch.where(valid_depth_mask(d), d, torch.zeros_like(d))[None]])
    c = image.shape[0]
    x = image[(slice(None),) + tuple(slice(0, g * k) for g, k in zip(grid, kernel))]
    shape = [c]
    for g, k in zip(grid, kernel):
        shape += [g, k]
    x = x.reshape(shape)  # (C, g1, k1, g2, k2[, g3, k3])
    n = len(grid)
    x = x.permute(*[1 + 2 * i for i in range(n)], *[2 + 2 * i for i in range(n)], 0)  # (g.., k.., C)
    patches = x.reshape(math.prod(grid), -1)  # (M, F)
    coord = torch.stack(torch.meshgrid(*[torch.arange(g) for g in grid], indexing="ij"), -1).reshape(-1, n)
    if drop > 0:
        m = patches.shape[0]
        keep = max(1, int(round(m * (1.0 - drop))))
        idx = torch.randperm(m, generator=generator)[:keep].sort().values
        patches, coord = patches[idx], coord[idx]
        z = None if z is None else z[idx]
    return PatchedImage(patches, coord, grid, z, int(label))


def pack(images: Sequence[PatchedImage], max_tokens: int, *, max_images: Optional[int] = None,
         pad_to: Optional[int] = None, rows: Optional[Sequence[Sequence[int]]] = None,
         num_rows: Optional[int] = None) -> PackedBatch:
    """Pack images into rows of at most ``max_tokens`` patch tokens, first fit in the given order (deterministic).

    Args:
        images: from :func:`patchify` (one kind: the same ``F`` and grid axes).
        max_tokens: the token budget of a row (``ValueError`` for an image with more tokens).
        max_images: at most this many images per row (``None``: no limit); also the number of slots ``S`` (else
            the fullest row's image count).
        pad_to: the row length ``N`` (``>=`` the longest row; ``None``: ``max_tokens``, the same shape every batch,
            which ``torch.compile`` likes; pass the longest row's length to pad less).
        rows: an assignment of the images to rows made beforehand (lists of indices into ``images``, each image
            once; e.g. a data loader's plan), used instead of first fit; rows over ``max_tokens`` are an error.
        num_rows: pad the batch to this many rows ``B`` with empty rows (``None``: as many as the images fill).
            Fixed ``B``, ``S`` and a few ``pad_to`` lengths keep ``torch.compile`` to one graph for all of them.

    Returns:
        :class:`PackedBatch` (on the CPU).
    """
    if not images:
        raise ValueError("pack needs at least one image")
    if max_tokens < 1 or (max_images is not None and max_images < 1):
        raise ValueError(f"max_tokens and max_images must be positive, got {max_tokens}, {max_images}")
    feat, k = images[0].patches.shape[-1], images[0].patch_coord.shape[-1]
    for i, im in enumerate(images):
        if im.patches.shape[-1] != feat or im.patch_coord.shape[-1] != k:
            raise ValueError(f"image {i} has patches of {im.patches.shape[-1]} values and {im.patch_coord.shape[-1]} "
                             f"axes, image 0 of {feat} and {k}: pack images of one kind")
        if im.patches.shape[0] > max_tokens:
            raise ValueError(f"image {i} has {im.patches.shape[0]} tokens, more than max_tokens={max_tokens}")
    if rows is not None:
        rows = [list(r) for r in rows if len(r)]
        if sorted(i for r in rows for i in r) != list(range(len(images))):
            raise ValueError(f"rows must hold every one of the {len(images)} images once")
        used = [sum(images[i].patches.shape[0] for i in r) for r in rows]
        if max(used) > max_tokens or (max_images is not None and max(len(r) for r in rows) > max_images):
            raise ValueError(f"a planned row holds {max(used)} tokens (max_tokens={max_tokens}) or too many images")
    else:
        rows, used = [], []
        for i, im in enumerate(images):  # first fit, in order
            m = im.patches.shape[0]
            for r, row in enumerate(rows):
                if used[r] + m <= max_tokens and (max_images is None or len(row) < max_images):
                    row.append(i)
                    used[r] += m
                    break
            else:
                rows.append([i])
                used.append(m)
    n = max_tokens if pad_to is None else int(pad_to)
    if n < max(used):
        raise ValueError(f"pad_to={pad_to} is shorter than the longest row ({max(used)} tokens)")
    b, s = len(rows), max(len(r) for r in rows) if max_images is None else max_images
    if num_rows is not None:
        if num_rows < b:
            raise ValueError(f"num_rows={num_rows} is fewer than the {b} rows the images fill")
        b = num_rows
    dtype = images[0].patches.dtype
    patches = torch.zeros(b, n, feat, dtype=dtype)
    coord = torch.zeros(b, n, k, dtype=torch.int64)
    grid = torch.ones(b, n, k, dtype=torch.int64)
    seg = torch.full((b, n), -1, dtype=torch.int64)
    index = torch.full((b, s), -1, dtype=torch.int64)
    has_depth = images[0].depth is not None
    depth = torch.zeros(b, n) if has_depth else None
    for r, row in enumerate(rows):
        at = 0
        for slot, i in enumerate(row):
            im = images[i]
            m = im.patches.shape[0]
            patches[r, at:at + m] = im.patches
            coord[r, at:at + m] = im.patch_coord
            grid[r, at:at + m] = torch.tensor(im.grid, dtype=torch.int64)
            seg[r, at:at + m] = slot
            if has_depth:
                depth[r, at:at + m] = im.depth
            index[r, slot] = i
            at += m
    labels = torch.tensor([im.label for im in images], dtype=torch.int64)
    return PackedBatch(patches, coord, grid, seg, index, depth, labels)


def from_naflex(batch: Mapping[str, Tensor], labels: Optional[Tensor] = None) -> PackedBatch:
    """A timm NaFlexViT batch as a :class:`PackedBatch`: one image per row.

    Args:
        batch: ``patches`` ``(B, N, F)`` (channels last within a patch), ``patch_coord`` ``(B, N, 2)`` integer
            ``(y, x)``, ``patch_valid`` ``(B, N)`` bool (``False``: padding). Each image's grid is read as one more
            than its largest valid coordinate per axis (on the device, no host synchronisation).
        labels: ``(B,)`` or ``None``.
    """
    missing = [key for key in ("patches", "patch_coord", "patch_valid") if key not in batch]
    if missing:
        raise ValueError(f"a NaFlex batch needs the keys patches, patch_coord, patch_valid; missing {missing}")
    patches, coord, valid = batch["patches"], batch["patch_coord"].long(), batch["patch_valid"].bool()
    b, n = valid.shape
    if patches.shape[:2] != (b, n) or coord.shape[:2] != (b, n):
        raise ValueError(f"patches {tuple(patches.shape)}, patch_coord {tuple(coord.shape)} and patch_valid "
                         f"{tuple(valid.shape)} disagree")
    coord = torch.where(valid.unsqueeze(-1), coord, torch.zeros_like(coord))
    grid = (coord.amax(dim=1, keepdim=True) + 1).expand_as(coord)  # (B, N, k)
    seg = torch.where(valid, torch.zeros_like(coord[..., 0]), torch.full_like(coord[..., 0], -1))
    index = torch.arange(b, device=valid.device).unsqueeze(1)  # (B, 1)
    patches = torch.where(valid.unsqueeze(-1), patches, torch.zeros_like(patches))
    return PackedBatch(patches, coord, grid.contiguous(), seg, index, None,
                       None if labels is None else labels.long())


def _patch_weight(model) -> Tuple[Tensor, Optional[Tensor]]:
    """The patch embedding as a linear map on channels-last patch vectors: ``(D, F)``, ``(D,)``."""
    proj = model.patch_embed.proj
    w = proj.weight  # (D, C, k1, k2[, k3])
    return w.movedim(1, -1).reshape(w.shape[0], -1), proj.bias


def _slot_onehot(seg: Tensor, slots: int, dtype: torch.dtype) -> Tensor:
    """``(B, S, N)``: 1 where token ``n`` belongs to slot ``s``."""
    return (seg.unsqueeze(1) == torch.arange(slots, device=seg.device).view(1, -1, 1)).to(dtype)


def packed_embed(model, batch: PackedBatch, coord_offset: Optional[Tensor] = None
                 ) -> Tuple[Tensor, Optional[Tensor], int, Tensor]:
    """Tokens, coordinates, prefix-token count and segment ids of a packed batch, before the blocks (what
    ``VisionTransformer.embed`` gives for one image).

    Args:
        model: a :class:`~ropekit.nn.VisionTransformer` without an absolute position embedding.
        batch: :class:`PackedBatch`.
        coord_offset: optional ``(I, c)`` global coordinate shift per image.

    Returns:
        ``(tokens (B, S' + N, D), coords (B, S'' + N, c) or None, num_prefix_tokens, segment_ids (B, S' + N))`` with
        ``S' = S`` when the model has a CLS token (else 0), ``S'' = S`` for a centroid CLS (else 0).
    """
    cfg = model.cfg
    if model.ape is not None:
        raise ValueError("packed sequences need a model without an absolute position embedding (its table is "
                         "resized per grid); use a rotary encoding")
    weight, bias = _patch_weight(model)
    patches = batch.patches
    seg = batch.segment_ids
    b, n = seg.shape
    if cfg.modality == "rgbd" and not cfg.depth_as_channel:  # the depth channel is not an input
        c = cfg.in_chans
        patches = patches.unflatten(-1, (-1, c + 1))[..., :c].flatten(-2)
    if patches.shape[-1] != weight.shape[1]:
        raise ValueError(f"packed patches have {patches.shape[-1]} values, the model's patch embedding takes "
                         f"{weight.shape[1]} (channels last within a patch)")
    tokens = F.linear(patches.to(weight.dtype), weight, bias)  # (B, N, D)
    coords = None
    if cfg.rotary is not None:
        idx, grid = batch.patch_coord, batch.patch_grid
        if cfg.coords == "grid":
            coords = idx.to(torch.float32)  # (B, N, k)
            unit = torch.ones_like(coords)
        else:
            coords = (idx.to(torch.float32) + 0.5) / grid
            unit = 1.0 / grid.to(torch.float32)
        if model.depth_lift is not None:
            if batch.depth is None:
                raise ValueError("this model takes depth as a coordinate: pack RGB-D images (patchify depth=True)")
            z = model.depth_lift.scale * batch.depth.float() + model.depth_lift.bias  # (B, N)
            coords = torch.cat([coords, z.unsqueeze(-1).to(coords.dtype)], dim=-1)
            unit = torch.cat([unit, torch.zeros_like(unit[..., :1])], dim=-1)  # z is not jittered
        if model.training and cfg.jitter > 0:
            noise = torch.empty_like(coords)
            torch.nn.init.trunc_normal_(noise, mean=0.0, std=1.0, a=-0.5 / cfg.jitter, b=0.5 / cfg.jitter)
            coords = coords + noise * cfg.jitter * unit
        if model.training and cfg.coord_augmenting:
            image = torch.where(seg >= 0, batch.image_index.gather(1, seg.clamp(min=0)), seg)  # (B, N)
            coords = augment_leading_axes(coords, cfg.coord_augment, batch.num_images, axes=idx.shape[-1],
                                          image=image)
        if coord_offset is not None:
            off = torch.as_tensor(coord_offset, dtype=coords.dtype, device=coords.device)
            if off.dim() != 2 or off.shape[-1] != coords.shape[-1]:
                raise ValueError(f"coord_offset must be (images, {coords.shape[-1]}), got {tuple(off.shape)}")
            image = batch.image_index.gather(1, seg.clamp(min=0))  # (B, N): each token's image
            coords = coords + torch.where((seg >= 0).unsqueeze(-1), off[image.clamp(min=0)], torch.zeros_like(coords))
    slots = batch.image_index.shape[1]
    slot_seg = torch.where(batch.image_index >= 0, torch.arange(slots, device=seg.device).expand(b, -1),
                           torch.full_like(batch.image_index, -1))  # (B, S)
    num_prefix = 0
    if model.cls_token is not None:
        tokens = torch.cat([model.cls_token.expand(b, slots, -1).to(tokens.dtype), tokens], dim=1)  # (B, S + N, D)
        seg = torch.cat([slot_seg, seg], dim=1)
        if cfg.cls == "unrotated":
            num_prefix = slots
        elif coords is not None:  # centroid: the mean coordinate of each slot's patches
            hot = _slot_onehot(batch.segment_ids, slots, coords.dtype)  # (B, S, N)
            cent = (hot @ coords) / hot.sum(-1, keepdim=True).clamp_min(1)  # (B, S, c)
            coords = torch.cat([cent, coords], dim=1)
    return tokens, coords, num_prefix, seg


def packed_forward(model, batch: PackedBatch, *, attention: str = "sdpa", coord_offset: Optional[Tensor] = None,
                   pre_logits: bool = False, max_seqlen: Optional[int] = None) -> Tensor:
    """Run a :class:`~ropekit.nn.VisionTransformer` on a packed batch: logits ``(I, K)`` (pooled features
    ``(I, D)`` with ``pre_logits`` or ``num_classes == 0``), one row per image in packing order -- each image's as
    ``model(image)`` gives them alone, to float round-off.

    Args:
        model: the ViT (image, RGB-D or video; no absolute position embedding).
        batch: :class:`PackedBatch` on the model's device.
        attention: ``"sdpa"`` (default: boolean block-diagonal mask), ``"flex"`` (FlexAttention document mask), ``"varlen"``
            (FlashAttention's varlen kernel: CUDA, float16 / bfloat16, e.g. under autocast; ``ValueError`` where no
            varlen function is installed or the batch is not on CUDA) or ``"auto"`` (``"varlen"`` where it
            can run -- a CUDA batch, a varlen function installed, half-precision q / k / v, no dropout unless
            flash-attn's -- decided in each layer, else ``"sdpa"``; on the CPU exactly ``"sdpa"``). The varlen kernel is
            opt-in until ``tools/gpu_session.sh`` has checked it on a GPU (its test is written, not yet run there).
        coord_offset: optional ``(I, c)`` shift per image (as ``model(x, coord_offset=...)``).
        max_seqlen: the longest image (prefix token included) for the varlen kernel, when known on the host; default
            the row length, a bound that needs no host synchronisation (see :mod:`ropekit.nn.masks`).

    ``I`` is ``batch.labels.numel()``, or, without labels, the number of slots (every slot then holds an image).
    """
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}")
    tokens, coords, num_prefix, seg = packed_embed(model, batch, coord_offset)
    mask = _attention_mask(attention, seg, batch.image_index.shape[1], tokens.device, max_seqlen)
    states = model.prepare_encodings(coords, num_prefix, tokens.dtype)
    for blk, state in zip(model.blocks, states):  # one prepared state per block, in order
        tokens = blk(tokens, coords, num_prefix, state, attn_mask=mask)
    feats = model.norm(tokens)  # (B, S' + N, D)
    index = batch.image_index  # (B, S)
    slots = index.shape[1]
    if model.cls_token is not None:
        pooled = feats[:, :slots]  # (B, S, D)
    else:
        hot = _slot_onehot(batch.segment_ids, slots, feats.dtype)  # (B, S, N)
        pooled = (hot @ feats) / hot.sum(-1, keepdim=True).clamp_min(1)  # (B, S, D)
    # image order without a data-dependent shape (no boolean indexing: torch.compile traces it in one graph): every
    # image's slot is added to its row of zeros, the unused slots to one extra row that is dropped
    num = batch.labels.numel() if batch.labels is not None else index.numel()
    rows = torch.where(index >= 0, index, torch.full_like(index, num)).flatten()  # (B S,)
    out = pooled.new_zeros(num + 1, pooled.shape[-1]).index_add(0, rows, pooled.flatten(0, 1))[:num]  # (I, D)
    return out if pre_logits else model.head(out)


def _attention_mask(attention: str, seg: Tensor, slots: int, device: torch.device, max_seqlen: Optional[int]) -> Any:
    """The ``attn_mask`` the blocks get for ``attention`` (one of :data:`ATTENTION_KINDS`)."""
    if attention == "flex":
        return flex_segment_mask(seg)
    kernel = varlen_function()
    if attention == "varlen":
        if kernel is None:
            raise ValueError(NO_VARLEN)
        if device.type not in kernel.device_types:
            raise ValueError(f"attention='varlen' runs on {'/'.join(kernel.device_types)}, the batch is on "
                             f"{device.type} (use 'auto' or 'sdpa')")
        return varlen_segments(seg, slots, max_seqlen=max_seqlen)
    if attention == "auto" and kernel is not None and device.type in kernel.device_types:
        return varlen_segments(seg, slots, max_seqlen=max_seqlen, mode="auto")  # (the dtype is checked per layer)
    return segment_mask(seg)


def packed_forward_any(model, batch: Union[PackedBatch, Mapping[str, Tensor]],
                       coord_offset: Optional[Tensor] = None) -> Tensor:
    """:func:`packed_forward` (SDPA with a block-diagonal mask) of a
    :class:`PackedBatch` or of a timm NaFlex dict (:func:`from_naflex`): what
    ``VisionTransformer.forward`` does with an input that is not a tensor."""
    if isinstance(batch, PackedBatch):
        return packed_forward(model, batch, coord_offset=coord_offset)
    if isinstance(batch, Mapping):
        return packed_forward(model, from_naflex(batch), coord_offset=coord_offset)
    raise ValueError(f"the ViT takes an image tensor, a PackedBatch or a NaFlex dict, got {type(batch).__name__}")
