"""The RoPE form of the encodings: every commuting STRING is RoPE in a learned basis, so in training and at inference
it costs what RoPE costs.

A commuting encoding satisfies ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P`` for one orthogonal ``P`` (per head) and
a frequency matrix ``freqs``. Attention only sees ``R(r_i)^T R(r_j)``, so the folded encoding
``R'(r) = RoPE_freqs(r) P`` gives the same logits; and since ``q = W_q x``, applying ``P`` to every query is the
same as using the weight ``P W_q``. Two uses:

* Training (``ropekit.nn.Attention(fold=True)``, the default of the ViT's ``pe_fold_train``): at every forward
  pass :func:`rope_form` gives ``(P, freqs, T)`` differentiably in the encoding's parameters,
  :func:`fold_qkv_weight` merges ``P`` into the q/k rows of the projection (one ``d x d`` by ``d x D`` product per
  head), and :func:`frequency_rope` rotates each token by its angles -- plain RoPE's per-token work, with the
  gradients of the unfolded form.
* Inference (:func:`ropekit.nn.fold.fold`): the same merge done once, in float64, into a copy of the model, whose encodings
  become :class:`FoldedRoPE` (fixed frequencies).

The pieces:

* :func:`rope_form` / :func:`to_rope` -- ``(P, freqs)`` of any commuting encoding: the RoPE family has ``P = I``;
  cayley's ``P`` is its Cayley rotation; circulant's the fixed real DFT basis of its blocks; general STRING's the
  transpose of its learned basis; exact relaxed STRING's its post-rotation; comrope's (and one-coordinate LieRE's)
  the eigenbases of its skew blocks. The frequencies are read off the generators in that basis.
* :func:`foldable_kind` -- which of these applies, from the encoding's type alone (``None``: not foldable).
* :class:`FoldedRoPE` -- the fixed-frequency RoPE that is left, with the transform of prefix tokens.
* :func:`fold_pe` -- ``(FoldedRoPE, P)`` for one encoding: ``folded(P q, P k, coords)`` has the logits of
  ``pe(q, k, coords)``.
* :func:`ropekit.nn.fold.fold` (it needs the model's attention layers, so it lives in :mod:`ropekit.nn`) -- a model
  (or an encoding) in, a folded copy out; :mod:`ropekit.fold` gathers all of these under one name.

Prefix tokens (CLS, registers) are left unrotated by every encoding. After folding, their q and k carry the
basis ``P`` too, so the folded encoding applies ``T = P R(0)^T P^T`` to them (from ``R(s) = R(0) P^T RoPE(s) P``):
the identity when ``R(0) = I`` (circulant, comrope, general STRING), ``P^T`` for encodings with a post-rotation
(cayley and exact relaxed STRING, ``R(0) = P``) -- one ``d x d`` product for the few prefix tokens, and every
logit (prefix-prefix, prefix-patch, patch-patch) is unchanged.

Only softmax attention (``ropekit.nn.Attention``) is folded: with linear attention the feature map is applied
to the rotated queries and keys, so the left ``P`` no longer cancels. Models folded by :func:`~ropekit.nn.fold.fold` are for
inference: their frequencies and basis are fixed (persistent buffers, saved with ``state_dict``), not trained.
"""

from __future__ import annotations

import copy
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .base import PositionEncoding
from .cayley import CayleySTRING
from .circulant import CirculantSTRING
from .comrope import _ComRoPE
from .functional import (_block_diag, apply_frequency_rope, basis_change, cayley_transform, frequency_angles,
                         precise_matmul, rotate_in_block_eigenbasis, skew_real_schur)
from .liere import LieRE
from .relaxed import RelaxedSTRING
from .rope import FrequencyRoPE, NoPE
from .skew import free_to_skew
from .string import GeneralSTRING

__all__ = ["to_rope", "rope_form", "rope_forms", "RoPEForm", "BlockEigenForm", "foldable_kind", "FoldedRoPE", "fold_pe",
           "is_foldable", "fold_qkv_weight", "frequency_rope"]


class BlockEigenForm(NamedTuple):
    """What the folded rotation of a block encoding (ComRoPE, one-axis LieRE) needs for exact gradients.

    Block ``j`` of ``R(r)`` is ``expm(s_j(r) K_j)`` with ``s_j(r) = sum_k r_k axis_weights[k, j]``. The basis
    ``Q`` and the frequencies ``mu`` (``K_j = Q_j blockdiag_n(mu_{j,n} J) Q_j^T``) are constants of this forward
    pass; the gradient reaches ``K`` and the axis weights through the exponential
    (``functional.rotate_in_block_eigenbasis``), never through an eigenvector derivative.

    Attributes:
        generators: ``K`` ``(Hp, nb, b, b)``, differentiable.
        axis_weights: ``(Hp, c, nb)``, differentiable (one-hot for comrope-ap, ones for one-axis LieRE).
        schur: ``Q`` ``(Hp, nb, b, b)`` float64, constant.
        mu: ``(Hp, nb, b/2)`` float64, constant.
    """

    generators: Tensor
    axis_weights: Tensor
    schur: Tensor
    mu: Tensor


