"""The rotation of pairs by angles, and the per-token work of every frequency RoPE with its execution paths (the
PyTorch operations, or the fused Triton kernel of :mod:`ropekit.kernels` where it runs).

Shape legend: ``B`` batch, ``H`` heads, ``N`` tokens, ``M`` tokens that carry a coordinate (``N`` minus the prefix
tokens), ``d`` head dimension (even), ``P = d / 2`` rotation planes ("pairs"), ``c`` coordinate dimension.

Pairs are *interleaved*: pair ``n`` is the two coordinates ``(2n, 2n + 1)`` of a head vector, and
``rotate_pairs`` turns it by the angle ``theta_n`` counter-clockwise::

    [y_2n  ]   [cos t  -sin t] [x_2n  ]
    [y_2n+1] = [sin t   cos t] [x_2n+1]

This is the layout of the original RoFormer and of every 2x2 block-diagonal generator, so that
"block j" and "pair j" are the same thing. The other common layout, HF / Llama's ``rotate_half`` (pair ``n``
is ``(x_n, x_{n + d/2})``), is ``pairs="half"`` in ``rotate_pairs``, ``rotate_angles`` and
``apply_frequency_rope``.

Angles ``theta = r . omega`` are formed by elementwise products and sums (``angles.frequency_angles``), never a
matrix product, whose TF32 rounding on a GPU would cost ~1e-3 relative; the tables are built in float64
(``angles.rope_cos_sin``) so that they stay exact to float32 round-off at any coordinate scale.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Sequence

import torch
from torch import Tensor

from .angles import rotate_pairs_real, wide_dtype, angle_table, frequency_angles
from .products import basis_change, reduce_to
from .validation import check_finite

__all__ = ["BACKENDS", "check_backend", "register_kernels", "rotate_pairs", "rotate_angles", "angle_tables", "apply_frequency_rope",
           "rotate_qk", "fused_kernel", "fused_basis_kernel", "complex_pairs", "slice_loops", "LOOP_MIN_BYTES"]


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
    return rotate_pairs_real(x, cos, sin)


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


def complex_pairs(x: Tensor) -> Tensor:
    """View ``(..., d)`` real as ``(..., d / 2)`` complex (pair ``n`` -> ``x_2n + i x_2n+1``); copies if the
    strides do not allow a view."""
    if x.is_contiguous():  # the common case, without the stride checks below (this runs on every call)
        return torch.view_as_complex(x.view(x.shape[:-1] + (x.shape[-1] // 2, 2)))
    xr = x.unflatten(-1, (-1, 2))  # (..., P, 2)
    if xr.stride(-1) != 1 or xr.storage_offset() % 2 or any(st % 2 for st in xr.stride()[:-1]):
        xr = xr.contiguous()
    return torch.view_as_complex(xr)


#: Smallest leading slice (bytes) for which a CPU backward reduction loops over the batch; smaller slices are
#: reduced in one batched operation, whose single temporary costs less than the loop's dispatch. 256 KiB makes the
#: tiny-ViT training step with learnable frequencies 4-6 % faster on one CPU thread than looping over every batch
#: (``tools/profile_step.py ab PE --what loop-threshold``, docs/bench/cpu-profile-step.txt). Both forms give the same
#: gradients up to the order of summation (tests/test_backward_loops.py); the committed studies' readings hold
#: with it (docs/results/classify/verify-loop-threshold.md).
LOOP_MIN_BYTES = 256 * 1024


def slice_loops(t: Tensor, lead: int = 1) -> bool:
    """Whether backward reductions may loop over the batch: on the CPU, where a fresh temporary of the whole
    tensor's size costs more in page faults than the arithmetic, when each slice (over the first ``lead``
    dimensions) has at least ``LOOP_MIN_BYTES``. On an accelerator each iteration costs kernel launches, so they
    always run as one batched operation."""
    if t.device.type != "cpu" or t.dim() < lead or math.prod(t.shape[:lead]) == 0:
        return False
    return t.numel() // math.prod(t.shape[:lead]) * t.element_size() >= LOOP_MIN_BYTES  # no t[0]: a view op


def _sum_times_conj(a: Tensor, b: Tensor, shape: Sequence[int]) -> Tensor:
    """``sum a * conj(b)`` over the dimensions that ``shape`` broadcasts, without a temporary of ``a``'s size.

    ``a``, ``b``: complex ``(n, ...)`` of equal shapes. On the CPU, computed one leading slice at a time in one
    reused scratch buffer: a fresh buffer of q's size costs more in page faults than the arithmetic does there. On
    an accelerator, where every launch costs several microseconds and a loop over the batch would cost ``4 n``
    launches, it is one product and one reduction. No autograd.
    """
    if a.dim() == len(shape) + 1 and slice_loops(a, lead=2):  # q and k stacked: each as below, summed
        acc = _sum_times_conj(a[0], b[0], shape)
        for i in range(1, a.shape[0]):
            acc = acc + _sum_times_conj(a[i], b[i], shape)
        return acc
    if not slice_loops(a) or a.dim() != len(shape) or a.dim() < 2:
        return reduce_to(a * b.conj_physical(), shape)
    scratch = torch.empty(a.shape[1:], dtype=a.dtype, device=a.device)
    parts, acc = [], None
    for i in range(a.shape[0]):
        torch.conj_physical(b[i], out=scratch)
        part = reduce_to(scratch.mul_(a[i]), shape[1:])
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
        y = torch.view_as_real(complex_pairs(x) * w).flatten(-2)  # (..., d)
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
        gc = complex_pairs(g.contiguous() if need_w else g)  # (..., P)
        gx = gcos = gsin = acc = None
        if not torch.is_grad_enabled():  # first-order backward: no temporary of the input's size
            if need_w:
                acc = _sum_times_conj(gc, complex_pairs(y), w.shape)  # sum g conj(y), shape of w
            if ctx.needs_input_grad[0]:
                gx = torch.view_as_real(gc * w_conj).flatten(-2)
        else:  # double backward: out-of-place, so that autograd records every step
            if ctx.needs_input_grad[0]:
                gx = torch.view_as_real(gc * w_conj).flatten(-2)
            if need_w:
                acc = reduce_to(gc * complex_pairs(y).conj_physical(), w.shape)
        if need_w:
            gw = acc * w / (w.real.square() + w.imag.square())  # = sum g conj(x)
            if ctx.needs_input_grad[1]:
                gcos = reduce_to(gw.real, ctx.cos_shape)
            if ctx.needs_input_grad[2]:
                gsin = reduce_to(gw.imag, ctx.sin_shape)
        return gx, gcos, gsin


class _RotateAngles(torch.autograd.Function):
    """``y = x * exp(i theta)`` per interleaved pair, differentiable in ``x`` and ``theta`` only.

    ``cos`` / ``sin`` (``theta``'s, rounded to ``x``'s dtype, no autograd history) are passed in so that they are
    computed once per table, not per call. Backward: ``gx = g * exp(-i theta)``; ``gtheta = sum Im(g conj(y))``
    over the broadcast dimensions (``dy/dtheta = i y``), from the saved output -- no gradient through cos/sin
    tables, no small-tensor chain. Under double backward every step is recomputed from ``theta`` with
    differentiable operations.

    ``collector`` (optional, from :func:`angle_tables`): a zero tensor of ``theta``'s shape in ``x``'s dtype. When
    given, a first-order backward returns the angle gradient as the collector's (in ``x``'s dtype, as it was
    reduced) and none for ``theta``: the node that made the collector maps the gradients of every rotation using
    one batch of tables to their frequencies at once. A double backward ignores it and differentiates ``theta``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, theta: Tensor, cos: Tensor, sin: Tensor, collector: Tensor | None = None) -> Tensor:
        yc = complex_pairs(x) * torch.complex(cos, sin)  # (..., P) complex
        y = torch.view_as_real(yc).flatten(-2)  # (..., d), a view of yc
        need_theta = ctx.needs_input_grad[1] or (collector is not None and ctx.needs_input_grad[4])
        # the output (for a double backward, which differentiates through it) and its complex form (the same
        # memory: the first-order backward reads it without re-viewing the output)
        ctx.save_for_backward(theta, cos, sin, y if need_theta else None, yc if need_theta else None)
        ctx.collect = collector is not None and ctx.needs_input_grad[4]
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        theta, cos, sin, y, yc = ctx.saved_tensors
        gx = gtheta = None
        if torch.is_grad_enabled():  # double backward: rebuild the rotation from theta, out-of-place
            c, s = torch.cos(theta).to(g.dtype), torch.sin(theta).to(g.dtype)
            gx = _RotateAngles.apply(g, -theta, c, -s) if ctx.needs_input_grad[0] else None
            if ctx.needs_input_grad[1]:
                gy = complex_pairs(g) * complex_pairs(y).conj_physical()
                gtheta = reduce_to(gy.imag, theta.shape).to(theta.dtype)
            return gx, gtheta, None, None, None
        need_theta = ctx.needs_input_grad[1] or ctx.collect
        gc = complex_pairs(g.contiguous() if need_theta and not g.is_contiguous() else g)  # (..., P)
        if ctx.collect:  # sum g conj(y), complex, for the collector's node, which takes Im() once for all rotations
            acc = _collect_times_conj(gc, yc, theta.shape)
            gx = torch.view_as_real(gc * torch.complex(cos, -sin)).flatten(-2) if ctx.needs_input_grad[0] else None
            return gx, None, None, None, acc
        if need_theta:
            gtheta = _sum_times_conj(gc, yc, theta.shape).imag
        if ctx.needs_input_grad[0]:
            gx = torch.view_as_real(gc * torch.complex(cos, -sin)).flatten(-2)
        if gtheta is not None and gtheta.dtype != theta.dtype:
            gtheta = gtheta.to(theta.dtype)
        return gx, gtheta, None, None, None


