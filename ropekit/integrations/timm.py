"""Any ropekit encoding inside a timm Vision Transformer: ``apply_pe(model, name, ...)``.

Shape legend: ``B`` batch, ``N`` tokens, ``P0`` prefix tokens (CLS, registers, distillation: the model's own
``num_prefix_tokens``), ``M = N - P0`` patch tokens, ``D`` width, ``H`` heads, ``d`` head dimension, ``d'`` the
encoded q/k width (``pe.out_dim``), ``c`` coordinate dimension, ``(gh, gw)`` the patch grid of the input.

What the conversion does (timm ``VisionTransformer`` with ``Block`` / ``ResPostBlock`` blocks, and ``Eva``):

* every attention layer gets an encoding ``pe`` that it applies to q and k *after* q/k normalisation, then
  ``F.scaled_dot_product_attention`` with the scale ``head_dim ** -0.5`` fixed (the tensor-product encoding
  widens q and k without changing the logit scale);
* every original parameter and buffer is kept, under its original ``state_dict`` name -- the modules are
  re-classed in place, not wrapped -- so a timm checkpoint (``pretrained=True`` before converting, or
  ``load_state_dict(..., strict=False)`` after) still loads; the encodings add ``blocks.<i>.attn.pe.*``;
* the coordinates come from the patch grid of the actual input at forward time (``"grid"``: integer patch
  indices ``(row, col)``; ``"normalized"``: centres in ``[0, 1]``), so a model built with
  ``dynamic_img_size=True`` accepts any image size (timm resamples its absolute embedding, the rotary encoding
  needs nothing); patch dropout drops the dropped patches' coordinates too;
* prefix tokens are left unrotated (``prefix="unrotated"``, timm-compatible; CLS-patch logits then depend on
  absolute patch coordinates) or given the centroid of the patch coordinates (``prefix="centroid"``: they move
  with a global offset, so a commuting encoding keeps the model offset invariant).
* an ``Eva`` model's own rotary embedding (``model.rope``; DINOv3, EVA02, timm's SBB and Perception Encoder ViTs,
  and timm's ports of rope-vit, whose attention is ``AttentionRope``) is *replaced* by the ropekit encoding. With
  ``init_identity=True`` the encoding starts as that rotary embedding instead of the identity: ``mixed`` and
  ``cayley`` (at ``S = 0``) rotate every pair by ``sum_k r_k w_{k,n}`` with a free frequency per pair and axis, so
  they hold axial RoPE (each pair's frequency on one axis; DINOv3's is axial on normalised patch centres) and
  RoPE-Mixed (per block and head, with ``sharing="head"``) exactly, on the same coordinates (built by timm's own
  grid function: offset, reference-grid rescaling, DINOv3's normalisation; in training mode with timm's coordinate
  augmentation, drawn as timm draws it).
  A model that rotates half-split pairs ``(x_i, x_{i+d/2})`` gets a fixed reordering of the q and k channels
  (the same for both, so the logits are unchanged) that makes them interleaved pairs. The conversion checks the
  result against timm's own rotation; where the encoding cannot hold the model's rotary embedding (another
  encoding, another coordinate mode, a centroid prefix, too coarse a sharing, another kind of rotary embedding) it
  warns with the reason and the encoding starts as the identity (the model then loses its rotary embedding).
  The rotary embedding's own parameters (RoPE-Mixed's ``rope.freqs``) leave the ``state_dict``: convert after
  loading the checkpoint.

The patch coordinates live in :mod:`ropekit.integrations.timm_grid`, the reading of a model's own rotary embedding
in :mod:`ropekit.integrations.timm_rope`.

The absolute position embedding is kept (``keep_abs_pos=True``) so that, with an encoding that starts as the
identity (``init_identity=True``, or ``name="none"``), the converted model computes exactly what the original
did: fine-tuning starts from the checkpoint's function.

Example::

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, dynamic_img_size=True)
    model = apply_pe(model, "cayley", coord_dim=2)          # in place; returns the model
    logits = model(torch.randn(2, 3, 64, 96))               # any multiple of the patch size
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .._optional import require
from ..encodings import PositionEncoding, create_pe
from ._common import encodings
from ..nn.coords import COORD_MODES, grid_coords
from ..nn.finetune import logits_match

_timm = require("timm", "timm", "ropekit.integrations.timm")
from timm.layers import Attention as _TimmAttention
from timm.layers import PatchDropout as _PatchDropout
from timm.layers.patch_dropout import patch_dropout_forward as _patch_dropout_forward
from timm.models.eva import Eva as _Eva
from timm.models.eva import EvaAttention as _EvaAttention
from timm.models.vision_transformer import Block as _Block
from timm.models.vision_transformer import ResPostBlock as _ResPostBlock
from timm.models.vision_transformer import VisionTransformer as _VisionTransformer

from . import timm_rope
from .timm_grid import GridCoordinates, TimmGrid

#: The oldest timm the integration is tested with (see docs/compatibility.md).
MIN_TIMM = (1, 0, 29)


def _version_tuple(version: str) -> Tuple[int, ...]:
    """``"1.0.29.dev0"`` -> ``(1, 0, 29)``: the leading numeric components."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _check_timm_version(version: str) -> None:
    if _version_tuple(version) < MIN_TIMM:
        warnings.warn(f"ropekit.integrations.timm is tested with timm >= {'.'.join(map(str, MIN_TIMM))}, found "
                      f"{version}: conversions may fail or differ", UserWarning, stacklevel=3)


