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

* :func:`rope_form` / :func:`to_rope` -- ``(P, freqs)`` of any commuting encoding, written by the encoding itself
  (``PositionEncoding.rope_form``; :mod:`ropekit.encodings.ops.forms` holds the pieces they share): the RoPE family
  has ``P = I``; cayley's ``P`` is its Cayley rotation; circulant's the fixed real DFT basis of its blocks;
  general STRING's the transpose of its learned basis; exact relaxed STRING's its post-rotation; comrope's (and
  one-coordinate LieRE's) the eigenbases of its skew blocks.
* :func:`foldable_kind` -- which of these applies (the encoding's ``rope_kind``; ``None``: not foldable).
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
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .ops.angles import wide_dtype
from .base import PositionEncoding
from .ops.blocks import rotate_in_block_eigenbasis
from .ops.forms import BlockEigenForm, RoPEForm, block_form, stack_layers, stacked_block_form
from .ops.products import basis_change, precise_matmul, reduce_to
from .rope import FrequencyRoPE
from .ops.rotation import apply_frequency_rope, rotate_qk
from .ops.skew import skew_real_schur

__all__ = ["to_rope", "rope_form", "rope_forms", "rope_forms_stacked", "unstack_rope_form", "RoPEForm",
           "BlockEigenForm", "foldable_kind", "FoldedRoPE", "fold_pe", "is_foldable", "fold_qkv_weight",
           "fold_qkv_weights", "frequency_rope", "frequency_rope_qk"]


def foldable_kind(pe: Optional[PositionEncoding]) -> Optional[str]:
    """How ``pe`` is written as RoPE in a basis: its ``rope_kind``, decided from its type and configuration alone (no
    computation, so it works on the meta device and inside ``torch.compile``).

    Returns:
        ``"rope"`` (already RoPE, ``P = I``: axial, mixed, liere-commute, none, folded), ``"post"`` (RoPE followed
        by a learned rotation: cayley), ``"fixed"`` (a constant basis: circulant), ``"string"`` (general STRING's
        learned basis), ``"relaxed"`` (exact relaxed STRING), ``"blocks"`` (one eigenbasis per skew block: comrope,
        liere with one coordinate), an encoding's own kind, or ``None`` when ``pe`` cannot be folded
        (non-commuting, tensor product).
    """
    if pe is None or not pe.is_rotation:
        return None
    return pe.rope_kind


def rope_form(pe: PositionEncoding) -> RoPEForm:
    """Write a commuting encoding as RoPE in a basis, differentiably: ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P``
    (``pe.rope_form()``).

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
    if not isinstance(pe, PositionEncoding):
        raise ValueError(f"rope_form needs a PositionEncoding, got {type(pe).__name__}")
    return pe.rope_form()


def rope_forms(pes: Sequence[PositionEncoding]) -> List[RoPEForm]:
    """:func:`rope_form` of several encodings at once, e.g. the per-layer encodings of one model.

    Encodings of one configuration (equal ``rope_batch_key``: Cayley-STRING, Circulant-STRING, the learned RoPE
    family) get their forms from one computation for all of them (``stacked_rope_form``): the Cayley bases from
    one batched solve, circulant's frequencies from one product, the frequencies stacked -- on a GPU, where each
    small operation is a launch, that removes the per-layer preparation's launches but one. ComRoPE (and one-axis
    LieRE) encodings of one configuration get their block eigenbases from one batched real Schur form (its Jacobi
    rounds run once per model forward, not once per layer). Every other encoding is written by :func:`rope_form`.
    Values and gradients are :func:`rope_form`'s (each matrix is factorised as it would be alone).

    Raises:
        ValueError: as :func:`rope_form`, for an encoding that has no RoPE form.
    """
    return rope_forms_stacked(pes)[0]


def unstack_rope_form(form: RoPEForm, n: int) -> List[RoPEForm]:
    """The ``n`` forms of a stacked form (``PositionEncoding.stacked_rope_form``): slice ``l`` of every tensor (a
    tensor with a leading dimension of 1 is shared by all)."""
    def parts(t: Optional[Tensor]) -> Sequence[Optional[Tensor]]:
        if t is None:
            return [None] * n
        return [t[0]] * n if t.shape[0] == 1 else t.unbind(0)

    return [RoPEForm(b, f, p, form.pairs, blocks=k)
            for b, f, p, k in zip(parts(form.basis), parts(form.freqs), parts(form.prefix), parts(form.blocks))]


def rope_forms_stacked(pes: Sequence[PositionEncoding], prefix: bool = True
                       ) -> Tuple[List[RoPEForm], List[Tuple[List[int], RoPEForm]]]:
    """:func:`rope_forms`, and the stacked forms they were sliced from: ``(forms, [(indices, stacked form), ...])``
    (``PositionEncoding.stacked_rope_form``), for callers that use the stacked tensors as they are (a model merging
    all bases into its projections in one product, forming all angle tables in one product). ``prefix=False``:
    the caller has no prefix tokens, and the stacked forms leave their prefix transforms out (``None``)."""
    forms: List[Optional[RoPEForm]] = [None] * len(pes)
    groups: Dict[tuple, List[int]] = {}
    for i, pe in enumerate(pes):
        kind = foldable_kind(pe)
        if kind == "blocks":
            p = next(pe.parameters())
            groups.setdefault(("blocks", type(pe), pe.head_dim, pe.block_size, pe.param_heads, p.dtype, p.device),
                              []).append(i)
        elif kind is not None and pe.rope_batch_key() is not None:
            groups.setdefault(("stack", pe.rope_batch_key()), []).append(i)
    stacks: List[Tuple[List[int], RoPEForm]] = []
    for key, idx in groups.items():
        if len(idx) < 2:
            continue
        if key[0] == "blocks":
            group = [pes[i] for i in idx]
            if hasattr(type(group[0]), "stacked_rope_blocks"):  # the blocks of all from one computation
                ks, ws = type(group[0]).stacked_rope_blocks(group)  # (L, Hp, nb, b, b), (L, Hp, c, nb)
            else:
                ks, ws = (torch.stack(t) for t in zip(*(pe.rope_blocks() for pe in group)))
            blocks = list(zip(ks.unbind(0), ws.unbind(0)))  # (K, axis weights) of each
            qs, mus = skew_real_schur(ks.detach().to(wide_dtype(ks.device)))  # (L, Hp, nb, b, b), (L, Hp, nb, b/2)
            schurs = list(zip(qs.unbind(0), mus.unbind(0)))
            if pes[idx[0]].pairs == "half":  # a permuted dense basis per layer
                for i, (k, w), schur in zip(idx, blocks, schurs):
                    forms[i] = block_form(pes[i], k, w, schur=schur)
                continue
            stacked = stacked_block_form(pes[idx[0]], ks, ws, qs, mus)._replace(eigen=BlockEigenForm(ks, ws, qs, mus))
            stacks.append((idx, stacked))
            for i, (k, w), (q, mu), form in zip(idx, blocks, schurs, unstack_rope_form(stacked, len(idx))):
                forms[i] = form._replace(eigen=BlockEigenForm(k, w, q, mu))
            continue
        stacked = type(pes[idx[0]]).stacked_rope_form([pes[i] for i in idx], prefix=prefix)
        stacks.append((idx, stacked))
        for i, form in zip(idx, unstack_rope_form(stacked, len(idx))):
            forms[i] = form
    return [form if form is not None else rope_form(pe) for form, pe in zip(forms, pes)], stacks


def to_rope(pe: PositionEncoding) -> Tuple[Tensor, Tensor]:
    """``(P, freqs)`` with ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P`` for a commuting encoding: ``pe.to_rope()``
    (see ``PositionEncoding.to_rope``).

    Raises:
        ValueError: for an encoding that does not commute or is not a rotation, or that is no encoding.
    """
    if not isinstance(pe, PositionEncoding):
        raise ValueError(f"to_rope needs a PositionEncoding, got {type(pe).__name__}")
    return pe.to_rope()


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


def fold_qkv_weights(weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                     bases: Union[Sequence[Tensor], Tensor], num_heads: int,
                     blocks: Optional[Tensor] = None) -> List[Tuple[Tensor, Optional[Tensor]]]:
    """:func:`fold_qkv_weight` for several layers at once (e.g. every layer of a ViT): one batched product for all
    of them instead of a merge per layer -- on a GPU a handful of launches per step instead of a handful per layer.
    On the CPU (outside ``torch.compile``), where launches cost nothing and moving the weights through memory is
    what costs, the layers are merged one by one in one autograd node that writes each merged weight, and each
    weight's gradient, once (``_MergeQKRows``; dense bases only, a block form is merged as below).

    Args:
        weights: ``L`` fused projections ``(3 D, D_in)`` of one shape and dtype.
        biases: ``L`` biases ``(3 D,)``, all present or all ``None``.
        bases: ``L`` bases ``(Hp, d, d)`` (``Hp`` 1 or ``H``, dense: the block form is merged layer by layer), or
            one tensor ``(L | 1, Hp, d, d)`` holding them (a stacked form's basis, ``rope_forms_stacked``; ``1``:
            the same basis for every layer), used as it is.
        num_heads: ``H``.
        blocks: optional ``(L | 1, Hp, nb, b, b)`` with ``bases[l] = blockdiag(blocks[l])`` (a stacked block
            form's, ``rope_forms_stacked``): the merge multiplies block by block, as :func:`fold_qkv_weight` does.

    Returns:
        ``L`` pairs ``(weight', bias')`` as :func:`fold_qkv_weight` returns them (the same products, batched; the
        biases multiplied as a last column of the weights, so one product and one backward serve both),
        differentiable in every input; the gradients of the ``L`` weights (biases, bases) come back from one
        stacked tensor.

    Raises:
        ValueError: mismatched lengths, shapes or dtypes, or biases that are present for some layers only.
    """
    n = len(weights)
    stacked = isinstance(bases, Tensor)
    if stacked and (bases.dim() != 4 or bases.shape[0] not in (1, n)):
        raise ValueError(f"stacked bases must be (1 or {n}, Hp, d, d), got {tuple(bases.shape)}")
    if not (n == len(biases) == (n if stacked and bases.shape[0] == 1 else len(bases))) or n == 0:
        raise ValueError(f"fold_qkv_weights needs as many weights, biases and bases (at least one), got "
                         f"{len(weights)}, {len(biases)}, {len(bases)}")
    if len({(tuple(w.shape), w.dtype, w.device) for w in weights}) != 1:
        raise ValueError("fold_qkv_weights needs weights of one shape, dtype and device")
    has_bias = {b is not None for b in biases}
    if len(has_bias) != 1:
        raise ValueError("fold_qkv_weights needs a bias for every layer or for none")
    three_d, d_in = weights[0].shape
    dim = three_d // 3
    h = num_heads
    d = dim // h
    for shape in (bases.shape[1:],) if stacked else (p.shape for p in bases):  # shapes: no slice of the stack
        if len(shape) != 3 or shape[-2:] != (d, d) or shape[0] not in (1, h):
            raise ValueError(f"every basis must have shape (1 or {h}, {d}, {d}), got {tuple(shape)}")
    dtype = weights[0].dtype
    if blocks is None and _merge_by_layer(weights[0].device):
        # the CPU: layer by layer, each merged weight written once (no stacked copies of the weights)
        if not stacked:
            if len({b.shape[0] for b in bases}) > 1:
                bases = [b.expand(h, d, d) for b in bases]
            bases = torch.stack(list(bases))  # (L, Hp, d, d), small
        return _merge_qk_rows(weights, biases, bases if bases.dtype == dtype else bases.to(dtype), h)
    with torch.autocast(device_type=weights[0].device.type, enabled=False):
        rows: Tuple[int, ...] = (d,)  # the rows one product takes: the head, or its nb blocks of b
        if blocks is not None:  # (L | 1, 1, Hp, nb, b, b), broadcast over the heads as fold_qkv_weight does
            if blocks.dim() != 5 or blocks.shape[0] not in (1, n) or blocks.shape[2] * blocks.shape[3] != d:
                raise ValueError(f"stacked blocks must be (1 or {n}, Hp, nb, b, b) with nb * b = {d}, "
                                 f"got {tuple(blocks.shape)}")
            p = (blocks if blocks.dtype == dtype else blocks.to(dtype)).unsqueeze(1)
            rows = tuple(blocks.shape[2:4])
        elif stacked:  # (L | 1, 1, H | 1, d, d): a view, broadcast over the layers and heads by the product
            p = bases if bases.dtype == dtype else bases.to(dtype)
            p = p.unsqueeze(1)  # P's gradient: one sum over q/k and the heads (its broadcast dimensions)
        else:
            if len({b.shape[0] for b in bases}) > 1:  # some shared by the heads, some not: (L, 1, H, d, d)
                bases = [b.expand(h, d, d) for b in bases]
            p = torch.stack([b.to(dtype) for b in bases]).unsqueeze(1)  # (L, 1, H | 1, d, d)
        wb = stack_layers(weights)  # (L, 3D, D_in)
        if biases[0] is not None:  # the biases as a last column: one product (and one backward) for both
            bs = stack_layers(biases)  # (L, 3D)
            wb = torch.cat([wb, (bs if bs.dtype == dtype else bs.to(dtype)).unsqueeze(-1)], dim=-1)
        cols = wb.shape[-1]  # D_in (+ 1)
        w_qk, w_v = wb.split([2 * dim, dim], dim=1)  # (L, 2D, cols), (L, D, cols)
        qk = precise_matmul(p, w_qk.reshape(n, 2, h, *rows, cols))  # (L, 2, H, d | nb b, cols)
        wb = torch.cat([qk.reshape(n, 2 * dim, cols), w_v], dim=1)  # (L, 3D, cols)
        if biases[0] is None:
            return [(w, None) for w in wb.unbind(0)]  # L x (3D, D_in)
        # contiguous again: a strided weight and bias make every layer's projection and its backward slower
        # (~10 % of the merged projections' CPU time, ViT-tiny) than the two copies here
        w, b = wb.split([d_in, 1], dim=-1)  # (L, 3D, D_in), (L, 3D, 1)
        w, b = w.contiguous(), b.squeeze(-1).contiguous()
        b = b if b.dtype == biases[0].dtype else b.to(biases[0].dtype)
    return list(zip(w.unbind(0), b.unbind(0)))


class _MergeQKRows(torch.autograd.Function):
    """``W'_l = [P_l W_qk,l; W_v,l]`` and ``b'_l = [P_l b_qk,l; b_v,l]`` for ``L`` layers (``P_l`` applied to every
    head's ``d`` rows of q and of k), each output written once into its own buffer, and a backward that writes each
    weight's gradient once: ``dW_qk = P^T dW'_qk``, ``dP = sum_heads (dW'_qk W_qk^T + db'_qk b_qk^T)``.

    The stacked form (``torch.stack`` of the weights, a bias column, one batched product, a concatenation, copies
    back to contiguous layers) moves every weight through memory about ten times per step, forward and backward;
    on the CPU, where a step's small operations cost no launches, that data movement was most of the merge's cost
    (ViT-S, depth 4, one core: ~42 ms of a ~1.1 s step, ~20 ms here). Under ``create_graph`` the backward is written with differentiable
    operations, so second derivatives are exact too.

    Inputs: ``bases`` ``(L | 1, Hp, d, d)`` in the weights' dtype, ``num_heads`` ``H``, ``n`` ``L``, then ``L``
    contiguous weights ``(3D, D_in)`` and, optionally, ``L`` biases ``(3D,)``. Outputs: the ``L`` merged weights,
    then the ``L`` merged biases.
    """

    @staticmethod
    def forward(ctx, bases: Tensor, num_heads: int, n: int, *tensors: Tensor):
        weights, biases = tensors[:n], tensors[n:]
        ctx.save_for_backward(bases, *tensors)
        ctx.num_heads, ctx.n = num_heads, n
        ctx.set_materialize_grads(False)  # an output without a gradient arrives as None: nothing computed for it
        d = bases.shape[-1]
        rows = 2 * num_heads * d  # the q and k rows
        out_w, out_b = [], []
        for layer, w in enumerate(weights):
            pe = _head_bases(bases, layer, num_heads)  # (2H, d, d)
            o = torch.empty_like(w, memory_format=torch.contiguous_format)  # (3D, D_in)
            torch.bmm(pe, _qk_rows(w, num_heads, d), out=_qk_rows(o, num_heads, d))  # (2H, d, D_in)
            o[rows:].copy_(w[rows:])  # the v rows as they are
            out_w.append(o)
            if biases:
                b = biases[layer]  # (3D,)
                bqk = torch.bmm(pe, _qk_rows(b.unsqueeze(-1), num_heads, d))  # (2H, d, 1)
                out_b.append(torch.cat([bqk.flatten(), b[rows:]]))
        return (*out_w, *out_b)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        bases, *tensors = ctx.saved_tensors
        with torch.autocast(device_type=bases.device.type, enabled=False):  # as the forward: no autocast
            return _MergeQKRows._backward(ctx, bases, tensors, grads)

    @staticmethod
    def _backward(ctx, bases: Tensor, tensors: Sequence[Tensor], grads: Sequence[Optional[Tensor]]):
        n, h, d = ctx.n, ctx.num_heads, bases.shape[-1]
        weights, biases = tensors[:n], tensors[n:]
        graph = torch.is_grad_enabled()  # double backward: out-of-place, recorded
        need_p = ctx.needs_input_grad[0]
        g_tensors: List[Optional[Tensor]] = [None] * len(tensors)
        g_bases: List[Optional[Tensor]] = [None] * n
        for layer in range(n):
            pe = _head_bases(bases, layer, h)  # (2H, d, d)
            gps = []
            for i, (x, g) in enumerate(((weights[layer], grads[layer]),
                                        *(((biases[layer], grads[n + layer]),) if biases else ()))):
                if g is None:
                    continue
                g = g.contiguous()
                col = g.dim() == 1  # a bias: one column
                g2, x2 = (g.unsqueeze(-1), x.unsqueeze(-1)) if col else (g, x)
                gqk, rows = _qk_rows(g2, h, d), 2 * h * d
                if ctx.needs_input_grad[3 + layer + i * n]:
                    if graph:
                        gx = torch.cat([(pe.mT @ gqk).reshape(rows, -1), g2[rows:]])
                    else:
                        gx = torch.empty_like(g2)
                        torch.bmm(pe.mT, gqk, out=_qk_rows(gx, h, d))
                        gx[rows:].copy_(g2[rows:])
                    g_tensors[layer + i * n] = gx.squeeze(-1) if col else gx
                if need_p:
                    gps.append(gqk @ _qk_rows(x2, h, d).mT)  # (2H, d, d)
            if need_p and gps:
                g_bases[layer] = sum(gps[1:], gps[0]).view(2, h, d, d).sum(0)  # (H, d, d)
        g_p = None
        if need_p:
            zero = bases.new_zeros(h, d, d)
            g_p = torch.stack([zero if g is None else g for g in g_bases])  # (L, H, d, d)
            g_p = reduce_to(g_p, bases.shape)  # (L | 1, Hp, d, d)
        return (g_p, None, None, *g_tensors)


#: Device types on which :func:`fold_qkv_weights` merges layer by layer (outside ``torch.compile``); on the others
#: (an accelerator) the stacked form's few launches for all layers matter more than its copies. ``ropekit bench
#: --ops`` empties it to count a step as a GPU runs it.
MERGE_BY_LAYER_DEVICES: Tuple[str, ...] = ("cpu",)


def _merge_by_layer(device: torch.device) -> bool:
    """Whether :func:`fold_qkv_weights` merges layer by layer (:class:`_MergeQKRows`): on a device type of
    :data:`MERGE_BY_LAYER_DEVICES`, outside ``torch.compile``."""
    return not torch.compiler.is_compiling() and device.type in MERGE_BY_LAYER_DEVICES


def _head_bases(bases: Tensor, layer: int, num_heads: int) -> Tensor:
    """Layer ``layer``'s basis of each q and k head: ``(2H, d, d)`` from ``(L | 1, Hp, d, d)``."""
    p = bases[layer if bases.shape[0] > 1 else 0]  # (Hp, d, d)
    d = p.shape[-1]
    return p.expand(2, num_heads, d, d).reshape(2 * num_heads, d, d)


def _qk_rows(w: Tensor, num_heads: int, d: int) -> Tensor:
    """The q and k rows of a contiguous ``(3D, C)`` projection as ``(2H, d, C)``, a view."""
    return w[: 2 * num_heads * d].view(2 * num_heads, d, w.shape[-1])


def _merge_qk_rows(weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]], bases: Tensor,
                   num_heads: int) -> List[Tuple[Tensor, Optional[Tensor]]]:
    """:class:`_MergeQKRows` of ``L`` layers: ``L`` pairs ``(weight', bias')`` (``bases`` ``(L | 1, Hp, d, d)`` in the
    weights' dtype)."""
    n = len(weights)
    ws = [w.contiguous() for w in weights]
    bs = [] if biases[0] is None else [b if b.dtype == ws[0].dtype else b.to(ws[0].dtype) for b in biases]
    with torch.autocast(device_type=ws[0].device.type, enabled=False):  # the merge in the weights' dtype
        out = _MergeQKRows.apply(bases, num_heads, n, *ws, *bs)
    if not bs:
        return [(w, None) for w in out]
    return [(w, b if b.dtype == biases[0].dtype else b.to(biases[0].dtype)) for w, b in zip(out[:n], out[n:])]