def _collector_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape in which a rotation hands a table ``(Bs, Hp, M, P)`` its angle gradient through the collector:
    without the leading dimensions of size 1 (shared coordinates, heads sharing frequencies), which a reduction
    that does not keep them drops for free."""
    return tuple(n for i, n in enumerate(shape) if i >= 2 or n != 1)


def _collect_times_conj(a: Tensor, b: Tensor, shape: Sequence[int]) -> Tensor:
    """``sum a * conj(b)`` over the dimensions that ``shape`` ``(Bs, Hp, M, P)`` broadcasts, complex, in
    :func:`_collector_shape`. Where those dimensions lead (shared coordinates; per-example coordinates with
    per-head frequencies) and ``a``, ``b`` are contiguous: one fused dot product per table entry
    (``torch.linalg.vecdot``: no temporary of ``a``'s size, no conjugated copy of ``b``; on the CPU about half
    the time of the forms below). Else the batched form (one product, one reduction) or the CPU's loop for large
    slices."""
    lead = a.dim() - len(shape)
    dims = list(range(lead)) + [lead + i for i in (0, 1) if shape[i] == 1]
    broadcast = any(n == 1 and a.shape[lead + i] != 1 for i, n in enumerate(shape) if i >= 2)
    if (dims == list(range(len(dims))) and not broadcast and a.numel() > 0 and a.is_contiguous()
            and b.is_contiguous()):
        n = math.prod(a.shape[:len(dims)])
        return torch.linalg.vecdot(b.view(n, -1), a.view(n, -1), dim=0).view(a.shape[len(dims):])  # sum conj(b) a
    if slice_loops(a, lead + 1) or broadcast:
        return _sum_times_conj(a, b, shape).reshape(_collector_shape(shape))
    return (a * b.conj_physical()).sum(dim=dims)


class _AngleGradientCollector(torch.autograd.Function):
    """Zeros ``(L, *S)`` (complex; ``S`` the :func:`_collector_shape` of a table ``(1 | B, Hp, M, P)``) that the
    rotations using a batch of :func:`angle_tables` take as an input: each hands it ``sum g conj(y)`` of its own
    table (autograd stacks them, one operation for all), whose imaginary part is its angle gradient, and the
    backward here maps them to the frequencies ``(L, Hp, c, P)`` and the coordinates in one product -- the angles
    ``theta_l = r . freqs_l`` are linear in both, so this equals differentiating each table on its own."""

    @staticmethod
    def forward(ctx, coords: Tensor, freqs: Tensor, dtype: torch.dtype) -> Tensor:
        # coords (M, c) | (B, M, c) wide; freqs (L, Hp, c, P) wide
        ctx.save_for_backward(coords, freqs)
        n, hp, _, p = freqs.shape
        ctx.table_shape = (n, 1 if coords.dim() == 2 else coords.shape[0], hp, coords.shape[-2], p)
        cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        return torch.zeros(n, *_collector_shape(ctx.table_shape[1:]), dtype=cdtype, device=coords.device)

    @staticmethod
    def backward(ctx, g: Tensor):
        coords, freqs = ctx.saved_tensors
        g = g.imag.reshape(ctx.table_shape).to(freqs.dtype)  # (L, Bs, Hp, M, P): the angle gradients
        g_coords = g_freqs = None
        if ctx.needs_input_grad[1]:  # sum over the batch and the tokens: (L, Hp, c, P), the parameters' layout
            if coords.dim() == 2:
                g_freqs = torch.einsum("lbhmp,mc->lhcp", g, coords).contiguous()
            else:
                g_freqs = torch.einsum("lbhmp,bmc->lhcp", g, coords).contiguous()
        if ctx.needs_input_grad[0]:  # sum over the tables, heads and pairs: (M, c) | (B, M, c)
            g_coords = torch.einsum("lbhmp,lhcp->bmc", g, freqs)
            g_coords = g_coords[0] if coords.dim() == 2 else g_coords
        return g_coords, g_freqs, None


def angle_tables(coords: Tensor, freqs: Sequence[Tensor] | Tensor, dtype: torch.dtype, validate: bool = True
                 ) -> list[tuple[Tensor, Tensor, Tensor, Tensor | None]]:
    """The angle tables of several frequency matrices on the same coordinates (e.g. the per-layer encodings of a
    model), formed together: one product for all angles, one cos and one sin, and -- when a gradient is needed --
    one node that maps every rotation's angle gradient back to all the frequencies at once.

    Args:
        coords: ``(M, c)`` shared by the batch or ``(B, M, c)`` per example.
        freqs: ``L`` frequency matrices ``(Hp, c, P)`` of one shape (any real dtypes, differentiable), or one
            tensor ``(L, Hp, c, P)`` holding them (a stacked form's frequencies, ``fold.rope_forms_stacked``).
        dtype: the rotation's compute dtype (float32, or float64 for float64 tokens).
        validate: check ``coords`` for NaN and infinity (as :func:`apply_frequency_rope`), once for all tables.

    Returns:
        ``L`` tables ``(theta, cos, sin, collector)`` for ``rotate_angles`` / ``apply_frequency_rope(table=...)``:
        ``theta`` ``(1 | B, Hp, M, P)`` in the wide dtype (``angles.angle_table``'s values, differentiable for
        double backward), cos/sin in ``dtype``, and ``collector`` (``None`` when no gradient is needed) through
        which a first-order backward reaches the frequencies and coordinates. Values and gradients equal
        ``angles.angle_table`` of each matrix alone (up to the order of summation).
    """
    stacked = isinstance(freqs, Tensor)
    n = freqs.shape[0] if stacked and freqs.dim() == 4 else len(freqs)
    if n == 0:
        return []
    if validate:
        check_finite(coords)
    shapes = {tuple(freqs.shape[1:])} if stacked else {tuple(f.shape) for f in freqs}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3:
        raise ValueError(f"angle_tables needs frequency matrices (Hp, c, P) of one shape, got {sorted(shapes)}")
    wide = wide_dtype(coords.device)
    with torch.autocast(device_type=coords.device.type, enabled=False):
        f = freqs if stacked else freqs[0].unsqueeze(0) if n == 1 else torch.stack(list(freqs))  # (L, Hp, c, P)
        f = f if f.dtype == wide else f.to(wide)
        hp = f.shape[1]
        r = coords if coords.dtype == wide else coords.to(wide)
        theta = frequency_angles(r, f.flatten(0, 1))  # (L Hp, M, P) | (B, L Hp, M, P)
        theta = theta.unflatten(0, (n, 1, hp)) if theta.dim() == 3 else theta.unflatten(1, (n, hp)).transpose(0, 1)
        with torch.no_grad():  # (L, 1 | B, Hp, M, P)
            cos, sin = torch.cos(theta).to(dtype), torch.sin(theta).to(dtype)
        collectors: Sequence[Tensor | None] = [None] * n
        # (compiled, the rotation takes theta's own gradient in real arithmetic: no complex collector there)
        if torch.is_grad_enabled() and (f.requires_grad or r.requires_grad) and not _is_compiling():
            collectors = _AngleGradientCollector.apply(r, f, dtype).unbind(0)
    return list(zip(theta.unbind(0), cos.unbind(0), sin.unbind(0), collectors))


def rotate_angles(x: Tensor, theta: Tensor, cos: Tensor | None = None, sin: Tensor | None = None,
                  pairs: str = "interleaved", collector: Tensor | None = None) -> Tensor:
    """Rotate each pair of ``x`` by ``theta``; differentiable in ``x`` and ``theta``.

    Args:
        x: ``(..., d)`` float32 or float64 (the compute dtype).
        theta: ``(..., d / 2)`` broadcastable against ``x``'s leading dimensions, any float dtype (float64 for
            exact tables, see ``rope_cos_sin``).
        cos, sin: optional ``cos(theta)`` / ``sin(theta)`` in ``x``'s dtype, already computed (treated as
            constants: the gradient reaches ``theta`` directly).
        pairs: ``"interleaved"`` or ``"half"`` (see ``rotate_pairs``).
        collector: from :func:`angle_tables` (with ``cos`` and ``sin``): the angle gradient goes to it instead.

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
        cos, sin = (t.detach() if t.requires_grad else t for t in (cos, sin))  # (constants; no op when they are)
        return _RotateAngles.apply(x, theta, cos, sin, collector)
    return rotate_pairs(x, torch.cos(theta).to(x.dtype), torch.sin(theta).to(x.dtype), pairs)