_check_timm_version(_timm.__version__)

try:  # the attention of timm's rope-vit / Perception Encoder models (attn_type="rope"); absent in old timm
    from timm.layers import AttentionRope as _AttentionRope
except ImportError:  # pragma: no cover - depends on the timm version
    _AttentionRope = None

__all__ = ["apply_pe", "encodings", "encode_qk", "SHARING", "PREFIX_MODES", "MIN_TIMM", "RopeAttention",
           "RopeEvaAttention", "RopeAttentionRope", "RopeBlock", "RopeResPostBlock", "RopeVisionTransformer", "RopeEva",
           "GridCoordinates", "TimmGrid"]

#: ``"model"``: one encoding module reused by every block; ``"layer"``: one per block; ``"head"``: one per block
#: with parameters per head (``per_head=True``).
SHARING = ("model", "layer", "head")
#: How prefix tokens are encoded (see the module docstring).
PREFIX_MODES = ("unrotated", "centroid")


# ---------------------------------------------------------------------------------------------- functional core
def encode_qk(pe: PositionEncoding, q: Tensor, k: Tensor, coords: Optional[Tensor], num_prefix_tokens: int,
              prefix: str = "unrotated") -> Tuple[Tensor, Tensor]:
    """Apply ``pe`` to ``q, k`` ``(B, H, N, d)`` with patch coordinates ``coords`` ``(M, c)`` or ``(B, M, c)``.

    ``prefix="centroid"`` gives each of the ``num_prefix_tokens`` leading tokens the centroid of the patch
    coordinates instead of leaving it unrotated. Returns ``(B, H, N, d')`` each.
    """
    if coords is None:
        raise ValueError("this attention layer has a ropekit position encoding but received no coordinates; call "
                         "the converted model's forward / forward_features / forward_intermediates")
    if coords.dim() == 4:  # (B, 1, M, c): timm's Eva patch dropout adds a head axis to its rope tensor
        coords = coords[:, 0]
    if prefix == "centroid" and num_prefix_tokens > 0:
        centre = coords.mean(dim=-2, keepdim=True)  # (1, c) or (B, 1, c)
        reps = centre.expand(*centre.shape[:-2], num_prefix_tokens, centre.shape[-1])  # (.., P0, c)
        coords = torch.cat([reps, coords], dim=-2)  # (.., N, c)
        num_prefix_tokens = 0
    return pe(q, k, coords, num_prefix_tokens)


