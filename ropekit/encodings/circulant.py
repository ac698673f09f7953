"""Circulant-STRING: block-circulant commuting generators, applied as RoPE in a fixed real DFT basis.

``L_k = C_k - C_k^T`` with ``C_k`` block-circulant, block size ``b`` (``b`` divides ``d``), each block
defined by its first column ``c`` (``C[i, j] = c[(i - j) mod b]``, as ``scipy.linalg.circulant``). The DFT
diagonalises every circulant, so per block::

    R(r) z = irfft( exp(i * sum_k r_k lambda_k) * rfft(z), n=b ),   lambda_k = 2 Im(rfft(c_k))

The same operator in real arithmetic: the orthonormal real DFT basis ``Q`` (``b x b``, fixed) turns every block
into RoPE planes -- mode ``f`` of the spectrum is the plane spanned by the rows
``sqrt(2/b) sin(2 pi f n / b)`` and ``sqrt(2/b) cos(2 pi f n / b)``, turning by ``theta_f = r . lambda_f`` -- so

    R(r) = blockdiag(Q^T) RoPE_lambda(r) blockdiag(Q),   lambda_f = -2 sum_n c_n sin(2 pi f n / b)

with ``lambda`` linear in the parameters (elementwise products with a fixed sine table, both in float64: no
TF32-rounded matmul, and no float32 rounding of ``lambda``, which would turn by ``r * ulp(lambda)`` ~ 1e-3 rad at
coordinates of 10^4). The DC mode (and the Nyquist mode for even ``b``) has ``lambda = 0``: those dimensions
are never rotated (2 of every ``b``). No complex tensor is involved, so ``torch.compile`` (Inductor) compiles it
and autograd gives exact first and second derivatives. ``Q`` and the sine table are non-persistent buffers,
rebuilt exactly whenever the module changes device or dtype (the sine table stays float64 whatever the module's
dtype, float32 on devices without float64).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .ops.angles import wide_dtype, angle_table
from .base import PositionEncoding
from .ops.blocks import block_diag
from .ops.forms import RoPEForm, half_pairs_basis, stack_layers
from .ops.frequencies import mixed_frequencies
from .ops.products import precise_matmul
from .registry import BenchRow, register_pe
from .rope import KernelState
from .ops.rotation import rotate_angles
from .ops.skew import skew

__all__ = ["CirculantSTRING", "circulant", "real_dft_basis", "block_dft_basis"]


def circulant(col: Tensor) -> Tensor:
    """Dense circulant matrices ``C[i, j] = col[(i - j) mod b]`` from first columns ``(..., b)`` -> ``(..., b, b)``."""
    b = col.shape[-1]
    i = torch.arange(b, device=col.device)
    return col[..., (i[:, None] - i[None, :]) % b]


def real_dft_basis(b: int, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
                   ) -> tuple[Tensor, Tensor]:
    """The orthonormal real DFT basis of one circulant block and the table giving the mode frequencies.

    Args:
        b: block size (>= 3).

    Returns:
        ``(Q, S)``: ``Q`` ``(b, b)`` orthogonal, rows ``2(f-1), 2(f-1)+1`` = ``sqrt(2/b) (sin, cos)(2 pi f n / b)``
        for the ``u = (b - 1) // 2`` rotating modes ``f = 1..u``, then the DC row ``1/sqrt(b)`` and, for even
        ``b``, the Nyquist row ``(-1)^n / sqrt(b)``; ``S`` ``(b, u)`` with ``S[n, f-1] = -2 sin(2 pi f n / b)``, so
        that ``lambda_f = sum_n c_n S[n, f-1] = 2 Im(rfft(c))_f``. Computed in float64, returned in ``dtype``.
    """
    u = (b - 1) // 2
    n = torch.arange(b, dtype=torch.float64, device="cpu")
    f = torch.arange(1, u + 1, dtype=torch.float64, device="cpu")
    ang = 2 * math.pi * f[:, None] * n[None, :] / b  # (u, b)
    rows = torch.stack((torch.sin(ang), torch.cos(ang)), dim=1).reshape(2 * u, b) * math.sqrt(2.0 / b)
    extra = [torch.full((1, b), 1.0 / math.sqrt(b), dtype=torch.float64, device="cpu")]
    if b % 2 == 0:
        extra.append((torch.cos(math.pi * n) / math.sqrt(b)).unsqueeze(0))
    q = torch.cat([rows] + extra, dim=0)  # (b, b)
    s = -2.0 * torch.sin(ang).transpose(0, 1)  # (b, u)
    return q.to(device=device, dtype=dtype), s.to(device=device, dtype=dtype)


_DFT_BASES: dict = {}


def block_dft_basis(head_dim: int, block_size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``real_dft_basis`` of every block of size ``b``, as one ``(1, d, d)`` matrix with the rotating rows of all
    blocks first (block by block) and the DC (and, for even ``b``, Nyquist) rows, which no circulant generator
    turns, last: the basis of circulant's RoPE form.

    Built in float64 once per (size, device, dtype) and kept -- a constant, so no host-to-device copy per forward
    pass.
    """
    key = (head_dim, block_size, str(device), dtype)
    if torch.compiler.is_compiling() and key not in _DFT_BASES:
        # built in the graph (a constant there), not stored: a dictionary filled while Dynamo traces fails its
        # guard on the next call and compiles the model a second time
        return _build_block_dft_basis(head_dim, block_size, device, dtype)
    if key in _DFT_BASES:
        return _DFT_BASES[key]
    with torch.inference_mode(False):  # a normal tensor even when first built in inference mode: autograd saves it
        return _DFT_BASES.setdefault(key, _build_block_dft_basis(head_dim, block_size, device, dtype))