def _transform_prefix(head: Tensor, prefix: Tensor) -> Tensor:
    """The prefix tokens ``head`` ``(..., P0, d)`` transformed by a folded encoding's ``prefix`` ``(Hp, d, d)``
    (``basis_change``), in ``head``'s dtype -- the one place both rotation paths apply it."""
    return basis_change(head, prefix if prefix.dtype == head.dtype else prefix.to(head.dtype))


def _rotate_tokens(x: Tensor, table: tuple, num_prefix_tokens: int, pairs: str,
                   prefix: Tensor | None = None) -> Tensor:
    """Rotate ``x`` ``(..., B, H, N, d)`` after its prefix tokens, math in the table's dtype, output in ``x``'s;
    ``table`` is ``(theta, cos, sin)`` or :func:`angle_tables`' ``(theta, cos, sin, collector)``. ``prefix``
    ``(Hp, d, d)``: the prefix tokens are transformed by it (``basis_change``) instead of passed through -- in the
    concatenation that assembles the output anyway, so it costs a product over the ``P0`` prefix tokens only."""
    theta, cos, sin = table[:3]
    collector = table[3] if len(table) > 3 else None
    with torch.autocast(device_type=x.device.type, enabled=False):
        xr = x[..., num_prefix_tokens:, :] if num_prefix_tokens else x
        xr = xr if xr.dtype == cos.dtype else xr.to(cos.dtype)
        y = rotate_angles(xr, theta, cos, sin, pairs, collector)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        if not num_prefix_tokens:
            return y
        head = x[..., :num_prefix_tokens, :]  # (..., B, H, P0, d)
        if prefix is not None:
            head = _transform_prefix(head, prefix)
        return torch.cat((head, y), dim=-2)


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
    kernel = fused_kernel(q.device, traceable=True, backend=check_backend(backend))
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