def _sdpa(attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
    drop = attn.attn_drop.p if attn.training else 0.0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop, is_causal=is_causal,
                                          scale=attn.scale)  # (B, H, N, d)


# ---------------------------------------------------------------------------------------------- re-classed modules
class RopeAttention(_TimmAttention):
    """timm ``Attention`` plus ``self.pe``; ``forward(x, coords=None, attn_mask=None, is_causal=False)``.

    Built by :func:`apply_pe` (which re-classes an existing layer and adds ``pe``, ``rope_prefix`` and
    ``rope_num_prefix_tokens``), never constructed directly.
    """

    pe: PositionEncoding
    rope_prefix: str
    rope_num_prefix_tokens: int

    def forward(self, x: Tensor, coords: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False) -> Tensor:
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
        q, k, v = qkv.unbind(0)  # (B, H, N, d) each
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = encode_qk(self.pe, q, k, coords, self.rope_num_prefix_tokens, self.rope_prefix)  # (B, H, N, d')
        x = _sdpa(self, q, k, v, attn_mask, is_causal)  # (B, H, N, d)
        x = x.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)  # (B, N, H * d)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


def _eva_qkv(attn: nn.Module, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``(B, H, N, d)``, ``(B, Hkv, N, d)`` x2 of a timm ``EvaAttention`` or ``AttentionRope``, as timm
    computes them (fused or separate projections, EVA's separate q/v biases with a zero k bias)."""
    b, n, _ = x.shape
    if attn.qkv is not None:
        q_bias = getattr(attn, "q_bias", None)
        if q_bias is None:
            qkv = attn.qkv(x)
        else:
            qkv_bias = torch.cat((q_bias, attn.k_bias, attn.v_bias))
            if getattr(attn, "qkv_bias_separate", False):
                qkv = attn.qkv(x) + qkv_bias
            else:
                qkv = F.linear(x, weight=attn.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
        q, k, v = qkv.unbind(0)
        return q, k, v
    hkv = getattr(attn, "num_kv_heads", attn.num_heads)
    q = attn.q_proj(x).reshape(b, n, attn.num_heads, -1).transpose(1, 2)  # (B, H, N, d)
    k = attn.k_proj(x).reshape(b, n, hkv, -1).transpose(1, 2)  # (B, Hkv, N, d)
    v = attn.v_proj(x).reshape(b, n, hkv, -1).transpose(1, 2)
    return q, k, v


def _eva_attention_forward(attn: nn.Module, x: Tensor, rope: Optional[Tensor], attn_mask: Optional[Tensor],
                           is_causal: bool) -> Tensor:
    """The forward of a converted ``EvaAttention`` / ``AttentionRope``: timm's, with ``attn.pe`` in place of timm's
    rotary table. Keys and values of grouped-query attention are repeated to every query head before encoding.
    ``attn.rope_qk_perm`` (or ``None``) reorders the channels of q and k alike before encoding: a model that
    rotates half-split pairs ``(x_i, x_{i+d/2})`` then becomes one that rotates interleaved pairs; the logits
    ``q . k`` do not change under a common permutation of q and k.
    """
    b, n, _ = x.shape
    gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
    q, k, v = _eva_qkv(attn, x)
    q, k = attn.q_norm(q), attn.k_norm(k)
    groups = attn.num_heads // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, N, d)
    perm = getattr(attn, "rope_qk_perm", None)
    if perm is not None:
        q, k = q[..., perm], k[..., perm]
    q, k = encode_qk(attn.pe, q, k, rope, attn.num_prefix_tokens, attn.rope_prefix)  # (B, H, N, d')
    x = _sdpa(attn, q, k, v, attn_mask, is_causal)  # (B, H, N, d)
    x = x.transpose(1, 2).reshape(b, n, -1)  # (B, N, H * d)
    x = attn.norm(x)
    if gate is not None:
        x = x * gate
    return attn.proj_drop(attn.proj(x))


class RopeEvaAttention(_EvaAttention):
    """timm ``EvaAttention`` whose ``rope`` argument carries the patch coordinates ``(M, c)`` (or ``(B, 1, M, c)``
    after patch dropout) instead of timm's sin/cos table: the ``Eva`` model passes whatever ``model.rope.get_embed``
    returns to every block, and :class:`GridCoordinates` returns coordinates.
    """

    pe: PositionEncoding
    rope_prefix: str

    def forward(self, x: Tensor, rope: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False) -> Tensor:
        return _eva_attention_forward(self, x, rope, attn_mask, is_causal)


if _AttentionRope is not None:
    class RopeAttentionRope(_AttentionRope):
        """timm ``AttentionRope`` (the ``Eva`` models with ``attn_type="rope"``: timm's ports of rope-vit and the
        Perception Encoder) converted like :class:`RopeEvaAttention`."""

        pe: PositionEncoding
        rope_prefix: str

        def forward(self, x: Tensor, rope: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                    is_causal: bool = False) -> Tensor:
            return _eva_attention_forward(self, x, rope, attn_mask, is_causal)
else:  # pragma: no cover - depends on the timm version
    RopeAttentionRope = None  # type: ignore[assignment,misc]

_EVA_ATTENTION = {_EvaAttention: RopeEvaAttention}
if _AttentionRope is not None:
    _EVA_ATTENTION[_AttentionRope] = RopeAttentionRope


class RopeBlock(_Block):
    """timm ``Block`` that passes ``coords`` to its attention."""

    def forward(self, x: Tensor, coords: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False) -> Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), coords, attn_mask=attn_mask, is_causal=is_causal)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class RopeResPostBlock(_ResPostBlock):
    """timm ``ResPostBlock`` (post-norm) that passes ``coords`` to its attention."""

    def forward(self, x: Tensor, coords: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False) -> Tensor:
        x = x + self.drop_path1(self.norm1(self.attn(x, coords, attn_mask=attn_mask, is_causal=is_causal)))
        return x + self.drop_path2(self.norm2(self.mlp(x)))


_BLOCK_CLASSES = {_Block: RopeBlock, _ResPostBlock: RopeResPostBlock}


def _pe_no_weight_decay(model: nn.Module) -> set:
    names = set()
    for mname, m in model.named_modules():
        if isinstance(m, PositionEncoding):
            names |= {f"{mname}.{n}" for n in m.no_weight_decay()}
    return names


class RopeVisionTransformer(_VisionTransformer):
    """timm ``VisionTransformer`` whose blocks receive patch coordinates.

    ``forward``, ``forward_features`` and ``forward_intermediates`` accept an optional ``coords`` (``(M, c)`` or
    ``(B, M, c)``, patch tokens only) that replaces the grid coordinates -- e.g. a global offset, or a third
    coordinate (depth) for ``coord_dim=3``. Without it the coordinates are the patch grid (``coord_dim`` 2).
    """

    rope_coord_mode: str
    rope_coord_dim: int

    def _rope_embed(self, x: Tensor, coords: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """Tokens ``(B, N, D)`` ready for the blocks and the coordinates of their patch tokens."""
        img_hw = x.shape[-2:]
        x = self.patch_embed(x)  # (B, gh, gw, D) with dynamic_img_size, else (B, M, D)
        grid = tuple(x.shape[1:3]) if x.dim() == 4 else self.patch_embed.dynamic_feat_size(img_hw)
        x = self._pos_embed(x)  # (B, N, D)
        if coords is None:
            if self.rope_coord_dim != 2:
                raise ValueError(f"the encodings were built for coord_dim={self.rope_coord_dim}: pass coords of shape "
                                 f"(M, {self.rope_coord_dim}) or (B, M, {self.rope_coord_dim}) to forward")
            coords = grid_coords(grid, self.rope_coord_mode, device=x.device)  # (M, 2) = (row, col)
        pd = self.patch_drop
        if isinstance(pd, _PatchDropout) and self.training and pd.prob > 0:
            x, keep = _patch_dropout_forward(x, pd.prob, pd.num_prefix_tokens, pd.ordered, True)  # keep (B, M')
            if coords.dim() == 2:
                coords = coords.unsqueeze(0).expand(x.shape[0], -1, -1)  # (B, M, c)
            coords = coords.gather(1, keep.unsqueeze(-1).expand(-1, -1, coords.shape[-1]))  # (B, M', c)
        else:
            x = pd(x)
        return self.norm_pre(x), coords

    def _rope_block(self, blk: nn.Module, x: Tensor, coords: Tensor, attn_mask: Optional[Tensor],
                    is_causal: bool) -> Tensor:
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(blk, x, coords, attn_mask, is_causal, use_reentrant=False)
        return blk(x, coords, attn_mask=attn_mask, is_causal=is_causal)

    def forward_features(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
                         coords: Optional[Tensor] = None) -> Tensor:
        x, coords = self._rope_embed(x, coords)
        for blk in self.blocks:
            x = self._rope_block(blk, x, coords, attn_mask, is_causal)
        return self.norm(x)

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
                coords: Optional[Tensor] = None) -> Tensor:
        return self.forward_head(self.forward_features(x, attn_mask=attn_mask, is_causal=is_causal, coords=coords))

    def forward_intermediates(self, x: Tensor, indices: Optional[Any] = None, return_prefix_tokens: bool = False,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = "NCHW",
                              intermediates_only: bool = False, output_dict: bool = False,
                              attn_mask: Optional[Tensor] = None, is_causal: bool = False,
                              coords: Optional[Tensor] = None) -> Any:
        """timm's ``forward_intermediates`` (same arguments and outputs) with coordinates wired through."""
        from timm.models._features import feature_take_indices

        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        b, _, height, width = x.shape
        x, coords = self._rope_embed(x, coords)
        blocks = self.blocks[:max_index + 1] if stop_early else self.blocks
        intermediates: List[Tensor] = []
        for i, blk in enumerate(blocks):
            x = self._rope_block(blk, x, coords, attn_mask, is_causal)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)
        npt = self.num_prefix_tokens
        prefix_tokens = [y[:, :npt] for y in intermediates] if npt else None
        intermediates = [y[:, npt:] for y in intermediates]  # (B, M, D) each
        if output_fmt == "NCHW":
            gh, gw = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(b, gh, gw, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if output_dict:
            out: Dict[str, Any] = {"image_intermediates": intermediates}
            if prefix_tokens is not None and return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix_tokens
            if not intermediates_only:
                out["image_features"] = self.norm(x)
            return out
        if return_prefix_tokens and prefix_tokens is not None:
            intermediates = list(zip(intermediates, prefix_tokens))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """timm's set plus the encodings' learnable parameters (as named in ``named_parameters()``)."""
        return set(super().no_weight_decay()) | _pe_no_weight_decay(self)


class RopeEva(_Eva):
    """timm ``Eva`` with ropekit encodings (its forward is timm's: ``model.rope`` yields coordinates).

    Converted with ``coord_dim > 2``, the patches' coordinates are ``(row, col, *extra)``: ``forward`` and
    ``forward_features`` take ``extra_coords`` ``(M, coord_dim - 2)`` or ``(B, M, coord_dim - 2)`` (patch tokens
    only, row-major; e.g. each patch's depth), zeros when not given.
    """

    def forward_features(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
                         extra_coords: Optional[Tensor] = None) -> Tensor:
        if extra_coords is None:
            return super().forward_features(x, attn_mask=attn_mask, is_causal=is_causal)
        rope = self.rope
        if not isinstance(rope, GridCoordinates) or rope.extra_axes == 0:
            raise ValueError("extra_coords needs a model converted with coord_dim > 2")
        rope.pending_extra = extra_coords  # read once by rope.get_embed inside this forward
        try:
            return super().forward_features(x, attn_mask=attn_mask, is_causal=is_causal)
        finally:
            rope.pending_extra = None

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
                extra_coords: Optional[Tensor] = None) -> Tensor:
        return self.forward_head(self.forward_features(x, attn_mask=attn_mask, is_causal=is_causal,
                                                       extra_coords=extra_coords))

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return set(super().no_weight_decay()) | _pe_no_weight_decay(self)


