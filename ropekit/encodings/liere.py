"""LieRE (Ostmeier et al. 2024): ``R(r) = expm(sum_k r_k L_k)`` with dense, non-commuting generators.

``L_k = triu(A_k, 1) - triu(A_k, 1)^T``, ``A_k`` unconstrained: dense ``d x d`` (``block_size=None``) or
block diagonal with blocks of size ``b``. Raw parameters start uniform in ``[0, init_scale)`` (the
authors' ``2 pi``). Not translation invariant for ``c >= 2`` unless the coordinates are collinear.

Fast path: the exponential depends on the coordinates and the generators only, so it is computed once
per parameter head and token -- not once per example when the coordinates are shared by the batch,
nor once per head when the generators are shared by heads -- and applied block by block (never as a
dense ``d x d`` scatter of the blocks). The exponentials come from ``expm.linear_skew_expm``: the generator
sum is formed in float64 chunk by chunk and exponentiated through one Hermitian eigendecomposition per token
and block, which stays orthogonal to round-off at the authors' large initial generators on real grid
coordinates (a float32 ``matrix_exp`` does not), with bounded workspace and a backward pass that reuses the
eigenbasis. With per-example coordinates (one exponential per example and token) the eigenbases are not kept
but recomputed in the backward pass, in smaller chunks: the activation memory is then the rotations alone and the
workspace a few MiB.

Parameters: the authors store a full ``b x b`` matrix per block and use its strict upper triangle; the
diagonal and lower triangle never reach the encoding. ``num_effective_parameters()`` counts only the
entries that do (``c * d (b - 1) / 2`` per parameter head).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .base import PositionEncoding
from .ops.blocks import block_diag, block_apply
from .ops.expm import DEFAULT_BUDGET, linear_skew_expm
from .ops.forms import RoPEForm, block_form
from .registry import BenchRow, register_pe
from .rope import FrequencyRoPE

__all__ = ["LieRE", "LieRECommute"]

#: Matrix entries per chunk of per-example exponentials on the CPU (~4 MiB per complex128 work array): the
#: workspace stays a small fraction of the rotations themselves at a batch of ViT tokens, at no measurable cost in
#: speed.
_PER_EXAMPLE_BUDGET = 1 << 18


@register_pe("liere", label="LieRE", bench_vit_gpu=True,  # Ostmeier et al.: dense generators, uniform in [0, 2 pi)
             bench_rows=(BenchRow("liere (b=8)", (("block_size", 8),)), BenchRow("liere (dense)"),
                         BenchRow("naive liere (b=8)", (("block_size", 8),), kind="naive", base="liere (b=8)"),
                         BenchRow("naive liere (dense)", kind="naive", base="liere (dense)", heavy=True)))
class LieRE(PositionEncoding):
    commuting = False

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, block_size: int | None = None,
                 init_scale: float = 2 * math.pi, per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        b = head_dim if block_size is None else block_size
        if b < 2 or head_dim % b:
            raise ValueError(f"liere block_size must divide head_dim={head_dim} and be >= 2, got {b}")
        self.block_size = b
        self.init_scale = float(init_scale)
        nb = head_dim // b
        self.generator_params = nn.Parameter(torch.empty(self.param_heads, coord_dim, nb, b, b))
        self._init_weights()
        if coord_dim == 1 or b == 2:
            self.commuting = True  # a single generator (or 2x2 blocks) always commutes with itself

    def _init_weights(self) -> None:
        """Raw parameters uniform in ``[0, init_scale)``, as the authors (skipped on the meta device)."""
        p = self.generator_params
        if not p.is_meta:
            with torch.no_grad():
                p.copy_(torch.rand(p.shape, dtype=p.dtype, device=p.device) * self.init_scale)

    def num_effective_parameters(self) -> int:
        """Entries that reach the generators: the strict upper triangle of every block."""
        hp, c, nb, b, _ = self.generator_params.shape
        return hp * c * nb * b * (b - 1) // 2

    def block_generators(self) -> Tensor:
        """``(Hp, c, nb, b, b)`` skew blocks ``triu(A, 1) - triu(A, 1)^T``."""
        a = torch.triu(self.generator_params, diagonal=1)
        return a - a.transpose(-1, -2)

    def generators(self) -> Tensor:
        return block_diag(self.block_generators()).expand(self.num_heads, -1, -1, -1)

    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> Tensor:
        gen = self.block_generators().to(dtype)  # (Hp, c, nb, b, b)
        lead = coords.shape[:-1]  # (M,) or (B, M)
        if coords.dim() == 3:  # per example: B * M exponentials; keep no eigenbases, small chunks (bounded peak)
            # (on a GPU the exponentials are batched float64 matrix_exps, which want large chunks)
            budget = _PER_EXAMPLE_BUDGET if coords.device.type == "cpu" else DEFAULT_BUDGET
            rot = linear_skew_expm(coords.reshape(-1, self.coord_dim), gen, budget, recompute=True)
        else:  # the shared grid: M exponentials once per forward, eigenbases kept for a faster backward
            rot = linear_skew_expm(coords, gen)  # (T, Hp, nb, b, b), T = [B *] M
        rot = rot.view(*lead, *rot.shape[1:])  # ([B,] M, Hp, nb, b, b)
        rot = rot if coords.dim() == 3 else rot.unsqueeze(0)  # (B | 1, M, Hp, nb, b, b)
        return rot.transpose(1, 2).contiguous()  # (B | 1, Hp, M, nb, b, b)

    def _transform(self, x: Tensor, rot: Tensor) -> Tensor:
        return block_apply(rot, x)  # rot: (B|1, Hp, M, nb, b, b), never expanded over batch or heads

    @property
    def rope_kind(self) -> str | None:  # type: ignore[override]
        """``"rope"`` with 2x2 blocks, ``"blocks"`` with one coordinate; otherwise LieRE does not commute."""
        if self.block_size == 2:
            return "rope"
        return "blocks" if self.coord_dim == 1 else None

    def rope_blocks(self) -> tuple[Tensor, Tensor]:
        """With one coordinate: the skew blocks ``K_j`` ``(Hp, nb, b, b)`` and their axis weights ``(Hp, 1, nb)``
        (ones: every block turns with ``r``)."""
        k = self.block_generators()[:, 0]
        return k, k.new_ones(k.shape[0], 1, k.shape[1])

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """Only where LieRE commutes. With 2x2 blocks, block ``j`` of ``L_k`` is ``f J`` with
        ``f = L_k[j][1, 0]``: ``P = I``. With one coordinate, the eigenbasis of each block generator
        (``forms.block_form``).

        Raises:
            ValueError: for ``c >= 2`` with blocks larger than 2 (the generators do not commute).
        """
        kind = self.rope_kind
        if kind == "rope":
            return RoPEForm(None, self.block_generators()[:, ..., 1, 0], None, self.pairs)  # (Hp, c, d/2)
        if kind == "blocks":
            return block_form(self, *self.rope_blocks(), basis_gradient=basis_gradient)
        raise ValueError(
            f"liere with coord_dim={self.coord_dim} and block_size={self.block_size} does not commute: "
            f"R(r)^T R(s) depends on r and s, not only on s - r, so it has no RoPE form (use block_size=2 or "
            f"liere-commute)")


@register_pe("liere-commute", label="LieRE-Commute")
class LieRECommute(FrequencyRoPE):
    """LieRE-Commute: LieRE restricted to 2x2 generator blocks, which commute.

    Block ``n`` of ``L_k`` is ``[[0, a_{k,n}], [-a_{k,n}, 0]]`` (LieRE's ``triu - triu^T`` on a 2x2 block), so
    pair ``n`` turns by ``-sum_k r_k a_{k,n}``. Raw parameters uniform in ``[0, init_scale)`` (LieRE's
    ``2 pi``). One set shared by all heads by default (and by all layers when the model builder shares it).
    """

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, init_scale: float = 2 * math.pi,
                 per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        self.init_scale = init_scale
        self.generator_params = nn.Parameter(torch.empty(self.param_heads, coord_dim, head_dim // 2))
        self._init_weights()

    def _init_weights(self) -> None:
        """Re-draw the raw parameters uniformly in ``[0, init_scale)`` (CPU generator)."""
        init = torch.rand(self.generator_params.shape, device="cpu") * self.init_scale
        if self.generator_params.device.type != "meta":
            with torch.no_grad():
                self.generator_params.copy_(init)

    @property
    def freqs(self) -> Tensor:
        return -self.generator_params