def rotate_qk(qk: Tensor, coords: Tensor, freqs: Tensor, *, table: tuple | None = None, num_prefix_tokens: int = 0,
              pairs: str = "interleaved", backend: str = "auto", validate: bool = True,
              prefix: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`apply_frequency_rope` for q and k held in one tensor -- the two leading slices of an attention layer's
    fused projection output, ``(3, B, H, N, d)`` split as ``(2, B, H, N, d)`` and ``(1, B, H, N, d)`` -- rotated
    together: one product, and in the backward pass one rotation and one angle-gradient reduction, instead of one
    each for q and for k.

    Args:
        qk: ``(2, B, H, N, d)``: q, then k (any strides).
        coords, num_prefix_tokens, pairs, backend, validate: as :func:`apply_frequency_rope` (keys share the
            queries' coordinates and length).
        freqs: ``(c, d/2)``, or ``(Hp, c, d/2)`` with ``Hp`` 1 (shared by heads) or ``H``.
        table: the angle table of ``coords`` and ``freqs`` already formed (:func:`angle_tables`, which checked the
            coordinates), or ``None``. Where the fused kernel runs it is not used (the kernel forms the angles
            itself).
        prefix: ``(Hp, d, d)`` applied to the ``num_prefix_tokens`` leading tokens of q and k (a folded encoding's
            prefix transform, ``RoPEForm.prefix``) instead of passing them through, or ``None``. On the PyTorch path
            it is applied inside the concatenation that assembles the rotated tokens (no further copy of q and k).

    Returns:
        ``(q, k)``, each ``(B, H, N, d)`` in ``qk``'s dtype, equal to :func:`apply_frequency_rope`'s.

    Raises:
        ValueError: as :func:`apply_frequency_rope`.
    """
    if qk.dim() != 5 or qk.shape[0] != 2:
        raise ValueError(f"qk must be (2, B, H, N, d), got {tuple(qk.shape)}")
    kernel = fused_kernel(qk.device, traceable=True, backend=check_backend(backend))
    if kernel is not None or table is None:
        freqs = freqs[0] if freqs.dim() == 3 and freqs.shape[0] == 1 else freqs  # (c, d/2) shared or (H, c, d/2)
    if prefix is not None and (prefix.dim() != 3 or prefix.shape[-2:] != (qk.shape[-1], qk.shape[-1])
                               or prefix.shape[0] not in (1, qk.shape[2])):
        raise ValueError(f"prefix must be (1 or {qk.shape[2]}, {qk.shape[-1]}, {qk.shape[-1]}), "
                         f"got {tuple(prefix.shape)}")
    if kernel is not None:
        if prefix is not None and num_prefix_tokens:
            p0 = num_prefix_tokens
            qk = torch.cat([_transform_prefix(qk[..., :p0, :], prefix), qk[..., p0:, :]], dim=-2)
        q, k = qk.unbind(0)
        return apply_frequency_rope(q, k, coords, freqs, num_prefix_tokens=num_prefix_tokens, pairs=pairs,
                                    backend=backend, validate=validate)
    if table is None:
        f = _check_rope_args(qk[0], qk[1], coords, freqs, None, num_prefix_tokens, pairs)
        table = angle_table(coords, f, torch.float64 if qk.dtype == torch.float64 else torch.float32)
        if validate:
            check_finite(coords)
    else:  # the coordinates were checked where the table was formed (angle_tables)
        m, d = qk.shape[-2] - num_prefix_tokens, qk.shape[-1]
        if coords.shape[-2] != m or freqs.shape[-1] * 2 != d or table[0].shape[-2:] != (m, d // 2):
            raise ValueError(f"the table {tuple(table[0].shape)}, freqs {tuple(freqs.shape)} and coords "
                             f"{tuple(coords.shape)} do not fit qk {tuple(qk.shape)} with {num_prefix_tokens} "
                             f"prefix tokens")
    q, k = _rotate_tokens(qk, table, num_prefix_tokens, pairs, prefix).unbind(0)
    return q, k


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


def register_kernels(module) -> None:
    """Make ``module`` (``ropekit.kernels``; ``import ropekit`` registers it) the fused kernels every execution path
    asks. Registered at import, not on first use: a module-level cache filled while ``torch.compile`` traces fails
    the graph's guard at the next call and compiles the model again."""
    _KERNELS[:] = [module]


def _kernel_reason(device: torch.device) -> str | None:
    """Why the fused rotation kernel cannot run on ``device``, or None when it can (its check never raises here:
    a broken install is a reason like any other)."""
    if not _KERNELS:  # ropekit.kernels imports ropekit.encodings, so the package registers it (register_kernels)
        from ... import kernels  # noqa: PLC0415,F401 -- importing it registers it

        register_kernels(kernels)
    kernels = _KERNELS[0]
    try:
        if kernels.available(device):
            return None
        return kernels.unavailable_reason(device)
    except Exception as e:  # noqa: BLE001 -- reported to the caller, which warns or raises
        return f"checking the kernels raised {type(e).__name__}: {' '.join(str(e).split())}"


def fused_kernel(device: torch.device, traceable: bool = False, backend: str = "auto"):
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


def fused_basis_kernel(x: Tensor, basis: Tensor, coords: Tensor, freqs: Tensor, backend: str = "auto"):
    """``ropekit.kernels.fused_basis_rotary`` where it handles these arguments (the rotation kernel is chosen by
    ``backend`` for their device, see :func:`fused_kernel`, and ``kernels.basis_rotary_supported`` accepts them)
    outside ``torch.compile``, else None."""
    kernels = _KERNELS[0] if fused_kernel(x.device, backend=backend) is not None else None
    if kernels is None or not kernels.basis_rotary_supported(x, basis, coords, freqs):
        return None
    return kernels.fused_basis_rotary
