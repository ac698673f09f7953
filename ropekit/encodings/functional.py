"""Functional core of the rotary encodings: pure functions on tensors, no modules, no state.

Shape legend used throughout ``ropekit.encodings``:

* ``B`` batch, ``H`` heads, ``M`` tokens that carry a coordinate, ``d`` head dimension (even),
  ``P = d / 2`` rotation planes ("pairs"), ``c`` coordinate dimension;
* ``Hp`` heads that own parameters: 1 when an encoding is shared by all heads, ``H`` when per head;
* ``nb = d / b`` blocks of size ``b`` for block-diagonal encodings.

Pairs are *interleaved*: pair ``n`` is the two coordinates ``(2n, 2n + 1)`` of a head vector, and
``rotate_pairs`` turns it by the angle ``theta_n`` counter-clockwise::

    [y_2n  ]   [cos t  -sin t] [x_2n  ]
    [y_2n+1] = [sin t   cos t] [x_2n+1]

This is the layout of the original RoFormer and of every 2x2 block-diagonal generator, so that
"block j" and "pair j" are the same thing. The other common layout, HF / Llama's ``rotate_half`` (pair ``n``
is ``(x_n, x_{n + d/2})``), is ``pairs="half"`` in ``rotate_pairs``, ``rotate_angles`` and
``apply_frequency_rope``.

Angles ``theta = r . omega`` are formed by elementwise products and sums (``frequency_angles``), never a
matrix product, whose TF32 rounding on a GPU would cost ~1e-3 relative; the tables are built in float64
(``rope_cos_sin``) so that they stay exact to float32 round-off at any coordinate scale.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Sequence

import torch
from torch import Tensor

from .angles import _rotate_pairs_real, _wide_dtype, angle_table, frequency_angles, rope_cos_sin, wide_angles
from .products import _reduce_to, basis_change, precise_matmul
from .validation import check_finite

__all__ = [
    "BACKENDS",
    "check_backend",
    "frequency_angles",
    "rope_cos_sin",
    "rotate_angles",
    "apply_frequency_rope",
    "rotate_pairs",
    "pair_generators",
    "axial_frequencies",
    "mixed_frequencies",
    "skew",
    "cayley_transform",
    "basis_change",
    "precise_matmul",
    "block_apply",
    "skew_real_schur",
    "scaled_block_exp_matrices",
    "scaled_block_exp_apply",
    "scaled_block_exp_reference",
    "rotate_in_block_eigenbasis",
]


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, pairs: str = "interleaved") -> Tensor:
    """Rotate each pair of ``x`` by the angle whose cos/sin are given.

    Args:
        x: ``(..., d)``.
        cos, sin: ``(..., d / 2)``, broadcastable against ``x``'s leading dimensions.
        pairs: ``"interleaved"`` -- pair ``n`` is ``(x_2n, x_2n+1)``; ``"half"`` -- pair ``n`` is
            ``(x_n, x_{n + d/2})`` (HF / Llama ``rotate_half``).

    Returns:
        ``(..., d)``, a new tensor (``x`` is not modified).

    Fast path (interleaved float32/float64, eager): one complex multiply per pair and a hand-written backward
    (``_RotatePairs``) that saves only the output and the cos/sin table; the reduction for the gradient of
    cos/sin over the broadcast (batch, head) dimensions is one pass. Under ``torch.compile`` (and for half
    pairs) the real-arithmetic form is used instead, which the compiler fuses into one kernel; no complex tensor
    reaches the compiler.
    """
    if pairs == "half":
        return _rotate_half_real(x, cos, sin)
    if pairs != "interleaved":
        raise ValueError(f"pairs must be 'interleaved' or 'half', got {pairs!r}")
    if _fast_rotation_ok(x, cos, sin):
        return _RotatePairs.apply(x, cos, sin)
    return _rotate_pairs_real(x, cos, sin)


def _rotate_half_real(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``rotate_pairs`` for half-split pairs ``(x_n, x_{n+d/2})``: ``x * cos2 + rotate_half(x) * sin2``."""
    x0, x1 = x.unflatten(-1, (2, -1)).unbind(-2)  # (..., P) each: first and second half
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)