def frequency_rope(q: Tensor, k: Optional[Tensor], coords: Tensor, form: "RoPEForm", num_prefix_tokens: int = 0,
                   backend: str = "auto", table: Optional[tuple] = None) -> Tuple[Tensor, Tensor]:
    """The per-token part of a folded encoding: RoPE by the angles ``coords . freqs`` on q and k (whose projection
    already holds the basis), with the prefix tokens transformed by ``form.prefix``.

    Args:
        q, k: ``(B, H, N, d)``.
        coords: ``(M, c)`` shared or ``(B, M, c)`` per example, ``M = N - num_prefix_tokens``.
        form: the encoding's :class:`RoPEForm`.
        num_prefix_tokens: ``P0`` leading tokens without a coordinate.
        backend: the execution path, ``"auto"``, ``"torch"`` or ``"triton"`` (see ``apply_frequency_rope``).
        table: for a block form (``form.eigen``), the angle table of ``coords`` and its frequencies already formed
            (``rotation.angle_tables``), or ``None``; ``k=None`` there: ``q`` holds q and k, ``(2, B, H, N, d)``.

    Returns:
        ``(q, k)`` of the same shapes and dtypes, from ``encodings.ops.rotation.apply_frequency_rope`` (float32 math,
        elementwise angles; the fused kernel on CUDA).
    """
    if form.eigen is not None:  # the value as below, the gradients through the block exponentials
        e = form.eigen
        return rotate_in_block_eigenbasis(q, k, coords, e.axis_weights, e.generators, e.schur, e.mu,
                                          num_prefix_tokens, backend, e.scales, e.collector, table)
    if form.prefix is not None and num_prefix_tokens > 0:
        p0 = num_prefix_tokens
        q = torch.cat([basis_change(q[:, :, :p0], form.prefix.to(q.dtype)), q[:, :, p0:]], dim=2)  # (B, H, N, d)
        k = torch.cat([basis_change(k[:, :, :p0], form.prefix.to(k.dtype)), k[:, :, p0:]], dim=2)
    f = form.freqs[0] if form.freqs.shape[0] == 1 else form.freqs  # (c, d/2) shared or (H, c, d/2)
    return apply_frequency_rope(q, k, coords, f, num_prefix_tokens=num_prefix_tokens, pairs=form.pairs,
                                backend=backend)


