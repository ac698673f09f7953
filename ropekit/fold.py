"""Inference folding: every commuting STRING is RoPE in a learned basis, so at inference it costs what RoPE costs.

SPEC §2: a commuting encoding satisfies ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P`` for one orthogonal ``P``
(per head) and a frequency matrix ``freqs``. Attention only sees ``R(r_i)^T R(r_j)``, so the folded
encoding ``R'(r) = RoPE_freqs(r) P`` gives the same logits -- and ``P`` can be merged into the query and key
projection weights once, leaving a fixed-frequency RoPE rotation (the axial RoPE code path) at inference.

* :func:`to_rope` -- ``(P (H, d, d), freqs (H, c, d/2))`` of any commuting encoding (each encoding's
  ``to_rope()`` method where it has one: cayley, circulant, comrope-ap/ld, liere when it commutes, and the RoPE
  family with ``P = I``; general STRING and exact relaxed STRING are handled here).
* :class:`FoldedRoPE` -- the fixed-frequency RoPE that is left, with the transform of prefix tokens.
* :func:`fold_pe` -- ``(FoldedRoPE, P)`` for one encoding: ``folded(P q, P k, coords)`` has the logits of
  ``pe(q, k, coords)``.
* :func:`fold` -- a model (or an encoding) in, a folded copy out: in every ``ropekit.nn.Attention`` the basis is
  merged into the q and k rows of the ``qkv`` projection and the encoding replaced by a :class:`FoldedRoPE`.

Prefix tokens (CLS, registers) are left unrotated by every encoding. After folding, their q and k carry the
basis ``P`` too, so the folded encoding applies ``T = P R(0)^T P^T`` to them (from ``R(s) = R(0) P^T RoPE(s) P``):
the identity when ``R(0) = I`` (circulant, comrope, general STRING), ``P^T`` for encodings with a post-rotation
(cayley and exact relaxed STRING, ``R(0) = P``) -- one ``d x d`` product for the few prefix tokens, and every
logit (prefix-prefix, prefix-patch, patch-patch) is unchanged.

Only softmax attention (``ropekit.nn.Attention``) is folded: with linear attention the feature map is applied
to the rotated queries and keys, so the left ``P`` is not redundant (SPEC §2). Folded models are for inference:
their frequencies and basis are fixed (persistent buffers, saved with ``state_dict``), not trained.
"""

from __future__ import annotations

import copy
from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .encodings import PositionEncoding
from .encodings.functional import basis_change
from .encodings.rope import FrequencyRoPE

__all__ = ["to_rope", "FoldedRoPE", "fold_pe", "fold", "is_foldable"]