def _fast_rotation_ok(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    return (not _is_compiling() and x.dtype in (torch.float32, torch.float64) and cos.dtype == x.dtype
            and sin.dtype == x.dtype and x.dim() >= 1 and x.shape[-1] % 2 == 0)


def _interpreting() -> bool:
    """Triton's interpreter mode (kernels run on the CPU, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _complex_pairs(x: Tensor) -> Tensor:
    """View ``(..., d)`` real as ``(..., d / 2)`` complex (pair ``n`` -> ``x_2n + i x_2n+1``); copies if the
    strides do not allow a view."""
    if x.is_contiguous():  # the common case, without the stride checks below (this runs on every call)
        return torch.view_as_complex(x.view(x.shape[:-1] + (x.shape[-1] // 2, 2)))
    xr = x.unflatten(-1, (-1, 2))  # (..., P, 2)
    if xr.stride(-1) != 1 or xr.storage_offset() % 2 or any(st % 2 for st in xr.stride()[:-1]):
        xr = xr.contiguous()
    return torch.view_as_complex(xr)


#: Smallest leading slice (bytes) for which a CPU backward reduction loops over the batch. 0 keeps every CPU
#: reduction in the loop, the form the committed study results were trained with. 256 KiB makes the tiny-ViT
#: training step with learnable frequencies ~5-6 % faster on one CPU thread (mixed 120 -> 115 ms, cayley
#: 125 -> 117 ms: ``tools/profile_step.py ab PE --what loop-threshold``, docs/bench/cpu-profile-step.txt), but it
#: changes the summation order of those gradients, so the committed studies would no longer regenerate bit for
#: bit: change it together with a regeneration.
_LOOP_MIN_BYTES = 0


def _slice_loops(t: Tensor) -> bool:
    """Whether backward reductions may loop over the batch: on the CPU, where a fresh temporary of the whole
    tensor's size costs more in page faults than the arithmetic, when each slice has at least
    ``_LOOP_MIN_BYTES``. On an accelerator each iteration costs kernel launches, so they always run as one
    batched operation."""
    return t.device.type == "cpu" and t.dim() > 0 and t[0].numel() * t.element_size() >= _LOOP_MIN_BYTES


def _sum_times_conj(a: Tensor, b: Tensor, shape: Sequence[int]) -> Tensor:
    """``sum a * conj(b)`` over the dimensions that ``shape`` broadcasts, without a temporary of ``a``'s size.

    ``a``, ``b``: complex ``(n, ...)`` of equal shapes. On the CPU, computed one leading slice at a time in one
    reused scratch buffer: a fresh buffer of q's size costs more in page faults than the arithmetic does there. On
    an accelerator, where every launch costs several microseconds and a loop over the batch would cost ``4 n``
    launches, it is one product and one reduction. No autograd.
    """
    if not _slice_loops(a) or a.dim() != len(shape) or a.dim() < 2:
        return _reduce_to(a * b.conj_physical(), shape)
    scratch = torch.empty(a.shape[1:], dtype=a.dtype, device=a.device)
    parts, acc = [], None
    for i in range(a.shape[0]):
        torch.conj_physical(b[i], out=scratch)
        part = _reduce_to(scratch.mul_(a[i]), shape[1:])
        if shape[0] != 1:
            parts.append(part.clone() if part.data_ptr() == scratch.data_ptr() else part)
        else:
            acc = part.clone() if acc is None else acc.add_(part)
    return torch.stack(parts) if shape[0] != 1 else acc.unsqueeze(0)


class _RotatePairs(torch.autograd.Function):
    """``y = x * w`` per pair in complex form, ``w = cos + i sin``.

    Backward: ``gx = g * conj(w)``; the gradient of ``w`` is ``sum(g * conj(x))`` over the broadcast
    dimensions, recovered from the saved output as ``sum(g * conj(y)) * w / |w|^2`` (``x = y / w``) so that
    the input need not be kept alive (only the output, which attention saves anyway, and the small table).
    Exact for any ``w != 0`` (``|w| = 1`` for a rotation).
    """

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        w = torch.complex(cos, sin)  # (..., P) broadcastable
        y = torch.view_as_real(_complex_pairs(x) * w).flatten(-2)  # (..., d)
        ctx.cos_shape, ctx.sin_shape = cos.shape, sin.shape
        ctx.save_for_backward(cos, sin, y if (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]) else None)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        cos, sin, y = ctx.saved_tensors
        w = torch.complex(cos, sin)  # recomputed (small) so that double backward sees cos and sin
        w_conj = torch.complex(cos, -sin)  # physical conjugate: a lazily conjugated operand is ~4x slower
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        # attention hands back gradients in its own layout (e.g. (B, N, H, d) strides); products inherit it, and
        # the reduction over (B, H) for the cos/sin gradient is ~40x slower on that layout than on a contiguous one
        gc = _complex_pairs(g.contiguous() if need_w else g)  # (..., P)
        gx = gcos = gsin = acc = None
        if not torch.is_grad_enabled():  # first-order backward: no temporary of the input's size
            if need_w:
                acc = _sum_times_conj(gc, _complex_pairs(y), w.shape)  # sum g conj(y), shape of w
            if ctx.needs_input_grad[0]:
                gx = torch.view_as_real(gc * w_conj).flatten(-2)
        else:  # double backward: out-of-place, so that autograd records every step
            if ctx.needs_input_grad[0]:
                gx = torch.view_as_real(gc * w_conj).flatten(-2)
            if need_w:
                acc = _reduce_to(gc * _complex_pairs(y).conj_physical(), w.shape)
        if need_w:
            gw = acc * w / (w.real.square() + w.imag.square())  # = sum g conj(x)
            if ctx.needs_input_grad[1]:
                gcos = _reduce_to(gw.real, ctx.cos_shape)
            if ctx.needs_input_grad[2]:
                gsin = _reduce_to(gw.imag, ctx.sin_shape)
        return gx, gcos, gsin


class _RotateAngles(torch.autograd.Function):
    """``y = x * exp(i theta)`` per interleaved pair, differentiable in ``x`` and ``theta`` only.

    ``cos`` / ``sin`` (``theta``'s, rounded to ``x``'s dtype, no autograd history) are passed in so that they are
    computed once per table, not per call. Backward: ``gx = g * exp(-i theta)``; ``gtheta = sum Im(g conj(y))``
    over the broadcast dimensions (``dy/dtheta = i y``), from the saved output -- no gradient through cos/sin
    tables, no small-tensor chain. Under double backward every step is recomputed from ``theta`` with
    differentiable operations.
    """

    @staticmethod
    def forward(ctx, x: Tensor, theta: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        y = torch.view_as_real(_complex_pairs(x) * torch.complex(cos, sin)).flatten(-2)  # (..., d)
        ctx.save_for_backward(theta, cos, sin, y if ctx.needs_input_grad[1] else None)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        theta, cos, sin, y = ctx.saved_tensors
        gx = gtheta = None
        if torch.is_grad_enabled():  # double backward: rebuild the rotation from theta, out-of-place
            c, s = torch.cos(theta).to(g.dtype), torch.sin(theta).to(g.dtype)
            gx = _RotateAngles.apply(g, -theta, c, -s) if ctx.needs_input_grad[0] else None
            if ctx.needs_input_grad[1]:
                gy = _complex_pairs(g) * _complex_pairs(y).conj_physical()
                gtheta = _reduce_to(gy.imag, theta.shape).to(theta.dtype)
            return gx, gtheta, None, None
        gc = _complex_pairs(g.contiguous() if ctx.needs_input_grad[1] else g)  # (..., P)
        if ctx.needs_input_grad[1]:
            gtheta = _sum_times_conj(gc, _complex_pairs(y), theta.shape).imag
            gtheta = gtheta if gtheta.dtype == theta.dtype else gtheta.to(theta.dtype)
        if ctx.needs_input_grad[0]:
            gx = torch.view_as_real(gc * torch.complex(cos, -sin)).flatten(-2)
        return gx, gtheta, None, None


def rotate_angles(x: Tensor, theta: Tensor, cos: Tensor | None = None, sin: Tensor | None = None,
                  pairs: str = "interleaved") -> Tensor:
    """Rotate each pair of ``x`` by ``theta``; differentiable in ``x`` and ``theta``.

    Args:
        x: ``(..., d)`` float32 or float64 (the compute dtype).
        theta: ``(..., d / 2)`` broadcastable against ``x``'s leading dimensions, any float dtype (float64 for
            exact tables, see ``rope_cos_sin``).
        cos, sin: optional ``cos(theta)`` / ``sin(theta)`` in ``x``'s dtype, already computed (treated as
            constants: the gradient reaches ``theta`` directly).
        pairs: ``"interleaved"`` or ``"half"`` (see ``rotate_pairs``).

    Returns:
        ``(..., d)`` in ``x``'s dtype.

    The eager interleaved path (``_RotateAngles``) returns the angle gradient as one reduction of
    ``Im(g conj(y))`` -- the cheapest backward of a learnable-frequency RoPE; other cases use ``rotate_pairs``
    with differentiable cos/sin.
    """
    if (pairs == "interleaved" and not _is_compiling() and x.dtype in (torch.float32, torch.float64)
            and x.shape[-1] % 2 == 0):
        if cos is None or sin is None:
            with torch.no_grad():
                cos, sin = torch.cos(theta).to(x.dtype), torch.sin(theta).to(x.dtype)
        return _RotateAngles.apply(x, theta, cos.detach(), sin.detach())
    return rotate_pairs(x, torch.cos(theta).to(x.dtype), torch.sin(theta).to(x.dtype), pairs)


def _rotate_tokens(x: Tensor, table: tuple[Tensor, Tensor, Tensor], num_prefix_tokens: int, pairs: str) -> Tensor:
    """Rotate ``x`` ``(B, H, N, d)`` after its prefix tokens, math in the table's dtype, output in ``x``'s."""
    theta, cos, sin = table
    with torch.autocast(device_type=x.device.type, enabled=False):
        xr = x[:, :, num_prefix_tokens:] if num_prefix_tokens else x
        xr = xr if xr.dtype == cos.dtype else xr.to(cos.dtype)
        y = rotate_angles(xr, theta, cos, sin, pairs)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return torch.cat((x[:, :, :num_prefix_tokens], y), dim=2) if num_prefix_tokens else y


def _check_rope_args(q: Tensor, k: Tensor | None, coords: Tensor, freqs: Tensor, k_coords: Tensor | None,
                     num_prefix_tokens: int, pairs: str) -> Tensor:
    """Validate ``apply_frequency_rope``'s arguments; return freqs as ``(Hp, c, P)``."""
    if q.dim() != 4 or (k is not None and k.dim() != 4):
        raise ValueError(f"q and k must be (B, H, N, d), got {tuple(q.shape)} and "
                         f"{None if k is None else tuple(k.shape)}")
    if pairs not in ("interleaved", "half"):
        raise ValueError(f"pairs must be 'interleaved' or 'half', got {pairs!r}")
    d = q.shape[-1]
    f = freqs.unsqueeze(0) if freqs.dim() == 2 else freqs
    if f.dim() != 3 or f.shape[-1] * 2 != d or f.shape[-2] != coords.shape[-1]:
        raise ValueError(f"freqs must be (c, d/2) or (H, c, d/2) = (.., {coords.shape[-1]}, {d // 2}), "
                         f"got {tuple(freqs.shape)}")
    if f.shape[0] not in (1, q.shape[1]):
        raise ValueError(f"per-head freqs have {f.shape[0]} heads, q has {q.shape[1]}")
    if not isinstance(num_prefix_tokens, int) or not 0 <= num_prefix_tokens <= q.shape[-2]:
        raise ValueError(f"num_prefix_tokens must be an int in [0, {q.shape[-2]}], got {num_prefix_tokens!r}")
    if coords.dim() not in (2, 3) or coords.shape[-2] != q.shape[-2] - num_prefix_tokens:
        raise ValueError(f"coords must be (M, c) or (B, M, c) with M = {q.shape[-2] - num_prefix_tokens} "
                         f"(q tokens minus prefix), got {tuple(coords.shape)}")
    if k is not None:
        if k.shape[-1] != d or k.shape[0] != q.shape[0]:
            raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head dim")
        if k.shape[1] != q.shape[1] and (q.shape[1] % k.shape[1] or f.shape[0] != 1):
            raise ValueError(f"k has {k.shape[1]} heads, q {q.shape[1]}: grouped keys need a head count dividing "
                             f"q's and frequencies shared by heads")
        kc = coords if k_coords is None else k_coords
        if k_coords is None and k.shape[-2] != q.shape[-2]:
            raise ValueError(f"q has {q.shape[-2]} tokens and k has {k.shape[-2]}: pass k_coords for the keys")
        num_keys = k.shape[-2] - num_prefix_tokens
        if kc.dim() not in (2, 3) or kc.shape[-2] != num_keys or kc.shape[-1] != coords.shape[-1]:
            raise ValueError(f"k_coords must be (M, c) or (B, M, c) with M = {num_keys}, "
                             f"got {tuple(kc.shape)}")
    return f


