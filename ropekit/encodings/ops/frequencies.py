"""Frequencies of the RoPE family: the initial frequency matrices of axial RoPE and RoPE-Mixed, and the dense
generators of a pairwise rotation.

Shape legend: ``Hp`` heads that own parameters (1 or ``H``), ``c`` coordinate dimension, ``d`` head dimension,
``P = d / 2`` rotation planes (interleaved pairs, see :mod:`ropekit.encodings.ops.rotation`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["pair_generators", "axial_frequencies", "mixed_frequencies"]


def pair_generators(freqs: Tensor) -> Tensor:
    """Dense generators of the pairwise rotation ``RoPE(r) = expm(sum_k r_k J_k)``.

    Args:
        freqs: ``(Hp, c, P)``.

    Returns:
        ``(Hp, c, 2P, 2P)`` skew-symmetric, block diagonal: block ``n`` of ``J_k`` is
        ``freqs[k, n] * [[0, -1], [1, 0]]``.
    """
    hp, c, p = freqs.shape
    gen = freqs.new_zeros(hp, c, p, 2, p, 2)
    idx = torch.arange(p, device=freqs.device)
    gen[:, :, idx, 1, idx, 0] = freqs
    gen[:, :, idx, 0, idx, 1] = -freqs
    return gen.reshape(hp, c, 2 * p, 2 * p)


def axial_frequencies(head_dim: int, coord_dim: int, base: float = 10000.0,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """Axial RoPE frequencies: pairs split evenly and contiguously across the axes.

    Axis ``k`` owns pairs ``[k * p, (k + 1) * p)`` with ``p = (d / 2) // c``; pair ``n`` of an axis turns
    by ``r_k * base ** (-2 n / d_k)`` with ``d_k = 2 p``. Leftover pairs (when ``d / 2`` is not divisible
    by ``c``) get frequency 0: they are not rotated.

    Args:
        dtype: of the result; the values are computed in float64 and rounded once (axial RoPE's fixed table keeps
            them in float64: rounded to float32, pair ``n`` turns ``r * ulp(omega_n)`` off at coordinate ``r``).

    Returns:
        ``(c, d / 2)`` frequency matrix in ``dtype`` (default float32), on the CPU (also under a
        ``torch.device("meta")`` context).
    """
    pairs = head_dim // 2
    per_axis = pairs // coord_dim
    if per_axis == 0:
        raise ValueError(
            f"axial RoPE needs at least one rotation plane per axis: head_dim={head_dim} gives "
            f"{pairs} planes for coord_dim={coord_dim}; use head_dim >= {2 * coord_dim}"
        )
    omega = base ** (-2.0 * torch.arange(per_axis, dtype=torch.float64, device="cpu") / (2 * per_axis))
    freqs = torch.zeros(coord_dim, pairs, dtype=torch.float64, device="cpu")
    for k in range(coord_dim):
        freqs[k, k * per_axis:(k + 1) * per_axis] = omega
    return freqs.to(dtype)


def mixed_frequencies(
    head_dim: int, coord_dim: int, num_heads: int, base: float = 100.0, generator: torch.Generator | None = None
) -> Tensor:
    """RoPE-Mixed initial frequencies (Heo et al. 2024), generalised to any coordinate dimension.

    Pairs are split into ``c`` contiguous groups. Within a group the magnitudes decay as in RoPE with
    maximum wavelength ``base`` (``|w_m| = base ** (-m / g)``, ``g`` the group size); every group points
    along one axis of a random orthonormal frame drawn per head. For ``c = 2`` the frame is a random
    angle ``a`` and the second group is offset by ``pi / 2`` (the authors' initialisation).

    Returns:
        ``(num_heads, c, d / 2)`` float32, on the CPU (drawn from the CPU generator, also under a device context).
    """
    pairs = head_dim // 2
    group = math.ceil(pairs / coord_dim)
    m = torch.arange(pairs, dtype=torch.float64, device="cpu") % group
    mag = base ** (-m / group)  # (P,)
    owner = torch.arange(pairs, device="cpu") // group  # (P,) which frame axis each pair follows
    freqs = torch.empty(num_heads, coord_dim, pairs, dtype=torch.float64, device="cpu")
    for h in range(num_heads):
        if coord_dim == 2:
            a = float(torch.rand((), generator=generator, dtype=torch.float64, device="cpu")) * 2 * math.pi
            frame = torch.tensor([[math.cos(a), math.cos(a + math.pi / 2)],
                                  [math.sin(a), math.sin(a + math.pi / 2)]], dtype=torch.float64,
                                 device="cpu")
        else:
            g = torch.randn(coord_dim, coord_dim, generator=generator, dtype=torch.float64, device="cpu")
            frame, _ = torch.linalg.qr(g)  # (c, c) orthonormal columns
        freqs[h] = frame[:, owner] * mag  # (c, P)
    return freqs.float()
