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
* an ``Eva`` model's own rotary embedding (``model.rope``) is *replaced* by the ropekit encoding.

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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..encodings import PositionEncoding, create_pe
from ..nn.coords import COORD_MODES, grid_coords
from .finetune import logits_match

try:  # timm is an optional dependency: ``pip install ropekit[timm]``
    from timm.layers import Attention as _TimmAttention
    from timm.layers import PatchDropout as _PatchDropout
    from timm.layers.patch_dropout import patch_dropout_forward as _patch_dropout_forward
    from timm.models.eva import Eva as _Eva
    from timm.models.eva import EvaAttention as _EvaAttention
    from timm.models.vision_transformer import Block as _Block
    from timm.models.vision_transformer import ResPostBlock as _ResPostBlock
    from timm.models.vision_transformer import VisionTransformer as _VisionTransformer
except ImportError as exc:  # pragma: no cover - exercised only without timm
    raise ImportError("ropekit.integrations.timm needs timm: pip install 'ropekit[timm]'") from exc

__all__ = ["apply_pe", "encodings", "encode_qk", "SHARING", "PREFIX_MODES", "RopeAttention", "RopeEvaAttention",
           "RopeBlock", "RopeResPostBlock", "RopeVisionTransformer", "RopeEva", "GridCoordinates"]

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


class RopeEvaAttention(_EvaAttention):
    """timm ``EvaAttention`` whose ``rope`` argument carries the patch coordinates ``(M, c)`` (or ``(B, 1, M, c)``
    after patch dropout) instead of timm's sin/cos table: the ``Eva`` model passes whatever ``model.rope.get_embed``
    returns to every block, and :class:`GridCoordinates` returns coordinates.
    """

    pe: PositionEncoding
    rope_prefix: str

    def forward(self, x: Tensor, rope: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False) -> Tensor:
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        if self.qkv is not None:
            if self.q_bias is None:
                qkv = self.qkv(x)
            else:
                qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
                if getattr(self, "qkv_bias_separate", False):
                    qkv = self.qkv(x) + qkv_bias
                else:
                    qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
            qkv = qkv.reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
            q, k, v = qkv.unbind(0)  # (B, H, N, d) each
        else:
            q = self.q_proj(x).reshape(b, n, self.num_heads, -1).transpose(1, 2)  # (B, H, N, d)
            k = self.k_proj(x).reshape(b, n, self.num_heads, -1).transpose(1, 2)
            v = self.v_proj(x).reshape(b, n, self.num_heads, -1).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = encode_qk(self.pe, q, k, rope, self.num_prefix_tokens, self.rope_prefix)  # (B, H, N, d')
        x = _sdpa(self, q, k, v, attn_mask, is_causal)  # (B, H, N, d)
        x = x.transpose(1, 2).reshape(b, n, -1)  # (B, N, H * d)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


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
    """timm ``Eva`` with ropekit encodings (its forward is unchanged: ``model.rope`` yields coordinates)."""

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return set(super().no_weight_decay()) | _pe_no_weight_decay(self)


class GridCoordinates(nn.Module):
    """Replaces an ``Eva`` model's ``rope``: ``get_embed(shape=(gh, gw))`` returns the patch coordinates
    ``(gh * gw, 2)`` (row-major, ``(row, col)``) that ``Eva`` then hands to every block.
    """

    def __init__(self, mode: str, feat_shape: Sequence[int]) -> None:
        super().__init__()
        self.mode = mode
        self.feat_shape = list(feat_shape)
        self.register_buffer("_anchor", torch.empty(0), persistent=False)  # follows .to(device)

    def get_embed(self, shape: Optional[Sequence[int]] = None) -> Tensor:
        grid = self.feat_shape if shape is None else shape
        return grid_coords(grid, self.mode, device=self._anchor.device)  # (M, 2)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, feat_shape={tuple(self.feat_shape)}"


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
            ``forward`` (``VisionTransformer`` only).
        sharing: ``"model"`` (one encoding for every block), ``"layer"`` (one per block) or ``"head"`` (one per
            block, parameters per head).
        coords: ``"grid"`` (integer patch indices) or ``"normalized"`` (patch centres in ``[0, 1]``).
        prefix: ``"unrotated"`` or ``"centroid"`` (see the module docstring).
        init_identity: set every encoding parameter to zero and check that the encoding is then the identity,
            so the converted model computes exactly what ``model`` did (fine-tuning a pretrained checkpoint).
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
    if not inplace:
        model = copy.deepcopy(model)

    attn_cls = _TimmAttention if kind == "vit" else _EvaAttention
    for i, blk in enumerate(model.blocks):
        if type(blk.attn) is not attn_cls:
            raise TypeError(f"block {i}: attention {type(blk.attn).__name__} is not supported (expected "
                            f"{attn_cls.__name__})")
        if kind == "vit" and type(blk) not in _BLOCK_CLASSES:
            raise TypeError(f"block {i}: {type(blk).__name__} is not supported (expected Block or ResPostBlock)")

    if sharing == "head":
        pe_opts = {**pe_opts, "per_head": True}
    shared: Optional[PositionEncoding] = None
    for blk in model.blocks:
        attn = blk.attn
        head_dim = attn.head_dim
        if shared is not None and (shared.head_dim, shared.num_heads) != (head_dim, attn.num_heads):
            raise ValueError("sharing='model' needs the same head_dim and num_heads in every block")
        pe = shared if shared is not None else create_pe(name, head_dim=head_dim, coord_dim=coord_dim,
                                                         num_heads=attn.num_heads, **pe_opts)
        if init_identity and pe is not shared:
            _make_identity_(pe, name)
        p = next(attn.parameters())
        attn.pe = pe.to(device=p.device)
        attn.rope_prefix = prefix
        if kind == "vit":
            attn.rope_num_prefix_tokens = int(model.num_prefix_tokens)
            attn.__class__ = RopeAttention
            blk.__class__ = _BLOCK_CLASSES[type(blk)]
        else:
            attn.__class__ = RopeEvaAttention
        if sharing == "model":
            shared = pe

    if not keep_abs_pos:
        model.pos_embed = None
    if kind == "vit":
        model.rope_coord_mode = coords
        model.rope_coord_dim = coord_dim
        model.__class__ = RopeVisionTransformer
    else:
        if coord_dim != 2:
            raise ValueError("Eva models take their coordinates from the patch grid: coord_dim must be 2")
        model.rope = GridCoordinates(coords, model.patch_embed.grid_size).to(next(model.parameters()).device)
        model.rope_mixed = False
        model.__class__ = RopeEva
    return model


def encodings(model: nn.Module) -> List[PositionEncoding]:
    """The distinct encoding modules of a converted model (one with ``sharing="model"``)."""
    seen: Dict[int, PositionEncoding] = {}
    for m in model.modules():
        if isinstance(m, PositionEncoding) and id(m) not in seen:
            seen[id(m)] = m
    return list(seen.values())
