"""Relaxed STRING: ``R_sp(r) = R_STR(r) . P_sp`` with ``R_STR(r) = expm(sum_k r_k L_k)``.

The generators act on the first ``2m`` coordinates (the *active* subspace, ``m = active_planes``); the other
``d - 2m`` form the *null* subspace. ``P_sp`` is a learnable rotation of all ``d`` coordinates.

* ``exact=False`` (the relaxed configuration, default): dense skew ``L_k`` on the active part with no
  commuting constraint (initialised as RoPE-Mixed planes plus a dense perturbation of size
  ``relax_scale``), and ``P_sp = expm(G - G^T)`` free to mix active and null coordinates. Not translation
  invariant; one matrix exponential per token, from an eigendecomposition in float64
  (``expm.linear_skew_expm``: orthogonal to round-off at any coordinate scale, bounded workspace).
* ``exact=True`` (the exact configuration): commuting 2x2-block ``L_k`` on the active part (cos/sin fast
  path) and ``P_sp = I_active (+) Q_null``, so ``R_sp(r)^T R_sp(s) = R_sp(0)^T R_sp(s - r)`` holds exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .ops.angles import wide_dtype, angle_table
from .base import PositionEncoding
from .ops.blocks import block_apply
from .ops.expm import linear_skew_expm
from .ops.forms import RoPEForm, basis_form, no_rope_form
from .ops.frequencies import mixed_frequencies, pair_generators
from .ops.products import basis_change
from .registry import BenchRow, register_pe
from .ops.rotation import rotate_angles
from .ops.skew import skew

__all__ = ["RelaxedSTRING"]


@register_pe("relaxed", label="relaxed STRING", paper_sharing="layer",
             bench_rows=(BenchRow("relaxed"), BenchRow("relaxed (exact)", (("exact", True),))))
class RelaxedSTRING(PositionEncoding):
    post_rotation = True

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, exact: bool = False,
                 active_planes: int | None = None, base: float = 100.0, relax_scale: float = 0.1,
                 per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        m = head_dim // 4 if active_planes is None else active_planes
        if not 1 <= m <= head_dim // 2:
            raise ValueError(f"relaxed: active_planes must be in [1, {head_dim // 2}], got {m}")
        self.exact = bool(exact)
        self.commuting = self.exact
        self.active_planes = m
        n_act, n_null = 2 * m, head_dim - 2 * m
        hp = self.param_heads
        self.base, self.relax_scale = base, relax_scale
        self.freq_param = nn.Parameter(torch.empty(hp, coord_dim, m))
        if self.exact:
            self.null_params = nn.Parameter(torch.empty(hp, n_null, n_null))
        else:
            self.relax_params = nn.Parameter(torch.empty(hp, coord_dim, n_act, n_act))
            self.mix_params = nn.Parameter(torch.empty(hp, head_dim, head_dim))
        self._init_weights()

    def _init_weights(self) -> None:
        """Frequencies as RoPE-Mixed; the other parameters normal with standard deviation ``relax_scale``."""
        if self.freq_param.is_meta:
            return
        with torch.no_grad():
            self.freq_param.copy_(mixed_frequencies(self.active_dim, self.coord_dim, self.param_heads, self.base))
            for p in ((self.null_params,) if self.exact else (self.relax_params, self.mix_params)):
                p.copy_(torch.randn(p.shape) * self.relax_scale)

    def num_effective_parameters(self) -> int:
        """Frequencies plus the free entries of every matrix used through ``A - A^T``."""
        skews = (self.null_params,) if self.exact else (self.relax_params, self.mix_params)
        free = sum(math.prod(p.shape[:-2]) * p.shape[-1] * (p.shape[-1] - 1) // 2 for p in skews)
        return self.freq_param.numel() + free

    @property
    def active_dim(self) -> int:
        return 2 * self.active_planes

    def active_generators(self, dtype: torch.dtype | None = None) -> Tensor:
        """``L_k`` restricted to the active subspace: ``(Hp, c, 2m, 2m)``, formed in ``dtype`` (default: the
        parameters')."""
        gen = pair_generators(self.freq_param if dtype is None else self.freq_param.to(dtype))
        return gen if self.exact else gen + skew(self.relax_params.to(gen.dtype))

    def generators(self) -> Tensor:
        a = self.active_dim
        act = self.active_generators()
        full = act.new_zeros(*act.shape[:2], self.head_dim, self.head_dim)
        full[..., :a, :a] = act
        return full.expand(self.num_heads, -1, -1, -1)

    def _post_rotation(self) -> Tensor:
        """``P_sp``: ``(Hp, d, d)`` in the parameters' dtype (float32 for bf16 / float16 parameters)."""
        # exponentials in float64: orthogonal to round-off; returned in the parameters' dtype, never below float32
        # (rounded to bf16 / float16 P would be orthogonal only to 2^-8 / 2^-11)
        if not self.exact:
            mix = self.mix_params
            return torch.linalg.matrix_exp(skew(mix.double())).to(torch.promote_types(mix.dtype, torch.float32))
        a = self.active_dim
        p = torch.eye(self.head_dim, dtype=torch.promote_types(self.null_params.dtype, torch.float32),
                      device=self.null_params.device)
        p = p.unsqueeze(0).repeat(self.param_heads, 1, 1)
        p[:, a:, a:] = torch.linalg.matrix_exp(skew(self.null_params.double())).to(p.dtype)
        return p

    def post_rotation_matrix(self) -> Tensor:
        return self._post_rotation().expand(self.num_heads, -1, -1)

    @property
    def rope_kind(self) -> str | None:  # type: ignore[override]
        """``"relaxed"`` in the exact configuration; the relaxed one does not commute."""
        return "relaxed" if self.exact else None

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """The exact configuration only: ``R(r) = RoPE_active(r) P_sp``, so ``P = P_sp = R(0)`` (one computation for
        both) and the null pairs turn with frequency 0.

        Raises:
            ValueError: in the relaxed configuration (``exact=False``), which does not commute.
        """
        if not self.exact:
            raise no_rope_form(self)
        basis = self.post_rotation_matrix()[:self.param_heads]
        return basis_form(self, basis, post=basis)

    def _prepare(self, coords: Tensor, dtype: torch.dtype):
        p = self._post_rotation().to(dtype)
        if self.exact:
            return p, angle_table(coords, self.freq_param, dtype)  # float64 angles, cos/sin: (1 | B, Hp, M, m)
        # the generator sums in float64: rounded to float32, each entry would be off by r * ulp at coordinate r
        gen = self.active_generators(wide_dtype(coords.device)).unsqueeze(2)  # (Hp, c, 1, 2m, 2m)
        lead = coords.shape[:-1]  # (M,) or (B, M)
        r = linear_skew_expm(coords.reshape(-1, self.coord_dim), gen, dtype=dtype)  # (T, Hp, 1, 2m, 2m)
        r = r.view(*lead, *r.shape[1:])  # ([B,] M, Hp, 1, 2m, 2m)
        r = (r if coords.dim() == 3 else r.unsqueeze(0)).transpose(1, 2).contiguous()  # (B | 1, Hp, M, 1, 2m, 2m)
        return p, r

    def _transform(self, x: Tensor, state) -> Tensor:
        p, rot = state
        a = self.active_dim
        x = basis_change(x, p)  # P_sp x: (B, H, M, d)
        act, null = x[..., :a], x[..., a:]
        if self.exact:
            act = rotate_angles(act, *rot)
        else:
            act = block_apply(rot, act.contiguous())  # one (2m x 2m) block per token
        return torch.cat([act, null], dim=-1)
