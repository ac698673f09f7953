"""Encodings that rotate interleaved pairs by angles linear in the coordinates (RoPE family).

``R(r) = RoPE(r)``: pair ``n`` turns by ``theta_n(r) = sum_k r_k * freqs[k, n]`` (see ``rotation``).
Fast path: cos/sin tables in real arithmetic, computed once per forward and shared by q and k
(once for the whole batch when the coordinates are shared).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .ops.angles import wide_dtype, angle_table, rope_cos_sin, wide_angles
from .base import PEState, PositionEncoding
from .ops.forms import RoPEForm, param_heads, stack_layers
from .ops.frequencies import axial_frequencies, mixed_frequencies, pair_generators
from .registry import BenchRow, register_pe
from .ops.rotation import apply_frequency_rope, fused_basis_kernel, fused_kernel, rotate_angles

__all__ = ["NoPE", "FrequencyRoPE", "AxialRoPE", "MixedRoPE", "KernelState"]


@register_pe("none", label="NoPE", bench_vit_gpu=True)
class NoPE(PositionEncoding):
    """The identity: no position information (``name="none"``).

    It holds no numbers, only an empty buffer that follows ``.to(...)``, ``.double()`` and the like, so that
    ``generators()``, ``to_rope()`` and ``matrix()`` come in the module's device and dtype as every encoding's do.
    """

    _native_half_pairs = True
    rope_kind = "rope"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, per_head: bool = False, *,
                 layout: str = "bhnd", pairs: str = "interleaved") -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head, layout=layout, pairs=pairs)
        self.register_buffer("placement", torch.empty(0), persistent=False)  # (0,): the device and dtype only

    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> None:
        return None

    def reset_parameters(self) -> None:
        """Nothing to reset: the identity has no parameters."""

    def _transform(self, x: Tensor, state: None) -> Tensor:
        return x

    def generators(self) -> Tensor:
        """Zeros ``(H, c, d, d)`` in the module's device and dtype."""
        return self.placement.new_zeros(self.num_heads, self.coord_dim, self.head_dim, self.head_dim)

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """RoPE with zero frequencies ``(Hp, c, d/2)`` in the module's device and dtype."""
        return RoPEForm(None, self.placement.new_zeros(self.param_heads, self.coord_dim, self.head_dim // 2), None,
                        self.pairs)


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class KernelState(NamedTuple):
    """Prepared data when the fused rotation kernel runs: the coordinates and frequencies themselves, and the
    encoding's ``backend``. An encoding's ``_prepare`` makes one (:meth:`prepare`) where the kernel was chosen for
    the coordinates' device, and rotates through it (:meth:`rotate`): the choice is made there, once."""

    coords: Tensor  # (M, c) or (B, M, c)
    freqs: Tensor  # (Hp, c, P)
    backend: str = "auto"

    @classmethod
    def prepare(cls, coords: Tensor, freqs: Tensor, backend: str, traceable: bool = False) -> "KernelState | None":
        """The state of ``coords`` ``(M, c) | (B, M, c)`` and ``freqs`` ``(Hp, c, P)`` where ``backend`` chooses
        the fused kernel on the coordinates' device (``rotation.fused_kernel``; ``traceable``: inside
        ``torch.compile`` the rotation can take it), else ``None``: the PyTorch rotation's tables are the state."""
        return cls(coords, freqs, backend) if fused_kernel(coords.device, traceable, backend) is not None else None

    def basis_kernel(self, x: Tensor, basis: Tensor):
        """``ropekit.kernels.fused_basis_rotary`` where it takes ``x`` ``(B, H, N, d)`` and ``basis``
        ``(Hp, d, d)`` with this state's coordinates and frequencies (``rotation.fused_basis_kernel``), else None."""
        return fused_basis_kernel(x, basis, self.coords, self.freqs, self.backend)

    def rotate(self, q: Tensor, k: Tensor | None = None, **kw) -> tuple[Tensor, Tensor | None]:
        """Rotate ``q`` (and ``k``) ``(B, H, N, d)`` by the state's angles (``kw``: the kernel's ``k_coords``,
        ``num_prefix_tokens``, ``pairs``): the fused kernel called directly in eager mode; inside
        ``torch.compile`` through ``apply_frequency_rope``, which keeps the kernel (as a custom operator) where it
        can be traced -- q and k together -- and takes the PyTorch rotation otherwise."""
        freqs = self.freqs[0] if self.freqs.shape[0] == 1 else self.freqs  # (c, P) shared or (H, c, P)
        kernel = None if torch.compiler.is_compiling() else fused_kernel(q.device, backend=self.backend)
        if kernel is not None:
            return kernel(q, k, self.coords, freqs, validate=False, **kw)
        return apply_frequency_rope(q, k, self.coords, freqs, backend=self.backend, validate=False, **kw)


class FrequencyRoPE(PositionEncoding):
    """RoPE with a frequency matrix ``freqs`` of shape ``(Hp, c, d/2)``; subclasses choose how it is stored.

    Subclasses provide the property ``freqs``. The prepared data are ``(theta, cos, sin)`` (``(cos, sin)``,
    differentiable, for a subclass that overrides ``_transform``), each
    ``(1 | B, Hp, M, d/2)``: the angles in float64 (elementwise products, never a TF32-rounded matmul; exact at
    any coordinate scale) and their cos/sin in the compute dtype -- or, where the fused rotation kernel of
    ``ropekit.kernels`` runs (CUDA), the coordinates and frequencies it needs; both pair conventions
    are handled natively (by subclasses that keep this class's ``_transform``; one that overrides it, e.g.
    with a basis change, gets the base class's permutation instead).
    """

    rope_kind = "rope"

    @property
    def _native_half_pairs(self) -> bool:  # type: ignore[override]
        return type(self)._transform is FrequencyRoPE._transform

    @property
    def freqs(self) -> Tensor:  # (Hp, c, P)
        raise NotImplementedError

    def angles(self, coords: Tensor) -> Tensor:
        """Rotation angles ``(Hp, M, d/2)`` for ``(M, c)`` coords or ``(B, Hp, M, d/2)`` per example.

        Formed in float64 (``angles.wide_angles``, as every rotation's angles), returned in float32 (float64 for
        float64 coords).
        """
        dtype = torch.float64 if coords.dtype == torch.float64 else torch.float32
        return wide_angles(coords, self.freqs).to(dtype)

    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
        if not self._native_half_pairs:  # a subclass with its own _transform gets differentiable (cos, sin)
            return rope_cos_sin(coords, self.freqs, dtype)
        kernel = KernelState.prepare(coords, self.freqs, self.backend, not coords.requires_grad)  # (compiled: rotate)
        if kernel is not None:
            return kernel  # the fused kernel forms the angles itself
        return angle_table(coords, self.freqs, dtype)  # (theta float64, cos, sin): (1 | B, Hp, M, P) each

    def _kernel_direct(self, x: Tensor, data: object, dtype: torch.dtype) -> bool:
        """Whether ``x`` goes to the fused kernel as it is: the kernel reads and writes bf16 / fp16 / fp32 / fp64
        itself with fp32 math (fp64 for fp64 inputs), so the compute-dtype copies around it (two casts forward,
        two backward, and the concatenation of prefix tokens) are skipped when that is the state's dtype."""
        return (isinstance(data, KernelState) and x.dtype in _KERNEL_DTYPES
                and (x.dtype == torch.float64) == (dtype == torch.float64)
                and not self.transforms_prefix)  # prefix tokens: identity

    def _encode(self, x: Tensor, data, num_prefix_tokens: int, dtype: torch.dtype) -> Tensor:
        if not self._kernel_direct(x, data, dtype):
            return super()._encode(x, data, num_prefix_tokens, dtype)
        return data.rotate(x, num_prefix_tokens=num_prefix_tokens, pairs=self.pairs)[0]

    def apply(self, q: Tensor, k: Tensor | None, state: PEState) -> tuple[Tensor, Tensor | None]:
        """As ``PositionEncoding.apply``; where the fused kernel runs, q and k go through one launch in their
        own dtype (prefix tokens passed through by the kernel)."""
        if k is None or not isinstance(state, PEState) or not self._kernel_direct(q, state.q, state.dtype) \
                or not self._kernel_direct(k, state.k, state.dtype):
            return super().apply(q, k, state)
        qb, kb = self._checked_bhnd(q, state, "q"), self._checked_bhnd(k, state, "k")
        q_out, k_out = state.q.rotate(qb, kb, k_coords=state.k.coords if state.separate_k else None,
                                      num_prefix_tokens=state.num_prefix_tokens, pairs=self.pairs)
        return self._from_bhnd(q_out), self._from_bhnd(k_out)

    def _transform(self, x: Tensor, state) -> Tensor:
        if isinstance(state, KernelState):
            return state.rotate(x, pairs=self.pairs)[0]
        theta, cos, sin = state
        return rotate_angles(x, theta, cos, sin, self.pairs)

    def generators(self) -> Tensor:
        gen = pair_generators(self.freqs)  # (Hp, c, d, d)
        return gen.expand(self.num_heads, -1, -1, -1)

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """Already RoPE: ``P = I`` and the frequencies ``(Hp, c, d/2)`` themselves (a view of the parameter)."""
        return RoPEForm(None, param_heads(self.freqs, self.param_heads), None, self.pairs)

    def rope_batch_key(self) -> tuple | None:
        """Encodings of the RoPE family (this class's ``rope_form``) with frequencies of one shape, dtype and
        device and one pair convention stack their frequencies."""
        if type(self).rope_form is not FrequencyRoPE.rope_form:
            return None
        f = self.freqs
        return ("rope", tuple(f.shape), f.dtype, f.device, self.param_heads, self.pairs)

    @classmethod
    def stacked_rope_form(cls, pes, prefix: bool = True) -> RoPEForm:
        """``P = I`` and the frequencies of all, stacked: ``(L, Hp, c, d/2)``."""
        freqs = stack_layers(param_heads(pe.freqs, pe.param_heads) for pe in pes)
        return RoPEForm(None, freqs, None, pes[0].pairs)


@register_pe("axial", label="Axial RoPE", bench_vit_gpu=True,  # VisionLlama / EVA: base 10000 (the defaults)
             bench_rows=(BenchRow("axial"), BenchRow("axial in training", kind="train", base="axial")))
class AxialRoPE(FrequencyRoPE):
    """Axial RoPE (VisionLlama / EVA): the pairs are split evenly across the ``c`` axes.

    Pair ``n`` of axis ``k`` turns by ``r_k * base ** (-2n / d_k)``. If ``d/2`` is not divisible by ``c``,
    the leftover pairs (the last ones) are not rotated. ``learnable_freqs=True`` makes the frequencies a
    parameter (initialised to the axial values); ``per_head=True`` then gives every head its own. With ``c = 1``
    this is classic RoPE on interleaved pairs.

    Raises:
        ValueError: ``per_head=True`` without ``learnable_freqs=True`` (fixed frequencies are the same for every
            head: there is nothing to keep per head).
    """

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, base: float = 10000.0,
                 learnable_freqs: bool = False, per_head: bool = False) -> None:
        if per_head and not learnable_freqs:
            raise ValueError("axial: per_head=True needs learnable_freqs=True (fixed axial frequencies are the same "
                             "for every head)")
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        self.base = base
        shape = (self.param_heads, coord_dim, head_dim // 2)
        if learnable_freqs:
            self.freq_param = nn.Parameter(torch.empty(shape))
        else:  # the module's device and dtype (first buffer: what param_dtype reads), then the float64 table
            self.register_buffer("placement", torch.empty(0), persistent=False)
            self.register_buffer("freq_table", torch.empty(shape, dtype=wide_dtype("cpu")), persistent=False)
        self._reset_axial()

    @property
    def freqs(self) -> Tensor:
        """``(Hp, c, d/2)``: the learnable frequencies, or the fixed table in float64 (float32 on devices without
        float64) whatever the module's dtype -- ``.to(torch.bfloat16)`` or ``.half()`` rebuilds it in float64
        (``_apply``); a table cast behind the module's back (FSDP's buffer casts) is recomputed here, unstored."""
        if hasattr(self, "freq_param"):
            return self.freq_param
        table = self.freq_table
        wide = wide_dtype(table.device)
        if table.dtype != wide:
            table = axial_frequencies(self.head_dim, self.coord_dim, self.base, torch.float64).to(table.device, wide)
            table = table.unsqueeze(0).expand(self.freq_table.shape)
        return table

    def _reset_axial(self) -> None:
        if hasattr(self, "freq_param"):
            target = self.freq_param
            if target.device.type != "meta":
                init = axial_frequencies(self.head_dim, self.coord_dim, self.base, torch.float64)  # (c, P), CPU
                with torch.no_grad():
                    target.copy_(init.unsqueeze(0).expand_as(target))
            return
        table = self.freq_table  # exact in float64 (rounded once to float32 on devices without float64)
        wide = wide_dtype(table.device)
        if table.device.type == "meta":
            self.freq_table = torch.empty(table.shape, dtype=wide, device=table.device)
            return
        init = axial_frequencies(self.head_dim, self.coord_dim, self.base, torch.float64)  # (c, P), CPU
        self.freq_table = init.to(table.device, wide).unsqueeze(0).expand(table.shape).contiguous()

    def _init_weights(self) -> None:
        """Back to the axial frequencies (learnable or not)."""
        self._reset_axial()

    def _apply(self, fn, recurse=True):  # device / dtype moves, to_empty: the fixed table is recomputed exactly
        out = super()._apply(fn, recurse)
        if not hasattr(self, "freq_param"):
            self._reset_axial()
        return out


@register_pe("mixed", label="RoPE-Mixed", paper_sharing="head", bench_vit_gpu=True,
             paper_preset={"base": 10.0, "per_head": True},  # Heo et al.: theta = 10, frequencies per head and layer
             bench_rows=(BenchRow("mixed"), BenchRow("mixed in training", kind="train", base="mixed")))
class MixedRoPE(FrequencyRoPE):
    """RoPE-Mixed (Heo et al. 2024): every pair turns by ``sum_k r_k w_{k,n}``, all ``w`` learnable.

    Initialised per parameter head with RoPE-like magnitudes (maximum wavelength ``base``, default 100)
    pointing in a random direction (see ``frequencies.mixed_frequencies``).
    """

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, base: float = 100.0,
                 per_head: bool = False, freqs: Tensor | None = None) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        self.base = base
        if freqs is not None:
            freqs = torch.as_tensor(freqs, dtype=torch.float32, device="cpu")
            if freqs.dim() == 2:
                freqs = freqs.unsqueeze(0).repeat(self.param_heads, 1, 1)
            if freqs.shape != (self.param_heads, coord_dim, head_dim // 2):
                raise ValueError(f"freqs must have shape ({self.param_heads}, {coord_dim}, {head_dim // 2}) or "
                                 f"({coord_dim}, {head_dim // 2}), got {tuple(freqs.shape)}")
            freqs = freqs.clone()
        self._given_freqs = freqs  # the initial value reset_parameters returns to (None: a random draw)
        self.freq_param = nn.Parameter(torch.empty(self.param_heads, coord_dim, head_dim // 2))
        self._reset_mixed()

    @property
    def freqs(self) -> Tensor:
        return self.freq_param

    def _reset_mixed(self) -> None:
        init = self._given_freqs
        if init is None:  # drawn on the CPU generator, also when the parameter lives on another device
            init = mixed_frequencies(self.head_dim, self.coord_dim, self.param_heads, self.base)
        if self.freq_param.device.type != "meta":
            with torch.no_grad():
                self.freq_param.copy_(init)

    def _init_weights(self) -> None:
        """Re-draw the initial frequencies (or restore the ``freqs`` given to the constructor)."""
        self._reset_mixed()
