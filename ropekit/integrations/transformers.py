"""Any ropekit encoding inside a Hugging Face Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``apply_pe``.

Shape legend: ``N`` vision patches (all images and videos of a call, packed), ``B`` batch, ``L`` text length,
``H`` heads, ``d`` head dimension, ``c`` coordinate dimension (2 for the vision tower's ``(h, w)``, 3 for the
language model's ``(t, h, w)``; one more with a depth or time axis added).

What these models do and how ropekit holds it:

* The **vision tower** rotates q and k by 2-D axial RoPE over the patch indices ``(h, w)`` (``position_ids``
  ``(N, 2)``, laid out block-major over the spatial-merge blocks): ``inv_freq = theta^(-2n / (d/2))`` for
  ``n < d/4``, the first ``d/4`` frequencies on ``h``, the next ``d/4`` on ``w``, half-split pairs
  ``(x_j, x_{j+d/2})`` (``rotate_half``).
* The **language model** rotates by multimodal RoPE (M-RoPE) over ``position_ids`` ``(3, B, L)`` = ``(t, h, w)``
  (from ``get_rope_index``): pair ``j`` has frequency ``theta^(-2j/d)`` and reads one of the three axes, by
  contiguous sections ``mrope_section`` (Qwen2-VL, Qwen2.5-VL: ``[16, 24, 24]`` -> ``t t .. h h .. w w ..``) or
  interleaved (Qwen3-VL: ``t h w t h w ...`` for the first ``3 * section`` pairs, ``t`` for the rest).

Both are "pair ``n`` turns by ``sum_k r_k w_{k,n}``" with one nonzero ``w_{k,n}`` per pair: a ``mixed`` or
``cayley`` encoding (Cayley at ``S = 0``) with ``pairs="half"`` holds each exactly (:func:`vision_frequencies`,
:func:`mrope_frequencies`). :func:`apply_pe` re-classes the attention layers in place (every weight keeps its
``state_dict`` name; the encodings add ``...attn.pe.*`` / ``...self_attn.pe.*``) and replaces the model's rotary
module by one that hands the coordinates themselves to every layer. The attention then runs through the model's own
attention interface (``config._attn_implementation``: ``"sdpa"``, ``"eager"``, ``"flex_attention"``,
``"flash_attention_2"``), with the vision tower's packing (``cu_seqlens``) and Qwen2.5-VL's window attention kept.

Time coordinates need not be integers: the converted language model accepts float ``position_ids``
``(3, B, L)`` and computes its angles in fp32 from them (``get_rope_index`` truncates a video's time index
``t * seconds_per_grid * tokens_per_second`` to an integer; pass the real value instead, see
:func:`video_time_index`).

Example::

    model = Qwen2VLForConditionalGeneration(small_config)        # or .from_pretrained(...)
    apply_pe(model, "cayley")                                    # in place; vision tower and language model
"""

from __future__ import annotations

import copy
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._optional import require
from ..encodings import PositionEncoding, create_pe
from ._common import encodings

_tf = require("transformers", "transformers", "ropekit.integrations.transformers")

__all__ = ["apply_pe", "encodings", "vision_frequencies", "mrope_frequencies", "hf_cos_sin", "video_time_index",
           "RopeVisionAttention", "RopeTextAttention", "Coordinates", "PARTS"]

#: What :func:`apply_pe` converts: ``"vision"`` (the vision tower), ``"text"`` (the language model's M-RoPE).
PARTS = ("vision", "text")