class RoPEForm(NamedTuple):
    """A commuting encoding written as RoPE in a basis, for one forward pass (see :func:`rope_form`).

    Attributes:
        basis: ``P`` ``(Hp, d, d)`` orthogonal (``(1, d, d)`` when it does not depend on the head), or ``None``
            when ``P = I`` (the RoPE family).
        freqs: ``(Hp, c, d/2)``: pair ``n`` of ``P x`` turns by ``sum_k r_k freqs[k, n]``. The parameters' dtype
            where they are parameters; float64 where they are derived from parameters (circulant's mode
            frequencies), since a float32 rounding of a frequency turns by ``r * ulp(freq)`` at coordinate ``r``
            (~1e-3 rad at 10^4); :func:`frequency_rope` forms the angles in float64 and rotates in q's dtype.
        prefix: ``T = P R(0)^T P^T`` ``(Hp, d, d)`` for prefix tokens whose q and k already carry ``P``, or
            ``None`` for the identity (``R(0) = I``).
        pairs: the pair convention of the frequency rotation (``"half"`` only for a RoPE-family encoding
            configured with half-split pairs; with a basis, the permutation to interleaved pairs is in ``P``).
        blocks: ``(Hp, nb, b, b)`` with ``basis = blockdiag(blocks)``, when ``P`` is block diagonal (comrope and
            one-coordinate LieRE with interleaved pairs), else ``None``. :func:`fold_qkv_weight` then merges the
            blocks, ``d / b`` times fewer products than the dense ``P``.
        eigen: for comrope and one-coordinate LieRE from :func:`rope_form`, the :class:`BlockEigenForm` that
            :func:`frequency_rope` rotates with; ``basis``, ``blocks`` and ``freqs`` are then constants (the
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


def foldable_kind(pe: Optional[PositionEncoding]) -> Optional[str]:
    """How :func:`rope_form` writes ``pe`` as RoPE in a basis, decided from its type and configuration alone
    (no computation, so it works on the meta device and inside ``torch.compile``).

    Returns:
        ``"rope"`` (already RoPE, ``P = I``: axial, mixed, liere-commute, none, folded), ``"post"`` (RoPE followed
        by a learned rotation: cayley), ``"fixed"`` (a constant basis: circulant), ``"string"`` (general STRING's
        learned basis), ``"relaxed"`` (exact relaxed STRING), ``"blocks"`` (one eigenbasis per skew block: comrope,
        liere with one coordinate), or ``None`` when ``pe`` cannot be folded (non-commuting, tensor product).
    """
    if pe is None or not pe.is_rotation:
        return None
    if isinstance(pe, (FrequencyRoPE, NoPE)):
        return "post" if pe.post_rotation and not isinstance(pe, FoldedRoPE) else "rope"
    if isinstance(pe, CirculantSTRING):
        return "fixed"
    if isinstance(pe, GeneralSTRING):
        return "string"
    if isinstance(pe, RelaxedSTRING):
        return "relaxed" if pe.exact else None
    if isinstance(pe, _ComRoPE):
        return "blocks"
    if isinstance(pe, LieRE):
        if pe.block_size == 2:
            return "rope"
        return "blocks" if pe.coord_dim == 1 else None
    return None


def _pair_frequencies(gen: Tensor, basis: Optional[Tensor]) -> Tensor:
    """Frequencies ``(Hp, c, d/2)`` of generators ``(Hp, c, d, d)`` in the basis ``P``: ``(P L_k P^T)[2n+1, 2n]``.

    Exact where ``P L_k P^T`` is 2x2-block diagonal, and so is its derivative: a change of ``P`` adds a
    commutator with the block-diagonal matrix, whose diagonal 2x2 blocks vanish (rotations of a plane commute).
    """
    if basis is None:
        g = gen
    else:  # float32-accurate also where float32 products run in TF32
        g = precise_matmul(precise_matmul(basis.unsqueeze(1), gen), basis.transpose(-1, -2).unsqueeze(1))
    return g[..., 1::2, 0::2].diagonal(dim1=-2, dim2=-1)  # (Hp, c, d/2)


_DFT_BASES: dict = {}


def _real_dft_basis(head_dim: int, block_size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The orthonormal real DFT basis of every block of size ``b``: ``(1, d, d)``, built in float64 once per
    (size, device, dtype) and kept -- a constant, so no host-to-device copy per forward pass.

    Rows ``(2i, 2i + 1)`` hold mode ``f`` of block ``j`` as ``sqrt(2/b) (sin, cos)(2 pi f n / b)``; the DC (and,
    for even ``b``, Nyquist) rows, which no circulant generator turns, come last.
    """
    key = (head_dim, block_size, str(device), dtype)
    if torch.compiler.is_compiling() and key not in _DFT_BASES:
        # built in the graph (a constant there), not stored: a dictionary filled while Dynamo traces fails its
        # guard on the next call and compiles the model a second time
        return _build_real_dft_basis(head_dim, block_size, device, dtype)
    if key in _DFT_BASES:
        return _DFT_BASES[key]
    with torch.inference_mode(False):  # a normal tensor even when first built in inference mode: autograd saves it
        return _DFT_BASES.setdefault(key, _build_real_dft_basis(head_dim, block_size, device, dtype))