def apply_frequency_rope(q: Tensor, k: Tensor | None, coords: Tensor, freqs: Tensor, *,
                         k_coords: Tensor | None = None, num_prefix_tokens: int = 0,
                         pairs: str = "interleaved", backend: str = "auto", validate: bool = True
                         ) -> tuple[Tensor, Tensor | None]:
    """Rotate q and k by the angles ``theta = r . omega``: the per-token work of every frequency RoPE.

    Args:
        q: ``(B, Hq, Nq, d)``; any strides (a ``(B, N, H, d)`` tensor transposed is fine).
        k: ``(B, Hk, Nk, d)`` with ``Hk`` dividing ``Hq`` (grouped keys need shared frequencies), or ``None``.
        coords: ``(Mq, c)`` shared by the batch or ``(B, Mq, c)`` per example, ``Mq = Nq - num_prefix_tokens``.
        freqs: ``(c, d/2)`` shared by heads or ``(Hq, c, d/2)`` per head.
        k_coords: key coordinates ``(Mk, c)`` / ``(B, Mk, c)``, ``Mk = Nk - num_prefix_tokens``; ``None``: keys
            use ``coords`` (then ``Nk`` must equal ``Nq``).
        num_prefix_tokens: leading tokens of q and k passed through unrotated.
        pairs: ``"interleaved"`` (planes ``(x_2n, x_2n+1)``) or ``"half"`` (planes ``(x_n, x_{n+d/2})``).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (:data:`BACKENDS`), see below.
        validate: check ``coords`` and ``k_coords`` for NaN and infinity (``check_coords``'s finiteness check:
            at once on the CPU, counted on the device and reported by ``check_deferred_coords()`` on an
            accelerator); ``False`` for callers that checked them already.

    Returns:
        ``(q_out, k_out)`` in the input dtypes and shapes (``k_out`` is ``None`` when ``k`` is); differentiable
        twice in q, k, freqs and coords.

    Numerics: angles by elementwise products and sums in float64 (``angles.angle_table``) -- never a matrix product,
    so TF32 settings do not round them, and float64 frequencies (e.g. derived from parameters) are used as they
    are -- cos/sin and the rotation in float32 (float64 if q or k is float64), autocast disabled.
    Path: with ``backend="auto"`` the fused Triton kernel ``ropekit.kernels.fused_rotary`` runs on CUDA when it is
    installed and works there (on the CPU only in Triton's interpreter mode, ``TRITON_INTERPRET=1``, for tests),
    else the PyTorch path below, which is also the reference (on CUDA after one warning saying why);
    ``"torch"`` always takes the PyTorch path; ``"triton"`` always the kernel. Inside ``torch.compile`` the kernel
    covers q and k together on shared coordinates only (``kernels.compile_supported``): ``"auto"`` takes the
    PyTorch path for other calls there.

    Raises:
        ValueError: shapes that do not fit together, an unknown ``backend``, ``backend="triton"`` where the
            kernel cannot run (the message says why), or (``validate``) NaN / infinite coordinates, naming their
            count.
    """
    f = _check_rope_args(q, k, coords, freqs, k_coords, num_prefix_tokens, pairs)
    if validate:
        check_finite(coords)
        if k_coords is not None:
            check_finite(k_coords, "k_coords")
    kernel = _fused_kernel(q.device, traceable=True, backend=check_backend(backend))
    if kernel is not None and _is_compiling() and not _KERNELS[0].compile_supported(q, k, coords, freqs, k_coords):
        if backend == "triton":
            raise ValueError(_TRITON_IN_COMPILE)
        kernel = None  # inside torch.compile the kernel covers q and k together only: the PyTorch path below
    if kernel is not None:
        return kernel(q, k, coords, freqs, k_coords=k_coords, num_prefix_tokens=num_prefix_tokens, pairs=pairs,
                      validate=False)
    dtype = torch.float64 if torch.float64 in (q.dtype, None if k is None else k.dtype) else torch.float32
    table = angle_table(coords, f, dtype)
    q_out = _rotate_tokens(q, table, num_prefix_tokens, pairs)
    if k is None:
        return q_out, None
    if k_coords is not None:
        table = angle_table(k_coords, f, dtype)
    return q_out, _rotate_tokens(k, table, num_prefix_tokens, pairs)


#: Execution paths of the per-token rotation: ``"auto"`` (the fused Triton kernel where it runs, else PyTorch),
#: ``"torch"`` (always PyTorch operations), ``"triton"`` (the fused kernel, or a ``ValueError`` saying why not).
BACKENDS = ("auto", "torch", "triton")

_TRITON_IN_COMPILE = ("backend='triton': inside torch.compile the fused kernel runs only for q and k together on "
                      "shared coordinates without a coordinate gradient (kernels.compile_supported); use "
                      "backend='auto' there")

_KERNELS: list = []  # the imported ropekit.kernels module (imported on first use)
_WARNED: set = set()  # the reasons "auto" has already warned about (one warning per reason and process)


def check_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`BACKENDS`, else a ``ValueError``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def _kernel_reason(device: torch.device) -> str | None:
    """Why the fused rotation kernel cannot run on ``device``, or None when it can (``ropekit.kernels`` imported
    once; its check never raises here: a broken install is a reason like any other)."""
    if not _KERNELS:
        from .. import kernels  # noqa: PLC0415 -- ropekit.kernels imports ropekit.encodings

        _KERNELS.append(kernels)
    kernels = _KERNELS[0]
    try:
        if kernels.available(device):
            return None
        return kernels.unavailable_reason(device)
    except Exception as e:  # noqa: BLE001 -- reported to the caller, which warns or raises
        return f"checking the kernels raised {type(e).__name__}: {' '.join(str(e).split())}"