# ---------------------------------------------------------------------------------------------- frequencies
def vision_frequencies(head_dim: int, theta: float = 10000.0, coord_dim: int = 2) -> Tensor:
    """The Qwen-VL vision tower's axial RoPE as ropekit frequencies ``(coord_dim, d/2)`` for half-split pairs.

    Pair ``j`` (channels ``j, j + d/2``) turns by ``h * inv[j]`` for ``j < d/4`` and ``w * inv[j - d/4]`` after,
    ``inv[n] = theta^(-2n / (d/2))`` (computed in fp32 as transformers does). Axes beyond the second (depth, time)
    get zero frequencies: the encoding ignores them until trained.
    """
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4, got {head_dim}")
    spatial = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))  # (d/4,)
    freqs = torch.zeros(coord_dim, head_dim // 2)
    freqs[0, : head_dim // 4] = inv
    freqs[1, head_dim // 4:] = inv
    return freqs


def mrope_frequencies(head_dim: int, mrope_section: Sequence[int], theta: float = 10000.0,
                      interleaved: bool = False, coord_dim: int = 3) -> Tensor:
    """Multimodal RoPE as ropekit frequencies ``(coord_dim, d/2)`` over ``(t, h, w)``, half-split pairs.

    ``interleaved=False`` (Qwen2-VL, Qwen2.5-VL): pairs ``[0, s_t)`` read ``t``, the next ``s_h`` read ``h``, the
    next ``s_w`` read ``w``. ``interleaved=True`` (Qwen3-VL): pair ``j`` reads ``h`` if ``j % 3 == 1`` and
    ``j < 3 s_h``, ``w`` if ``j % 3 == 2`` and ``j < 3 s_w``, else ``t``. Frequencies ``theta^(-2j/d)``.
    """
    d2 = head_dim // 2
    if len(mrope_section) != 3 or (not interleaved and sum(mrope_section) != d2):
        raise ValueError(f"mrope_section must be 3 sections summing to head_dim / 2 = {d2}, got {list(mrope_section)}")
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # (d/2,)
    axis = torch.zeros(d2, dtype=torch.long)
    if interleaved:
        j = torch.arange(d2)
        axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    else:
        axis[mrope_section[0]: mrope_section[0] + mrope_section[1]] = 1
        axis[mrope_section[0] + mrope_section[1]:] = 2
    freqs = torch.zeros(coord_dim, d2)
    freqs[axis, torch.arange(d2)] = inv
    return freqs


def hf_cos_sin(pe: PositionEncoding, coords: Tensor) -> Tuple[Tensor, Tensor]:
    """The ``(cos, sin)`` tables transformers would use, from a RoPE-family encoding's frequencies.

    ``coords`` ``(..., c)``; returns ``(..., d)`` each in transformers' ``rotate_half`` layout
    (``[cos theta_0 .. cos theta_{d/2-1}, cos theta_0 ..]``), ``theta_j = sum_k r_k w_{k,j}`` in fp32 (fp64 for fp64
    coordinates). For checking an encoding against a model's rotary module; the converted model never builds them.
    """
    freqs = pe.rope_form().freqs  # (Hp, c, d/2)
    if freqs.shape[0] != 1:
        raise ValueError("hf_cos_sin needs frequencies shared by the heads")
    dtype = torch.float64 if coords.dtype == torch.float64 else torch.float32
    theta = coords.to(dtype) @ freqs[0].to(dtype)  # (..., d/2)
    theta = torch.cat([theta, theta], dim=-1)  # (..., d)
    return theta.cos(), theta.sin()


def video_time_index(num_frames: int, seconds_per_grid: float, tokens_per_second: float,
                     start: float = 0.0) -> Tensor:
    """Real-valued time coordinates ``(num_frames,)`` of a video's temporal grid: ``start + t * seconds_per_grid
    * tokens_per_second`` -- what Qwen2.5-VL's ``get_rope_index`` computes before truncating it to an integer."""
    return start + torch.arange(num_frames, dtype=torch.float64) * float(seconds_per_grid) * float(tokens_per_second)


# ---------------------------------------------------------------------------------------------- modules
class Coordinates(nn.Module):
    """Replaces a Qwen-VL rotary module: ``forward(x, position_ids)`` returns ``(coords,)`` instead of
    ``(cos, sin)``, the coordinates as float32 ``(N, c)`` (vision: ``position_ids`` ``(N, c)``) or ``(B, L, c)``
    (text: ``position_ids`` ``(3, B, L)``, or ``(c, B, L)`` with more axes), which the model hands to every layer.
    A 1-tuple, because Qwen2.5-VL reorders each element of it for its window attention.

    ``text=True`` with ``coord_dim > 3``: ids with only 3 axes get zeros on the extra ones.
    """

    def __init__(self, text: bool, coord_dim: int) -> None:
        super().__init__()
        self.text = text
        self.coord_dim = coord_dim

    def forward(self, x: Tensor, position_ids: Tensor) -> Tuple[Tensor]:
        if self.text:
            ids = position_ids.expand(3, -1, -1) if position_ids.shape[0] == 1 else position_ids  # (c', B, L)
            coords = ids.permute(1, 2, 0)  # (B, L, c')
        else:
            coords = position_ids  # (N, c')
        coords = coords.float()
        if coords.shape[-1] < self.coord_dim:
            pad = coords.new_zeros(*coords.shape[:-1], self.coord_dim - coords.shape[-1])
            coords = torch.cat([coords, pad], dim=-1)
        elif coords.shape[-1] != self.coord_dim:
            raise ValueError(f"position ids with {coords.shape[-1]} axes for encodings over {self.coord_dim}")
        return (coords,)

    def extra_repr(self) -> str:
        return f"text={self.text}, coord_dim={self.coord_dim}"


def _coords(position_embeddings: Any) -> Tensor:
    if not (isinstance(position_embeddings, tuple) and len(position_embeddings) == 1):
        raise ValueError("this attention layer has a ropekit encoding but received (cos, sin): run it inside the "
                         "converted model (apply_pe replaces the model's rotary module)")
    return position_embeddings[0]


def _modeling(module: nn.Module) -> Any:
    """The transformers modeling module that defines ``module``'s class (its attention helpers live there)."""
    for cls in type(module).__mro__:
        mod = sys.modules.get(cls.__module__)
        if mod is not None and hasattr(mod, "eager_attention_forward"):
            return mod
    raise TypeError(f"{type(module).__name__} is not a transformers attention module")


class RopeVisionAttention(nn.Module):
    """A Qwen-VL vision attention (``VisionAttention``, ``Qwen2_5_VLVisionAttention``, ``Qwen3VLVisionAttention``)
    with ``self.pe`` in place of the rotary table: the same forward, q and k encoded by ``pe``.

    Built by :func:`apply_pe`, which re-classes an existing layer into a subclass of its own class; never
    constructed directly.
    """

    pe: PositionEncoding

    def forward(self, hidden_states: Tensor, cu_seqlens: Tensor, position_embeddings: Any = None,
                max_seqlen: Optional[int] = None, **kwargs: Any) -> Tensor:
        mod = _modeling(self)
        n = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)  # (N, H, d)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, N, d)
        q, k = self.pe(q, k, _coords(position_embeddings))  # fp32 rotation, input dtype out
        interface: Callable = mod.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                        mod.eager_attention_forward)
        drop = 0.0 if not self.training else self.attention_dropout
        if mod.is_flash_attention_requested(self.config):  # packed: one call with the sequence boundaries
            max_seqlen = mod.get_max_seqlen(cu_seqlens, self.config, kwargs={"max_seqlen": max_seqlen})
            out, _ = interface(self, q, k, v, attention_mask=None, scaling=self.scaling, dropout=drop,
                               cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen,
                               max_length_k=max_seqlen, is_causal=False, **kwargs)
        else:  # one call per image / video
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            parts = [torch.split(t, lengths, dim=2) for t in (q, k, v)]
            out = torch.cat([interface(self, qi, ki, vi, attention_mask=None, scaling=self.scaling, dropout=drop,
                                       is_causal=False, **kwargs)[0] for qi, ki, vi in zip(*parts)], dim=1)
        return self.proj(out.reshape(n, -1).contiguous())  # (N, D)


class RopeTextAttention(nn.Module):
    """A Qwen-VL language-model attention (``Qwen2VLAttention``, ``Qwen2_5_VLAttention``, ``Qwen3VLTextAttention``)
    with ``self.pe`` over ``(t, h, w)`` in place of M-RoPE's table; keys are encoded before the KV cache, as
    transformers does, so generation with a cache works.
    """

    pe: PositionEncoding

    def forward(self, hidden_states: Tensor, position_embeddings: Any = None, attention_mask: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None, cache: Any = None, **kwargs: Any) -> Tuple[Tensor, Any]:
        mod = _modeling(self)
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        kwargs.pop("use_cache", None)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k = self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape)  # (B, L, H, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, L, d), (B, Hkv, L, d)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = self.pe(q, k, _coords(position_embeddings))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        interface: Callable = mod.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                        mod.eager_attention_forward)
        extra = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}
        if position_ids is not None:
            extra["position_ids"] = position_ids
        out, weights = interface(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                                 self.attention_dropout, scaling=self.scaling, **extra, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


# ---------------------------------------------------------------------------------------------- conversion
def _towers(model: nn.Module) -> Tuple[Optional[nn.Module], Optional[nn.Module]]:
    """``(vision tower, language model)`` of a Qwen-VL model, its ``.model``, or either part alone."""
    vision = text = None
    for m in model.modules():
        if vision is None and hasattr(m, "rotary_pos_emb") and hasattr(m, "blocks"):
            vision = m
        if text is None and hasattr(m, "rotary_emb") and hasattr(m, "layers"):
            text = m
    return vision, text


def _new_pe(name: str, freqs: Tensor, heads: int, head_dim: int, init_identity: bool,
            pe_opts: Dict[str, Any]) -> PositionEncoding:
    coord_dim = freqs.shape[0]
    pe = create_pe(name, head_dim=head_dim, coord_dim=coord_dim, num_heads=heads, pairs="half", **pe_opts)
    if init_identity:
        target = getattr(pe, "freq_param", None)
        if not isinstance(target, nn.Parameter) or tuple(target.shape[-2:]) != tuple(freqs.shape):
            raise ValueError(f"init_identity: {name!r} has no learnable frequency for every pair and axis, so it cannot "
                             f"start as the model's rotary embedding; use 'mixed' or 'cayley'")
        with torch.no_grad():
            for p in pe.parameters():
                p.zero_()
            target.copy_(freqs.to(target).expand_as(target))
    return pe


def apply_pe(model: nn.Module, name: str = "cayley", *, parts: Sequence[str] = PARTS, init_identity: bool = True,
             sharing: str = "model", extra_axes: int = 0, inplace: bool = True, **pe_opts: Any) -> nn.Module:
    """Make the attention of a Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) apply the ropekit encoding ``name``.

    Args:
        model: a ``Qwen*VLForConditionalGeneration``, its ``.model``, a vision tower or a language model.
        name: a ``ropekit.create_pe`` name; with ``init_identity`` one with a free frequency per pair and axis
            (``mixed``, ``cayley``).
        parts: which of ``"vision"`` and ``"text"`` to convert.
        init_identity: start each encoding as the model's own rotary embedding (function-preserving);
            ``False``: a freshly initialised encoding.
        sharing: ``"model"`` (one encoding per tower) or ``"layer"`` (one per layer).
        extra_axes: coordinate axes added after the model's own (the vision tower's ``(h, w)``, the language
            model's ``(t, h, w)``) with zero frequencies, e.g. 1 for depth: the converted model then takes
            ``position_ids`` with the extra axes (vision tower: ``(N, 2 + extra_axes)`` through ``forward(...,
            position_ids=...)``) and starts as the model without them.
        inplace: convert ``model`` itself (default) or a deep copy.
        **pe_opts: options of the encoding (``ropekit.pe_options(name)``).

    Returns:
        The converted model.

    Raises:
        TypeError: no Qwen-VL vision tower or language model found, or one converted already.
        ValueError: a bad option.
    """
    if sharing not in ("model", "layer"):
        raise ValueError(f"sharing must be 'model' or 'layer', got {sharing!r}")
    if not set(parts) <= set(PARTS) or not parts:
        raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {parts!r}")
    if not isinstance(extra_axes, int) or extra_axes < 0:
        raise ValueError(f"extra_axes must be a non-negative int, got {extra_axes!r}")
    if not inplace:
        model = copy.deepcopy(model)
    vision, text = _towers(model)
    if "vision" in parts and vision is None and "text" in parts and text is None:
        raise TypeError(f"{type(model).__name__} has no Qwen-VL vision tower or language model")
    if "vision" in parts and vision is not None:
        if isinstance(vision.rotary_pos_emb, Coordinates):
            raise TypeError("this vision tower has ropekit encodings already")
        cfg = vision.config
        attn0 = vision.blocks[0].attn
        theta = float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None) else 10000.0
        freqs = vision_frequencies(attn0.head_dim, theta, 2 + extra_axes)
        _convert_layers([blk.attn for blk in vision.blocks], RopeVisionAttention, name, freqs, init_identity,
                        sharing, pe_opts)
        vision.rotary_pos_emb = Coordinates(False, 2 + extra_axes)
    if "text" in parts and text is not None:
        if isinstance(text.rotary_emb, Coordinates):
            raise TypeError("this language model has ropekit encodings already")
        rot = text.rotary_emb
        attn0 = text.layers[0].self_attn
        head_dim = int(attn0.head_dim)
        if getattr(rot, "rope_type", "default") != "default" or float(getattr(rot, "attention_scaling", 1.0)) != 1.0:
            raise ValueError(f"the language model's rope_type {rot.rope_type!r} scales its frequencies or tables; only "
                             f"'default' M-RoPE is reproduced")
        interleaved = type(rot).recomposition_frequencies.__qualname__.startswith("Qwen3")
        theta = float(rot.config.rope_parameters["rope_theta"])
        freqs = mrope_frequencies(head_dim, list(rot.mrope_section), theta, interleaved, 3 + extra_axes)
        inv = rot.inv_freq.detach().float().cpu()  # check against the model's own frequencies
        if not torch.allclose(freqs.abs().sum(0), inv, rtol=1e-6, atol=0):
            raise ValueError("the language model's inverse frequencies are not theta^(-2j/d): not default M-RoPE")
        _convert_layers([layer.self_attn for layer in text.layers], RopeTextAttention, name, freqs, init_identity,
                        sharing, pe_opts)
        text.rotary_emb = Coordinates(True, 3 + extra_axes)
    return model


def _convert_layers(attns: List[nn.Module], mixin: type, name: str, freqs: Tensor, init_identity: bool,
                    sharing: str, pe_opts: Dict[str, Any]) -> None:
    shared: Optional[PositionEncoding] = None
    for attn in attns:
        heads = int(getattr(attn, "num_heads", 0) or attn.config.num_attention_heads)
        pe = shared if shared is not None else _new_pe(name, freqs, heads, int(attn.head_dim), init_identity,
                                                       pe_opts)
        if sharing == "model":
            shared = pe
        param = next(attn.parameters())
        attn.pe = pe.to(device=param.device)
        attn.__class__ = _subclass(type(attn), mixin)


_SUBCLASSES: Dict[Tuple[type, type], type] = {}


def _subclass(base: type, mixin: type) -> type:
    """``mixin``'s forward on ``base`` (kept in ``base``'s module, so the attention helpers resolve), cached."""
    key = (base, mixin)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"Rope{base.__name__}", (mixin, base), {"__module__": base.__module__,
                                                                        "__doc__": mixin.__doc__})
    return _SUBCLASSES[key]
