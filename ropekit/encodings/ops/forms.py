"""The RoPE form of a commuting encoding, ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P``, and the pieces every encoding's
``rope_form`` builds it from.

Each encoding writes its own form (``PositionEncoding.rope_form``, ``rope_kind`` says which kind it is, ``None``
when it has none); this module holds what they share: the :class:`RoPEForm` record, the frequencies read off the
generators in a basis, the prefix transform, the pair permutation, and the eigenbasis form of block encodings
(ComRoPE, one-axis LieRE). Folding (:mod:`ropekit.encodings.fold`) consumes the forms.

Shape legend: ``Hp`` heads that own parameters (1 or ``H``), ``c`` coordinate dimension, ``d`` head dimension,
``nb`` blocks of size ``b``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .angles import wide_dtype
from .blocks import block_diag
from .products import precise_matmul
from .skew import real_schur, skew_real_schur

__all__ = ["RoPEForm", "BlockEigenForm", "pair_frequencies", "basis_form", "post_form", "half_pairs_basis",
           "block_form", "stacked_block_form", "no_rope_form", "param_heads", "stack_layers"]


class BlockEigenForm(NamedTuple):
    """What the folded rotation of a block encoding (ComRoPE, one-axis LieRE) needs for exact gradients.

    Block ``j`` of ``R(r)`` is ``expm(s_j(r) K_j)`` with ``s_j(r) = sum_k r_k axis_weights[k, j]``. The basis
    ``Q`` and the frequencies ``mu`` (``K_j = Q_j blockdiag_n(mu_{j,n} J) Q_j^T``) are constants of this forward
    pass; the gradient reaches ``K`` and the axis weights through the exponential
    (``blocks.rotate_in_block_eigenbasis``), never through an eigenvector derivative.

    Attributes:
        generators: ``K`` ``(Hp, nb, b, b)``, differentiable.
        axis_weights: ``(Hp, c, nb)``, differentiable (one-hot for comrope-ap, ones for one-axis LieRE).
        schur: ``Q`` ``(Hp, nb, b, b)`` float64, constant.
        mu: ``(Hp, nb, b/2)`` float64, constant.
        scales, collector: set by ``blocks.share_block_gradients`` for one set of coordinates: the scalars
            ``s_j(r)`` ``(Bs, Hp, M, nb)`` of every token and the node that gathers the gradients of every layer
            using this form, to map their sum to ``K`` and ``s`` once (``None``: each rotation maps its own).
    """

    generators: Tensor
    axis_weights: Tensor
    schur: Tensor
    mu: Tensor
    scales: Optional[Tensor] = None
    collector: Optional[Tensor] = None


class RoPEForm(NamedTuple):
    """A commuting encoding written as RoPE in a basis, for one forward pass (``PositionEncoding.rope_form``).

    Attributes:
        basis: ``P`` ``(Hp, d, d)`` orthogonal (``(1, d, d)`` when it does not depend on the head), or ``None``
            when ``P = I`` (the RoPE family).
        freqs: ``(Hp, c, d/2)``: pair ``n`` of ``P x`` turns by ``sum_k r_k freqs[k, n]``. The parameters' dtype
            where they are parameters; float64 where they are derived from parameters (circulant's mode
            frequencies), since a float32 rounding of a frequency turns by ``r * ulp(freq)`` at coordinate ``r``
            (~1e-3 rad at 10^4); ``fold.frequency_rope`` forms the angles in float64 and rotates in q's dtype.
        prefix: ``T = P R(0)^T P^T`` ``(Hp, d, d)`` for prefix tokens whose q and k already carry ``P``, or
            ``None`` for the identity (``R(0) = I``).
        pairs: the pair convention of the frequency rotation (``"half"`` only for a RoPE-family encoding
            configured with half-split pairs; with a basis, the permutation to interleaved pairs is in ``P``).
        blocks: ``(Hp, nb, b, b)`` with ``basis = blockdiag(blocks)``, when ``P`` is block diagonal (comrope and
            one-coordinate LieRE with interleaved pairs), else ``None``. ``fold.fold_qkv_weight`` then merges the
            blocks, ``d / b`` times fewer products than the dense ``P``.
        eigen: for comrope and one-coordinate LieRE (``rope_form()``), the :class:`BlockEigenForm` that
            ``fold.frequency_rope`` rotates with; ``basis``, ``blocks`` and ``freqs`` are then constants (the
            eigenbasis has no derivative where frequencies coincide, so the gradient takes another way).

    ``Hp`` is 1 when the encoding's parameters are shared by its heads, else ``H``. Every tensor is differentiable
    in the encoding's parameters, except where ``eigen`` is set.
    """

    basis: Optional[Tensor]
    freqs: Tensor
    prefix: Optional[Tensor]
    pairs: str = "interleaved"
    blocks: Optional[Tensor] = None
    eigen: Optional[BlockEigenForm] = None


class _StackLayers(torch.autograd.Function):
    """``torch.stack(tensors)`` whose backward hands the gradient back as one ``unbind`` (``torch.stack``'s takes one
    ``select`` per tensor: ``L`` operations, each a dispatch on the host, for the ``L`` layers' parameters). A
    gradient that is not contiguous (a slice of a larger one) is made so once: each layer's slice then has its
    parameter's layout, which spares gradient accumulation a copy per layer."""

    @staticmethod
    def forward(ctx, *tensors: Tensor) -> Tensor:
        return torch.stack(tensors)

    @staticmethod
    def backward(ctx, g: Tensor):
        return (g if g.is_contiguous() else g.contiguous()).unbind(0)


def stack_layers(tensors) -> Tensor:
    """``torch.stack(tensors)`` (``L`` tensors of one shape, e.g. the same parameter of every layer), differentiable,
    with a one-operation backward (``_StackLayers``) where a gradient is recorded; values and gradients are
    ``torch.stack``'s."""
    tensors = list(tensors)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and not torch.compiler.is_compiling():
        return _StackLayers.apply(*tensors)
    return torch.stack(tensors)


def param_heads(t: Tensor, hp: int) -> Tensor:
    """The first ``hp`` heads of ``t`` ``(H, ...)``: ``t`` itself when it has ``hp`` already (a slice would be one
    more operation forward and a zero-filled buffer backward, at every step)."""
    return t if t.shape[0] == hp else t[:hp]


def no_rope_form(pe) -> ValueError:
    """The error of ``rope_form`` / ``to_rope`` for an encoding ``pe`` without a RoPE form."""
    if not pe.is_rotation:
        return ValueError(f"{pe.name} is not a rotation (it widens q and k): it has no RoPE form")
    return ValueError(f"{pe.name} does not commute (R(r)^T R(s) is not a function of s - r): "
                      f"it cannot be written as RoPE in a fixed basis")


def pair_frequencies(gen: Tensor, basis: Optional[Tensor]) -> Tensor:
    """Frequencies ``(Hp, c, d/2)`` of generators ``(Hp, c, d, d)`` in the basis ``P``: ``(P L_k P^T)[2n+1, 2n]``.

    Exact where ``P L_k P^T`` is 2x2-block diagonal, and so is its derivative: a change of ``P`` adds a
    commutator with the block-diagonal matrix, whose diagonal 2x2 blocks vanish (rotations of a plane commute).
    """
    if basis is None:
        g = gen
    else:  # float32-accurate also where float32 products run in TF32
        g = precise_matmul(precise_matmul(basis.unsqueeze(1), gen), basis.transpose(-1, -2).unsqueeze(1))
    return g[..., 1::2, 0::2].diagonal(dim1=-2, dim2=-1)  # (Hp, c, d/2)


def half_pairs_basis(pe, basis: Tensor) -> Tensor:
    """``P Pi`` for an encoding ``pe`` configured with half-split pairs (``R_half(r) = Pi^T R(r) Pi``), else ``P``.

    ``T`` is unchanged by the permutation: ``Pi`` cancels in ``P Pi Pi^T R(0)^T Pi Pi^T P^T``.
    """
    if pe.pairs != "half":
        return basis
    d = pe.head_dim
    order = torch.cat([torch.arange(0, d, 2, device=basis.device), torch.arange(1, d, 2, device=basis.device)])
    return basis[..., order]


def post_form(pe, basis: Tensor) -> RoPEForm:
    """The RoPE form of an encoding ``R(r) = RoPE(r) P`` with frequencies ``pe.freqs``, from its ``P``
    ``(Hp, d, d)``: ``R(0) = P``, so the prefix transform is ``T = P P^T P^T = P^T`` (no product needed)."""
    return RoPEForm(half_pairs_basis(pe, basis), param_heads(pe.freqs, pe.param_heads), basis.transpose(-1, -2))


def basis_form(pe, basis: Tensor, post: Optional[Tensor] = None, blocks: Optional[Tensor] = None) -> RoPEForm:
    """The RoPE form from the basis ``P`` ``(Hp, d, d)``: frequencies ``P L_k P^T`` read off ``pe.generators()``,
    the prefix transform ``T = P R(0)^T P^T`` from ``R(0)`` (``post``, else ``pe.post_rotation_matrix()``)."""
    hp = pe.param_heads
    prefix: Optional[Tensor] = None
    freqs = pair_frequencies(pe.generators()[:hp], basis)  # (Hp, c, d/2)
    if post is None:
        post = pe.post_rotation_matrix()
    if post is not None:  # T = P R(0)^T P^T
        post = post[:hp]
        prefix = precise_matmul(precise_matmul(basis, post.transpose(-1, -2)), basis.transpose(-1, -2))
    if pe.pairs == "half":  # the permutation breaks the block structure
        blocks = None
    return RoPEForm(half_pairs_basis(pe, basis), freqs, prefix, blocks=blocks)


def block_form(pe, k: Tensor, axis_weights: Tensor, basis_gradient: bool = False,
               schur: Optional[tuple[Tensor, Tensor]] = None) -> RoPEForm:
    """The RoPE form of a block encoding, block ``j`` of ``R(r)`` being ``expm(s_j(r) K_j)`` with
    ``s_j(r) = sum_k r_k axis_weights[k, j]`` (ComRoPE, one-axis LieRE).

    With ``K_j = Q_j blockdiag_n(mu_{j,n} J) Q_j^T`` (``skew.real_schur``) the basis is ``P = blockdiag_j(Q_j^T)``
    and pair ``n`` of block ``j`` turns with frequency ``w_{k,j} mu_{j,n}`` along axis ``k``.

    Args:
        pe: the encoding (its heads, pair convention).
        k: the skew blocks ``K`` ``(Hp, nb, b, b)``.
        axis_weights: ``w`` ``(Hp, c, nb)``.
        basis_gradient: ``False`` (training): ``Q`` and ``mu`` are constants and the form carries the
            :class:`BlockEigenForm` whose gradient goes through the block exponential, exact everywhere, ties
            included. ``True`` (``to_rope``): ``P`` and ``freqs`` themselves differentiable through
            ``skew.real_schur`` -- exact where each block's frequencies are distinct and non-zero.
        schur: ``(Q, mu)`` of ``K`` already computed (float64, constants; ``fold.rope_forms`` batches them).
    """
    half = pe.pairs == "half"  # the pair permutation goes into P, which is then dense
    if basis_gradient:
        q, mu = real_schur(k.to(wide_dtype(k.device)))  # (Hp, nb, b, b), (Hp, nb, b/2)
        freqs = (axis_weights.to(mu.dtype).unsqueeze(-1) * mu.unsqueeze(1)).flatten(-2)  # (Hp, c, d/2)
        blocks = q.transpose(-1, -2).to(k.dtype)
        return RoPEForm(half_pairs_basis(pe, block_diag(blocks)), freqs.to(k.dtype), None,
                        blocks=None if half else blocks)
    q, mu = schur if schur is not None else skew_real_schur(k.detach().to(wide_dtype(k.device)))
    blocks = q.transpose(-1, -2).to(k.dtype)  # (Hp, nb, b, b)
    freqs = (axis_weights.detach().to(mu.dtype).unsqueeze(-1) * mu.unsqueeze(1)).flatten(-2)  # (Hp, c, d/2)
    return RoPEForm(half_pairs_basis(pe, block_diag(blocks)), freqs, None, blocks=None if half else blocks,
                    eigen=BlockEigenForm(k, axis_weights, q, mu))


def stacked_block_form(pe, k: Tensor, axis_weights: Tensor, q: Tensor, mu: Tensor) -> RoPEForm:
    """:func:`block_form`'s training form of ``L`` block encodings at once, from their Schur forms computed together
    (``skew_real_schur`` of the stacked blocks), stacked as ``PositionEncoding.stacked_rope_form`` describes: the
    basis ``(L, Hp, d, d)``, its blocks ``(L, Hp, nb, b, b)`` and the frequencies ``(L, Hp, c, d/2)``, constants;
    ``eigen`` is left to each layer's own form (``fold.rope_forms_stacked`` sets the stacked form's to the stacked
    ``BlockEigenForm``; interleaved pairs only: with half pairs the basis is permuted).

    Args:
        pe: the first encoding (its pair convention).
        k: the skew blocks ``(L, Hp, nb, b, b)``.
        axis_weights: ``(L, Hp, c, nb)``.
        q, mu: ``(L, Hp, nb, b, b)`` and ``(L, Hp, nb, b/2)`` from ``skew_real_schur(k)``.
    """
    if pe.pairs == "half":
        raise ValueError("stacked_block_form is for interleaved pairs (half pairs permute the basis)")
    blocks = q.transpose(-1, -2).to(k.dtype)  # (L, Hp, nb, b, b)
    freqs = (axis_weights.detach().to(mu.dtype).unsqueeze(-1) * mu.unsqueeze(-3)).flatten(-2)  # (L, Hp, c, d/2)
    return RoPEForm(block_diag(blocks), freqs, None, blocks=blocks)