def _fused_kernel(device: torch.device, traceable: bool = False, backend: str = "auto"):
    """``ropekit.kernels.fused_rotary`` where ``backend`` asks for it and it can run on ``device``, else None.

    ``"torch"``: None. ``"auto"``: the kernel on a CUDA device (and on the CPU under ``TRITON_INTERPRET=1``, for
    tests) when it runs there; when it does not (Triton missing or broken, its check raising), one
    ``RuntimeWarning`` per reason and process, and None. On other devices (the CPU without the interpreter) None
    at once: PyTorch is their path, not a fallback. ``"triton"``: the kernel, or a ``ValueError`` naming why it
    cannot run. Inside ``torch.compile`` the kernel is returned only for a call that ``kernels.compile_supported``
    accepts (the caller says so with ``traceable``): it then runs as a custom operator that Inductor keeps.
    """
    if backend == "torch":
        return None
    device = torch.device(device)
    if backend == "auto" and not (device.type == "cuda" or (device.type == "cpu" and _interpreting())):
        return None
    if _is_compiling() and not traceable:
        if backend == "triton":
            raise ValueError(_TRITON_IN_COMPILE)
        return None
    reason = _kernel_reason(device)
    if reason is None:
        return _KERNELS[0].fused_rotary
    if backend == "triton":
        raise ValueError(f"backend='triton' cannot run on {device}: {reason}")
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"ropekit: the fused Triton kernels are not used on {device} ({reason}); the encodings run "
                      f"their PyTorch operations (pass backend='torch' to choose them explicitly)", RuntimeWarning,
                      stacklevel=3)
    return None


def _fused_basis_kernel(x: Tensor, basis: Tensor, coords: Tensor, freqs: Tensor, backend: str = "auto"):
    """``ropekit.kernels.fused_basis_rotary`` where it handles these arguments (the rotation kernel is chosen by
    ``backend`` for their device, see :func:`_fused_kernel`, and ``kernels.basis_rotary_supported`` accepts them)
    outside ``torch.compile``, else None."""
    kernels = _KERNELS[0] if _fused_kernel(x.device, backend=backend) is not None else None
    if kernels is None or not kernels.basis_rotary_supported(x, basis, coords, freqs):
        return None
    return kernels.fused_basis_rotary


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


