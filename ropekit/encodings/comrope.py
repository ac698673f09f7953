"""ComRoPE (Yu et al. 2025): block-diagonal commuting generators with one skew base per block.

* ``comrope-ap`` (axis-partitioned): block ``j`` belongs to axis ``j mod c`` only; block ``j`` of
  ``R(r)`` is ``expm(r_{j mod c} K_j)``, ``K_j = B_j - B_j^T``. Needs ``d / b`` to be a multiple of ``c``.
* ``comrope-ld`` (linearly dependent): ``L_k = blockdiag_j(lambda_{k,j} K_j)``; block ``j`` of ``R(r)`` is
  ``expm(s_j K_j)`` with ``s_j = sum_k r_k lambda_{k,j}``. With ``b = 2`` it is RoPE-Mixed.

Fast path: each block's generator is fixed, so one real block-diagonalisation per block,
``K = Q blockdiag(mu J) Q^T``, serves all tokens: ``expm(s K) = Q RoPE(s mu) Q^T``. The ``b x b`` block
exponentials are built once per forward for every distinct (coordinate, parameter head, block) -- ``M * nb``
matrices for an image grid shared by the batch, never one per example and head -- shared by q and k, and
applied with batched products (``blocks.scaled_block_exp_matrices`` and ``blocks.block_apply``). The
backward pass is the exact Frechet derivative in the basis ``Q`` (``sinc`` form: finite at ``K = 0`` and for
coinciding eigenvalues). No per-token matrix exponential, no dense ``d x d`` scatter.

Initialisation ``init="rope"`` (default) makes the encoding start as axial RoPE (each block holds ``b/2``
RoPE planes of its axis); ``init="zero"`` starts at the identity (for fine-tuning a model trained
without it); ``init="normal"`` is the authors' random start: full bases ``B_j`` with entries drawn from
``N(0, init_std^2)`` (``K_j = B_j - B_j^T``) and, for ComRoPE-LD, axis weights from ``N(0, 1)``. The authors'
``init_std = 1`` goes with coordinates normalised to ``[0, 1]`` over the image; with integer grid coordinates
scale it down by the grid size.

Parameters: each block's skew generator ``K_j`` is stored by its ``b (b - 1) / 2`` free entries (the strict upper
triangle), not as a full ``B_j`` with ``K_j = B_j - B_j^T`` (which counts and steps every free entry twice)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops.angles import wide_angles
from .base import PositionEncoding
from .ops.blocks import block_diag, block_apply, scaled_block_exp_matrices
from .ops.forms import RoPEForm, block_form, stack_layers
from .registry import BenchRow, register_pe
from .ops.skew import free_to_skew, full_to_free, num_free

__all__ = ["ComRoPEAP", "ComRoPELD"]


def _rope_block_bases(head_dim: int, coord_dim: int, block_size: int, base: float) -> Tensor:
    """Bases ``B_j`` ``(nb, b, b)`` such that ``B_j - B_j^T`` rotates the planes of block ``j`` like axial RoPE.

    Block ``j`` belongs to axis ``j mod c``; its ``b/2`` planes are planes ``floor(j / c) * b/2 + i`` of
    that axis, with axial frequencies ``base ** (-2n / (d / c))``.
    """
    nb, half = head_dim // block_size, block_size // 2
    d_axis = head_dim / coord_dim
    bases = torch.zeros(nb, block_size, block_size, dtype=torch.float64)
    for j in range(nb):
        for i in range(half):
            n = (j // coord_dim) * half + i
            bases[j, 2 * i, 2 * i + 1] = -base ** (-2.0 * n / d_axis)
    return bases.float()


class _ComRoPE(PositionEncoding):
    rope_kind = "blocks"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int, block_size: int, init: str, base: float,
                 per_head: bool, init_std: float = 1.0) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        if block_size < 2 or block_size % 2 or head_dim % block_size:
            raise ValueError(f"{self.name}: block_size must be even and divide head_dim={head_dim}, got {block_size}")
        if init not in ("rope", "zero", "normal"):
            raise ValueError(f"{self.name}: init must be 'rope', 'zero' or 'normal', got {init!r}")
        self.block_size = block_size
        self.num_blocks = head_dim // block_size
        self.init, self.base, self.init_std = init, base, float(init_std)
        self.block_params = nn.Parameter(torch.empty(self.param_heads, self.num_blocks, num_free(block_size)))
        self.register_buffer("block_axis", torch.arange(self.num_blocks) % coord_dim, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        """Bases as RoPE, zero or random (``init``); ``block_axis`` (a derived buffer) refilled."""
        if self.block_params.is_meta:
            return
        with torch.no_grad():
            self.block_axis.copy_(torch.arange(self.num_blocks) % self.coord_dim)
            if self.init == "rope":
                bases = full_to_free(_rope_block_bases(self.head_dim, self.coord_dim, self.block_size, self.base))
                self.block_params.copy_(bases)  # (nb, F) broadcast over parameter heads
            elif self.init == "normal":  # the authors' full bases, reduced to the free entries of B - B^T
                hp, nb, b = self.param_heads, self.num_blocks, self.block_size
                self.block_params.copy_(full_to_free(torch.randn(hp, nb, b, b) * self.init_std))
            else:
                self.block_params.zero_()

    def block_generators(self) -> Tensor:
        """``K_j`` from the free entries: ``(Hp, nb, b, b)``."""
        return free_to_skew(self.block_params, self.block_size)

    def block_scales(self, coords: Tensor) -> Tensor:
        """``s_j(r)``: ``(Hp, M, nb)`` for ``(M, c)`` coords, ``(B, Hp, M, nb)`` per example."""
        raise NotImplementedError

    def _axis_weights(self) -> Tensor:
        """``lambda``: ``(Hp, c, nb)``."""
        raise NotImplementedError

    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> Tensor:
        # (1 | B, Hp, M, nb, b, b): once per forward, shared by q and k
        return scaled_block_exp_matrices(self.block_scales(coords), self.block_generators().to(dtype))

    def _transform(self, x: Tensor, blocks: Tensor) -> Tensor:
        return block_apply(blocks, x)

    def rope_blocks(self) -> tuple[Tensor, Tensor]:
        """The skew blocks ``K_j`` ``(Hp, nb, b, b)`` and the axis weights ``lambda`` ``(Hp, c, nb)``."""
        return self.block_generators(), self._axis_weights()

    @classmethod
    def stacked_rope_blocks(cls, pes) -> tuple[Tensor, Tensor]:
        """:meth:`rope_blocks` of ``L`` encodings of one configuration, stacked: the skew blocks of all from one
        scatter of their stacked free entries, ``(L, Hp, nb, b, b)``, and the axis weights ``(L, Hp, c, nb)``."""
        k = free_to_skew(stack_layers(pe.block_params for pe in pes), pes[0].block_size)
        return k, torch.stack([pe._axis_weights() for pe in pes])

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """``R(r) = P^T RoPE_freqs(r) P`` with ``P = blockdiag_j(Q_j^T)``, ``K_j = Q_j blockdiag_n(mu_{j,n} J) Q_j^T``
        (zero and repeated eigenvalues included): pair ``n`` of block ``j`` turns with frequency
        ``lambda_{k,j} mu_{j,n}`` along axis ``k`` (``forms.block_form``)."""
        return block_form(self, *self.rope_blocks(), basis_gradient=basis_gradient)

    def generators(self) -> Tensor:
        lam = self._axis_weights()  # (Hp, c, nb)
        blocks = lam[..., None, None] * self.block_generators().unsqueeze(1)  # (Hp, c, nb, b, b)
        return block_diag(blocks).expand(self.num_heads, -1, -1, -1)


@register_pe("comrope-ap", label="ComRoPE-AP", paper_sharing="head", bench_vit_options={"block_size": 8},
             paper_preset={"init": "normal", "init_std": 1.0, "per_head": True},  # Yu et al.: random bases per head
             bench_rows=(BenchRow("comrope-ap (b=8)", (("block_size", 8),)),
                         BenchRow("comrope-ap (b=8) in training (folded)", (("block_size", 8),), kind="train",
                                  base="comrope-ap (b=8)"),
                         BenchRow("dense d x d comrope-ap (b=8)", (("block_size", 8),), kind="naive",
                                  base="comrope-ap (b=8)", heavy=True)))
class ComRoPEAP(_ComRoPE):

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, block_size: int = 8,
                 init: str = "rope", base: float = 10000.0, per_head: bool = False, init_std: float = 1.0) -> None:
        if block_size > 0 and head_dim % block_size == 0 and (head_dim // block_size) % coord_dim:
            raise ValueError(
                f"comrope-ap needs head_dim / block_size to be a multiple of coord_dim: {head_dim} / {block_size} = "
                f"{head_dim // block_size} blocks cannot be split evenly over {coord_dim} axes"
            )
        super().__init__(head_dim, coord_dim, num_heads, block_size, init, base, per_head, init_std)

    def _axis_weights(self) -> Tensor:
        lam = torch.zeros(self.param_heads, self.coord_dim, self.num_blocks, device=self.block_params.device,
                          dtype=self.block_params.dtype)
        lam[:, self.block_axis, torch.arange(self.num_blocks, device=lam.device)] = 1.0  # device index: no host copy
        return lam

    def block_scales(self, coords: Tensor) -> Tensor:
        s = coords[..., self.block_axis]  # (M, nb) or (B, M, nb)
        return s.unsqueeze(-3)  # (1, M, nb) or (B, 1, M, nb): shared by all parameter heads


@register_pe("comrope-ld", label="ComRoPE-LD", paper_sharing="head", bench_vit_options={"block_size": 8},
             bench_vit_gpu=True,
             paper_preset={"init": "normal", "init_std": 1.0, "per_head": True},
             bench_rows=(BenchRow("comrope-ld (b=8)", (("block_size", 8),)),
                         BenchRow("folded comrope-ld (b=8)", (("block_size", 8),), kind="folded",
                                  base="comrope-ld (b=8)"),
                         BenchRow("comrope-ld (b=8) in training (folded)", (("block_size", 8),), kind="train",
                                  base="comrope-ld (b=8)"),
                         BenchRow("dense d x d comrope-ld (b=8)", (("block_size", 8),), kind="naive",
                                  base="comrope-ld (b=8)")))
class ComRoPELD(_ComRoPE):

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, block_size: int = 8,
                 init: str = "rope", base: float = 10000.0, per_head: bool = False, init_std: float = 1.0) -> None:
        super().__init__(head_dim, coord_dim, num_heads, block_size, init, base, per_head, init_std)
        self.axis_weights = nn.Parameter(torch.empty(self.param_heads, coord_dim, self.num_blocks))
        self._init_axis_weights()

    def _init_weights(self) -> None:
        """As ComRoPE-AP, then the axis weights (same random draws, in the same order, as the constructor)."""
        super()._init_weights()
        if hasattr(self, "axis_weights"):
            self._init_axis_weights()

    def _init_axis_weights(self) -> None:
        """One-hot on the block's axis (starts axis-partitioned), or ``N(0, 1)`` for ``init="normal"``."""
        lam = self.axis_weights
        if lam.is_meta:
            return
        with torch.no_grad():
            if self.init == "normal":
                lam.copy_(torch.randn(lam.shape))
            else:
                lam.zero_()
                lam[:, torch.arange(self.num_blocks) % self.coord_dim, torch.arange(self.num_blocks)] = 1.0

    def _axis_weights(self) -> Tensor:
        return self.axis_weights

    def block_scales(self, coords: Tensor) -> Tensor:
        """``s_j(r) = sum_k r_k lambda_{k,j}``, formed as every encoding's angles (``angles.wide_angles``: float64,
        never a TF32-rounded matmul), which the block exponentials take as they are."""
        return wide_angles(coords, self.axis_weights)
