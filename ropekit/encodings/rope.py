"""Encodings that rotate interleaved pairs by angles linear in the coordinates (RoPE family).

``R(r) = RoPE(r)``: pair ``n`` turns by ``theta_n(r) = sum_k r_k * freqs[k, n]`` (see ``functional``).
Fast path: cos/sin tables in real arithmetic, computed once per forward and shared by q and k
(once for the whole batch when the coordinates are shared).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .base import PositionEncoding
from .functional import axial_frequencies, mixed_frequencies, pair_generators, rope_angles, rotate_pairs

__all__ = ["NoPE", "FrequencyRoPE", "AxialRoPE", "MixedRoPE", "LieRECommute"]


class NoPE(PositionEncoding):
    """The identity: no position information (``name="none"``)."""

    name = "none"

    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> None:
        return None

    def _transform(self, x: Tensor, state: None) -> Tensor:
        return x

    def generators(self) -> Tensor:
        return torch.zeros(self.num_heads, self.coord_dim, self.head_dim, self.head_dim)

    def to_rope(self) -> tuple[Tensor, Tensor]:
        """``(P, freqs)`` with ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P``: the identity and zero frequencies."""
        dtype = self._param_dtype()
        eye = torch.eye(self.head_dim, dtype=dtype).expand(self.num_heads, -1, -1)
        return eye, torch.zeros(self.num_heads, self.coord_dim, self.head_dim // 2, dtype=dtype)


class FrequencyRoPE(PositionEncoding):
    """RoPE with a frequency matrix ``freqs`` of shape ``(Hp, c, d/2)``; subclasses choose how it is stored.

    Subclasses provide the property ``freqs``.
    """

    @property
    def freqs(self) -> Tensor:  # (Hp, c, P)
        raise NotImplementedError

    def angles(self, coords: Tensor) -> Tensor:
        """Rotation angles ``(Hp, M, d/2)`` for ``(M, c)`` coords or ``(B, Hp, M, d/2)`` per example.

        Computed in float32 (float64 for float64 coords) with autocast disabled.
        """
        dtype = torch.float64 if coords.dtype == torch.float64 else torch.float32
        with torch.autocast(device_type=coords.device.type, enabled=False):
            return rope_angles(coords.to(dtype), self.freqs.to(dtype))

    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        theta = rope_angles(coords, self.freqs.to(dtype))
        if theta.dim() == 3:
            theta = theta.unsqueeze(0)  # (1, Hp, M, P): shared by the batch
        return torch.cos(theta), torch.sin(theta)

    def _transform(self, x: Tensor, state: tuple[Tensor, Tensor]) -> Tensor:
        cos, sin = state
        return rotate_pairs(x, cos, sin)

    def generators(self) -> Tensor:
        gen = pair_generators(self.freqs)  # (Hp, c, d, d)
        return gen.expand(self.num_heads, -1, -1, -1)

    def to_rope(self) -> tuple[Tensor, Tensor]:
        """``(P, freqs)`` with ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P``: ``P = I`` (already RoPE).

        Returns ``P`` ``(H, d, d)`` and ``freqs`` ``(H, c, d/2)``, detached.
        """
        f = self.freqs.detach()
        eye = torch.eye(self.head_dim, dtype=f.dtype, device=f.device).expand(self.num_heads, -1, -1)
        return eye, f.expand(self.num_heads, -1, -1)


class AxialRoPE(FrequencyRoPE):
    """Axial RoPE (VisionLlama / EVA): the pairs are split evenly across the ``c`` axes.

    Pair ``n`` of axis ``k`` turns by ``r_k * base ** (-2n / d_k)``. If ``d/2`` is not divisible by ``c``,
    the leftover pairs (the last ones) are not rotated. ``learnable_freqs=True`` makes the frequencies a
    parameter (initialised to the axial values). With ``c = 1`` this is classic RoPE on interleaved pairs.
    """

    name = "axial"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, base: float = 10000.0,
                 learnable_freqs: bool = False, per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head and learnable_freqs)
        init = axial_frequencies(head_dim, coord_dim, base).unsqueeze(0).repeat(self.param_heads, 1, 1)
        self.base = base
        if learnable_freqs:
            self.freq_param = nn.Parameter(init)
        else:
            self.register_buffer("freq_table", init, persistent=False)

    def _init_weights(self) -> None:
        if not self.freqs.is_meta:  # also refills the (non-persistent) table after ``to_empty``
            self.freqs.copy_(axial_frequencies(self.head_dim, self.coord_dim, self.base))

    @property
    def freqs(self) -> Tensor:
        return self.freq_param if hasattr(self, "freq_param") else self.freq_table


class MixedRoPE(FrequencyRoPE):
    """RoPE-Mixed (Heo et al. 2024): every pair turns by ``sum_k r_k w_{k,n}``, all ``w`` learnable.

    Initialised per parameter head with RoPE-like magnitudes (maximum wavelength ``base``, default 100)
    pointing in a random direction (see ``functional.mixed_frequencies``).
    """

    name = "mixed"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, base: float = 100.0,
                 per_head: bool = False, freqs: Tensor | None = None) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        self.base, self._given_freqs = base, None
        if freqs is not None:
            freqs = torch.as_tensor(freqs, dtype=torch.float32, device="cpu")
            if freqs.dim() == 2:
                freqs = freqs.unsqueeze(0).repeat(self.param_heads, 1, 1)
            if freqs.shape != (self.param_heads, coord_dim, head_dim // 2):
                raise ValueError(f"freqs must have shape ({self.param_heads}, {coord_dim}, {head_dim // 2}) or "
                                 f"({coord_dim}, {head_dim // 2}), got {tuple(freqs.shape)}")
            self._given_freqs = freqs.clone()
        self.freq_param = nn.Parameter(torch.empty(self.param_heads, coord_dim, head_dim // 2))
        self._init_weights()

    def _init_weights(self) -> None:
        if not self.freq_param.is_meta:
            with torch.no_grad():
                init = self._given_freqs if self._given_freqs is not None else \
                    mixed_frequencies(self.head_dim, self.coord_dim, self.param_heads, self.base)
                self.freq_param.copy_(init)

    @property
    def freqs(self) -> Tensor:
        return self.freq_param


class LieRECommute(FrequencyRoPE):
    """LieRE-Commute: LieRE restricted to 2x2 generator blocks, which commute.

    Block ``n`` of ``L_k`` is ``[[0, a_{k,n}], [-a_{k,n}, 0]]`` (LieRE's ``triu - triu^T`` on a 2x2 block), so
    pair ``n`` turns by ``-sum_k r_k a_{k,n}``. Raw parameters uniform in ``[0, init_scale)`` (LieRE's
    ``2 pi``). One set shared by all heads by default (and by all layers when the model builder shares it).
    """

    name = "liere-commute"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, init_scale: float = 2 * math.pi,
                 per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        self.init_scale = init_scale
        self.generator_params = nn.Parameter(torch.empty(self.param_heads, coord_dim, head_dim // 2))
        self._init_weights()

    def _init_weights(self) -> None:
        p = self.generator_params
        if not p.is_meta:
            with torch.no_grad():
                p.copy_(torch.rand(p.shape) * self.init_scale)

    @property
    def freqs(self) -> Tensor:
        return -self.generator_params