def to_rope(pe: PositionEncoding) -> Tuple[Tensor, Tensor]:
    """``(P, freqs)`` with ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P`` for a commuting encoding.

    Returns:
        ``P`` ``(H, d, d)`` orthogonal and ``freqs`` ``(H, c, d/2)`` (pair ``n`` of ``P x`` turns by
        ``sum_k r_k freqs[k, n]``, as in ``functional.rotate_pairs``), detached, in the encoding's dtype.

    Raises:
        ValueError: for an encoding that does not commute (LieRE with ``c >= 2`` and blocks > 2, relaxed STRING
            in its relaxed configuration) or is not a rotation (the tensor-product encoding).
    """
    if not isinstance(pe, PositionEncoding):
        raise ValueError(f"to_rope needs a PositionEncoding, got {type(pe).__name__}")
    if not pe.is_rotation:
        raise ValueError(f"{pe.name} is not a rotation (it widens q and k): it has no RoPE form")
    if hasattr(pe, "to_rope"):
        return pe.to_rope()
    from .encodings.relaxed import RelaxedSTRING
    from .encodings.string import GeneralSTRING

    with torch.no_grad():
        if isinstance(pe, GeneralSTRING):  # L_k = Q D_k Q^T: R(r) = Q RoPE(r) Q^T, so P = Q^T
            p = pe.basis().transpose(-1, -2)
            freqs = pe.freq_param
        elif isinstance(pe, RelaxedSTRING) and pe.exact:  # R(r) = RoPE_active(r) P_sp, null pairs never turn
            p = pe.post_rotation_matrix()[: pe.param_heads]
            f = pe.freq_param  # (Hp, c, m)
            freqs = torch.cat([f, f.new_zeros(*f.shape[:2], pe.head_dim // 2 - f.shape[-1])], dim=-1)
        else:
            raise ValueError(f"{pe.name} does not commute (R(r)^T R(s) is not a function of s - r): "
                             f"it cannot be written as RoPE in a fixed basis")
    h = pe.num_heads
    return p.detach().expand(h, -1, -1), freqs.detach().expand(h, -1, -1)


def is_foldable(pe: Optional[PositionEncoding]) -> bool:
    """Whether :func:`to_rope` succeeds for ``pe`` (``None`` -- no encoding -- is trivially foldable)."""
    if pe is None:
        return True
    try:
        to_rope(pe)
    except ValueError:
        return False
    return True


class FoldedRoPE(FrequencyRoPE):
    """RoPE with fixed frequencies: what a commuting STRING leaves after :func:`fold` (``name="folded"``).

    Args:
        head_dim, coord_dim, num_heads: as every encoding.
        freqs: ``(Hp, c, d/2)`` with ``Hp`` 1 or ``num_heads``.
        prefix_matrix: ``(Hp, d, d)`` applied to prefix tokens (``T = P R(0)^T P^T``), or ``None`` for the identity.

    The frequencies and the prefix matrix are persistent buffers: they are the folded model's weights, not
    caches derived from parameters.
    """

    name = "folded"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int, freqs: Tensor,
                 prefix_matrix: Optional[Tensor] = None) -> None:
        hp = freqs.shape[0]
        if freqs.dim() != 3 or hp not in (1, num_heads) or freqs.shape[1:] != (coord_dim, head_dim // 2):
            raise ValueError(f"freqs must have shape (1 or {num_heads}, {coord_dim}, {head_dim // 2}), "
                             f"got {tuple(freqs.shape)}")
        super().__init__(head_dim, coord_dim, num_heads, per_head=hp > 1)
        self.register_buffer("freq_table", freqs.detach().clone())
        if prefix_matrix is not None:
            if prefix_matrix.shape[0] not in (1, num_heads) or prefix_matrix.shape[1:] != (head_dim, head_dim):
                raise ValueError(f"prefix_matrix must have shape (1 or {num_heads}, {head_dim}, {head_dim}), "
                                 f"got {tuple(prefix_matrix.shape)}")
            prefix_matrix = prefix_matrix.detach().clone()
        self.register_buffer("prefix_matrix", prefix_matrix)

    @property
    def freqs(self) -> Tensor:
        return self.freq_table

    def _transform_prefix(self, x: Tensor) -> Tensor:
        if self.prefix_matrix is None:
            return x
        return basis_change(x, self.prefix_matrix.to(x.dtype))  # (B, H, P0, d)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", prefix_matrix={self.prefix_matrix is not None}"


def _shared(t: Tensor) -> Tensor:
    """``(H, ...)`` -> ``(1, ...)`` when every head holds the same values."""
    return t[:1] if bool((t == t[:1]).all()) else t


def fold_pe(pe: PositionEncoding) -> Tuple[FoldedRoPE, Tensor]:
    """Fold one encoding: ``(folded, P)`` with ``folded(P q, P k, coords)`` giving the logits of ``pe(q, k, coords)``.

    ``P`` is ``(H, d, d)``; apply it per head (``functional.basis_change(q, P)``) or merge it into the projection
    that produces ``q`` and ``k`` (what :func:`fold` does). Prefix tokens are handled by ``folded`` (see the
    module docstring).
    """
    p, freqs = to_rope(pe)
    p64 = p.double()
    post = pe.post_rotation_matrix()
    prefix = None
    if post is not None:  # T = P R(0)^T P^T
        prefix = (p64 @ post.detach().double().transpose(-1, -2) @ p64.transpose(-1, -2)).to(p.dtype)
        prefix = _shared(prefix)
    folded = FoldedRoPE(pe.head_dim, pe.coord_dim, pe.num_heads, _shared(freqs.contiguous()), prefix)
    folded.to(device=p.device)
    return folded, p


def _is_plain_rope(pe: PositionEncoding) -> bool:
    """RoPE already (axial, mixed, liere-commute, none, folded): ``P = I`` and no post-rotation."""
    if isinstance(pe, FoldedRoPE):
        return True
    if not isinstance(pe, FrequencyRoPE) or pe.post_rotation_matrix() is not None:
        return False
    p, _ = pe.to_rope()
    return bool(torch.equal(p, torch.eye(pe.head_dim, dtype=p.dtype, device=p.device).expand_as(p)))


def _fold_into_qkv(qkv: nn.Linear, p: Tensor, num_heads: int, head_dim: int) -> None:
    """Replace the q and k rows of a fused ``(3 D, D_in)`` projection by ``P_h W_h`` (and the biases by ``P_h b_h``)."""
    dim = num_heads * head_dim
    p64 = p.to(torch.float64)  # (H, d, d)
    with torch.no_grad():
        w = qkv.weight
        for part in (0, 1):  # q rows [0, D), k rows [D, 2D)
            rows = slice(part * dim, (part + 1) * dim)
            wh = w[rows].to(torch.float64).view(num_heads, head_dim, -1)  # (H, d, D_in)
            w[rows] = (p64 @ wh).reshape(dim, -1).to(w.dtype)
            if qkv.bias is not None:
                bh = qkv.bias[rows].to(torch.float64).view(num_heads, head_dim, 1)
                qkv.bias[rows] = (p64 @ bh).reshape(dim).to(qkv.bias.dtype)


def fold(obj: Union[nn.Module, PositionEncoding], *, inplace: bool = False,
         strict: bool = True) -> Union[nn.Module, Tuple[FoldedRoPE, Tensor]]:
    """Fold the learned basis of every commuting encoding into the query/key projections, for inference.

    Args:
        obj: a model holding ``ropekit.nn.Attention`` layers (e.g. a ``VisionTransformer``), or one encoding.
        inplace: modify ``obj`` instead of a deep copy (models only).
        strict: raise on an encoding that cannot be folded (non-commuting, tensor-product) or on an encoding
            held by a layer other than ``ropekit.nn.Attention``; with ``strict=False`` those are left unchanged.

    Returns:
        For a model: the folded model (logits equal the original's up to float rounding; eval mode is not
        changed). Encodings with ``P = I`` (axial, mixed, liere-commute, already folded) are kept as they are;
        an encoding shared by several layers becomes one shared :class:`FoldedRoPE`.
        For an encoding: ``(FoldedRoPE, P)`` as :func:`fold_pe`.

    Raises:
        ValueError: see ``strict``.
    """
    if isinstance(obj, PositionEncoding):
        return fold_pe(obj)
    if not isinstance(obj, nn.Module):
        raise ValueError(f"fold needs an nn.Module or a PositionEncoding, got {type(obj).__name__}")
    from .nn.attention import Attention

    model = obj if inplace else copy.deepcopy(obj)
    done: dict = {}
    layers = [m for m in model.modules() if isinstance(getattr(m, "pe", None), PositionEncoding)]
    for m in layers:
        pe = m.pe
        if _is_plain_rope(pe):  # already RoPE (P = I): nothing to fold
            continue
        if not isinstance(m, Attention):
            if strict:
                raise ValueError(f"cannot fold the encoding of a {type(m).__name__}: only ropekit.nn.Attention "
                                 f"(softmax attention with a fused qkv projection) is supported")
            continue
        if id(pe) not in done:
            if not is_foldable(pe):
                if strict:
                    to_rope(pe)  # raises with the reason
                continue
            done[id(pe)] = fold_pe(pe)
        folded, p = done[id(pe)]
        _fold_into_qkv(m.qkv, p.to(m.qkv.weight.device), m.num_heads, m.head_dim)
        m.pe = folded
    return model
