"""Circulant-STRING: block-circulant commuting generators, applied through the real FFT.

``L_k = C_k - C_k^T`` with ``C_k`` block-circulant, block size ``b`` (``b`` divides ``d``), each block
defined by its first column ``c`` (``C[i, j] = c[(i - j) mod b]``, as ``scipy.linalg.circulant``). The DFT
diagonalises every circulant, so per block::

    R(r) z = irfft( exp(i * sum_k r_k lambda_k) * rfft(z), n=b ),   lambda_k = 2 Im(rfft(c_k))

O(d log b) per token. The DC mode (and the Nyquist mode for even ``b``) has ``lambda = 0``: those
dimensions are never rotated (2 of every ``b``).

Fast path (``_PhaseFFT``): the backward pass is again one ``rfft``/``irfft`` pair, ``gx = R(r)^T g =
irfft(conj(phase) rfft(g))``, and the phase gradient one reduction over the batch and heads -- instead of
autograd's ``rfft`` backward, which zero-pads to a full complex FFT.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .base import PositionEncoding
from .functional import _is_compiling, _reduce_to, mixed_frequencies, skew

__all__ = ["CirculantSTRING", "circulant", "phase_fft_apply"]


def circulant(col: Tensor) -> Tensor:
    """Dense circulant matrices ``C[i, j] = col[(i - j) mod b]`` from first columns ``(..., b)`` -> ``(..., b, b)``."""
    b = col.shape[-1]
    i = torch.arange(b, device=col.device)
    return col[..., (i[:, None] - i[None, :]) % b]


def phase_fft_apply(x: Tensor, phase: Tensor, block_size: int) -> Tensor:
    """``irfft(phase * rfft(z), n=b)`` on every block ``z`` of size ``b`` of every token.

    Args:
        x: ``(B, H, M, nb * b)``.
        phase: ``(B | 1, Hp, M, nb, b // 2 + 1)`` complex, unit modulus, ``1`` on the DC (and Nyquist) mode.
        block_size: ``b``.

    Returns:
        ``(B, H, M, nb * b)``; differentiable in ``x`` and ``phase``.
    """
    if _is_compiling() or x.dtype not in (torch.float32, torch.float64):
        spec = torch.fft.rfft(x.unflatten(-1, (-1, block_size)), dim=-1)  # (B, H, M, nb, F)
        return torch.fft.irfft(spec * phase, n=block_size, dim=-1).flatten(-2)  # (B, H, M, d)
    return _PhaseFFT.apply(x, phase, block_size)


class _PhaseFFT(torch.autograd.Function):
    """``y = irfft(phase * rfft(x))`` per block with a real-FFT backward.

    With ``G = rfft(g)``: ``gx = irfft(conj(phase) G)`` (the exact adjoint, any phase), and
    ``gphase = sum (alpha_f / b) G conj(S)`` over the broadcast dimensions, ``S = rfft(x)``, ``alpha_f = 1`` on
    the DC and Nyquist modes and 2 elsewhere (the Hermitian half counts the other modes twice). ``conj(S)`` is
    recovered from the saved product ``Z = phase S`` as ``conj(Z) phase / |phase|^2``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, phase: Tensor, b: int) -> Tensor:
        z = torch.fft.rfft(x.unflatten(-1, (-1, b)), dim=-1) * phase  # (B, H, M, nb, F)
        ctx.b = b
        ctx.save_for_backward(phase, z if ctx.needs_input_grad[1] else None)
        return torch.fft.irfft(z, n=b, dim=-1).flatten(-2)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor):
        phase, z = ctx.saved_tensors
        b = ctx.b
        # contiguous: attention's gradients come in its own layout, on which the reduction below is ~40x slower
        spec_g = torch.fft.rfft(g.contiguous().unflatten(-1, (-1, b)), dim=-1)  # G: (B, H, M, nb, F)
        gx = gp = None
        if ctx.needs_input_grad[0]:
            gx = torch.fft.irfft(spec_g * phase.conj(), n=b, dim=-1).flatten(-2)
        if ctx.needs_input_grad[1]:
            nf = spec_g.shape[-1]
            alpha = torch.full((nf,), 2.0 / b, dtype=g.dtype, device=g.device)
            alpha[0] = 1.0 / b
            if b % 2 == 0:
                alpha[-1] = 1.0 / b
            acc = _reduce_to(spec_g * z.conj(), phase.shape)  # sum G conj(Z)
            gp = acc * alpha * phase / (phase.real.square() + phase.imag.square())
        return gx, gp, None


