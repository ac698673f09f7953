"""Linear (kernelised) attention with any ropekit position encoding: Performer-style random features.

Shape legend: ``B`` batch, ``H`` heads, ``N`` tokens (``P0`` prefix tokens first, then ``M = N - P0`` with
coordinates), ``D`` width, ``d = D / H`` head dimension, ``m`` random features, ``m'`` the encoded feature width
(``pe.out_dim``: ``m`` for every rotation), ``c`` coordinate dimension.

Softmax attention weighs value ``v_j`` for query ``i`` by ``exp(q_i^T k_j / sqrt(d))``. Linear attention replaces
that kernel by a feature-map inner product ``phi(q_i)^T phi(k_j)``, so the sums over ``j`` are computed once
(``O(N m d)`` instead of ``O(N^2 d)``)::

    out_i = sum_j phi(q_i)^T phi(k_j) v_j / sum_j phi(q_i)^T phi(k_j)
          = phi(q_i)^T [sum_j phi(k_j) v_j^T] / phi(q_i)^T [sum_j phi(k_j)]

Feature maps (``W`` is an ``(m, d_in)`` Gaussian matrix, rows drawn in orthogonal blocks, fixed by a seed):

* ``"positive"`` (Performer FAVOR+): ``phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(m)`` with ``x' = x / d^(1/4)``;
  unbiased for the softmax kernel ``exp(q^T k / sqrt(d))`` and always positive. A per-query and a per-(example,
  head) key stabiliser (the maxima of the exponent, detached) are subtracted; they cancel in the ratio.
* ``"relu"`` (Performer-ReLU): ``phi(x) = relu(W x) / sqrt(m)``; non-negative, not a softmax approximation.
  A query whose features are all zero gets a zero output (the denominator is clamped at ``eps``).

Where the position encoding goes (``rotate``):

* ``"features"`` (default; RoFormer, Su et al. 2021, §3.4): the encoding rotates the *features*, in the numerator
  only; the denominator stays unrotated::

      out_i = sum_j (R(r_i) phi(q_i))^T (R(r_j) phi(k_j)) v_j / sum_j phi(q_i)^T phi(k_j)

  The encoding is built for ``head_dim = m`` (the feature width), not ``d``. For a commuting encoding
  ``R(r_i)^T R(r_j) = R(0)^T R(r_j - r_i)``, so the numerator depends on coordinate offsets only and the
  denominator on no coordinate at all: the output is *exactly* invariant to a global coordinate shift. (The
  rotated numerator can be negative: the weights still sum to one only for ``R = I``; the denominator stays
  positive.) A non-commuting encoding (LieRE) loses that invariance, as with softmax attention.
* ``"inputs"``: rotate q and k (encoding built for ``head_dim = d``) and apply the feature map to the rotated
  vectors, in numerator and denominator. With positive features this is an unbiased estimate of softmax
  attention *with* the encoding, but a fixed draw of ``W`` is not invariant to a coordinate shift -- only its
  expectation is (``R`` rotates ``q`` against a fixed ``W``). Use it to approximate a trained softmax model.

``causal=True`` restricts token ``i`` to tokens ``j <= i`` (prefix sums), the recurrent form that processes a
sequence incrementally. (The positive features' key stabiliser is one constant per sequence, so running a prefix
of the sequence alone gives the same outputs up to round-off.)
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from ..encodings import PositionEncoding

__all__ = [
    "FEATURE_MAPS", "ROTATE_MODES", "random_projection", "positive_features", "relu_features",
    "linear_attention", "rotary_linear_attention", "LinearAttention",
]

FEATURE_MAPS = ("positive", "relu")
ROTATE_MODES = ("features", "inputs")


# ---------------------------------------------------------------------------------------------- functional core
def random_projection(num_features: int, dim: int, *, orthogonal: bool = True, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """Gaussian projection ``W`` of shape ``(m, d_in)`` (rows ~ N(0, I)), from a fixed seed (CPU generator).

    ``orthogonal=True`` draws the rows in blocks of ``d_in`` mutually orthogonal directions with chi-distributed
    norms (Performer's ORF: same marginals, lower variance).
    """
    gen = torch.Generator().manual_seed(int(seed))
    if not orthogonal:
        return torch.randn(num_features, dim, generator=gen, dtype=torch.float64).to(dtype)
    blocks = []
    for _ in range(math.ceil(num_features / dim)):
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))  # (d_in, d_in)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # sign fix: Haar-distributed (uniform) rotation
        blocks.append(q.T)
    w = torch.cat(blocks)[:num_features]  # (m, d_in), unit rows
    norms = torch.randn(num_features, dim, generator=gen, dtype=torch.float64).norm(dim=1, keepdim=True)  # chi(d_in)
    return (w * norms).to(dtype)


def positive_features(x: Tensor, proj: Tensor, *, is_query: bool, scale: float) -> Tensor:
    """FAVOR+ features ``(B, H, N, m)`` of ``x`` ``(B, H, N, d_in)``: ``exp(W x' - |x'|^2/2 - s) / sqrt(m)``.

    ``x' = x * scale`` (``scale = d^(-1/4)`` for the softmax kernel ``exp(q^T k / sqrt(d))``). The stabiliser ``s``
    is the (detached) maximum of the exponent per query token (``is_query``) or per ``(B, H)`` over all keys: a
    constant factor per query row, or per sequence, that cancels in the attention ratio.
    """
    x = x * scale
    wx = torch.einsum("bhnd,md->bhnm", x, proj.to(x.dtype))  # (B, H, N, m)
    expo = wx - 0.5 * (x * x).sum(dim=-1, keepdim=True)  # (B, H, N, m)
    if is_query:
        stab = expo.amax(dim=-1, keepdim=True)  # (B, H, N, 1)
    else:
        stab = expo.amax(dim=(-2, -1), keepdim=True)  # (B, H, 1, 1)
    return torch.exp(expo - stab.detach()) / math.sqrt(proj.shape[0])


def relu_features(x: Tensor, proj: Tensor) -> Tensor:
    """Performer-ReLU features ``relu(W x) / sqrt(m)``: ``(B, H, N, d_in) -> (B, H, N, m)``."""
    return torch.relu(torch.einsum("bhnd,md->bhnm", x, proj.to(x.dtype))) / math.sqrt(proj.shape[0])


def linear_attention(q_num: Tensor, k_num: Tensor, q_den: Tensor, k_den: Tensor, v: Tensor, *,
                     causal: bool = False, eps: float = 1e-12) -> Tensor:
    """``out_i = q_num_i^T [sum_j k_num_j v_j^T] / max(q_den_i^T [sum_j k_den_j], eps)``.

    Args:
        q_num, k_num: numerator features ``(B, H, N, m')`` (rotated, for the RoFormer form).
        q_den, k_den: denominator features ``(B, H, N, m)`` (non-negative).
        v: values ``(B, H, N, e)``.
        causal: sum over ``j <= i`` only (prefix sums; memory ``O(N m' e)``).
        eps: lower bound of the denominator (a clamp, not an added constant, so that a constant factor on the
            features -- the stabilisers -- cancels exactly; matters only for all-zero ReLU features).

    Returns:
        ``(B, H, N, e)``.
    """
    if causal:
        kv = torch.einsum("bhnm,bhne->bhnme", k_num, v).cumsum(dim=2)  # (B, H, N, m', e)
        num = torch.einsum("bhnm,bhnme->bhne", q_num, kv)  # (B, H, N, e)
        den = (q_den * k_den.cumsum(dim=2)).sum(dim=-1)  # (B, H, N)
    else:
        kv = torch.einsum("bhnm,bhne->bhme", k_num, v)  # (B, H, m', e)
        num = torch.einsum("bhnm,bhme->bhne", q_num, kv)  # (B, H, N, e)
        den = torch.einsum("bhnm,bhm->bhn", q_den, k_den.sum(dim=2))  # (B, H, N)
    return num / den.clamp_min(eps).unsqueeze(-1)


def rotary_linear_attention(q: Tensor, k: Tensor, v: Tensor, feature_map: Callable[[Tensor, bool], Tensor], *,
                            pe: Optional[PositionEncoding] = None, coords: Optional[Tensor] = None,
                            num_prefix_tokens: int = 0, rotate: str = "features", causal: bool = False,
                            eps: float = 1e-12) -> Tensor:
    """Linear attention with a position encoding (see the module docstring for ``rotate``).

    Args:
        q, k, v: ``(B, H, N, d)``.
        feature_map: ``(x, is_query) -> (B, H, N, m)`` non-negative features.
        pe: an encoding for ``head_dim = m`` (``rotate="features"``) or ``d`` (``"inputs"``), or ``None``.
        coords: ``(M, c)`` or ``(B, M, c)``.
        num_prefix_tokens: leading tokens the encoding leaves unrotated.

    Returns:
        ``(B, H, N, d)``.
    """
    if rotate not in ROTATE_MODES:
        raise ValueError(f"rotate must be one of {ROTATE_MODES}, got {rotate!r}")
    if pe is not None and coords is None:
        raise ValueError("a position encoding needs coords")
    if pe is not None and rotate == "inputs":
        q, k = pe(q, k, coords, num_prefix_tokens)  # (B, H, N, d')
    fq, fk = feature_map(q, True), feature_map(k, False)  # (B, H, N, m)
    nq, nk = fq, fk
    if pe is not None and rotate == "features":
        nq, nk = pe(fq, fk, coords, num_prefix_tokens)  # (B, H, N, m'): numerator only
    return linear_attention(nq, nk, fq, fk, v, causal=causal, eps=eps)


# ---------------------------------------------------------------------------------------------- module
class LinearAttention(nn.Module):
    """Multi-head linear attention (random features) with any ``PositionEncoding``.

    Same call as :class:`ropekit.nn.Attention`: ``forward(x (B, N, D), coords, num_prefix_tokens) -> (B, N, D)``.

    Args:
        dim: ``D``.
        num_heads: ``H`` (divides ``D``).
        pe: the encoding or ``None``. With ``rotate="features"`` it must be built for ``head_dim=num_features``,
            with ``"inputs"`` for ``head_dim=D // H`` (``num_heads=H`` either way).
        kernel: ``"positive"`` (FAVOR+) or ``"relu"``.
        num_features: ``m`` (even for ``rotate="features"``); default ``D // H``.
        rotate: ``"features"`` (RoFormer: rotate the features in the numerator) or ``"inputs"``.
        causal: token ``i`` attends to ``j <= i`` only.
        orthogonal: draw the projection in orthogonal blocks.
        seed: the projection's seed. The projection is a non-persistent buffer rebuilt from the seed, so it is
            not in ``state_dict`` yet a saved model reproduces its outputs; :meth:`redraw` draws a new one.
        qkv_bias, proj_drop, eps: as usual.
    """

    def __init__(self, dim: int, num_heads: int, pe: Optional[PositionEncoding] = None, *, kernel: str = "positive",
                 num_features: Optional[int] = None, rotate: str = "features", causal: bool = False,
                 orthogonal: bool = True, seed: int = 0, qkv_bias: bool = True, proj_drop: float = 0.0,
                 eps: float = 1e-12) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads={num_heads}")
        if kernel not in FEATURE_MAPS:
            raise ValueError(f"kernel must be one of {FEATURE_MAPS}, got {kernel!r}")
        if rotate not in ROTATE_MODES:
            raise ValueError(f"rotate must be one of {ROTATE_MODES}, got {rotate!r}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.num_features = int(num_features or self.head_dim)
        self.kernel, self.rotate, self.causal, self.orthogonal, self.eps = kernel, rotate, causal, orthogonal, eps
        if pe is not None:
            want = self.num_features if rotate == "features" else self.head_dim
            if pe.head_dim != want or pe.num_heads != num_heads:
                raise ValueError(f"with rotate={rotate!r} the position encoding must be built for head_dim={want}, "
                                 f"num_heads={num_heads}; got head_dim={pe.head_dim}, num_heads={pe.num_heads}")
        self.pe = pe
        # the feature map sees d, or the encoded width d' when q/k are encoded first (tensor-product encoding)
        self.feature_in = pe.out_dim if (pe is not None and rotate == "inputs") else self.head_dim
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.register_buffer("projection", torch.empty(0), persistent=False)
        self.redraw(seed)

    def redraw(self, seed: int) -> None:
        """Draw a new random projection ``(m, d_in)`` from ``seed``."""
        self.seed = int(seed)
        w = random_projection(self.num_features, self.feature_in, orthogonal=self.orthogonal, seed=self.seed)
        self.projection = w.to(self.projection.device)

    def feature_map(self, x: Tensor, is_query: bool) -> Tensor:
        """``(B, H, N, d_in) -> (B, H, N, m)``, computed in float32 (float64 for float64 input)."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.to(dtype)
            if self.kernel == "positive":
                return positive_features(x, self.projection, is_query=is_query, scale=self.head_dim ** -0.25)
            return relu_features(x, self.projection)

    def forward(self, x: Tensor, coords: Optional[Tensor] = None, num_prefix_tokens: int = 0) -> Tensor:
        """Args:
            x: ``(B, N, D)``.
            coords: ``(M, c)`` or ``(B, M, c)``; ignored without an encoding.
            num_prefix_tokens: ``P0`` leading tokens the encoding leaves unrotated.

        Returns:
            ``(B, N, D)``.
        """
        b, n, dim = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
        q, k, v = qkv.unbind(0)  # (B, H, N, d) each
        out = rotary_linear_attention(q, k, v.float() if v.dtype != torch.float64 else v, self.feature_map,
                                      pe=self.pe, coords=coords, num_prefix_tokens=num_prefix_tokens,
                                      rotate=self.rotate, causal=self.causal, eps=self.eps)  # (B, H, N, d)
        out = out.to(x.dtype).transpose(1, 2).reshape(b, n, dim)  # (B, N, D)
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, kernel={self.kernel!r}, "
                f"num_features={self.num_features}, rotate={self.rotate!r}, causal={self.causal}, seed={self.seed}")
