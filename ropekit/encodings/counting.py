"""Parameter counts that report what a model learns: encodings count their effective parameters.

LieRE keeps its authors' full ``b x b`` raw matrices of which only the strict upper triangle reaches the
generators, and general / relaxed STRING use full matrices through ``A - A^T``: their stored ``numel`` overstates
what is learned. :func:`count_parameters` counts every parameter of a model once (shared modules and tied
parameters included once), and the parameters owned by a ``PositionEncoding`` by its
``num_effective_parameters()``.
"""

from __future__ import annotations

from torch import nn

from .base import PositionEncoding

__all__ = ["count_parameters"]


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Learned numbers in ``model``: plain parameters by ``numel``, encodings by their effective count.

    Args:
        model: any module (a ViT, a detector, a bare encoding).
        trainable_only: count only parameters with ``requires_grad`` (encodings: their effective count,
            which covers trainable parameters only).

    Returns:
        The count, each shared module or tied parameter counted once.
    """
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, PositionEncoding) and id(module) not in seen:
            seen.add(id(module))
            total += module.num_effective_parameters()
            seen.update(id(p) for p in module.parameters())
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total
