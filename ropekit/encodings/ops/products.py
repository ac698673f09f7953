"""Products with a basis that stay float32-accurate where float32 matrix products run in TF32 (CUDA).

Shape legend: ``B`` batch, ``H`` heads, ``Hp`` heads that own a basis (1 or ``H``), ``M`` tokens, ``d`` head
dimension.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["precise_matmul", "basis_change", "reduce_to"]


def reduce_to(t: Tensor, shape: Sequence[int]) -> Tensor:
    """Sum ``t`` over the dimensions that ``shape`` broadcasts (the inverse of broadcasting), in one reduction."""
    lead = t.dim() - len(shape)
    dims = list(range(lead)) + [lead + i for i, n in enumerate(shape) if n == 1 and t.shape[lead + i] != 1]
    if dims:
        t = t.sum(dim=dims, keepdim=True)
    return t.reshape(shape)



def _tf32_round(t: Tensor) -> Tensor:
    """float32 ``t`` truncated to TF32's 10 explicit mantissa bits (exact in a TF32 product)."""
    return (t.view(torch.int32) & -8192).view(torch.float32)


_mm = torch.matmul  # the product the split form is built from (a test substitutes an emulated TF32 one)


def _split_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` from three products whose inputs are exact in TF32: ``ah bh + (al bh + ah bl)``, with
    ``a = ah + al`` (``al`` below 2^-10 of ``a``); error ~2^-20 relative instead of TF32's ~2^-11."""
    ah, bh = _tf32_round(a), _tf32_round(b)
    return _mm(ah, bh) + (_mm(a - ah, bh) + _mm(ah, b - bh))


class _PreciseMatmul(torch.autograd.Function):
    """``a @ b`` (broadcasting) with forward and backward in the split form: independent of TF32 settings."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return _split_matmul(a, b)

    @staticmethod
    def backward(ctx, g: Tensor):
        a, b = ctx.saved_tensors
        mm = _PreciseMatmul.apply if torch.is_grad_enabled() else _split_matmul  # double backward: recorded
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = reduce_to(mm(g, b.transpose(-1, -2)), a.shape)
        if ctx.needs_input_grad[1]:
            gb = reduce_to(mm(a.transpose(-1, -2), g), b.shape)
        return ga, gb


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing Dynamo when ropekit is imported (Dynamo's import
    costs about a second and scans every third-party package): the public decorator only sets this attribute
    (torch 2.11 to 2.14), and ``tests/test_compile_step.py`` fails if a later torch reads another."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _tf32_matmuls() -> bool:
    """Whether float32 products may run in TF32 (read once per trace under ``torch.compile``: Dynamo cannot put
    ``get_float32_matmul_precision``'s string in a graph and broke the graph there on every CUDA model)."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def precise_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``torch.matmul(a, b)`` that stays float32-accurate where float32 products run in TF32.

    On CUDA with TF32 enabled (``torch.backends.cuda.matmul.allow_tf32`` or a float32 matmul precision other
    than ``"highest"``), a float32 product rounds its inputs to 10 mantissa bits (~1e-3 relative); there it is
    computed from three TF32-exact products (``_split_matmul``), forward and backward. Elsewhere it is
    ``torch.matmul``.
    """
    tf32 = _tf32_matmuls()  # read on every device, so that a CPU trace follows the Python a GPU's trace does
    if tf32 and a.is_cuda and a.dtype == torch.float32 and b.dtype == torch.float32:
        return _PreciseMatmul.apply(a, b)
    return torch.matmul(a, b)


def basis_change(x: Tensor, p: Tensor) -> Tensor:
    """``P x`` for every token: ``y_i = sum_j p[h, i, j] x_j``.

    Args:
        x: ``(B, H, M, d)``.
        p: ``(Hp, d, d)`` with ``Hp`` 1 (shared by heads) or ``H``.

    Returns:
        ``(B, H, M, d)``. One GEMM over all tokens when ``P`` is shared by the heads (its gradient is then
        one GEMM too), a batched GEMM per head otherwise; float32-accurate also under TF32 (``precise_matmul``).
    """
    if p.shape[0] == 1:
        return precise_matmul(x, p[0].transpose(0, 1))  # (B, H, M, d) @ (d, d)
    return precise_matmul(x, p.transpose(-1, -2))  # (B, H, M, d) @ (H, d, d)
