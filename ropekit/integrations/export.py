"""Export a folded ropekit image model once and serve it at any image size: ONNX and ``torch.export``.

Shape legend: ``B`` batch, ``C`` input channels (colour, plus depth for RGB-D), ``H, W`` pixels, ``p`` the patch
size.

:func:`export_program` and :func:`export_onnx` fold the model (``ropekit.fold``: a commuting encoding becomes
fixed-frequency RoPE with its basis merged into the q/k projections) and export it with a symbolic height and
width (multiples of the patch size), so the patch grid, the coordinates (``Range`` over the grid, then the
angles' ``Sin`` / ``Cos``) and the absolute embedding's resampling are computed inside the graph for every input
size. :func:`fused_rotary_ops` lists nodes an exporter or optimiser may have fused into a 1-D rotary operator
(ONNX ``RotaryEmbedding``, onnxruntime's ``com.microsoft`` rotary ops): those rotate one position axis and would
silently break a 2-D or 3-D encoding, so :func:`export_onnx` refuses a graph that has one.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, List, Optional, Union

import torch
from torch import Tensor, nn

from .._optional import require
from ..fold import fold

__all__ = ["export_program", "export_onnx", "fused_rotary_ops"]


def _folded(model: nn.Module) -> nn.Module:
    from ..fold import FoldedRoPE

    blocks = getattr(model, "blocks", None)
    if blocks is not None and all(isinstance(getattr(b.attn, "pe", None), FoldedRoPE) for b in blocks):
        return model
    return fold(model)


def _dynamic_shapes(model: nn.Module, example: Tensor, max_pixels: int) -> tuple:
    if example.dim() != 4:
        raise ValueError(f"example must be an image batch (B, C, H, W), got shape {tuple(example.shape)}")
    p = model.cfg.patch_size
    p = p if isinstance(p, int) else int(p[0])
    top = max(2, max_pixels // p)
    gh, gw = torch.export.Dim("grid_h", min=1, max=top), torch.export.Dim("grid_w", min=1, max=top)
    batch = torch.export.Dim("batch", min=1, max=65536) if example.shape[0] > 1 else None  # 1 would specialise
    return ({0: batch, 2: p * gh, 3: p * gw} if batch is not None else {2: p * gh, 3: p * gw},)


def export_program(model: nn.Module, example: Tensor, max_pixels: int = 4096) -> Any:
    """A ``torch.export.ExportedProgram`` of the folded ``model`` with dynamic height and width.

    Args:
        model: a ropekit image model (``ropekit.nn.VisionTransformer``, image or RGB-D) with a commuting encoding,
            folded or not; ``eval()`` it first.
        example: ``(B, C, H, W)`` with ``H, W`` multiples of the patch size (and not 1 patch: a size of 1 is
            specialised by the exporter); ``B >= 2`` makes the batch dynamic too, ``B = 1`` fixes it at 1.
        max_pixels: the largest height and width the program accepts.

    Returns:
        The program; ``program.module()(x)`` runs it on any ``(B, C, p * gh, p * gw)``.
    """
    folded = _folded(model)
    return torch.export.export(folded, (example,), dynamic_shapes=_dynamic_shapes(folded, example, max_pixels))


def fused_rotary_ops(onnx_model: Any) -> List[str]:
    """``domain::op_type`` of every node (subgraphs and functions included) that is a fused rotary operator."""
    found = []
    graphs = [onnx_model.graph] + [f for f in getattr(onnx_model, "functions", [])]
    while graphs:
        g = graphs.pop()
        for node in g.node:
            if "rotary" in node.op_type.lower():
                found.append(f"{node.domain or 'ai.onnx'}::{node.op_type}")
            for attr in node.attribute:
                if attr.g is not None and len(attr.g.node):
                    graphs.append(attr.g)
                graphs.extend(sg for sg in attr.graphs)
    return found


def export_onnx(model: nn.Module, example: Tensor, path: Union[str, Path], max_pixels: int = 4096,
                opset: Optional[int] = None) -> Path:
    """Write one ONNX file of the folded ``model`` that serves any image size (see the module docstring).

    Raises:
        RuntimeError: the exported graph contains a fused rotary operator (which rotates one axis only).
    """
    onnx = require("onnx", "export", "ropekit.integrations.export")
    require("onnxscript", "export", "ropekit.integrations.export")
    folded = _folded(model)
    kw = {} if opset is None else {"opset_version": opset}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's progress notes
        program = torch.onnx.export(folded, (example,), dynamo=True, verbose=False,
                                    dynamic_shapes=_dynamic_shapes(folded, example, max_pixels), **kw)
    path = Path(path)
    program.save(str(path))
    proto = onnx.load(str(path))
    fused = fused_rotary_ops(proto)
    if fused:
        raise RuntimeError(f"the exported graph has fused rotary operators {sorted(set(fused))}: they rotate one "
                           f"position axis and break a 2-D/3-D encoding")
    return path