def _build_real_dft_basis(head_dim: int, block_size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    b, nb = block_size, head_dim // block_size
    n = torch.arange(b, dtype=torch.float64)
    f = torch.arange(1, (b - 1) // 2 + 1, dtype=torch.float64)
    ang = 2 * math.pi * f[:, None] * n[None, :] / b  # (usable, b)
    modes = torch.stack((ang.sin(), ang.cos()), dim=1).flatten(0, 1) * math.sqrt(2.0 / b)  # (2 usable, b)
    fixed = [torch.ones(b, dtype=torch.float64)] + ([torch.cos(math.pi * n)] if b % 2 == 0 else [])
    still = torch.stack(fixed) / math.sqrt(b)  # (1 or 2, b): DC (and Nyquist)
    p = torch.cat([torch.block_diag(*[modes] * nb), torch.block_diag(*[still] * nb)], dim=0)  # (d, d)
    return p.to(device=device, dtype=dtype).unsqueeze(0)


def _block_eigenbasis(k: Tensor, rtol: float = 1e-6) -> Tensor:
    """The blocks ``Q_j^T`` of ``P = blockdiag_j(Q_j^T)`` with ``K_j = Q_j blockdiag_n(mu_n J) Q_j^T``,
    differentiable in ``K``.

    Args:
        k: ``(Hp, nb, b, b)`` skew blocks.

    Returns:
        ``(Hp, nb, b, b)`` (``_block_diag`` of it is ``P`` ``(Hp, d, d)``). The value is
        ``functional.skew_real_schur``'s basis; the derivative is the first-order change of an eigenbasis:
        ``Q -> Q (I + W)`` with ``W`` skew solving ``[blockdiag(mu J), W] = off-diagonal blocks of Q^T dK Q``
        plane by plane (the part commuting with the rotations divided by ``mu_n - mu_m``, the anti-commuting part
        by ``mu_n + mu_m``). Planes whose frequencies coincide (within ``rtol`` of the largest)
        have no unique basis and get no basis gradient from each other: the derivative is exact for distinct
        frequencies (e.g. the RoPE initialisation) and drops the coupling of coinciding ones (e.g. ``K = 0``).
    """
    q0, mu = skew_real_schur(k)  # (Hp, nb, b, b), (Hp, nb, h)
    q0, mu = q0.detach(), mu.detach()
    e = precise_matmul(precise_matmul(q0.transpose(-1, -2), k), q0)  # (Hp, nb, b, b): blockdiag(mu J) in value
    de = e - e.detach()  # zero in value, carries dK
    h = mu.shape[-1]
    blk = de.unflatten(-2, (h, 2)).unflatten(-1, (h, 2)).transpose(-3, -2)  # (Hp, nb, h, h, 2, 2): block (n, m)
    y00, y01, y10, y11 = blk[..., 0, 0], blk[..., 0, 1], blk[..., 1, 0], blk[..., 1, 1]
    ca, cb = (y00 + y11) / 2, (y10 - y01) / 2  # commuting part ca I + cb J
    aa, ab = (y00 - y11) / 2, (y01 + y10) / 2  # anti-commuting part aa Z + ab X (Z = diag(1, -1), X = [[0,1],[1,0]])
    scale = mu.amax(dim=-1, keepdim=True).unsqueeze(-1).clamp_min(torch.finfo(mu.dtype).tiny)  # (Hp, nb, 1, 1)
    diff = mu.unsqueeze(-1) - mu.unsqueeze(-2)  # (Hp, nb, h, h)
    summ = mu.unsqueeze(-1) + mu.unsqueeze(-2)
    ok_d = diff.abs() > rtol * scale
    ok_s = summ.abs() > rtol * scale
    inv_d = torch.where(ok_d, 1.0 / torch.where(ok_d, diff, torch.ones_like(diff)), torch.zeros_like(diff))
    inv_s = torch.where(ok_s, 1.0 / torch.where(ok_s, summ, torch.ones_like(summ)), torch.zeros_like(summ))
    # W_nm = J (commuting part) / (mu_n - mu_m) + J (anti-commuting part) / (mu_n + mu_m); J (a I + b J) = -b I + a J,
    # J (a Z + b X) = a (J Z) + b (J X) with J Z = [[0, 1], [1, 0]] = X and J X = [[-1, 0], [0, 1]] = -Z
    wc_i, wc_j = -cb * inv_d, ca * inv_d  # (-b) I + a J
    wa_z, wa_x = -ab * inv_s, aa * inv_s  # (-b) Z + a X
    w00 = wc_i + wa_z
    w11 = wc_i - wa_z
    w01 = -wc_j + wa_x
    w10 = wc_j + wa_x
    w = torch.stack((torch.stack((w00, w01), -1), torch.stack((w10, w11), -1)), -2)  # (Hp, nb, h, h, 2, 2)
    w = w.transpose(-3, -2).reshape(de.shape)  # (Hp, nb, b, b)
    return q0.transpose(-1, -2) - precise_matmul(w, q0.transpose(-1, -2))  # (Q0 (I + W))^T = (I - W) Q0^T, W skew


def rope_form(pe: PositionEncoding) -> RoPEForm:
    """Write a commuting encoding as RoPE in a basis, differentiably: ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P``.

    This is what training-time folding uses: ``P`` goes into the q/k rows of the attention's projection weight
    (one ``d x d`` by ``d x D`` product per head and step), ``freqs`` into a plain frequency RoPE per token, and
    ``prefix`` into the few prefix tokens. Gradients flow to every parameter of the encoding. Computed once per
    forward pass (once per model forward when the encoding is shared by the layers).

    For comrope and one-coordinate LieRE the basis is the eigenbasis of the skew blocks, which has no derivative
    where two frequencies of a block coincide (``K = 0``, ties met during training): their form carries the
    blocks themselves (:attr:`RoPEForm.eigen`), the basis is a constant, and :func:`frequency_rope` takes the
    gradient through the block exponential -- exact everywhere, ties included, to second order.

    Raises:
        ValueError: for an encoding that does not commute or is not a rotation (see :func:`foldable_kind`).
    """
    kind = foldable_kind(pe)
    if kind is None:
        if isinstance(pe, PositionEncoding) and not pe.is_rotation:
            raise ValueError(f"{pe.name} is not a rotation (it widens q and k): it has no RoPE form")
        name = pe.name if isinstance(pe, PositionEncoding) else type(pe).__name__
        raise ValueError(f"{name} does not commute (R(r)^T R(s) is not a function of s - r): "
                         f"it cannot be written as RoPE in a fixed basis")
    hp = pe.param_heads
    basis: Optional[Tensor] = None
    prefix: Optional[Tensor] = None
    if kind == "rope":
        if isinstance(pe, FrequencyRoPE):
            freqs = pe.freqs[:hp]
        else:  # none, liere with 2x2 blocks: read the frequencies off the generators
            gen = _block_diag(pe.block_generators()) if isinstance(pe, LieRE) else pe.generators()
            freqs = _pair_frequencies(gen[:hp], None)
        if isinstance(pe, FoldedRoPE) and pe.prefix_matrix is not None:
            prefix = pe.prefix_matrix
        return RoPEForm(None, freqs, prefix, getattr(pe, "pairs", "interleaved"))
    if kind == "post":  # one solve per forward pass, shared by the basis and T
        return _post_form(pe, pe.post_rotation_matrix()[:hp])
    if kind == "fixed":  # constant basis, frequencies linear in the parameters: no generator is built
        basis = _real_dft_basis(pe.head_dim, pe.block_size, pe.circ_params.device, pe.circ_params.dtype)
        # derived frequencies stay in the table's float64: rounded to float32 they would turn by r * ulp(lambda)
        lam = pe.mode_frequencies(pe.mode_table.dtype).flatten(-2)[:hp]  # (Hp, c, nb * u): block by block
        freqs = torch.cat((lam, lam.new_zeros(*lam.shape[:-1], pe.head_dim // 2 - lam.shape[-1])), dim=-1)
        return RoPEForm(_half_pairs_basis(pe, basis), freqs, None)
    if kind == "string":  # L_k = Q D_k Q^T: in the basis P = Q^T the frequencies are the parameters themselves
        return RoPEForm(_half_pairs_basis(pe, pe.basis().transpose(-1, -2)[:hp]), pe.freq_param[:hp], None)
    if kind == "relaxed":  # R(r) = RoPE_active(r) P_sp, R(0) = P_sp: one computation for both
        basis = pe.post_rotation_matrix()[:hp]
        return _basis_form(pe, basis, post=basis)
    k = _skew_blocks(pe)  # "blocks"
    q, mu = skew_real_schur(k.detach().to(_wide(k.device)))
    return _eigen_form(pe, k, q, mu)


def _wide(device: torch.device) -> torch.dtype:
    """float64 where the device has it (every one but MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _block_axis_weights(pe: PositionEncoding) -> Tensor:
    """``(Hp, c, nb)``: the weights of ``s_j(r) = sum_k r_k w[k, j]`` of a "blocks" encoding."""
    if isinstance(pe, LieRE):  # one coordinate: every block turns with r
        k = pe.block_generators()
        return k.new_ones(k.shape[0], 1, k.shape[2])
    return pe._axis_weights()


def _eigen_form(pe: PositionEncoding, k: Tensor, q: Tensor, mu: Tensor) -> RoPEForm:
    """The RoPE form of a "blocks" encoding from its skew blocks ``K`` ``(Hp, nb, b, b)`` and their constant Schur
    form ``(Q, mu)`` (float64): ``P = blockdiag_j(Q_j^T)`` and frequencies ``w_{k,j} mu_{j,n}``, both constants,
    with the :class:`BlockEigenForm` that makes the gradients exact."""
    dtype = k.dtype
    weights = _block_axis_weights(pe)  # (Hp, c, nb)
    blocks = q.transpose(-1, -2).to(dtype)  # (Hp, nb, b, b)
    freqs = (weights.detach().to(mu.dtype).unsqueeze(-1) * mu.unsqueeze(1)).flatten(-2)  # (Hp, c, d/2)
    half = getattr(pe, "pairs", "interleaved") == "half"  # the pair permutation goes into P, which is then dense
    return RoPEForm(_half_pairs_basis(pe, _block_diag(blocks)), freqs, None, blocks=None if half else blocks,
                    eigen=BlockEigenForm(k, weights, q, mu))


def _skew_blocks(pe: PositionEncoding) -> Tensor:
    """The skew blocks ``K_j`` ``(Hp, nb, b, b)`` of an encoding of kind ``"blocks"`` (ComRoPE, one-axis LieRE)."""
    return pe.block_generators()[:, 0] if isinstance(pe, LieRE) else pe.block_generators()


def _blocks_form(pe: PositionEncoding, blocks: Tensor) -> RoPEForm:
    """The RoPE form of a ``"blocks"`` encoding from its blocks ``Q_j^T`` ``(Hp, nb, b, b)`` (``_block_eigenbasis``)."""
    return _basis_form(pe, _block_diag(blocks), blocks=blocks)


def _basis_form(pe: PositionEncoding, basis: Tensor, post: Optional[Tensor] = None,
                blocks: Optional[Tensor] = None) -> RoPEForm:
    """The RoPE form from the basis ``P`` ``(Hp, d, d)``: frequencies ``P L_k P^T`` read off the generators, the
    prefix transform ``T = P R(0)^T P^T`` from ``R(0)`` (``post``, else the encoding's own)."""
    hp = pe.param_heads
    prefix: Optional[Tensor] = None
    gen = pe.generators()[:hp]  # (Hp, c, d, d)
    freqs = _pair_frequencies(gen, basis)  # (Hp, c, d/2)
    if post is None:
        post = pe.post_rotation_matrix()
    if post is not None:  # T = P R(0)^T P^T
        post = post[:hp]
        prefix = precise_matmul(precise_matmul(basis, post.transpose(-1, -2)), basis.transpose(-1, -2))
    if getattr(pe, "pairs", "interleaved") == "half":  # the permutation breaks the block structure
        blocks = None
    return RoPEForm(_half_pairs_basis(pe, basis), freqs, prefix, blocks=blocks)


def _post_form(pe: PositionEncoding, basis: Tensor) -> RoPEForm:
    """The RoPE form of an encoding ``R(r) = RoPE(r) P`` from its ``P`` ``(Hp, d, d)``: ``R(0) = P``, so the prefix
    transform is ``T = P P^T P^T = P^T`` (no product needed)."""
    hp = pe.param_heads
    return RoPEForm(_half_pairs_basis(pe, basis), pe.freqs[:hp], basis.transpose(-1, -2))


def rope_forms(pes: Sequence[PositionEncoding]) -> List[RoPEForm]:
    """:func:`rope_form` of several encodings at once, e.g. the per-layer encodings of one model.

    Cayley-STRING encodings of one configuration (size, band, parameter heads, dtype, device) get their bases from
    one batched solve over all of them instead of one solve per encoding -- on a GPU, where each small operation
    is a launch, that removes the per-layer preparation's launches but one. ComRoPE (and one-axis LieRE)
    encodings of one configuration get their block eigenbases from one batched eigendecomposition: on a GPU each
    eigendecomposition also makes the host wait for the device (its error check), so one per model forward
    instead of one per layer. Every other encoding is written by :func:`rope_form`. Values and gradients are
    :func:`rope_form`'s (each matrix is factorised as it would be alone).

    Raises:
        ValueError: as :func:`rope_form`, for an encoding that has no RoPE form.
    """
    forms: List[Optional[RoPEForm]] = [None] * len(pes)
    groups: Dict[tuple, List[int]] = {}
    for i, pe in enumerate(pes):
        kind = foldable_kind(pe)
        if isinstance(pe, CayleySTRING) and kind == "post":
            p = pe.cayley_params
            groups.setdefault(("post", pe.head_dim, pe.band, tuple(p.shape), p.dtype, p.device), []).append(i)
        elif kind == "blocks":
            p = next(pe.parameters())
            groups.setdefault(("blocks", type(pe), pe.head_dim, pe.block_size, pe.param_heads, p.dtype, p.device),
                              []).append(i)
    for key, idx in groups.items():
        if len(idx) < 2:
            continue
        if key[0] == "blocks":
            ks = [_skew_blocks(pes[i]) for i in idx]
            qs, mus = skew_real_schur(torch.stack(ks).detach().to(_wide(ks[0].device)))  # (L, Hp, nb, b, b)
            for i, k, q, mu in zip(idx, ks, qs.unbind(0), mus.unbind(0)):
                forms[i] = _eigen_form(pes[i], k, q, mu)
            continue
        first = pes[idx[0]]
        params = torch.stack([pes[i].cayley_params for i in idx])  # (L, Hp, F)
        bases = cayley_transform(free_to_skew(params, first.head_dim, first.band))  # (L, Hp, d, d), one solve
        for i, basis in zip(idx, bases.unbind(0)):
            forms[i] = _post_form(pes[i], basis)
    return [form if form is not None else rope_form(pe) for form, pe in zip(forms, pes)]


def _half_pairs_basis(pe: PositionEncoding, basis: Tensor) -> Tensor:
    """``P Pi`` for an encoding configured with half-split pairs (``R_half(r) = Pi^T R(r) Pi``), else ``P``.

    ``T`` is unchanged by the permutation: ``Pi`` cancels in ``P Pi Pi^T R(0)^T Pi Pi^T P^T``.
    """
    if getattr(pe, "pairs", "interleaved") != "half":
        return basis
    d = pe.head_dim
    order = torch.cat([torch.arange(0, d, 2, device=basis.device), torch.arange(1, d, 2, device=basis.device)])
    return basis[..., order]


def to_rope(pe: PositionEncoding) -> Tuple[Tensor, Tensor]:
    """``(P, freqs)`` with ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P`` for a commuting encoding.

    Returns:
        ``P`` ``(H, d, d)`` orthogonal and ``freqs`` ``(H, c, d/2)`` (pair ``n`` of ``P x`` turns by
        ``sum_k r_k freqs[k, n]``, as in ``functional.rotate_pairs``), in the encoding's dtype, differentiable in
        its parameters (:func:`rope_form` with the heads expanded; detach them to keep a snapshot). For comrope
        and one-coordinate LieRE ``P`` is the eigenbasis of the skew blocks, whose derivative exists only where
        the frequencies of a block are distinct and non-zero; train through :func:`rope_form` and
        :func:`frequency_rope` (what ``ropekit.nn.Attention`` does), which are exact there too.

    Raises:
        ValueError: for an encoding that does not commute (LieRE with ``c >= 2`` and blocks > 2, relaxed STRING
            in its relaxed configuration) or is not a rotation (the tensor-product encoding).
    """
    if not isinstance(pe, PositionEncoding):
        raise ValueError(f"to_rope needs a PositionEncoding, got {type(pe).__name__}")
    if foldable_kind(pe) == "blocks":  # the eigenbasis itself, differentiated where it has a derivative
        form = _blocks_form(pe, _block_eigenbasis(_skew_blocks(pe)))
    else:
        form = rope_form(pe)
    h = pe.num_heads
    freqs = form.freqs.to(pe._param_dtype())
    p = form.basis
    if p is None:
        p = torch.eye(pe.head_dim, dtype=freqs.dtype, device=freqs.device).unsqueeze(0)
        if form.pairs == "half":  # half-split pairs: the permutation to interleaved ones
            d = pe.head_dim
            p = p[..., torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)]).to(p.device)]
    return p.expand(h, -1, -1), freqs.expand(h, -1, -1)


def is_foldable(pe: Optional[PositionEncoding]) -> bool:
    """Whether :func:`to_rope` succeeds for ``pe`` (``None`` -- no encoding -- is trivially foldable)."""
    return pe is None or foldable_kind(pe) is not None


def fold_qkv_weight(weight: Tensor, bias: Optional[Tensor], basis: Tensor, num_heads: int,
                    blocks: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """The fused q/k/v projection with the basis merged into its q and k rows: ``W_q -> P_h W_q``, ``b_q -> P_h b_q``.

    Args:
        weight: ``(3 D, D_in)`` rows ordered q, k, v and, within each, head by head (``D = H d``).
        bias: ``(3 D,)`` or ``None``.
        basis: ``(Hp, d, d)`` with ``Hp`` 1 (same basis for every head) or ``H``.
        num_heads: ``H``.
        blocks: optional ``(Hp, nb, b, b)`` with ``basis = blockdiag(blocks)`` (:attr:`RoPEForm.blocks`): the
            merge then multiplies block by block, ``b x b`` by ``b x D_in`` (``d / b`` times fewer products).

    Returns:
        ``(weight', bias')`` of the same shapes; differentiable in all inputs. Cost: one ``d x d`` by ``d x D_in``
        product per head for q and for k -- once per step, independent of the number of tokens. Computed in
        the parameters' dtype with autocast off and float32-accurate also under TF32 (the projection itself then
        runs under autocast and the user's matmul precision, as the unfolded one does).
    """
    three_d, d_in = weight.shape
    dim = three_d // 3
    d = dim // num_heads
    if basis.shape[-1] != d or basis.shape[0] not in (1, num_heads):
        raise ValueError(f"basis must have shape (1 or {num_heads}, {d}, {d}), got {tuple(basis.shape)}")
    if blocks is not None and (blocks.dim() != 4 or blocks.shape[0] != basis.shape[0]
                               or blocks.shape[1] * blocks.shape[2] != d):
        raise ValueError(f"blocks must have shape ({basis.shape[0]}, nb, b, b) with nb * b = {d}, "
                         f"got {tuple(blocks.shape)}")
    h = num_heads
    with torch.autocast(device_type=weight.device.type, enabled=False):
        # split, not two slices: its backward is one concatenation, a slice's a zero-filled weight-sized buffer
        w_qk, w_v = weight.split([2 * dim, dim])
        b_qk, b_v = (None, None) if bias is None else bias.split([2 * dim, dim])
        b_qk = None if b_qk is None else b_qk.to(weight.dtype)
        if blocks is not None:  # block by block: rows (2, H, nb, b, .) against blocks (1, H or 1, nb, b, b)
            nb, bs = blocks.shape[1], blocks.shape[2]
            p = blocks.to(weight.dtype).view(1, blocks.shape[0], nb, bs, bs)
            qk = precise_matmul(p, w_qk.view(2, h, nb, bs, d_in))  # (2, H, nb, b, D_in)
            bqk = None if b_qk is None else precise_matmul(p, b_qk.view(2, h, nb, bs, 1))  # (2, H, nb, b, 1)
        elif basis.shape[0] == 1:  # one basis for every head: a single (d x d) @ (d x 2 H D_in) product, no batch
            p = basis.to(weight.dtype)[0]  # (d, d)
            cols = w_qk.view(2 * h, d, d_in).transpose(0, 1).reshape(d, -1)  # (d, 2H D_in)
            qk = precise_matmul(p, cols).view(d, 2 * h, d_in).transpose(0, 1)  # (2H, d, D_in)
            bqk = None if b_qk is None else precise_matmul(b_qk.view(2 * h, d), p.transpose(0, 1))  # (2H, d)
        else:
            p = basis.to(weight.dtype).unsqueeze(0)  # (1, H, d, d)
            qk = precise_matmul(p, w_qk.view(2, h, d, d_in))  # (2, H, d, D_in)
            bqk = None if b_qk is None else precise_matmul(p, b_qk.view(2, h, d, 1))  # (2, H, d, 1)
        w = torch.cat([qk.reshape(2 * dim, d_in), w_v], dim=0)  # (3 D, D_in)
        b = None if bias is None else torch.cat([bqk.reshape(2 * dim).to(bias.dtype), b_v], dim=0)
    return w, b


def frequency_rope(q: Tensor, k: Tensor, coords: Tensor, form: "RoPEForm", num_prefix_tokens: int = 0,
                   backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """The per-token part of a folded encoding: RoPE by the angles ``coords . freqs`` on q and k (whose projection
    already holds the basis), with the prefix tokens transformed by ``form.prefix``.

    Args:
        q, k: ``(B, H, N, d)``.
        coords: ``(M, c)`` shared or ``(B, M, c)`` per example, ``M = N - num_prefix_tokens``.
        form: the encoding's :class:`RoPEForm`.
        num_prefix_tokens: ``P0`` leading tokens without a coordinate.
        backend: the execution path, ``"auto"``, ``"torch"`` or ``"triton"`` (see ``apply_frequency_rope``).

    Returns:
        ``(q, k)`` of the same shapes and dtypes, from ``encodings.functional.apply_frequency_rope`` (float32 math,
        elementwise angles; the fused kernel on CUDA).
    """
    if form.eigen is not None:  # the value as below, the gradients through the block exponentials
        e = form.eigen
        return rotate_in_block_eigenbasis(q, k, coords, e.axis_weights, e.generators, e.schur, e.mu,
                                          num_prefix_tokens, backend)
    if form.prefix is not None and num_prefix_tokens > 0:
        p0 = num_prefix_tokens
        q = torch.cat([basis_change(q[:, :, :p0], form.prefix.to(q.dtype)), q[:, :, p0:]], dim=2)  # (B, H, N, d)
        k = torch.cat([basis_change(k[:, :, :p0], form.prefix.to(k.dtype)), k[:, :, p0:]], dim=2)
    f = form.freqs[0] if form.freqs.shape[0] == 1 else form.freqs  # (c, d/2) shared or (H, c, d/2)
    return apply_frequency_rope(q, k, coords, f, num_prefix_tokens=num_prefix_tokens, pairs=form.pairs,
                                backend=backend)


class FoldedRoPE(FrequencyRoPE):
    """RoPE with fixed frequencies: what a commuting STRING leaves after :func:`~ropekit.nn.fold.fold` (``name="folded"``).

    Args:
        head_dim, coord_dim, num_heads: as every encoding.
        freqs: ``(Hp, c, d/2)`` with ``Hp`` 1 or ``num_heads``.
        prefix_matrix: ``(Hp, d, d)`` applied to prefix tokens (``T = P R(0)^T P^T``), or ``None`` for the identity.

    The frequencies and the prefix matrix are persistent buffers: they are the folded model's weights, not
    caches derived from parameters. The frequencies stay float64 whatever the module's dtype (float32 on devices
    without float64): a frequency rounded to float32 turns a token at coordinate 1e4 by ~1e-3 rad too much or too
    little; the angles are formed in float64 and only their cos / sin meet the tokens' dtype.
    """

    name = "folded"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int, freqs: Tensor,
                 prefix_matrix: Optional[Tensor] = None) -> None:
        hp = freqs.shape[0]
        if freqs.dim() != 3 or hp not in (1, num_heads) or freqs.shape[1:] != (coord_dim, head_dim // 2):
            raise ValueError(f"freqs must have shape (1 or {num_heads}, {coord_dim}, {head_dim // 2}), "
                             f"got {tuple(freqs.shape)}")
        super().__init__(head_dim, coord_dim, num_heads, per_head=hp > 1)
        self.register_buffer("freq_table", freqs.detach().to(_wide(freqs.device)).clone())
        if prefix_matrix is not None:
            if prefix_matrix.shape[0] not in (1, num_heads) or prefix_matrix.shape[1:] != (head_dim, head_dim):
                raise ValueError(f"prefix_matrix must have shape (1 or {num_heads}, {head_dim}, {head_dim}), "
                                 f"got {tuple(prefix_matrix.shape)}")
            prefix_matrix = prefix_matrix.detach().clone()
        self.register_buffer("prefix_matrix", prefix_matrix)

    @property
    def freqs(self) -> Tensor:
        return self.freq_table

    def _apply(self, fn, recurse=True):  # device and dtype moves: the frequencies keep their float64 values
        table = self.freq_table
        out = super()._apply(fn, recurse)
        device = self.freq_table.device
        self.freq_table = table.to(device=device, dtype=_wide(device))
        return out

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
    that produces ``q`` and ``k`` (what :func:`~ropekit.nn.fold.fold` does). Prefix tokens are handled by ``folded`` (see the
    module docstring).
    """
    dtype = pe._param_dtype()
    with torch.no_grad():  # a snapshot, computed in float64 and rounded once
        pe64 = copy.deepcopy(pe).double()
        p64, freqs = to_rope(pe64)
        post = pe64.post_rotation_matrix()
    p = p64.to(dtype)  # the frequencies stay float64 (FoldedRoPE)
    prefix = None
    if post is not None:  # T = P R(0)^T P^T
        prefix = (p64 @ post.detach().double().transpose(-1, -2) @ p64.transpose(-1, -2)).to(p.dtype)
        prefix = _shared(prefix)
    folded = FoldedRoPE(pe.head_dim, pe.coord_dim, pe.num_heads, _shared(freqs.contiguous()), prefix)
    folded.set_conventions(backend=pe.backend).to(device=p.device)
    return folded, p