def axial_frequencies(head_dim: int, coord_dim: int, base: float = 10000.0) -> Tensor:
    """Axial RoPE frequencies: pairs split evenly and contiguously across the axes.

    Axis ``k`` owns pairs ``[k * p, (k + 1) * p)`` with ``p = (d / 2) // c``; pair ``n`` of an axis turns
    by ``r_k * base ** (-2 n / d_k)`` with ``d_k = 2 p``. Leftover pairs (when ``d / 2`` is not divisible
    by ``c``) get frequency 0: they are not rotated.

    Returns:
        ``(c, d / 2)`` float32 frequency matrix, on the CPU (also under a ``torch.device("meta")`` context).
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
    return freqs.float()


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


def skew(a: Tensor) -> Tensor:
    """``A - A^T`` over the last two dimensions."""
    return a - a.transpose(-1, -2)


def cayley_transform(s: Tensor) -> Tensor:
    """Orthogonal ``P = (I - S)(I + S)^-1`` for skew ``S`` of shape ``(..., d, d)``.

    Computed with one factorised linear solve (``torch.linalg.solve_ex``), never an explicit inverse;
    ``(I - S)`` and ``(I + S)^-1`` commute, so ``P = solve(I + S, I - S)``. ``I + S`` is always
    invertible for skew ``S`` (its eigenvalues are ``1 + i mu``).
    """
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device)
    p, _ = torch.linalg.solve_ex(eye + s, eye - s)
    return p


# ----------------------------------------------------------------------------- per-block matrices
def block_apply(e: Tensor, x: Tensor) -> Tensor:
    """Apply a ``b x b`` matrix to every block of every token: ``y[.., j, :] = e[.., j, :, :] @ x[.., j, :]``.

    Args:
        e: ``(Be, He, M, nb, b, b)`` with ``Be`` 1 (shared by the batch: an image grid) or ``B``, and ``He`` 1
            (shared by the heads) or ``H`` -- one matrix per distinct (coordinate, parameter head, block).
        x: ``(B, H, M, nb * b)``.

    Returns:
        ``(B, H, M, nb * b)``, differentiable in ``e`` and ``x``.

    The matrices are never expanded over the batch or heads they are shared by: the shared dimensions become
    the columns of one batched matrix product per (coordinate, block), and the backward pass sums the outer
    products ``g x^T`` over them with one batched product per coordinate (``_BlockApply``); under
    ``create_graph`` the backward is written with differentiable ops, so second derivatives are exact.
    """
    return _BlockApply.apply(e, x)


def _block_matvec(e: Tensor, x: Tensor) -> Tensor:
    """Forward of ``block_apply`` (no autograd). Shapes as in ``block_apply``."""
    bsz, h, m, d = x.shape
    be, he, _, nb, b, _ = e.shape
    hr = h // he
    xv = x.reshape(bsz, he, hr, m, nb, b)  # (B, He, Hr, M, nb, b)
    if be == 1:
        cols = xv.permute(1, 3, 4, 5, 0, 2).reshape(he, m, nb, b, bsz * hr)  # (He, M, nb, b, B*Hr)
        y = precise_matmul(e[0], cols)  # (He, M, nb, b, B*Hr)
        y = y.view(he, m, nb, b, bsz, hr).permute(4, 0, 5, 1, 2, 3)  # (B, He, Hr, M, nb, b)
    else:
        cols = xv.permute(0, 1, 3, 4, 5, 2)  # (B, He, M, nb, b, Hr)
        y = precise_matmul(e, cols).permute(0, 1, 5, 2, 3, 4)  # (B, He, Hr, M, nb, b)
    return y.reshape(bsz, h, m, d)


def _block_outer_sum(g: Tensor, x: Tensor, eshape: Sequence[int]) -> Tensor:
    """``sum g_j x_j^T`` per block over the dimensions a ``block_apply`` matrix of shape ``eshape`` is shared by.

    Computed as one ``(d x R) @ (R x d)`` product per coordinate (``R`` the shared batch x head columns), whose
    diagonal ``b x b`` blocks are kept: on CPU this beats a batched product of ``b x b`` outer products.
    """
    bsz, h, m, d = x.shape
    be, he, _, nb, b, _ = eshape
    hr = h // he
    if be == bsz and hr == 1:  # nothing is shared: plain per-token outer products
        return g.reshape(bsz, h, m, nb, b, 1) * x.reshape(bsz, h, m, nb, 1, b)
    gv, xv = g.reshape(bsz, he, hr, m, d), x.reshape(bsz, he, hr, m, d)
    if be == 1:
        gm = gv.permute(1, 3, 4, 0, 2).reshape(he, m, d, bsz * hr)  # (He, M, d, R)
        xm = xv.permute(1, 3, 0, 2, 4).reshape(he, m, bsz * hr, d)  # (He, M, R, d)
        full = precise_matmul(gm, xm).unsqueeze(0)  # (1, He, M, d, d)
    elif he == 1 and not _slice_loops(x):  # per-example coordinates, shared by heads: one batched product
        gb = g.reshape(bsz, h, m * nb, b).permute(0, 2, 3, 1)  # (B, M*nb, b, H)
        xb = x.reshape(bsz, h, m * nb, b).permute(0, 2, 1, 3)  # (B, M*nb, H, b)
        return precise_matmul(gb, xb).view(bsz, 1, m, nb, b, b)
    elif he == 1:  # the same on the CPU, one strided batched product per example (cheaper there)
        # (no ``out=``: it would break double backward, where these products are recorded by autograd)
        per_example = []
        for i in range(bsz):
            gi = g[i].reshape(h, m * nb, b).permute(1, 2, 0)  # (M*nb, b, H)
            xi = x[i].reshape(h, m * nb, b).permute(1, 0, 2)  # (M*nb, H, b)
            per_example.append(precise_matmul(gi, xi))
        return torch.stack(per_example).view(bsz, 1, m, nb, b, b)
    else:
        gm = gv.permute(0, 1, 3, 4, 2).contiguous()  # (B, He, M, d, Hr)
        xm = xv.permute(0, 1, 3, 2, 4).contiguous()  # (B, He, M, Hr, d)
        full = precise_matmul(gm, xm)  # (B, He, M, d, d)
    if nb == 1:
        return full.unsqueeze(-3)  # (Be, He, M, 1, d, d)
    blocks = full.view(be, he, m, nb, b, nb, b).diagonal(dim1=3, dim2=5)  # (Be, He, M, b, b, nb)
    return blocks.permute(0, 1, 2, 5, 3, 4)  # (Be, He, M, nb, b, b)


class _BlockApply(torch.autograd.Function):
    """``block_apply`` with a backward that keeps the shared matrices un-expanded (see ``block_apply``)."""

    @staticmethod
    def forward(ctx, e: Tensor, x: Tensor) -> Tensor:
        ctx.save_for_backward(e, x)
        return _block_matvec(e, x)

    @staticmethod
    def backward(ctx, g: Tensor):
        e, x = ctx.saved_tensors
        ge = gx = None
        if not torch.is_grad_enabled():  # first order: batched products, shared matrices never expanded
            if ctx.needs_input_grad[1]:
                gx = _block_matvec(e.transpose(-1, -2), g)  # R^T g
            if ctx.needs_input_grad[0]:
                ge = _block_outer_sum(g, x, e.shape)
            return ge, gx
        # a gradient graph is requested (create_graph): the same gradients from differentiable ops
        if ctx.needs_input_grad[1]:
            gx = _BlockApply.apply(e.transpose(-1, -2), g)  # R^T g, itself twice differentiable
        if ctx.needs_input_grad[0]:
            bsz, h, m, _ = x.shape
            be, he, _, nb, b, _ = e.shape
            gv = g.reshape(bsz, he, h // he, m, nb, b)
            xv = x.reshape(bsz, he, h // he, m, nb, b)
            ge = torch.einsum("bhrmni,bhrmnj->bhmnij", gv, xv)  # (B, He, M, nb, b, b): per-token outer products
            if be == 1:
                ge = ge.sum(0, keepdim=True)
        return ge, gx


def skew_real_schur(k: Tensor, rtol: float = 1e-8) -> tuple[Tensor, Tensor]:
    """Real block-diagonal form of skew matrices: ``K = Q blockdiag_n(mu_n J) Q^T``, ``J = [[0, -1], [1, 0]]``.

    Args:
        k: ``(..., b, b)`` skew-symmetric, ``b`` even.
        rtol: eigenvalues ``mu <= rtol * max(mu)`` count as small (see below).

    Returns:
        ``(Q, mu)``: ``Q`` ``(..., b, b)`` orthogonal, its columns ``(2n, 2n + 1)`` spanning rotation plane ``n``,
        and ``mu`` ``(..., b / 2)`` >= 0 (ascending: the planes that do not turn first), in ``k``'s dtype;
        computed in float64, not differentiable.

    From a Hermitian eigendecomposition of ``-iK`` (backward stable whatever the eigenvalue gaps): an
    eigenvector ``u`` of ``mu > 0`` gives the real orthonormal pair ``sqrt(2) (Im u, Re u)`` -- also when several
    ``mu`` coincide. For ``mu`` near zero that pairing fails (``u`` and its conjugate, the eigenvector of
    ``-mu``, mix), so the small eigenvalues are resolved again on their own scale: ``K`` restricted to the
    complement of the well-separated planes (an exactly block-structured matrix in an orthonormal basis of that
    complement) is rescaled to norm one and decomposed the same way -- its planes keep their frequencies exactly
    (``mu`` from ``1e-8`` of the largest down to ``1e-16`` of it, which would otherwise be dropped: an angle error
    of ``mu * s``, ~1e-4 rad at coordinates of 1e4). What is left below that scale is the null space, given a
    real orthonormal basis of its own; its planes turn by 0 (``K = 0`` gives a valid ``Q``). Four small
    eigendecompositions in all, batched over the leading dimensions.
    """
    b = k.shape[-1]
    kd = k.detach().to(torch.float64)
    eye = torch.eye(b, dtype=kd.dtype, device=kd.device)
    pairs, mu, good = _schur_pairs(kd, rtol)  # the well-separated planes
    kept = pairs * good.repeat_interleave(2, dim=-1).unsqueeze(-2).to(pairs.dtype)
    # an orthonormal basis W whose last 2r columns span the complement of the kept planes (projector eigenvalue 1)
    lam, w = torch.linalg.eigh(eye - kept @ kept.transpose(-1, -2))
    inner = (lam > 0.5).to(kd.dtype)  # (..., b): the complement's coordinates in W
    kn = (w.transpose(-1, -2) @ kd @ w) * inner.unsqueeze(-1) * inner.unsqueeze(-2)  # exactly zero elsewhere
    scale = kn.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(kd.dtype).tiny)
    pairs2, mu2, good2 = _schur_pairs(kn / scale, rtol)  # the small planes, on their own scale
    # below the round-off of K's own entries a plane is still: its pair is noise, and so is its turn
    good2 = good2 & (mu2 * scale.squeeze(-1) > 64 * torch.finfo(kd.dtype).eps * mu.amax(dim=-1, keepdim=True))
    small = w @ (pairs2 * good2.repeat_interleave(2, dim=-1).unsqueeze(-2).to(pairs2.dtype))
    # slot order: null planes, small planes, then the separated ones (each ascending); the separated planes hold
    # the last g slots, the small ones the g2 slots before them
    h = b // 2
    g, g2 = good.sum(-1, keepdim=True), good2.sum(-1, keepdim=True)  # (..., 1)
    slot = torch.arange(h, device=kd.device)
    src2 = (slot + g).clamp(max=h - 1)  # small plane at slot n comes from pass 2's slot n + g
    is_small = (slot >= h - g - g2) & (slot < h - g)  # (..., h)
    small = torch.gather(small.unflatten(-1, (h, 2)), -2, src2.unsqueeze(-2).unsqueeze(-1).expand(
        *small.shape[:-1], h, 2)).flatten(-2)
    mu_small = torch.gather(mu2 * scale.squeeze(-1), -1, src2)
    small_cols = is_small.repeat_interleave(2, dim=-1).unsqueeze(-2)
    q = torch.where(small_cols, small, kept)
    mu = torch.where(good, mu, torch.where(is_small, mu_small, torch.zeros_like(mu)))
    # the null space: the last 2 r0 eigenvectors of the projector onto the complement of every plane found
    found = q * (good | is_small).repeat_interleave(2, dim=-1).unsqueeze(-2).to(q.dtype)
    _, null_vecs = torch.linalg.eigh(eye - found @ found.transpose(-1, -2))
    r2 = 2 * (~(good | is_small)).sum(dim=-1, keepdim=True)  # (..., 1)
    idx = (torch.arange(b, device=kd.device) + b - r2).clamp(max=b - 1)  # (..., b): column c <- b - 2r + c
    null_cols = torch.gather(null_vecs, -1, idx.unsqueeze(-2).expand(null_vecs.shape))
    q = torch.where((good | is_small).repeat_interleave(2, dim=-1).unsqueeze(-2), q, null_cols)
    return q.to(k.dtype), mu.to(k.dtype)


def _schur_pairs(kd: Tensor, rtol: float) -> tuple[Tensor, Tensor, Tensor]:
    """The planes of ``kd`` ``(..., b, b)`` (float64 skew) from one eigendecomposition of ``-iK``: ``(pairs, mu,
    good)`` -- ``(..., b, b)`` columns ``sqrt(2) (Im u, Re u)`` per non-negative eigenvalue (ascending),
    ``(..., b/2)`` those eigenvalues, and ``(..., b/2)`` whether each exceeds ``rtol`` times the largest (only
    those columns are trustworthy)."""
    half = kd.shape[-1] // 2
    mu_all, u = torch.linalg.eigh((-1j) * kd.to(torch.complex128))  # ascending, -mu_max .. mu_max
    mu, u = mu_all[..., half:], u[..., :, half:]  # (..., h), (..., b, h): the non-negative half
    pairs = torch.stack((u.imag, u.real), dim=-1).flatten(-2) * math.sqrt(2.0)  # (..., b, b)
    good = mu > rtol * mu.abs().amax(dim=-1, keepdim=True)  # (..., h); the small ones come first
    return pairs, mu, good


def _plane_basis(q: Tensor) -> Tensor:
    """``(A_n, B_n)`` with ``Q RoPE(theta) Q^T = sum_n cos(theta_n) A_n + sin(theta_n) B_n``.

    ``A_n = q0 q0^T + q1 q1^T`` (projector on plane ``n``), ``B_n = q1 q0^T - q0 q1^T`` (its generator), from the
    column pair ``(q0, q1) = (Q[:, 2n], Q[:, 2n+1])``. Args: ``q`` ``(..., b, b)``. Returns ``(..., b, b * b)``:
    rows ``0 .. b/2 - 1`` the ``A_n``, rows ``b/2 .. b - 1`` the ``B_n``, each flattened.
    """
    q0, q1 = q.unflatten(-1, (-1, 2)).unbind(-1)  # (..., b, h): plane n's two columns
    a = q0.transpose(-1, -2).unsqueeze(-1) * q0.transpose(-1, -2).unsqueeze(-2)  # (..., h, b, b)
    a = a + q1.transpose(-1, -2).unsqueeze(-1) * q1.transpose(-1, -2).unsqueeze(-2)
    g = q1.transpose(-1, -2).unsqueeze(-1) * q0.transpose(-1, -2).unsqueeze(-2)
    g = g - g.transpose(-1, -2)
    return torch.cat((a, g), dim=-3).flatten(-2)  # (..., 2h, b*b)


class _ScaledBlockExpm(torch.autograd.Function):
    """``E = expm(s K)`` for a fixed skew ``K`` per block and a scalar ``s`` per (coordinate, block).

    Forward: one real block-diagonalisation per block (``skew_real_schur``) serves every coordinate:
    ``expm(s K) = Q RoPE(s mu) Q^T = sum_n cos(s mu_n) A_n + sin(s mu_n) B_n`` -- one small matrix product
    per block for all coordinates (``_plane_basis``). The angles ``s mu_n`` are formed in float64 from ``s`` (pass
    it in float64 where it is itself a sum of products) and the float64 eigenvalues, so the exponentials stay exact
    to ``K``'s dtype at any coordinate scale.

    Backward: the exact Frechet derivative of the exponential, in the real basis ``Q``. ``G^ = Q^T gE Q`` (one
    product with ``Q (x) Q`` per block); every 2x2 block ``(n, m)`` of ``G^`` splits into a part commuting with
    the plane rotations, ``a I + b J``, and an anti-commuting one, ``c Z + e W``; integrating
    ``expm(-(1 - t) s D) G^ expm(-t s D)`` over ``t`` multiplies them by ``s sinc(s (mu_n - mu_m) / 2)`` and
    ``s sinc(s (mu_n + mu_m) / 2)`` phase factors -- finite and exact also when eigenvalues coincide
    (``K = 0``, zero initialisation), where an eigendecomposition backward would divide by zero. Under
    ``create_graph`` the backward differentiates a dense ``matrix_exp`` reference instead, so second
    derivatives are exact too.
    """

    @staticmethod
    def forward(ctx, s: Tensor, k: Tensor) -> Tensor:
        # s: (Bs, Hp, M, nb); k: (Hp, nb, b, b)
        bs, hp, m, nb = s.shape
        b = k.shape[-1]
        wide = _wide_dtype(k.device)
        q, mu_wide = skew_real_schur(k.to(wide))  # (Hp, nb, b, b), (Hp, nb, h)
        q, mu = q.to(k.dtype), mu_wide.to(k.dtype)
        st = s.permute(1, 3, 0, 2).reshape(hp, nb, bs * m, 1)  # (Hp, nb, T, 1), T = Bs * M coordinates
        theta = st.to(wide) * mu_wide.unsqueeze(-2)  # (Hp, nb, T, h): float64, exact at any coordinate scale
        cs = torch.cat((torch.cos(theta), torch.sin(theta)), dim=-1).to(k.dtype)  # (Hp, nb, T, 2h)
        e = precise_matmul(cs, _plane_basis(q))  # (Hp, nb, T, b*b)
        # the backward's phase factors are angles too: float64 scalars and frequencies
        ctx.save_for_backward(s, k, st.to(wide), q, mu_wide)
        ctx.shape = (bs, hp, m, nb)
        return e.view(hp, nb, bs, m, b, b).permute(2, 0, 3, 1, 4, 5).contiguous()  # (Bs, Hp, M, nb, b, b)

    @staticmethod
    def backward(ctx, ge: Tensor):
        s, k, st, q, mu = ctx.saved_tensors
        if torch.is_grad_enabled():  # a gradient graph is requested: differentiate a dense reference instead
            with torch.enable_grad():
                ref = torch.linalg.matrix_exp(s.unsqueeze(-1).unsqueeze(-1) * k.unsqueeze(-4).unsqueeze(0))
                want = [t for t, n in zip((s, k), ctx.needs_input_grad[:2]) if n]
                grads = iter(torch.autograd.grad(ref, want, ge, create_graph=True))
            return tuple(next(grads) if n else None for n in ctx.needs_input_grad[:2])
        bs, hp, m, nb = ctx.shape
        b = q.shape[-1]
        kron = (q.unsqueeze(-1).unsqueeze(-3) * q.unsqueeze(-2).unsqueeze(-4)).reshape(hp, nb, b * b, b * b)
        ge = ge.permute(1, 3, 0, 2, 4, 5).reshape(hp, nb, bs * m, b * b)  # (Hp, nb, T, b*b)
        gh = precise_matmul(ge, kron).view(hp, nb, bs * m, b, b)  # Q^T gE Q
        gst, mt = _frechet_block_grads(gh, st, mu, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        gs = None if gst is None else gst.view(hp, nb, bs, m).permute(2, 0, 3, 1).to(s.dtype)  # (Bs, Hp, M, nb)
        if mt is not None:
            qw = q.to(mt.dtype)
            mt = precise_matmul(precise_matmul(qw, mt), qw.transpose(-1, -2)).to(k.dtype)
        return gs, mt


def _frechet_block_grads(gh: Tensor, st: Tensor, mu: Tensor, need_s: bool, need_k: bool
                         ) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of ``E_t = Q expm(s_t D) Q^T`` (``D = blockdiag_n(mu_n J)``) with respect to ``s`` and to ``D``,
    from the gradient of the ``E_t`` written in the basis ``Q``: the exact Frechet derivative of the exponential.

    Args:
        gh: ``(Hp, nb, T, b, b)``: ``Q^T gE_t Q`` for every coordinate ``t`` (for ``y = E x``:
            ``sum (Q^T g)(Q^T x)^T`` over the tokens at ``t``).
        st: ``(Hp, nb, T, 1)`` the scalars ``s_t``; mu: ``(Hp, nb, b/2)`` the plane frequencies.
        need_s, need_k: which gradients to form.

    Returns:
        ``(gs, gd)``: ``gs`` ``(Hp, nb, T)`` and ``gd`` ``(Hp, nb, b, b)``, the gradient with respect to a
        perturbation of the generator in the basis (``Q gd Q^T`` is the one of ``K``); ``None`` where not asked.
        Computed in ``st``'s dtype.

    Every 2x2 block ``(n, m)`` of ``gh`` splits into a part commuting with the plane rotations, ``a I + b J``, and
    an anti-commuting one, ``c Z + e W``; integrating ``expm(-(1 - t) s D) gh expm(-t s D)`` over ``t`` multiplies
    them by ``s sinc(s (mu_n - mu_m) / 2)`` and ``s sinc(s (mu_n + mu_m) / 2)`` phase factors -- finite and exact
    also where frequencies coincide or vanish, where an eigenvector derivative would divide by zero.
    """
    hp, nb, t, b, _ = gh.shape
    h = b // 2
    gh = gh.to(st.dtype).view(hp, nb, t, h, 2, h, 2)  # 2x2 blocks (n, m)
    # (Hp, nb, 2, 2, T, h*h): every later op runs on contiguous (T, h*h) planes, no small broadcast dims
    gh = gh.permute(0, 1, 4, 6, 2, 3, 5).reshape(hp, nb, 2, 2, t, h * h)
    g00, g01, g10, g11 = gh[:, :, 0, 0], gh[:, :, 0, 1], gh[:, :, 1, 0], gh[:, :, 1, 1]  # (Hp, nb, T, h*h)
    ca, cb = (g00 + g11) * 0.5, (g10 - g01) * 0.5  # commuting part a I + b J of block (n, m)
    mu = mu.to(st.dtype)
    gst = gd = None
    if need_s:
        half = st * mu.unsqueeze(-2) * 0.5  # alpha_n = s mu_n / 2: (Hp, nb, T, h)
        ch, sh = torch.cos(half), torch.sin(half)
        diag = torch.arange(h, device=gh.device) * (h + 1)  # (n, n) in the flattened h*h
        ca_d, sa_d = ch * ch - sh * sh, 2.0 * sh * ch  # cos, sin of s mu_n
        da, db = ca[..., diag], cb[..., diag]  # (Hp, nb, T, h)
        # <G^_nn, mu_n J Rot(s mu_n)> = 2 mu_n Im((a + ib) exp(-i s mu_n))
        gst = 2.0 * (mu.unsqueeze(-2) * (db * ca_d - da * sa_d)).sum(-1)  # (Hp, nb, T)
    if need_k:
        aa, ae = (g00 - g11) * 0.5, (g01 + g10) * 0.5  # anti-commuting part c Z + e W
        hd = (mu.unsqueeze(-1) - mu.unsqueeze(-2)).flatten(-2).unsqueeze(-2) * 0.5  # (Hp, nb, 1, h*h)
        hs = (mu.unsqueeze(-1) + mu.unsqueeze(-2)).flatten(-2).unsqueeze(-2) * 0.5  # (mu_n -+ mu_m) / 2
        x1, x2 = st * hd, st * hs  # (Hp, nb, T, h*h)
        c1, s1, c2, s2 = torch.cos(x1), torch.sin(x1), torch.cos(x2), torch.sin(x2)
        # s sinc(s (mu_n -+ mu_m) / 2) = sin(x) / ((mu_n -+ mu_m) / 2), and s where the difference is 0:
        # exact for tiny differences too (sin is accurate relative to its argument), no Taylor branch
        u1 = torch.where(hd == 0, st, s1 / torch.where(hd == 0, torch.ones_like(hd), hd))
        u2 = torch.where(hs == 0, st, s2 / torch.where(hs == 0, torch.ones_like(hs), hs))
        # commuting part times w_c = u1 exp(-i x2); anti-commuting part times conj(w_a) = u2 exp(-i x1)
        zcr = (u1 * (ca * c2 + cb * s2)).sum(2)  # (Hp, nb, h*h)
        zci = (u1 * (cb * c2 - ca * s2)).sum(2)
        zar = (u2 * (aa * c1 + ae * s1)).sum(2)
        zai = (u2 * (ae * c1 - aa * s1)).sum(2)
        gd = torch.stack((zcr + zar, zai - zci, zci + zai, zcr - zar), dim=-1)  # (Hp, nb, h*h, 4): 2x2 blocks
        gd = gd.view(hp, nb, h, h, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(hp, nb, b, b)
    return gst, gd


def scaled_block_exp_matrices(s: Tensor, k: Tensor) -> Tensor:
    """``expm(s_{t,j} K_j)`` for every coordinate ``t`` and block ``j`` (the ``b x b`` blocks only).

    Args:
        s: ``(Hp, M, nb)`` shared by the batch or ``(B, Hp, M, nb)`` per example, float32 or float64 (the angles
            ``s mu`` are formed in float64 either way).
        k: ``(Hp, nb, b, b)`` skew-symmetric block generators, ``b`` even.

    Returns:
        ``(1 | B, Hp, M, nb, b, b)`` in ``k``'s dtype; differentiable in ``s`` and ``k`` (finite at ``k = 0``).
    """
    if s.dim() == 3:
        s = s.unsqueeze(0)  # (1, Hp, M, nb)
    hp = max(s.shape[1], k.shape[0])
    s = s.expand(s.shape[0], hp, *s.shape[2:])
    k = k.expand(hp, *k.shape[1:])
    if k.shape[-1] % 2:
        return torch.linalg.matrix_exp(s.unsqueeze(-1).unsqueeze(-1) * k.unsqueeze(-4)).to(k.dtype)
    return _ScaledBlockExpm.apply(s, k)


def scaled_block_exp_apply(x: Tensor, s: Tensor, k: Tensor) -> Tensor:
    """Apply ``expm(s_{t,j} K_j)`` to block ``j`` of every token ``t`` of ``x`` (ComRoPE's operator).

    Args:
        x: ``(B, H, M, d)``.
        s: ``(Hp, M, nb)`` shared by the batch or ``(B, Hp, M, nb)`` per example: the scalar multiplying
            each block's generator.
        k: ``(Hp, nb, b, b)`` skew-symmetric block generators; ``Hp`` is 1 or ``H``.

    Returns:
        ``(B, H, M, d)``; differentiable in ``x``, ``s`` and ``k`` (finite at ``k = 0``).

    The block exponentials are built once per distinct (coordinate, parameter head, block) -- for an image
    grid shared by the batch that is ``M * nb`` small matrices, never one per example and head -- from one
    real block-diagonalisation per block (``scaled_block_exp_matrices``), then applied with ``block_apply``.
    """
    return block_apply(scaled_block_exp_matrices(s, k), x)


class _BlockEigenRotation(torch.autograd.Function):
    """q and k rotated by ``Q_j^T expm(s_j K_j) Q_j`` block by block after their prefix tokens, computed as RoPE in
    the basis ``Q`` (see ``rotate_in_block_eigenbasis``)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, s: Tensor, gens: Tensor, basis: Tensor, mu: Tensor, coords: Tensor,
                freqs: Tensor, num_prefix_tokens: int, backend: str) -> tuple[Tensor, Tensor]:
        # q, k: (B, H, N, d); s: (Bs, Hp, M, nb) wide; gens, basis: (Hp, nb, b, b); mu: (Hp, nb, h) wide;
        # coords: (M, c) | (B, M, c); freqs: (Hp, c, d/2) wide, = axis weights x mu
        f = freqs[0] if freqs.shape[0] == 1 else freqs
        qo, ko = apply_frequency_rope(q, k, coords, f, num_prefix_tokens=num_prefix_tokens, backend=backend)
        ctx.save_for_backward(q, k, s, gens, basis, mu, coords, f)
        ctx.num_prefix_tokens, ctx.backend = num_prefix_tokens, backend
        return qo, ko

    @staticmethod
    def backward(ctx, gq: Tensor, gk: Tensor):
        q, k, s, gens, basis, mu, coords, f = ctx.saved_tensors
        p0 = ctx.num_prefix_tokens
        need_q, need_k, need_s, need_g = ctx.needs_input_grad[:4]
        if torch.is_grad_enabled():  # a gradient graph is requested: differentiate the dense exponential instead
            with torch.enable_grad():
                inputs = [t for t, n in zip((q, k, s, gens), (need_q, need_k, need_s, need_g)) if n]
                outs = [_block_eigen_reference(x, s, gens, basis, p0) for x in (q, k)]
                grads = iter(torch.autograd.grad(outs, inputs, [gq, gk], create_graph=True, allow_unused=True))
            return tuple(next(grads) if n else None for n in (need_q, need_k, need_s, need_g)) + (None,) * 6
        gx_q = gx_k = g_s = g_gens = None
        if need_q or need_k:  # the transposed rotation: the same angles negated
            gx_q, gx_k = apply_frequency_rope(gq, gk, coords, -f, num_prefix_tokens=p0, backend=ctx.backend,
                                              validate=False)
        if need_s or need_g:
            bs, hp, m, nb = s.shape
            b = basis.shape[-1]
            heads = q.shape[1]
            with torch.autocast(device_type=q.device.type, enabled=False):
                dt = torch.float64 if q.dtype == torch.float64 else torch.float32
                # (Hp, nb, M | (B, M), ., .) batches of outer products summed over the batch and heads sharing the
                # parameters (shared coordinates) or over the heads only (per example): one bmm each for q and k
                order, batch = ((1, 4, 3, 0, 2, 5), hp * nb * m) if bs == 1 else ((1, 4, 0, 3, 2, 5), hp * nb * bs * m)
                gh = None
                for x, g in ((q, gq), (k, gk)):  # sum over the tokens at each coordinate of g x^T in the basis
                    xv, gv = (t[:, :, p0:].to(dt).unflatten(1, (hp, heads // hp)).unflatten(-1, (nb, b))
                              .permute(order).reshape(batch, -1, b) for t in (x, g))  # (batch, B r | r, b)
                    gh = torch.bmm(gv.transpose(1, 2), xv) if gh is None else gh.baddbmm_(gv.transpose(1, 2), xv)
                gh = gh.view(hp, nb, bs * m, b, b)
                st = s.permute(1, 3, 0, 2).reshape(hp, nb, bs * m, 1)  # (Hp, nb, T, 1), T = Bs * M
                gst, gd = _frechet_block_grads(gh, st, mu, need_s, need_g)
            if need_s:
                g_s = gst.view(hp, nb, bs, m).permute(2, 0, 3, 1).to(s.dtype)  # (Bs, Hp, M, nb)
            if need_g:
                qw = basis.to(gd.dtype)
                g_gens = precise_matmul(precise_matmul(qw, gd), qw.transpose(-1, -2)).to(gens.dtype)
        return gx_q, gx_k, g_s, g_gens, None, None, None, None, None, None


def _block_eigen_reference(x: Tensor, s: Tensor, gens: Tensor, basis: Tensor, num_prefix_tokens: int) -> Tensor:
    """Dense form of one output of ``_BlockEigenRotation``: ``Q^T expm(s K) Q`` by ``torch.linalg.matrix_exp``,
    differentiable in ``x``, ``s`` and ``K`` (``Q`` a constant), computed in ``s``'s dtype."""
    bsz, heads, n, d = x.shape
    hp, nb, b = gens.shape[0], gens.shape[1], gens.shape[-1]
    m = n - num_prefix_tokens
    e = torch.linalg.matrix_exp(s.unsqueeze(-1).unsqueeze(-1) * gens.to(s.dtype).unsqueeze(-4))  # (Bs,Hp,M,nb,b,b)
    qw = basis.to(s.dtype).unsqueeze(1)  # (Hp, 1, nb, b, b)
    e = qw.transpose(-1, -2) @ e @ qw
    xv = x[:, :, num_prefix_tokens:].to(s.dtype).reshape(bsz, hp, heads // hp, m, nb, b)
    y = (e.unsqueeze(2) @ xv.unsqueeze(-1)).squeeze(-1).reshape(bsz, heads, m, d).to(x.dtype)
    return torch.cat((x[:, :, :num_prefix_tokens], y), dim=2) if num_prefix_tokens else y


def rotate_in_block_eigenbasis(q: Tensor, k: Tensor, coords: Tensor, axis_weights: Tensor, gens: Tensor,
                               basis: Tensor, mu: Tensor, num_prefix_tokens: int = 0, backend: str = "auto"
                               ) -> tuple[Tensor, Tensor]:
    """Rotate q and k, already written in the eigenbasis of a block-diagonal generator, by ``expm(s_j K_j)`` in
    block ``j``: ``y = Q_j^T expm(s_j(r) K_j) Q_j x``, ``s_j(r) = sum_k r_k axis_weights[k, j]`` -- the per-token
    work of a folded ComRoPE (and one-axis LieRE).

    With ``K_j = Q_j blockdiag_n(mu_{j,n} J) Q_j^T`` (``skew_real_schur``) the value is plain RoPE by the angles
    ``s_j(r) mu_{j,n}`` (``apply_frequency_rope``: the fused kernel where it runs). The gradients are those of
    the exponential itself, not of the eigendecomposition: with respect to ``K`` the exact Frechet derivative
    (``_frechet_block_grads``), so they are exact and finite also where frequencies coincide or vanish (where an
    eigenbasis has no derivative); ``Q`` and ``mu`` are constants. Under ``create_graph`` the backward
    differentiates the dense ``matrix_exp`` form, so second derivatives are exact too.

    Args:
        q, k: ``(B, H, N, d)`` in the basis (``Q_j x`` per block), any float dtype; the first
            ``num_prefix_tokens`` pass unrotated.
        coords: ``(M, c)`` shared by the batch or ``(B, M, c)`` per example, ``M = N - num_prefix_tokens``.
        axis_weights: ``(Hp, c, nb)``, differentiable.
        gens: ``(Hp, nb, b, b)`` the skew blocks ``K``, differentiable; ``Hp`` is 1 or ``H``.
        basis, mu: ``(Hp, nb, b, b)`` and ``(Hp, nb, b/2)`` from ``skew_real_schur(K)`` (constants; float64 for
            exact angles at large coordinates).
        backend: the path of the rotation, as ``apply_frequency_rope``.

    Returns:
        ``(q, k)`` of the same shapes and dtypes (float32 math, float64 for float64 tokens).
    """
    wide = mu.dtype
    s = wide_angles(coords, axis_weights)  # (Hp, M, nb) or (B, Hp, M, nb)
    s = s.unsqueeze(0) if s.dim() == 3 else s  # (Bs, Hp, M, nb)
    mu = mu.detach()
    freqs = (axis_weights.detach().to(wide).unsqueeze(-1) * mu.unsqueeze(1)).flatten(-2)  # (Hp, c, d/2)
    return _BlockEigenRotation.apply(q, k, s, gens, basis.detach(), mu, coords.detach(), freqs, num_prefix_tokens,
                                     backend)


def scaled_block_exp_reference(s: Tensor, k: Tensor) -> Tensor:
    """Dense reference ``blockdiag_j expm(s_j K_j)`` with one ``torch.linalg.matrix_exp`` per token and block.

    Args:
        s: ``(..., Hp, M, nb)``; k: ``(Hp, nb, b, b)``.

    Returns:
        ``(..., Hp, M, d, d)``.
    """
    blocks = torch.linalg.matrix_exp(s.unsqueeze(-1).unsqueeze(-1) * k.unsqueeze(-4))  # (.., Hp, M, nb, b, b)
    return _block_diag(blocks)


def _block_diag(blocks: Tensor) -> Tensor:
    """``(..., nb, b, b)`` -> ``(..., nb * b, nb * b)`` block-diagonal matrices."""
    *lead, nb, b, _ = blocks.shape
    out = blocks.new_zeros(*lead, nb, b, nb, b)
    idx = torch.arange(nb, device=blocks.device)
    out[..., idx, :, idx, :] = blocks.movedim(-3, 0)
    return out.reshape(*lead, nb * b, nb * b)
