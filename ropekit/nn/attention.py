"""Multi-head self-attention that receives its position encoding from the model builder.

Shape legend: ``B`` batch, ``N`` tokens (``P0`` prefix tokens first, then ``M = N - P0`` tokens with
coordinates), ``D`` width, ``H`` heads, ``d = D / H`` head dimension, ``d'`` the encoded q/k width
(``pe.out_dim``; ``d`` for every rotation, ``2m * d`` for the tensor-product encoding), ``c`` coordinate
dimension, ``Hp`` heads that own encoding parameters (1 or ``H``).

Training-time folding. Every commuting encoding is RoPE in a learned basis: ``R(r) = RoPE_freqs(r) P`` up to a
rotation that attention never sees. Since ``q = W_q x``, applying ``P`` to every query equals using the weight
``P W_q``; so with ``fold=True`` (the default) the layer merges ``P`` into the q and k rows of its ``qkv``
weight and bias once per forward pass -- one ``d x d`` by ``d x D`` product per head, differentiable in ``P``
and in the weight -- and then only rotates each token by its frequency angles, which is what plain RoPE costs.
Logits and gradients are those of the unfolded layer up to float rounding. Encodings that do not commute
(LieRE with ``c >= 2``, relaxed STRING, the tensor-product encoding) always take the unfolded path.

Grouped-query and multi-query attention (``num_kv_heads = Hk < H``). The ``H`` query heads form ``Hk`` groups
of ``H / Hk`` consecutive heads (query head ``h`` in group ``h // (H / Hk)``, as PyTorch's ``enable_gqa`` and
``repeat_interleave`` group them); each group shares one key projection ``W_k,g`` and one value projection
``W_v,g`` (``Hk = 1``: multi-query attention). The position encoding stays per *query* head: query head ``h``
sees the logit ``(R_h(r_i) W_q,h x_i)^T (R_h(r_j) W_k,g x_j)`` -- the group's shared key, rotated by head ``h``'s
own encoding ``R_h``, so every head's logit is relative (``R_h(r_i)^T R_h(r_j) = R_h(r_j - r_i)`` for a commuting
encoding). With a per-head basis ``P_h`` (``R_h(r) = RoPE_h(r) P_h``) the logit is
``x_i^T W_q,h^T P_h^T RoPE_h(r_j - r_i) P_h W_k,g x_j``: ``P_h`` on the query side is absorbed by the free
``W_q,h``, but ``P_h W_k,g`` differs from head to head of a group while ``W_k,g`` is one matrix, so the basis is
*not* absorbed by the key projection (with full multi-head attention, ``H = Hk``, it is: each ``W_k,h`` is free,
see docs/encodings.md). An encoding whose parameters the heads share (``Hp = 1``) is absorbed as before. The layer
computes this by expanding the shared key and value rows to one copy per query head (``(Hk d, D) -> (H d, D)``)
before the projection; the rest of the forward pass -- folding included, which merges ``P_h`` into each
expanded copy -- is that of multi-head attention. The compute is that of ``H`` key heads; the saving is in
parameters (``2 (H - Hk) d D`` fewer).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..encodings import PositionEncoding
from ..encodings.fold import foldable_kind
from ..encodings.prepared import PreparedState, prepare_attention
from .masks import masked_attention

__all__ = ["Attention", "PreparedPE", "scaled_dot_product_attention"]


class _SecondOrderSDPA(torch.autograd.Function):
    """An identity on the attention's output whose backward routes a gradient graph around the fused kernel.

    ``out = F.scaled_dot_product_attention(q, k, v)`` runs the kernel PyTorch picks (flash attention on the CPU and
    on CUDA) and records its backward as usual; this node sits after it. A first-order backward passes the
    gradient straight on to that fused backward (one trivial node, nothing recomputed). Those kernels have no double
    backward, so when a gradient graph is requested (``create_graph=True``) this node instead recomputes the
    attention with the math backend, whose operations are all differentiable, and returns its gradients for q, k
    and v directly -- the fused node then receives no gradient and is skipped.
    """

    @staticmethod
    def forward(ctx, out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: Optional[float]) -> Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g: Tensor):
        if not torch.is_grad_enabled():
            return g, None, None, None, None
        q, k, v = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:4]
        with torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q, k, v, scale=ctx.scale)
            grads = iter(torch.autograd.grad(out, [t for t, n in zip((q, k, v), needs) if n], g, create_graph=True))
        return (None,) + tuple(next(grads) if n else None for n in needs) + (None,)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                                 scale: Optional[float] = None) -> Tensor:
    """``F.scaled_dot_product_attention`` (no mask) that also supports second derivatives.

    Args:
        q, k, v: ``(B, H, N, d)`` (``k`` and ``v`` may have their own length).
        dropout_p: attention dropout; with dropout (or inside ``torch.compile``, or without gradients) this is
            PyTorch's function itself.
        scale: logit scale (``None``: ``1 / sqrt(d)``).

    Returns:
        ``(B, H, N, d)``. Values and first derivatives come from the fused kernel PyTorch selects; under
        ``torch.autograd.grad(..., create_graph=True)`` the gradients come from the math backend instead, so
        second derivatives (gradient penalties, meta-learning, Hessian-vector products) are exact -- PyTorch's
        fused CPU and CUDA kernels have no double backward.
    """
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
    if (dropout_p == 0.0 and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return _SecondOrderSDPA.apply(out, q, k, v, scale)
    return out


#: an attention layer's encoding state for one forward pass (``ropekit.encodings.prepared``): a ``FoldedState``
#: (RoPE in a basis, the basis merged into the projection) or a ``TokenState`` (the encoding applied per token)
PreparedPE = PreparedState


class Attention(nn.Module):
    """Self-attention with any ``PositionEncoding`` applied to queries and keys.

    The layer never inspects which encoding it has: it asks the encoding for its state (or its RoPE form, when
    folding) and calls ``F.scaled_dot_product_attention`` with the scale ``1 / sqrt(head_dim)`` fixed explicitly
    (the tensor-product encoding widens q and k but keeps the logit ``q^T k * phi^T phi``, so SDPA's default
    ``1 / sqrt(out_dim)`` would be wrong).

    Args:
        dim: ``D``.
        num_heads: ``H`` (must divide ``D``).
        pe: the encoding (``head_dim = D / H``, ``num_heads = H``), or ``None`` for no rotary encoding.
            A module shared by several layers is simply passed to each of them.
        num_kv_heads: ``Hk``, key/value heads (must divide ``H``; ``None``: ``H``, multi-head attention; ``1``:
            multi-query attention). The projection ``qkv`` then has ``D + 2 Hk d`` output rows (q, then k, then
            v, head by head); the encoding is applied per query head (module docstring).
        qkv_bias: bias of the fused q/k/v projection.
        attn_drop, proj_drop: dropout on the attention weights and on the output.
        fold: merge a commuting encoding's basis into the q/k projection (see the module docstring); ``False``
            applies the encoding to every token as ``pe(q, k, coords)`` does. Ignored for encodings that
            cannot be folded.

    The folded rotation runs on the execution path the encoding's ``backend`` names (``"auto"``, ``"torch"`` or
    ``"triton"``, see ``PositionEncoding.set_conventions``), as its own forward does.
    """

    def __init__(self, dim: int, num_heads: int, pe: Optional[PositionEncoding] = None, *, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, fold: bool = True,
                 num_kv_heads: Optional[int] = None) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads={num_heads}")
        kv = num_heads if num_kv_heads is None else int(num_kv_heads)
        if kv < 1 or num_heads % kv:
            raise ValueError(f"num_kv_heads={num_kv_heads} must be a positive divisor of num_heads={num_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = kv
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        if pe is not None and (pe.head_dim != self.head_dim or pe.num_heads != num_heads):
            raise ValueError(f"the position encoding was built for head_dim={pe.head_dim}, num_heads={pe.num_heads}; "
                             f"this attention has head_dim={self.head_dim}, num_heads={num_heads}")
        self.qkv = nn.Linear(dim, dim + 2 * kv * self.head_dim, bias=qkv_bias)  # (3D, D) for multi-head
        self.pe = pe
        self.fold = bool(fold)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    @property
    def folds(self) -> bool:
        """Whether the forward pass folds the encoding's basis into the projection (``fold`` and foldable)."""
        return self.fold and self.pe is not None and foldable_kind(self.pe) is not None

    def prepare(self, coords: Tensor, num_prefix_tokens: int = 0,
                dtype: Optional[torch.dtype] = None) -> Optional[PreparedState]:
        """The encoding's per-forward state (``encodings.prepared.prepare_attention``): everything that depends on
        its parameters and the coordinates but not on the tokens, the execution path chosen. Pass it to every layer
        that holds the same encoding (``forward(..., pe_state=)``).

        Args:
            coords, num_prefix_tokens: as :meth:`forward`.
            dtype: the tokens' dtype (float64 tokens get a float64 state; anything else float32).

        Returns ``None`` without an encoding.
        """
        if self.pe is None:
            return None
        return prepare_attention(self.pe, coords, num_prefix_tokens, dtype, self.fold)

    def forward(self, x: Tensor, coords: Optional[Tensor] = None, num_prefix_tokens: int = 0,
                pe_state: Optional[PreparedPE] = None, attn_mask: Optional[Any] = None) -> Tensor:
        """Args:
            x: ``(B, N, D)``.
            coords: ``(M, c)`` shared by the batch or ``(B, M, c)`` per example; ignored without an encoding.
            num_prefix_tokens: ``P0`` leading tokens that the encoding leaves unrotated.
            pe_state: this layer's encoding state from :meth:`prepare` (computed here when ``None``).
            attn_mask: ``None`` (full attention), a boolean mask broadcastable to ``(B, H, N, N)`` (``True``:
                attend; e.g. ``ropekit.nn.masks.segment_mask`` for packed sequences), a FlexAttention
                ``BlockMask`` (``ropekit.nn.masks.flex_segment_mask``) or the varlen layout of packed rows
                (``ropekit.nn.masks.varlen_segments``), see ``ropekit.nn.masks.masked_attention``.

        Returns:
            ``(B, N, D)``.

        Raises:
            ValueError: NaN or infinite coordinates, naming their count, on the folded path and the unfolded one
                alike (``ropekit.encodings.check_coords``'s finiteness check, run at every call: on the CPU at
                once; on an accelerator counted on the device without a host synchronisation and raised by
                ``ropekit.encodings.check_deferred_coords()``, which the training engine calls every ``log_every`` steps).
        """
        b, n, dim = x.shape
        if self.pe is None:
            # (3D, D), (3D,): each group's key and value once per query head
            q, k, v = F.linear(x, *self.expanded_qkv()).reshape(b, n, 3, self.num_heads, self.head_dim).permute(
                2, 0, 3, 1, 4).unbind(0)  # (B, H, N, d) each
        else:
            if coords is None:
                raise ValueError("this attention layer has a position encoding: pass coords")
            state = pe_state if pe_state is not None and pe_state.pe is self.pe else \
                self.prepare(coords, num_prefix_tokens, x.dtype)
            qkv = F.linear(x, *state.projection(self))  # (B, N, 3D): the basis merged where the encoding folds
            q, k, v = state.apply_qkv(qkv, self.num_heads)  # (B, H, N, d') each, v (B, H, N, d)
        drop = self.attn_drop if self.training else 0.0
        if attn_mask is None:
            out = scaled_dot_product_attention(q, k, v, dropout_p=drop, scale=self.scale)  # (B, H, N, d)
        else:  # packed sequences: block-diagonal over segments (a boolean mask or a FlexAttention block mask)
            out = masked_attention(q, k, v, attn_mask, dropout_p=drop, scale=self.scale)  # (B, H, N, d)
        out = out.transpose(1, 2).reshape(b, n, dim)  # (B, N, D)
        return self.proj_drop(self.proj(out))

    def expanded_qkv(self) -> Tuple[Tensor, Optional[Tensor]]:
        """The projection as multi-head attention's ``(3 D, D_in)`` weight and ``(3 D,)`` bias: the q rows as they
        are, each group's k and v rows repeated once per query head of the group (differentiable; the same
        tensors for ``num_kv_heads = num_heads``)."""
        w, b = self.qkv.weight, self.qkv.bias
        h, g, d = self.num_heads, self.num_kv_heads, self.head_dim
        if g == h:
            return w, b
        dim, r = h * d, h // g

        def rep(t: Tensor) -> Tensor:  # (g d, ...) -> (h d, ...), group by group
            return t.unflatten(0, (g, 1, d)).expand(g, r, d, *t.shape[1:]).flatten(0, 2)

        wq, wk, wv = w.split([dim, g * d, g * d])
        weight = torch.cat([wq, rep(wk), rep(wv)])
        if b is None:
            return weight, None
        bq, bk, bv = b.split([dim, g * d, g * d])
        return weight, torch.cat([bq, rep(bk), rep(bv)])

    def no_weight_decay(self) -> set:
        """Names (relative to this layer, as in ``named_parameters()``) of its encoding's learnable parameters."""
        if self.pe is None:
            return set()
        return {f"pe.{name}" for name in self.pe.no_weight_decay()}

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        return f"num_heads={self.num_heads}{kv}, head_dim={self.head_dim}, fold={self.fold}"