def _build_block_dft_basis(head_dim: int, block_size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    b, nb, u2 = block_size, head_dim // block_size, 2 * ((block_size - 1) // 2)
    q, _ = real_dft_basis(b)  # (b, b) float64: u2 rotating rows, then DC (and Nyquist)
    rows = torch.arange(head_dim).view(nb, b)
    order = torch.cat((rows[:, :u2].reshape(-1), rows[:, u2:].reshape(-1)))  # rotating rows of every block first
    p = block_diag(q.expand(nb, -1, -1))[order]  # (d, d)
    return p.to(device=device, dtype=dtype).unsqueeze(0)


@register_pe("circulant", label="Circulant-STRING", paper_sharing="layer", bench_vit_gpu=True,
             paper_preset={"block_size": 16},  # STRING: block sizes 16-32 worked best
             bench_rows=(BenchRow("circulant"), BenchRow("circulant (b=16)", (("block_size", 16),)),
                         BenchRow("folded circulant", kind="folded", base="circulant"),
                         BenchRow("circulant in training (folded)", kind="train", base="circulant")))
class CirculantSTRING(PositionEncoding):
    """Circulant-STRING (see the module docstring): ``circ_params`` ``(Hp, c, nb, b)`` are the first columns.

    Prepared data: ``(theta, cos, sin)`` tables ``(1 | B, Hp, M, nb * b/2)`` of the mode angles (float64 angles,
    cos/sin in the compute dtype; a non-rotating pair of angle 0 fills the DC/Nyquist slot of each block for even
    ``b``).
    """

    rope_kind = "fixed"

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, block_size: int | None = None,
                 base: float = 100.0, per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        b = head_dim if block_size is None else block_size
        if b < 3 or head_dim % b:
            raise ValueError(f"circulant block_size must divide head_dim={head_dim} and be >= 3, got {b}")
        self.block_size = b
        nb = head_dim // b
        usable = (b - 1) // 2  # modes 1 .. usable rotate; DC (and Nyquist for even b) never do
        self.num_modes = usable
        self.register_buffer("dft_basis", torch.empty(b, b), persistent=False)
        self.register_buffer("mode_table", torch.empty(b, usable), persistent=False)
        self.register_buffer("dft_blockdiag", torch.empty(1, head_dim, head_dim), persistent=False)  # fused kernel's
        self.register_buffer("form_table", torch.empty(head_dim, head_dim // 2), persistent=False)  # RoPE form's
        self._build_buffers()
        self.base = base
        self.circ_params = nn.Parameter(torch.empty(self.param_heads, coord_dim, nb, b))
        self._init_weights()

    def _init_weights(self) -> None:
        """Re-draw the first columns so that the mode frequencies have RoPE-Mixed's scale and directions.

        ``c = S lambda / (2b)`` inverts ``lambda = S^T c`` on the rotating modes (the sine rows of ``S`` are
        orthogonal with squared norm ``b/2``); the DC part of ``c`` is 0. Drawn on the CPU generator. The fixed
        basis buffers are rebuilt too.
        """
        self._build_buffers()
        hp, c, nb, b = self.circ_params.shape
        u = self.num_modes
        lam = mixed_frequencies(2 * nb * u, c, hp, self.base).double().reshape(hp, c, nb, u)  # (Hp, c, nb, u)
        _, table = real_dft_basis(b)
        col = (lam.unsqueeze(-2) * table).sum(-1) / (2 * b)  # (Hp, c, nb, b)
        if self.circ_params.device.type != "meta":
            with torch.no_grad():
                self.circ_params.copy_(col)

    def _build_buffers(self) -> None:
        """(Re)compute the fixed basis and sine table exactly (float64, then the basis in the compute dtype: float64
        for a float64 module, else float32 -- a module cast to bf16 or float16 keeps float32 bases; the table stays
        float64), the block-diagonal ``(1, d, d)`` basis of every block that the fused kernel takes,
        and the RoPE form's ``(d, d/2)`` table: the sine table of every block on its own rows and mode columns,
        zero elsewhere (float64)."""
        ref = self.dft_basis
        q, table = real_dft_basis(self.block_size, dtype=wide_dtype(ref.device), device=ref.device)
        # the bases the rotation multiplies by: in the compute dtype (float64 for a float64 module, else float32),
        # rounded once from float64 -- never in bf16 / float16, whatever the module was cast to
        params = getattr(self, "circ_params", None)
        basis_dtype = torch.float64 if params is not None and params.dtype == torch.float64 else torch.float32
        if ref.device.type != "meta":
            with torch.no_grad():
                self.dft_basis = q.to(basis_dtype)
                self.mode_table = table
                blocks = block_diag(q.expand(self.head_dim // self.block_size, -1, -1))  # (d, d)
                self.dft_blockdiag = blocks.to(basis_dtype).unsqueeze(0)  # (1, d, d)
                nb, b, u = self.head_dim // self.block_size, self.block_size, self.num_modes
                form = table.new_zeros(nb * b, self.head_dim // 2)  # rows j b .. (j + 1) b, columns j u .. (j + 1) u
                for j in range(nb):
                    form[j * b:(j + 1) * b, j * u:(j + 1) * u] = table
                self.form_table = form

    def _apply(self, fn, recurse=True):  # device / dtype moves, to_empty: rebuild the fixed tables exactly
        out = super()._apply(fn, recurse)
        self._build_buffers()
        return out

    def mode_frequencies(self, dtype: torch.dtype | None = None) -> Tensor:
        """``lambda_f = 2 Im(rfft(c))_f`` of the rotating modes ``f = 1..u``: ``(Hp, c, nb, u)`` in ``dtype``
        (default: the parameters').

        Elementwise products with the fixed sine table and a sum (linear in the parameters; no FFT, no matmul), in
        the table's float64, rounded once to ``dtype``: pass float64 where the frequencies multiply large
        coordinates.
        """
        table = self.mode_table  # (b, u)
        lam = (self.circ_params.to(table.dtype).unsqueeze(-1) * table).sum(-2)  # (Hp, c, nb, b, 1) -> (Hp, c, nb, u)
        return lam.to(self.circ_params.dtype if dtype is None else dtype)

    def _pair_frequencies(self, dtype: torch.dtype) -> Tensor:
        """Frequencies of the ``nb * b/2`` pairs of the DFT-basis coordinates (zero for the DC/Nyquist pair):
        ``(Hp, c, nb * (b // 2))`` (``b`` even) or ``(Hp, c, nb * u)`` (``b`` odd)."""
        lam = self.mode_frequencies(dtype)  # (Hp, c, nb, u)
        if self.block_size % 2 == 0:
            lam = torch.cat((lam, lam.new_zeros(*lam.shape[:-1], 1)), dim=-1)  # (Hp, c, nb, b/2)
        return lam.flatten(-2)

    def _prepare(self, coords: Tensor, dtype: torch.dtype):
        """``(theta, cos, sin)`` tables ``(1 | B, Hp, M, F)``; where the fused rotation kernel runs (CUDA) and
        ``b`` is even, the coordinates and pair frequencies it forms the angles from instead. The frequencies are
        float64 (the table's dtype) either way."""
        freqs = self._pair_frequencies(self.mode_table.dtype)
        kernel = KernelState.prepare(coords, freqs, self.backend) if self.block_size % 2 == 0 else None
        if kernel is not None:
            return kernel
        return angle_table(coords, freqs, dtype)  # (theta, cos, sin): (1 | B, Hp, M, F)

    def _encode(self, x: Tensor, data, num_prefix_tokens: int, dtype: torch.dtype) -> Tensor:
        """Where the fused rotation kernel runs (even ``b``), ``Q^T RoPE(theta) Q x`` in one pass over the tokens in
        their own dtype (``ropekit.kernels.fused_basis_rotary`` with ``Q`` the block-diagonal DFT basis: the DFT
        coordinates are never written to memory); else the three steps of ``_transform``."""
        if isinstance(data, KernelState) and self.pairs == "interleaved" and dtype == torch.float32:
            basis = self.dft_blockdiag  # (1, d, d), built with the other fixed tables
            kernel = data.basis_kernel(x, basis)
            if kernel is not None:  # freqs (Hp, c, d/2), Hp = 1 or H: as the kernel takes them
                return kernel(x, basis, data.coords, data.freqs, num_prefix_tokens=num_prefix_tokens,
                              transpose_back=True, validate=False)
        return super()._encode(x, data, num_prefix_tokens, dtype)

    def _transform(self, x: Tensor, state) -> Tensor:
        b = self.block_size
        q = self.dft_basis.to(x.dtype)
        z = precise_matmul(x.unflatten(-1, (-1, b)), q.transpose(0, 1))  # (B, H, M, nb, b): Q z per block
        if isinstance(state, KernelState):  # even b: every pair of the DFT coordinates, in one launch
            z = state.rotate(z.flatten(-2))[0]  # (B, H, M, d)
            return precise_matmul(z.unflatten(-1, (-1, b)), q).flatten(-2)  # Q^T per block: (B, H, M, d)
        theta, cos, sin = state
        if b % 2 == 0:
            z = rotate_angles(z.flatten(-2), theta, cos, sin)  # (B, H, M, d)
        else:  # odd b: the DC coordinate of each block stays out of the pairs
            u2 = 2 * self.num_modes
            rot = rotate_angles(z[..., :u2].flatten(-2), theta, cos, sin).unflatten(-1, (-1, u2))
            z = torch.cat((rot, z[..., u2:]), dim=-1).flatten(-2)
        return precise_matmul(z.unflatten(-1, (-1, b)), q).flatten(-2)  # Q^T per block: (B, H, M, d)

    def generators(self) -> Tensor:
        blocks = skew(circulant(self.circ_params))  # (Hp, c, nb, b, b)
        hp, c, nb, b, _ = blocks.shape
        out = blocks.new_zeros(hp, c, nb, b, nb, b)
        idx = torch.arange(nb, device=blocks.device)  # on the device: a host index would copy and sync
        out[:, :, idx, :, idx, :] = blocks.permute(2, 0, 1, 3, 4)
        return out.reshape(hp, c, nb * b, nb * b).expand(self.num_heads, -1, -1, -1)

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """``R(r) = P^T RoPE_freqs(r) P`` with ``P`` the constant real DFT basis of every block
        (``block_dft_basis``: the rotating pairs of all blocks first, the never-rotated DC and Nyquist rows last)
        and ``freqs`` the mode frequencies ``lambda`` (zero for the rows that never turn), linear in
        ``circ_params``; no generator is built. The frequencies stay in the sine table's float64: rounded to
        float32 they would turn by ``r * ulp(lambda)``."""
        p = self.circ_params  # (the fixed basis never below float32, whatever the parameters were cast to)
        basis = block_dft_basis(self.head_dim, self.block_size, p.device, torch.promote_types(p.dtype, torch.float32))
        return RoPEForm(half_pairs_basis(self, basis), self._form_frequencies(p), None)

    def _form_frequencies(self, params: Tensor) -> Tensor:
        """The RoPE form's frequencies ``(..., Hp, c, d/2)`` of parameters ``(..., Hp, c, nb, b)``: the mode
        frequencies block by block (float64, the sine table's), then zeros for the rows that never turn -- one
        product with ``form_table`` and one sum (the other blocks' rows and the last columns are zeros)."""
        table = self.form_table  # (d, d/2)
        return (params.to(table.dtype).flatten(-2).unsqueeze(-1) * table).sum(-2)  # (..., Hp, c, d/2)

    def rope_batch_key(self) -> tuple | None:
        """Circulant-STRING encodings of one size, block size, head sharing, pair convention, dtype and device."""
        p = self.circ_params
        return ("circulant", type(self), self.head_dim, self.block_size, tuple(p.shape), p.dtype, p.device,
                self.pairs)

    @classmethod
    def stacked_rope_form(cls, pes, prefix: bool = True) -> RoPEForm:
        """The one fixed basis ``(1, 1, d, d)`` and the frequencies of all from one product ``(L, Hp, c, d/2)``."""
        first = pes[0]
        p = first.circ_params
        basis = block_dft_basis(first.head_dim, first.block_size, p.device,
                                torch.promote_types(p.dtype, torch.float32))  # (1, d, d)
        freqs = first._form_frequencies(stack_layers(pe.circ_params for pe in pes))  # (L, Hp, c, d/2)
        return RoPEForm(half_pairs_basis(first, basis).unsqueeze(0), freqs, None)