def frequency_rope_qk(qk: Tensor, coords: Tensor, form: "RoPEForm", num_prefix_tokens: int = 0,
                      backend: str = "auto", table: Optional[tuple] = None) -> Tuple[Tensor, Tensor]:
    """:func:`frequency_rope` for q and k held in one ``(2, B, H, N, d)`` tensor (q, then k: the leading slices of
    an attention layer's fused projection), rotated together (``rotation.rotate_qk``).

    Args:
        qk: ``(2, B, H, N, d)``.
        coords, form, num_prefix_tokens, backend: as :func:`frequency_rope`.
        table: the angle table of ``coords`` and ``form.freqs`` already formed (``rotation.angle_tables``: a
            model forms those of all its layers together), or ``None``.

    Returns:
        ``(q, k)``, each ``(B, H, N, d)``, equal to :func:`frequency_rope`'s.
    """
    if form.eigen is not None:
        return frequency_rope(qk, None, coords, form, num_prefix_tokens, backend, table)
    return rotate_qk(qk, coords, form.freqs, table=table, num_prefix_tokens=num_prefix_tokens, pairs=form.pairs,
                     backend=backend, prefix=form.prefix if num_prefix_tokens > 0 else None)


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
        self.register_buffer("freq_table", freqs.detach().to(wide_dtype(freqs.device)).clone())
        if prefix_matrix is not None:
            if prefix_matrix.shape[0] not in (1, num_heads) or prefix_matrix.shape[1:] != (head_dim, head_dim):
                raise ValueError(f"prefix_matrix must have shape (1 or {num_heads}, {head_dim}, {head_dim}), "
                                 f"got {tuple(prefix_matrix.shape)}")
            prefix_matrix = prefix_matrix.detach().clone()
        self.register_buffer("prefix_matrix", prefix_matrix)

    @property
    def freqs(self) -> Tensor:
        return self.freq_table

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """RoPE with the fixed frequencies, the prefix matrix for the prefix tokens."""
        return RoPEForm(None, self.freqs[:self.param_heads], self.prefix_matrix, self.pairs)

    def _apply(self, fn, recurse=True):  # device and dtype moves: the frequencies keep their float64 values
        table = self.freq_table
        out = super()._apply(fn, recurse)
        device = self.freq_table.device
        self.freq_table = table.to(device=device, dtype=wide_dtype(device))
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

    ``P`` is ``(H, d, d)``; apply it per head (``products.basis_change(q, P)``) or merge it into the projection
    that produces ``q`` and ``k`` (what :func:`~ropekit.nn.fold.fold` does). Prefix tokens are handled by ``folded`` (see the
    module docstring).
    """
    dtype = pe.param_dtype()
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
