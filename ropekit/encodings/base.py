"""The interface every position encoding implements, and the checks they all share.

Shape legend: ``B`` batch, ``H`` heads, ``N`` tokens in the sequence, ``P0 = num_prefix_tokens`` prefix tokens
(CLS, registers) at the front of ``N``, ``M = N - P0`` tokens with coordinates, ``d`` head dimension,
``c`` coordinate dimension, ``Hp`` heads that own parameters (1 when shared by heads, else ``H``).

Coordinates are ``(M, c)`` when shared by the whole batch (an image grid) or ``(B, M, c)`` per example
(RGB-D patches, point clouds). Rotations are computed in float32 (float64 when the input is float64) with
autocast disabled, and the result is cast back to the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["PositionEncoding", "check_coords"]


def _is_compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


def check_coords(coords: Tensor, coord_dim: int, num_tokens: int, batch: int | None = None) -> None:
    """Validate a coordinate tensor; raise ``ValueError`` naming the expected shape.

    Args:
        coords: ``(M, c)`` or ``(B, M, c)``, real dtype.
        coord_dim: expected ``c``.
        num_tokens: expected ``M``.
        batch: expected ``B`` for per-example coordinates (``None`` skips that check).
    """
    expected = f"({num_tokens}, {coord_dim}) or ({batch if batch is not None else 'B'}, {num_tokens}, {coord_dim})"
    if not isinstance(coords, Tensor):
        raise ValueError(f"coords must be a torch.Tensor of shape {expected}, got {type(coords).__name__}")
    if coords.is_complex() or coords.dtype == torch.bool:
        raise ValueError(f"coords must be real numbers, got dtype {coords.dtype}")
    if coords.dim() not in (2, 3):
        raise ValueError(f"coords must have shape {expected}, got {tuple(coords.shape)}")
    if coords.shape[-1] != coord_dim:
        raise ValueError(
            f"coords have {coords.shape[-1]} coordinate dimensions but the encoding was built for "
            f"coord_dim={coord_dim}: expected shape {expected}, got {tuple(coords.shape)}"
        )
    if coords.shape[-2] != num_tokens:
        raise ValueError(
            f"coords hold {coords.shape[-2]} tokens but the input has {num_tokens} tokens after the prefix: "
            f"expected shape {expected}, got {tuple(coords.shape)}"
        )
    if coords.dim() == 3 and batch is not None and coords.shape[0] not in (batch,):
        raise ValueError(f"per-example coords have batch {coords.shape[0]}, input has {batch}: expected {expected}")
    if not _is_compiling() and coords.is_floating_point() and not bool(torch.isfinite(coords).all()):
        raise ValueError("coords contain NaN or infinite values; mask invalid tokens before encoding")


class PositionEncoding(nn.Module):
    """Base class: a rotary (or rotary-like) position encoding applied to queries and keys.

    Subclasses implement two hooks:

    * ``_prepare(coords, dtype) -> state``: everything that depends on the coordinates only (angles,
      cos/sin tables, basis changes), computed once per forward and shared by q and k;
    * ``_transform(x, state) -> x``: the action on ``x`` of shape ``(B, H, M, d)`` in the compute dtype.

    Class attributes describe the mathematics: ``commuting`` (relative: ``R(r)^T R(s) = R(0)^T R(s - r)``),
    ``post_rotation`` (``R(0) != I``), ``is_rotation`` (``False`` for the tensor-product encoding, which widens
    q and k instead).
    """

    name: str = "base"
    commuting: bool = True
    post_rotation: bool = False
    is_rotation: bool = True

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, per_head: bool = False) -> None:
        super().__init__()
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"{self.name}: head_dim must be a positive even integer, got {head_dim!r}")
        if not isinstance(coord_dim, int) or coord_dim <= 0:
            raise ValueError(f"{self.name}: coord_dim must be a positive integer, got {coord_dim!r}")
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"{self.name}: num_heads must be a positive integer, got {num_heads!r}")
        self.head_dim = head_dim
        self.coord_dim = coord_dim
        self.num_heads = num_heads
        self.per_head = bool(per_head)
        self.param_heads = num_heads if per_head else 1

    # ------------------------------------------------------------------ hooks for subclasses
    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> Any:
        raise NotImplementedError

    def _transform(self, x: Tensor, state: Any) -> Tensor:
        raise NotImplementedError

    def _transform_prefix(self, x: Tensor) -> Tensor:
        """Action on prefix tokens ``(B, H, P0, d)``: the identity for rotations."""
        return x

    @property
    def out_dim(self) -> int:
        """Width of the encoded q and k (``head_dim`` except for the tensor-product encoding)."""
        return self.head_dim

    # ------------------------------------------------------------------ public API
    def forward(self, q: Tensor, k: Tensor, coords: Tensor, num_prefix_tokens: int = 0) -> tuple[Tensor, Tensor]:
        """Encode queries and keys.

        Args:
            q, k: ``(B, H, N, d)``.
            coords: ``(M, c)`` or ``(B, M, c)`` with ``M = N - num_prefix_tokens``.
            num_prefix_tokens: leading tokens left unrotated (CLS, registers).

        Returns:
            ``(q, k)`` of shape ``(B, H, N, out_dim)`` in the input dtype.

        Raises:
            ValueError: on a shape, dtype or non-finite coordinate problem.
        """
        self._check_x(q, "q")
        self._check_x(k, "k")
        if q.shape[-2] != k.shape[-2] and coords.dim() == 3:
            raise ValueError("q and k must have the same number of tokens for per-example coordinates")
        state = self._state(q, coords, num_prefix_tokens)
        return self._encode(q, state, num_prefix_tokens), self._encode(k, state, num_prefix_tokens)

    def rotate(self, x: Tensor, coords: Tensor, num_prefix_tokens: int = 0) -> Tensor:
        """Encode one tensor ``x`` of shape ``(B, H, N, d)`` (separability: KV caches, linear attention)."""
        self._check_x(x, "x")
        state = self._state(x, coords, num_prefix_tokens)
        return self._encode(x, state, num_prefix_tokens)

    def matrix(self, coords: Tensor) -> Tensor:
        """The explicit matrices ``R(r)``: ``(H, M, d, d)`` for ``(M, c)`` coords, ``(B, H, M, d, d)`` per example.

        Built by applying the encoding to the basis vectors, so it is exactly what ``rotate`` does.
        For tests and diagnostics; not available for the tensor-product encoding.
        """
        if not self.is_rotation:
            raise NotImplementedError(f"{self.name} is not a rotation: it has no matrix R(r)")
        d, h = self.head_dim, self.num_heads
        if coords.dim() == 3:
            return torch.stack([self.matrix(c) for c in coords])
        check_coords(coords, self.coord_dim, coords.shape[-2] if coords.dim() >= 2 else -1)
        m = coords.shape[0]
        dtype = torch.float64 if self._param_dtype() == torch.float64 else torch.float32
        eye = torch.eye(d, dtype=dtype, device=coords.device)
        basis = eye[:, None, None, :].expand(d, h, m, d)  # (d, H, M, d): batch j holds e_j at every token
        cols = self.rotate(basis, coords)  # (d, H, M, d): cols[j] = R e_j
        return cols.permute(1, 2, 3, 0)  # (H, M, d, d), [..., :, j] = R e_j

    def generators(self) -> Tensor:
        """The generators ``L_k`` with ``R_STR(r) = expm(sum_k r_k L_k)``: ``(H, c, d, d)``."""
        raise NotImplementedError(f"{self.name} has no generators")

    def post_rotation_matrix(self) -> Tensor | None:
        """The fixed orthogonal ``P`` with ``R(r) = R_STR(r) P`` (``(H, d, d)``), or ``None`` if ``P = I``."""
        return None

    @property
    def active_dim(self) -> int:
        """Dimensions the generators act on (relaxed STRING: ``2m``; all others ``d``)."""
        return self.head_dim

    def no_weight_decay(self) -> set[str]:
        """Names (relative to this module) of learnable parameters to exclude from weight decay."""
        return {name for name, p in self.named_parameters() if p.requires_grad}

    def reset_parameters(self) -> None:
        """Re-initialise parameters and derived buffers exactly as the constructor does (same random draws).

        Makes ``with torch.device("meta"): pe = create_pe(...)``, ``pe.to_empty(device=...)``,
        ``pe.reset_parameters()`` equal to an eager build with the same seed. Subclasses with state define
        ``_init_weights()`` (called by their constructor too); an encoding without any needs nothing.

        Raises:
            NotImplementedError: if the encoding holds tensors but defines no ``_init_weights``.
        """
        init = getattr(self, "_init_weights", None)
        if init is None:
            if any(True for _ in self.parameters()) or any(True for _ in self.buffers()):
                raise NotImplementedError(f"{type(self).__name__} cannot re-initialise its tensors")
            return
        with torch.no_grad():
            init()

    def num_effective_parameters(self) -> int:
        """Learnable numbers that reach the encoding (LieRE stores entries its generators never use)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, coord_dim={self.coord_dim}, num_heads={self.num_heads}, "
                f"per_head={self.per_head}")

    # ------------------------------------------------------------------ internals
    def _param_dtype(self) -> torch.dtype:
        for p in self.parameters():
            return p.dtype
        for b in self.buffers():
            if b.is_floating_point():
                return b.dtype
        return torch.float32

    def _check_x(self, x: Tensor, what: str) -> None:
        if not isinstance(x, Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{what} must have shape (B, H, N, d) = (B, {self.num_heads}, N, {self.head_dim}), got {shape}")
        if x.shape[1] != self.num_heads or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{what} has shape {tuple(x.shape)}; {self.name} was built for (B, H={self.num_heads}, N, "
                f"d={self.head_dim})"
            )
        if not x.is_floating_point():
            raise ValueError(f"{what} must be floating point, got {x.dtype}")

    def _compute_dtype(self, x: Tensor) -> torch.dtype:
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def _state(self, x: Tensor, coords: Tensor, num_prefix_tokens: int) -> Any:
        if not isinstance(num_prefix_tokens, int) or num_prefix_tokens < 0 or num_prefix_tokens > x.shape[-2]:
            raise ValueError(f"num_prefix_tokens must be an int in [0, {x.shape[-2]}], got {num_prefix_tokens!r}")
        check_coords(coords, self.coord_dim, x.shape[-2] - num_prefix_tokens, x.shape[0])
        dtype = self._compute_dtype(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self._prepare(coords.to(dtype), dtype)

    def _encode(self, x: Tensor, state: Any, num_prefix_tokens: int) -> Tensor:
        dtype = self._compute_dtype(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if num_prefix_tokens == 0:
                return self._transform(x.to(dtype), state).to(x.dtype)
            prefix, rest = x[:, :, :num_prefix_tokens], x[:, :, num_prefix_tokens:]
            out = torch.cat([self._transform_prefix(prefix.to(dtype)), self._transform(rest.to(dtype), state)], dim=2)
            return out.to(x.dtype)
