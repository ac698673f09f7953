"""Prepared states: what an attention layer needs from its encoding for one forward pass, and how it runs.

An encoding owns its execution: :func:`prepare_attention` (one layer) and :func:`prepare_layers` (every layer of a
model at once, batched) return one typed state per layer, and the layer calls two methods of it:

* ``projection(layer)``: the q/k/v projection to use -- with the encoding's basis merged into the q and k rows for a
  folded commuting encoding (:class:`FoldedState`; ``fold_into(weight, bias, num_heads)`` merges it into given
  weights), the layer's own otherwise (:class:`TokenState`);
* ``apply_qkv(qkv, num_heads)``: q, k, v ``(B, H, N, d)`` from the projection's output ``(B, N, 3 D)``, q and k
  encoded (``apply(q, k)`` for q and k already split).

Everything that does not depend on the tokens -- the RoPE form, the angle tables, the merged projections, and the
choice between the fused kernel and the PyTorch rotation -- is decided in ``prepare``, once per forward pass.

The states are named tuples of tensors, plain values and the encoding module, built by the forward pass itself:
``torch.compile`` traces them without guards on object identity (no dictionary keyed by ``id()``, no module-level
cache read on the hot path), so a compiled training step compiles once.

Shape legend: ``B`` batch, ``N`` tokens (``P0`` prefix tokens first), ``M = N - P0`` tokens with coordinates, ``D``
width, ``H`` heads, ``d = D / H``, ``c`` coordinate dimension, ``Hp`` heads owning parameters (1 or ``H``), ``L``
layers.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Protocol, Sequence, Tuple, Union

import torch
from torch import Tensor

from .base import PEState, PositionEncoding
from .ops.blocks import batch_block_gradients, share_block_gradients
from .fold import fold_qkv_weight, fold_qkv_weights, foldable_kind, frequency_rope, frequency_rope_qk, rope_form
from .fold import rope_forms_stacked
from .ops.forms import RoPEForm
from .ops.products import basis_change
from .ops.rotation import fused_kernel, angle_tables

__all__ = ["FoldedState", "TokenState", "PreparedState", "AttentionLayer", "prepare_attention", "prepare_layers",
           "rotation_backend"]


def rotation_backend(pe: PositionEncoding, device: torch.device) -> str:
    """The execution path of ``pe``'s folded rotation on ``device``, chosen once per forward pass: ``"torch"``
    where the fused kernel does not run (``backend="torch"``, the CPU, Triton missing -- with its one warning),
    else the encoding's own ``backend`` (``"auto"``: inside ``torch.compile`` a call the kernel cannot take still
    falls back to PyTorch). Raises ``ValueError`` for ``backend="triton"`` where the kernel cannot run."""
    return "torch" if fused_kernel(device, True, pe.backend) is None else pe.backend


def _split_heads(qkv: Tensor, num_heads: int) -> Tensor:
    b, n, width = qkv.shape
    return qkv.reshape(b, n, 3, num_heads, width // (3 * num_heads)).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)


def _transform_prefix_rows(qkv: Tensor, prefix: Tensor, num_prefix_tokens: int, num_heads: int) -> None:
    """Apply a folded encoding's prefix transform ``T`` (``(Hp, d, d)``) to the q and k of the prefix tokens, in
    place in the projection's output ``qkv`` ``(B, N, 3D)`` (which no backward pass has saved).

    Used where the fused kernel rotates (it passes the prefix tokens through without copying q and k): slicing q and
    k into prefix and patch tokens and concatenating them again would cost two copies of q and k forward and a
    zero-filled buffer of their size per slice backward; here only the few prefix rows are copied. The PyTorch
    rotation slices and concatenates anyway and applies ``T`` there (``rotation.rotate_qk(..., prefix=)``): the
    in-place write would add, in the backward pass, a copy and a zero-filled buffer of the whole ``(B, N, 3D)``
    gradient per layer.
    """
    b, p0, h = qkv.shape[0], num_prefix_tokens, num_heads
    d = qkv.shape[-1] // (3 * h)
    rows = qkv[:, :p0, : 2 * h * d].unflatten(-1, (2, h, d))  # (B, P0, 2, H, d), a view of qkv
    # (2B, H, P0, d): always a copy (the few prefix rows), never a view of qkv that the product could save
    xb = rows.permute(0, 2, 3, 1, 4).clone(memory_format=torch.contiguous_format).view(b * 2, h, p0, d)
    y = basis_change(xb, prefix.to(xb.dtype))  # T per head: (2B, H, P0, d)
    rows.copy_(y.view(b, 2, h, p0, d).permute(0, 3, 1, 2, 4))


class FoldedState(NamedTuple):
    """A commuting encoding folded into one layer's projection for one forward pass: RoPE in a basis.

    Attributes:
        pe: the encoding (a state is used by layers holding this very module).
        form: its :class:`~ropekit.encodings.ops.forms.RoPEForm` (basis ``P``, frequencies, prefix transform).
        coords: ``(M, c)`` or ``(B, M, c)``, the coordinates of this forward pass.
        num_prefix_tokens: ``P0``.
        backend: the rotation's execution path, chosen in ``prepare`` (:func:`rotation_backend`).
        table: the angle table of ``coords`` and the form's frequencies (``rotation.angle_tables``: a model forms
            those of all its layers together), or ``None``: the rotation forms it (and the fused kernel always does).
        qkv: this layer's projection ``(weight (3D, D_in), bias (3D,) or None)`` with the basis already merged (a
            model merges all its layers in one batched product, ``fold.fold_qkv_weights``), or ``None``.
    """

    pe: PositionEncoding
    form: RoPEForm
    coords: Tensor
    num_prefix_tokens: int
    backend: str
    table: Optional[tuple] = None
    qkv: Optional[Tuple[Tensor, Optional[Tensor]]] = None

    def fold_into(self, weight: Tensor, bias: Optional[Tensor], num_heads: int) -> Tuple[Tensor, Optional[Tensor]]:
        """The projection ``(3D, D_in)``, ``(3D,)`` with ``P_h`` merged into every head's q and k rows
        (``W_q -> P_h W_q``), differentiable in both; the model's merged copy where it made one."""
        if self.qkv is not None:
            return self.qkv
        if self.form.basis is None:
            return weight, bias
        return fold_qkv_weight(weight, bias, self.form.basis, num_heads, blocks=self.form.blocks)

    def projection(self, layer: "AttentionLayer") -> Tuple[Tensor, Optional[Tensor]]:
        """The projection ``(3D, D_in)``, ``(3D,)`` that ``layer`` runs with this state: the model's merged copy
        where :func:`prepare_layers` made one (``layer``'s own weight is then not read -- not even expanded for
        grouped-query attention), else :meth:`fold_into` of ``layer.expanded_qkv()``."""
        if self.qkv is not None:
            return self.qkv
        return self.fold_into(*layer.expanded_qkv(), layer.num_heads)

    def apply_qkv(self, qkv: Tensor, num_heads: int) -> Tuple[Tensor, Tensor, Tensor]:
        """``(q, k, v)``, each ``(B, H, N, d)``, from ``qkv`` ``(B, N, 3D)`` (the output of :meth:`fold_into`'s
        projection), q and k rotated together: one product, one backward. The prefix rows of ``qkv`` are
        transformed in place (no backward has saved it)."""
        form, p0 = self.form, self.num_prefix_tokens
        if form.prefix is not None and p0 and self.backend != "torch":  # the fused kernel passes them through
            _transform_prefix_rows(qkv, form.prefix, p0, num_heads)
            form = form._replace(prefix=None)  # done
        # (the PyTorch rotation transforms them in the concatenation that assembles its output: no further copy)
        qk, v = _split_heads(qkv, num_heads).split([2, 1])  # (2, B, H, N, d), (1, B, H, N, d)
        q, k = frequency_rope_qk(qk, self.coords, form, p0, self.backend, self.table)  # (B, H, N, d)
        return q, k, v.squeeze(0)

    def apply(self, q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
        """Rotate q and k ``(B, H, N, d)`` projected with :meth:`fold_into`'s weights (prefix tokens by ``T``)."""
        return frequency_rope(q, k, self.coords, self.form, self.num_prefix_tokens, self.backend)


class TokenState(NamedTuple):
    """An encoding applied to every token (not folded): its own ``prepare`` state.

    Attributes:
        pe: the encoding.
        value: ``pe.prepare(...)``'s :class:`~ropekit.encodings.base.PEState`.
    """

    pe: PositionEncoding
    value: PEState

    def fold_into(self, weight: Tensor, bias: Optional[Tensor], num_heads: int) -> Tuple[Tensor, Optional[Tensor]]:
        """The projection unchanged: nothing is folded."""
        return weight, bias

    def projection(self, layer: "AttentionLayer") -> Tuple[Tensor, Optional[Tensor]]:
        """The projection ``(3D, D_in)``, ``(3D,)`` that ``layer`` runs with this state: its own, expanded for
        grouped-query attention (``layer.expanded_qkv()``)."""
        return layer.expanded_qkv()

    def apply(self, q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
        """Encode q and k ``(B, H, N, d)``; returns ``(B, H, N, d')`` each (``d' = pe.out_dim``), in the encoding's
        layout handled here (a ``"bnhd"`` encoding gets ``(B, N, H, d)`` views)."""
        if self.pe.layout == "bnhd":
            q, k = self.pe.apply(q.transpose(1, 2), k.transpose(1, 2), self.value)
            return q.transpose(1, 2), k.transpose(1, 2)
        return self.pe.apply(q, k, self.value)

    def apply_qkv(self, qkv: Tensor, num_heads: int) -> Tuple[Tensor, Tensor, Tensor]:
        """``(q, k, v)`` from ``qkv`` ``(B, N, 3D)``: q and k encoded ``(B, H, N, d')``, v ``(B, H, N, d)``."""
        q, k, v = _split_heads(qkv, num_heads).unbind(0)
        q, k = self.apply(q, k)
        return q, k, v


#: what ``prepare`` returns for a layer with an encoding
PreparedState = Union[FoldedState, TokenState]


class AttentionLayer(Protocol):
    """What :func:`prepare_layers` reads of an attention layer (``ropekit.nn.Attention`` has it)."""

    pe: Optional[PositionEncoding]
    fold: bool
    num_heads: int

    def expanded_qkv(self) -> Tuple[Tensor, Optional[Tensor]]: ...


def _folds(pe: Optional[PositionEncoding], fold: bool) -> bool:
    return fold and pe is not None and foldable_kind(pe) is not None


def prepare_attention(pe: PositionEncoding, coords: Tensor, num_prefix_tokens: int = 0,
                      dtype: Optional[torch.dtype] = None, fold: bool = True) -> PreparedState:
    """One attention layer's state of ``pe`` for this forward pass (pass it to every layer holding ``pe``).

    Args:
        pe: the encoding.
        coords: ``(M, c)`` shared by the batch or ``(B, M, c)`` per example.
        num_prefix_tokens: ``P0`` leading tokens left unrotated.
        dtype: the tokens' dtype (float64 tokens get a float64 state; else float64 only for float64 coordinates or
            parameters, float32 otherwise).
        fold: fold a commuting encoding into the projection (:class:`FoldedState`); otherwise, and for encodings
            that cannot be folded, a :class:`TokenState`.

    Raises:
        ValueError: bad coordinates (as ``pe.prepare``), or ``backend="triton"`` where the kernel cannot run.
    """
    if _folds(pe, fold):  # block forms: the angles and one gradient map shared by every layer using this state
        form = share_block_gradients(rope_form(pe), coords)
        return FoldedState(pe, form, coords, num_prefix_tokens, rotation_backend(pe, coords.device))
    return TokenState(pe, pe.prepare(coords, num_prefix_tokens, dtype=torch.float64 if dtype == torch.float64
                                     else None))


def _uniform(expanded: Sequence[Tuple[Tensor, Optional[Tensor]]]) -> bool:
    return len({(tuple(w.shape), w.dtype, b is None) for w, b in expanded}) == 1


def prepare_layers(layers: Sequence[AttentionLayer], coords: Optional[Tensor], num_prefix_tokens: int = 0,
                   dtype: Optional[torch.dtype] = None) -> Tuple[Optional[PreparedState], ...]:
    """The states of every layer of a model for one forward pass, computed together: one per layer, in order
    (``None`` for a layer without an encoding, or without coordinates).

    An encoding held by several layers is prepared once (:func:`prepare_attention`) and its state handed to each.
    The folded forms of single-layer encodings are computed together (``fold.rope_forms_stacked``: the per-layer
    Cayley bases in one batched solve, the per-layer ComRoPE block Schur forms in one batched set of Jacobi rounds;
    ``blocks.batch_block_gradients``: the ComRoPE layers' gradients mapped in one batched Frechet map per step).
    Where several layers fold a dense basis (Cayley, Circulant, general STRING), their bases are merged into their
    q/k projections in one batched product (``fold.fold_qkv_weights``, in ``FoldedState.qkv``). Where the PyTorch
    rotation runs, every folded rotation gets its angle table from one batched product for all layers
    (``rotation.angle_tables``, in ``FoldedState.table``; one node maps all their frequency gradients); the fused
    kernel forms its angles itself.

    Args:
        layers: the attention layers (:class:`AttentionLayer`), in the model's order.
        coords, num_prefix_tokens, dtype: as :func:`prepare_attention`.
    """
    if coords is None:
        return (None,) * len(layers)
    # the distinct encodings in order of first use, and for every layer the index of its own (-1: none)
    pes: List[PositionEncoding] = []
    users: List[List[int]] = []
    owner: List[int] = []
    for i, layer in enumerate(layers):
        pe = layer.pe
        j = -1 if pe is None else next((j for j, p in enumerate(pes) if p is pe), len(pes))
        if j == len(pes):
            pes.append(pe)
            users.append([])
        if j >= 0:
            users[j].append(i)
        owner.append(j)
    states: List[Optional[PreparedState]] = [
        prepare_attention(pe, coords, num_prefix_tokens, dtype, layers[idx[0]].fold) if len(idx) > 1 else None
        for pe, idx in zip(pes, users)]
    folding = [j for j, idx in enumerate(users) if len(idx) == 1 and _folds(pes[j], layers[idx[0]].fold)]
    stacks: list = []
    if len(folding) > 1:
        forms, stacks = rope_forms_stacked([pes[j] for j in folding], prefix=num_prefix_tokens > 0)
        # block forms (ComRoPE): one node maps every layer's gradient in one batched Frechet map per step
        stacked_eigen = [(idx, st.eigen) for idx, st in stacks if st.eigen is not None]
        forms = batch_block_gradients(forms, coords, stacked_eigen)
        for j, form in zip(folding, forms):
            states[j] = FoldedState(pes[j], form, coords, num_prefix_tokens, rotation_backend(pes[j], coords.device))
    table_dtype = torch.float64 if torch.float64 in (dtype, coords.dtype) else torch.float32
    merged: List[Optional[Tuple[Tensor, Optional[Tensor]]]] = [None] * len(layers)
    for idx, stacked in stacks:  # the stacked tensors as they are: one table, one merge for the group
        group = [folding[i] for i in idx]
        if states[group[0]].backend == "torch":  # (the kernel forms its angles)
            for j, table in zip(group, angle_tables(coords, stacked.freqs, table_dtype)):
                states[j] = states[j]._replace(table=table)
        if stacked.basis is None:
            continue
        expanded = [layers[users[j][0]].expanded_qkv() for j in group]  # (3D, D_in), (3D,): k/v rows per query head
        if _uniform(expanded):
            qkvs = fold_qkv_weights([w for w, _ in expanded], [b for _, b in expanded], stacked.basis,
                                    layers[users[group[0]][0]].num_heads, blocks=stacked.blocks)
            for j, qkv in zip(group, qkvs):
                merged[users[j][0]] = qkv
    # the other dense bases merged into every folding layer's projection in one batched product
    merging = [i for i, j in enumerate(owner) if j >= 0 and merged[i] is None and isinstance(states[j], FoldedState)
               and states[j].form.basis is not None and states[j].form.blocks is None]
    expanded = [layers[i].expanded_qkv() for i in merging] if len(merging) > 1 else []  # (3D, D_in), (3D,)
    if expanded and _uniform(expanded):
        qkvs = fold_qkv_weights([w for w, _ in expanded], [b for _, b in expanded],
                                [states[owner[i]].form.basis for i in merging], layers[merging[0]].num_heads)
        for i, qkv in zip(merging, qkvs):
            merged[i] = qkv
    states = _with_angle_tables(states, coords, table_dtype)
    out: List[Optional[PreparedState]] = []
    for i, j in enumerate(owner):
        st = states[j] if j >= 0 else None
        out.append(st._replace(qkv=merged[i]) if merged[i] is not None else st)
    return tuple(out)


def _with_angle_tables(states: List[Optional[PreparedState]], coords: Tensor,
                       dtype: torch.dtype) -> List[Optional[PreparedState]]:
    """``states`` where every folded rotation that runs in PyTorch and has no angle table yet has its table, formed
    together for all of them (``rotation.angle_tables``: one product, one cos and sin, one node mapping every
    layer's angle gradient to its frequencies). Block forms (ComRoPE) get the table of their constant frequencies
    ``axis weights x mu``, used for the value and the backward's transposed rotation."""
    groups: dict = {}  # (shapes, dtypes) -> indices into states
    for j, st in enumerate(states):
        if not isinstance(st, FoldedState) or st.table is not None or st.backend != "torch":
            continue
        form, e = st.form, st.form.eigen
        key: Any = ((tuple(form.freqs.shape), form.freqs.dtype) if e is None else
                    ("blocks", tuple(e.axis_weights.shape), tuple(e.mu.shape), e.mu.dtype))
        groups.setdefault(key, []).append(j)
    states = list(states)
    for key, group in groups.items():
        if key[0] == "blocks":  # (L, Hp, c, nb, 1) x (L, Hp, 1, nb, b/2) -> (L, Hp, c, d/2), constants
            w = torch.stack([states[j].form.eigen.axis_weights.detach() for j in group]).to(key[3])
            mu = torch.stack([states[j].form.eigen.mu for j in group])
            freqs: Any = (w.unsqueeze(-1) * mu.unsqueeze(2)).flatten(-2)
        else:
            freqs = [states[j].form.freqs for j in group]
        for j, table in zip(group, angle_tables(coords, freqs, dtype)):
            states[j] = states[j]._replace(table=table)
    return states