# ---------------------------------------------------------------------------------------------- conversion
def _make_identity_(pe: PositionEncoding, name: str) -> None:
    with torch.no_grad():
        for p in pe.parameters():
            p.zero_()
    if not logits_match(pe, None):
        raise ValueError(f"init_identity: the encoding {name!r} is not the identity with its parameters at zero "
                         f"(e.g. 'axial' has fixed frequencies); use mixed, cayley, circulant, liere, "
                         f"liere-commute, comrope-* or none")


def apply_pe(model: nn.Module, name: str, coord_dim: int = 2, *, sharing: str = "model", coords: str = "grid",
             prefix: str = "unrotated", init_identity: bool = False, keep_abs_pos: bool = True,
             inplace: bool = True, **pe_opts: Any) -> nn.Module:
    """Make every attention layer of a timm ViT apply the ropekit encoding ``name`` to q and k.

    Args:
        model: a timm ``VisionTransformer`` (blocks ``Block`` or ``ResPostBlock``, attention
            ``timm.layers.Attention``) or ``Eva`` (attention ``EvaAttention``). Build it with
            ``dynamic_img_size=True`` to accept any image size.
        name: a ``ropekit.create_pe`` name (``none, axial, mixed, cayley, circulant, tensor, string, liere,
            liere-commute, comrope-ap, comrope-ld, relaxed``).
        coord_dim: ``c``. With 2 the coordinates are the patch grid; any other value needs ``coords`` passed to
            ``forward`` (``VisionTransformer``). An ``Eva`` model takes ``(row, col)`` from the grid and the other
            ``c - 2`` axes (depth, time) from ``forward(..., extra_coords=...)`` (zeros when not given); with
            ``init_identity`` and a kept rotary embedding those axes start at zero frequency, so the model starts
            as the 2-D one whatever the extra coordinates are.
        sharing: ``"model"`` (one encoding for every block), ``"layer"`` (one per block) or ``"head"`` (one per
            block, parameters per head).
        coords: ``"grid"`` (integer patch indices) or ``"normalized"`` (patch centres in ``[0, 1]``).
        prefix: ``"unrotated"`` or ``"centroid"`` (see the module docstring).
        init_identity: start from the function of ``model`` (fine-tuning a pretrained checkpoint): for a model
            without rotary embedding, set every encoding parameter to zero and check that the encoding is then the
            identity; for an ``Eva`` model with one, start the encoding as that rotary embedding (see the module
            docstring; a ``UserWarning`` gives the reason where it cannot).
        keep_abs_pos: keep the model's absolute position embedding (``False`` sets ``model.pos_embed = None``:
            the rotary encoding is then the only position information; that parameter is dropped).
        inplace: convert ``model`` itself (default) or a deep copy.
        **pe_opts: options of the encoding (``ropekit.pe_options(name)``), e.g. ``block_size=8``.

    Returns:
        The converted model (``model`` itself when ``inplace``). Its class becomes ``RopeVisionTransformer`` /
        ``RopeEva`` (subclasses of the timm ones); ``no_weight_decay()`` includes the encodings' parameters.

    Raises:
        TypeError: an unsupported model, block or attention class (or a model converted already).
        ValueError: a bad option, or an encoding that cannot start as the identity with ``init_identity``.
    """
    if sharing not in SHARING:
        raise ValueError(f"sharing must be one of {SHARING}, got {sharing!r}")
    if coords not in COORD_MODES:
        raise ValueError(f"coords must be one of {COORD_MODES}, got {coords!r}")
    if prefix not in PREFIX_MODES:
        raise ValueError(f"prefix must be one of {PREFIX_MODES}, got {prefix!r}")
    if isinstance(model, (RopeVisionTransformer, RopeEva)):
        raise TypeError("this model has ropekit encodings already")
    if type(model) is _VisionTransformer:
        kind = "vit"
    elif type(model) is _Eva:
        kind = "eva"
    else:
        raise TypeError(f"apply_pe supports timm VisionTransformer and Eva models, got {type(model).__name__}")
    if kind == "eva" and (not isinstance(coord_dim, int) or coord_dim < 2):
        raise ValueError(f"Eva models take (row, col) from the patch grid: coord_dim must be an int >= 2, got "
                         f"{coord_dim!r}")
    allowed = {_TimmAttention: RopeAttention} if kind == "vit" else _EVA_ATTENTION
    for i, blk in enumerate(model.blocks):
        if type(blk.attn) not in allowed:
            raise TypeError(f"block {i}: attention {type(blk.attn).__name__} is not supported (expected "
                            f"{' or '.join(c.__name__ for c in allowed)})")
        if kind == "vit" and type(blk) not in _BLOCK_CLASSES:
            raise TypeError(f"block {i}: {type(blk).__name__} is not supported (expected Block or ResPostBlock)")
    if not inplace:
        model = copy.deepcopy(model)
    if sharing == "head":
        pe_opts = {**pe_opts, "per_head": True}

    own_rope: Optional[timm_rope.TimmRope] = None
    if kind == "eva" and init_identity and getattr(model, "rope", None) is not None:
        try:
            own_rope = timm_rope.plan_keep_rope(model, name, sharing, coords, prefix, pe_opts, coord_dim)
        except timm_rope.CannotKeep as exc:
            timm_rope.warn_rope_removed(model, name, str(exc))

    pes: List[PositionEncoding] = []
    shared: Optional[PositionEncoding] = None
    for i, blk in enumerate(model.blocks):
        attn = blk.attn
        if shared is not None and (shared.head_dim, shared.num_heads) != (attn.head_dim, attn.num_heads):
            raise ValueError("sharing='model' needs the same head_dim and num_heads in every block")
        pe = shared if shared is not None else create_pe(name, head_dim=attn.head_dim, coord_dim=coord_dim,
                                                         num_heads=attn.num_heads, **pe_opts)
        if pe is not shared:
            if own_rope is not None:
                timm_rope.keep_rope_(pe, own_rope, i)
            elif init_identity:
                _make_identity_(pe, name)
        pes.append(pe)
        if sharing == "model":
            shared = pe

    grid_source: Optional[GridCoordinates] = None
    if kind == "eva":
        if own_rope is not None:
            grid_source = GridCoordinates("grid", model.patch_embed.grid_size, timm_grid=own_rope.grid,
                                          extra_axes=coord_dim - 2)
            reason = timm_rope.check_keeps_rope(model, pes, own_rope, grid_source)
            if reason is not None:
                timm_rope.warn_rope_removed(model, name, reason)
                for pe in {id(p): p for p in pes}.values():
                    _make_identity_(pe, name)
                own_rope = None
        if own_rope is None:
            grid_source = GridCoordinates(coords, model.patch_embed.grid_size, extra_axes=coord_dim - 2)

    for blk, pe in zip(model.blocks, pes):
        attn = blk.attn
        device = next(attn.parameters()).device
        attn.pe = pe.to(device=device)
        attn.rope_prefix = prefix
        if kind == "vit":
            attn.rope_num_prefix_tokens = int(model.num_prefix_tokens)
            attn.__class__ = RopeAttention
            blk.__class__ = _BLOCK_CLASSES[type(blk)]
        else:
            perm = None if own_rope is None or own_rope.perm is None else own_rope.perm.to(device)
            attn.register_buffer("rope_qk_perm", perm, persistent=False)
            attn.__class__ = _EVA_ATTENTION[type(attn)]

    if not keep_abs_pos:
        model.pos_embed = None
    if kind == "vit":
        model.rope_coord_mode = coords
        model.rope_coord_dim = coord_dim
        model.__class__ = RopeVisionTransformer
    else:
        model.rope = grid_source.to(next(model.parameters()).device).train(model.training)
        model.rope_mixed = False
        model.__class__ = RopeEva
    return model
