"""Cayley-STRING: ``R(r) = RoPE-Mixed(r) . P`` with a learnable orthogonal ``P = (I - S)(I + S)^-1``.

``S`` is skew-symmetric, stored by its free entries (the strict upper triangle, ``d (d - 1) / 2`` numbers per
parameter head; with ``band`` only the entries with ``0 < j - i <= band``); they start at zero, so the
encoding starts as RoPE-Mixed. ``P`` comes from one LU factorisation per forward (``lu_factor_ex``, with a
hand-written backward that reuses its factors: ``skew.cayley_from_free``), shared by q, k and every token, and
is applied as a matrix product. The commuting generators it implies are
``L_k = P^T J_k P`` (``J_k`` the RoPE-Mixed generators): ``R(r) = P expm(sum_k r_k L_k)`` (``P`` on the left).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops.forms import RoPEForm, half_pairs_basis, param_heads, post_form, stack_layers
from .ops.products import basis_change
from .registry import BenchRow, register_pe
from .rope import MixedRoPE, KernelState
from .ops.rotation import rotate_pairs
from .ops.skew import cayley_from_free, free_to_skew, num_free

__all__ = ["CayleySTRING"]


@register_pe("cayley", label="Cayley-STRING", paper_sharing="layer", bench_vit_gpu=True,  # STRING: S = 0 at start
             bench_rows=(BenchRow("cayley"), BenchRow("folded cayley", kind="folded", base="cayley"),
                         BenchRow("cayley in training (folded)", kind="train", base="cayley")))
class CayleySTRING(MixedRoPE):
    post_rotation = True
    rope_kind = "post"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, base: float = 100.0,
                 per_head: bool = False, band: int | None = None, freqs: Tensor | None = None) -> None:
        if band is not None and not 1 <= band < head_dim:
            raise ValueError(f"cayley band must be in [1, {head_dim - 1}], got {band}")
        super().__init__(head_dim, coord_dim, num_heads, base=base, per_head=per_head, freqs=freqs)
        self.band = band
        self.cayley_params = nn.Parameter(torch.zeros(self.param_heads, num_free(head_dim, band)))  # (Hp, F)

    def _init_weights(self) -> None:
        """Frequencies as RoPE-Mixed, ``S = 0`` (``P = I``)."""
        super()._init_weights()
        if hasattr(self, "cayley_params") and not self.cayley_params.is_meta:
            with torch.no_grad():
                self.cayley_params.zero_()

    def skew_matrix(self) -> Tensor:
        """``S`` of shape ``(Hp, d, d)``, from the free entries."""
        return free_to_skew(self.cayley_params, self.head_dim, self.band)

    def _rotation(self, dtype: torch.dtype | None = None) -> Tensor:
        """``P = (I - S)(I + S)^-1`` ``(Hp, d, d)`` (``skew.cayley_from_free``: one gather, one solve), in ``dtype``
        (default the parameters', float32 for bf16 / float16 parameters: no solve runs in those, and a rotation
        rounded to them is orthogonal only to 2^-8 / 2^-11)."""
        p = self.cayley_params
        v = p.to(torch.promote_types(p.dtype, torch.float32) if dtype is None else dtype)
        return cayley_from_free(v, self.head_dim, self.band)

    def post_rotation_matrix(self) -> Tensor:
        return self._rotation().expand(self.num_heads, -1, -1)

    def _prepare(self, coords: Tensor, dtype: torch.dtype):
        p = self._rotation(dtype)  # (Hp, d, d)
        kernel = KernelState.prepare(coords, self.freqs, self.backend)
        if kernel is not None:
            return kernel, p  # the fused kernel rotates P x, angles formed in-kernel
        cos, sin = super()._prepare(coords, dtype)
        return cos, sin, p

    def _encode(self, x: Tensor, data, num_prefix_tokens: int, dtype: torch.dtype) -> Tensor:
        """Where the fused rotation kernel runs, ``RoPE(theta) P x`` in one pass over the tokens in their own dtype
        (``ropekit.kernels.fused_basis_rotary``: ``P x`` is never written to memory); else the two steps."""
        if isinstance(data, tuple) and isinstance(data[0], KernelState) and self.pairs == "interleaved" \
                and dtype == torch.float32:
            kernel = data[0].basis_kernel(x, data[-1])
            if kernel is not None:  # freqs (Hp, c, P), Hp = 1 or H: as the kernel takes them
                return kernel(x, data[-1], data[0].coords, data[0].freqs, num_prefix_tokens=num_prefix_tokens,
                              validate=False)
        return super()._encode(x, data, num_prefix_tokens, dtype)

    def _transform(self, x: Tensor, state) -> Tensor:
        x = basis_change(x, state[-1])  # P x per token, one GEMM: (B, H, M, d)
        if isinstance(state[0], KernelState):
            return state[0].rotate(x)[0]
        cos, sin, _ = state
        return rotate_pairs(x, cos, sin)

    def generators(self) -> Tensor:
        """``L_k = P^T J_k P`` (``J_k`` the RoPE-Mixed generators): ``R(r) = P expm(sum_k r_k L_k)``.

        ``P`` multiplies on the left here, unlike relaxed STRING's ``R_STR(r) P_sp``: with these generators
        ``R(r)^T R(s) = R_STR(s - r)`` exactly, which is what the invariance diagnostics compare against.
        """
        p = self.post_rotation_matrix()  # (H, d, d)
        j = super().generators()  # (H, c, d, d)
        return p.transpose(-1, -2).unsqueeze(1) @ j @ p.unsqueeze(1)

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """``R(r) = RoPE(r) P`` exactly: ``P`` is the Cayley rotation (one solve, shared by the basis and the prefix
        transform ``P^T``) and the frequencies are the mixed ones."""
        return post_form(self, self._rotation())  # (Hp, d, d)

    def rope_batch_key(self) -> tuple | None:
        """Cayley-STRING encodings of one size, band, head sharing, pair convention, dtype and device."""
        p = self.cayley_params
        return ("cayley", type(self), self.head_dim, self.band, tuple(p.shape), tuple(self.freqs.shape), p.dtype,
                p.device, self.pairs)

    @classmethod
    def stacked_rope_form(cls, pes, prefix: bool = True) -> RoPEForm:
        """All the Cayley rotations from one batched solve ``(L, Hp, d, d)``, the frequencies stacked, the prefix
        transforms ``P^T`` (``None`` with ``prefix=False``: a model without prefix tokens does not form them)."""
        first = pes[0]
        params = stack_layers(pe.cayley_params for pe in pes)  # (L, Hp, F)
        params = params.to(torch.promote_types(params.dtype, torch.float32))  # (bf16 / float16: the solve in float32)
        bases = cayley_from_free(params, first.head_dim, first.band)  # (L, Hp, d, d), one solve
        freqs = stack_layers(param_heads(pe.freqs, pe.param_heads) for pe in pes)  # (L, Hp, c, d/2)
        return RoPEForm(half_pairs_basis(first, bases), freqs, bases.transpose(-1, -2) if prefix else None)