class CirculantSTRING(PositionEncoding):
    name = "circulant"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, block_size: int | None = None,
                 base: float = 100.0, per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        b = head_dim if block_size is None else block_size
        if b < 3 or head_dim % b:
            raise ValueError(f"circulant block_size must divide head_dim={head_dim} and be >= 3, got {b}")
        self.block_size, self.base = b, base
        self.circ_params = nn.Parameter(torch.empty(self.param_heads, coord_dim, head_dim // b, b))
        self._init_weights()

    def _init_weights(self) -> None:
        if self.circ_params.is_meta:
            return
        hp, c, nb, b = self.circ_params.shape
        nf = b // 2 + 1  # rfft modes
        usable = (b - 1) // 2  # modes 1 .. usable rotate; DC (and Nyquist for even b) never do
        # Initialise so that the mode frequencies lambda have RoPE-Mixed's scale: rfft(c) = i lambda / 2.
        lam = torch.zeros(hp, c, nb, nf)
        init = mixed_frequencies(2 * nb * usable, c, hp, self.base)  # (Hp, c, nb*usable)
        lam[..., 1:1 + usable] = init.reshape(hp, c, nb, usable)
        col = torch.fft.irfft(torch.complex(torch.zeros_like(lam), lam / 2), n=b)  # (Hp, c, nb, b)
        with torch.no_grad():
            self.circ_params.copy_(col)

    def mode_frequencies(self, dtype: torch.dtype | None = None) -> Tensor:
        """``lambda = 2 Im(rfft(c))``: ``(Hp, c, nb, b//2 + 1)``."""
        c = self.circ_params if dtype is None else self.circ_params.to(dtype)
        return 2 * torch.fft.rfft(c, dim=-1).imag

    def _prepare(self, coords: Tensor, dtype: torch.dtype):
        lam = self.mode_frequencies(dtype).flatten(-2)  # (Hp, c, nb*F)
        if coords.dim() == 2:
            theta = torch.einsum("mc,hcf->hmf", coords, lam).unsqueeze(0)  # (1, Hp, M, nb*F)
        else:
            theta = torch.einsum("bmc,hcf->bhmf", coords, lam)  # (B, Hp, M, nb*F)
        theta = theta.unflatten(-1, (-1, self.block_size // 2 + 1))  # (.., Hp, M, nb, F)
        return torch.complex(torch.cos(theta), torch.sin(theta))

    def _transform(self, x: Tensor, phase: Tensor) -> Tensor:
        return phase_fft_apply(x, phase, self.block_size)

    def generators(self) -> Tensor:
        blocks = skew(circulant(self.circ_params))  # (Hp, c, nb, b, b)
        hp, c, nb, b, _ = blocks.shape
        out = blocks.new_zeros(hp, c, nb, b, nb, b)
        idx = torch.arange(nb)
        out[:, :, idx, :, idx, :] = blocks.permute(2, 0, 1, 3, 4)
        return out.reshape(hp, c, nb * b, nb * b).expand(self.num_heads, -1, -1, -1)

    def to_rope(self) -> tuple[Tensor, Tensor]:
        """``(P, freqs)`` with ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P`` (here ``R(r) = P^T RoPE_freqs(r) P``).

        ``P`` is the orthonormal real DFT basis of each block: mode ``f`` (``1 <= f < b/2``) of block ``j`` is the
        pair ``(sqrt(2/b) sin(2 pi f n / b), sqrt(2/b) cos(2 pi f n / b))``, which turns with ``lambda_f`` (the
        ``rfft`` phase ``exp(i theta)`` rotates ``(Im, Re)`` of the spectrum's conjugate by ``+theta``). The
        never-rotated DC (and Nyquist) rows come last, paired with frequency 0. Returns ``(H, d, d)`` and
        ``(H, c, d/2)``, detached.
        """
        b, d = self.block_size, self.head_dim
        nb, usable = d // b, (b - 1) // 2
        with torch.no_grad():
            lam = self.mode_frequencies(torch.float64)  # (Hp, c, nb, F)
            n = torch.arange(b, dtype=torch.float64)
            p = torch.zeros(d, d, dtype=torch.float64)
            hp, c = lam.shape[:2]
            freqs = torch.zeros(hp, c, d // 2, dtype=torch.float64)
            row = 0
            for j in range(nb):
                for f in range(1, usable + 1):
                    ang = 2 * math.pi * f * n / b
                    p[row, j * b:(j + 1) * b] = math.sqrt(2.0 / b) * torch.sin(ang)
                    p[row + 1, j * b:(j + 1) * b] = math.sqrt(2.0 / b) * torch.cos(ang)
                    freqs[:, :, row // 2] = lam[:, :, j, f]
                    row += 2
            for j in range(nb):  # DC (and Nyquist) rows: frequency 0
                p[row, j * b:(j + 1) * b] = 1.0 / math.sqrt(b)
                row += 1
                if b % 2 == 0:
                    p[row, j * b:(j + 1) * b] = torch.cos(math.pi * n) / math.sqrt(b)
                    row += 1
        dtype = self.circ_params.dtype
        return (p.to(dtype).expand(self.num_heads, -1, -1),
                freqs.to(dtype).expand(self.num_heads if hp == 1 else hp, -1, -1).expand(self.num_heads, -1, -1))
