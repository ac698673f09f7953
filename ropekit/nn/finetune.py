"""Fine-tuning a 2-D checkpoint into an RGB-D model with a 3-D encoding, starting from the same function.

Shape legend: ``Hp`` heads that own encoding parameters, ``c`` coordinate dimension (2 -> 3), ``d`` head dimension.

:func:`init_3d_from_2d` loads a 2-D model (RGB, 2-D encoding or none) into a 3-D one (RGB-D with the depth lift
``z = a * mean_depth + b``, 3-D encoding) so that the first forward pass of the 3-D model on RGB-D input equals
the 2-D model's on the same input:

* every tensor with the same name and shape is copied;
* an encoding parameter that carries the coordinate axis (size 2 -> 3: RoPE-Mixed / Cayley frequencies
  ``(Hp, c, d/2)``, Circulant columns, LieRE generators, ComRoPE-LD scales) gets the 2-D values in its ``y, x``
  slices; the new ``z`` slice keeps its fresh initialisation, so that depth can be learnt;
* the depth lift starts at ``a = b = 0``: every patch has ``z = 0``, where the ``z`` generator does nothing;
* encoding parameters the checkpoint does not have are set to zero -- the new encoding starts as the identity
  when the checkpoint had no rotary encoding (``none`` or an absolute embedding), and Cayley's basis starts at
  ``P = I`` when the checkpoint was RoPE-Mixed. (From a checkpoint without a rotary encoding, the zero ``z``
  generator and the zero depth lift give each other no gradient: depth then enters only once the ``y, x``
  generators have moved; start from a rotary checkpoint to learn depth at once.)
* any other tensor that grew along exactly one axis keeps the old slice and zeros the rest (the patch embedding of
  a model that takes depth as an extra input channel: the depth channel starts with zero weights).

Given the 2-D *model* (not only its ``state_dict``), the result is checked: every 3-D encoding at ``z = 0`` must give
the 2-D encoding's logits (axial RoPE, whose fixed pairs are split over 3 axes instead of 2, and ComRoPE-AP, whose
blocks are dealt to the axes in turn, cannot, and raise ``ValueError``).

Example::

    model3d = VisionTransformer(vit_config(..., modality="rgbd", depth_input="coord", pe="cayley"))
    report = init_3d_from_2d(model3d, model2d)
    # from a run folder or a checkpoint file: ropekit.train.finetune.init_3d_from_checkpoint(model3d, "runs/mnist-2d")
"""

from __future__ import annotations

import copy
from typing import Dict, List, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from ..encodings import PositionEncoding
from .depth import DepthLift

__all__ = ["init_3d_from_2d", "logits_match"]


def _owner(key: str) -> str:
    return key.rpartition(".")[0]


def _grown_axis(src: Tensor, dst: Tensor) -> Optional[int]:
    """The one axis along which ``dst`` is larger than ``src`` (all others equal), else ``None``."""
    if src.dim() != dst.dim():
        return None
    diff = [i for i, (a, b) in enumerate(zip(src.shape, dst.shape)) if a != b]
    if len(diff) == 1 and src.shape[diff[0]] < dst.shape[diff[0]]:
        return diff[0]
    return None


def logits_match(pe3d: PositionEncoding, pe2d: Optional[PositionEncoding], *, tol: float = 1e-6,
                 num_tokens: int = 9) -> bool:
    """Whether ``pe3d`` at ``(y, x, 0, ...)`` gives the logits of ``pe2d`` at ``(y, x)`` -- or, for ``pe2d=None``,
    whether ``pe3d`` leaves every logit unchanged at any coordinate -- on random queries, keys and coordinates, in
    float64."""
    gen = torch.Generator().manual_seed(0)
    h, d = pe3d.num_heads, pe3d.head_dim
    q = torch.randn(1, h, num_tokens, d, generator=gen, dtype=torch.float64)
    k = torch.randn(1, h, num_tokens, d, generator=gen, dtype=torch.float64)
    coords = torch.randn(num_tokens, pe3d.coord_dim, generator=gen, dtype=torch.float64) * 5
    if pe2d is not None:
        coords[:, pe2d.coord_dim:] = 0.0  # the new axes at zero
    with torch.no_grad():
        q3, k3 = copy.deepcopy(pe3d).double().cpu()(q, k, coords)
        ref = q @ k.transpose(-1, -2)
        if pe2d is not None:
            q2, k2 = copy.deepcopy(pe2d).double().cpu()(q, k, coords[:, :pe2d.coord_dim])
            ref = q2 @ k2.transpose(-1, -2)
    got = q3 @ k3.transpose(-1, -2)
    return bool((got - ref).abs().max() <= tol * max(1.0, float(ref.abs().max())))


def init_3d_from_2d(model: nn.Module, source: Union[nn.Module, Mapping[str, Tensor]], *,
                    check: bool = True) -> Dict[str, List[str]]:
    """Initialise the 3-D ``model`` from a 2-D ``source`` model or ``state_dict`` (see the module docstring).

    Args:
        model: the RGB-D model with a 3-D encoding (e.g. a ``ropekit.nn.VisionTransformer`` with
            ``modality="rgbd"``), modified in place.
        source: the 2-D model, or its ``state_dict``.
        check: with a source *model*, verify that every encoding of ``model`` at ``z = 0`` reproduces the source's
            encoding of the same name (or the identity where the source has none).

    Returns:
        Names per action: ``copied``, ``widened`` (encoding parameters, new slices freshly initialised), ``grown``
        (other tensors, new slices zero), ``zeroed`` (encoding parameters new in ``model``), ``depth_lift``,
        ``missing`` (other new tensors, left as initialised) and ``skipped`` (source tensors ``model`` lacks).

    Raises:
        ValueError: a tensor whose shape cannot be mapped, or (``check``) an encoding that cannot reproduce the 2-D
            one at ``z = 0``.
    """
    state = source.state_dict() if isinstance(source, nn.Module) else dict(source)
    modules = dict(model.named_modules(remove_duplicate=False))  # a shared encoding under every block's name
    pe_names = {n for n, m in modules.items() if isinstance(m, PositionEncoding)}
    lift_names = {n for n, m in modules.items() if isinstance(m, DepthLift)}
    own = model.state_dict()  # tensors share storage with the model: in-place copies update it
    report: Dict[str, List[str]] = {k: [] for k in ("copied", "widened", "grown", "zeroed", "depth_lift", "missing",
                                                    "skipped")}
    with torch.no_grad():
        for key, dst in own.items():
            owner = _owner(key)
            in_pe = any(owner == p or owner.startswith(p + ".") for p in pe_names)
            if owner in lift_names:
                dst.zero_()
                report["depth_lift"].append(key)
            elif key in state:
                src = state[key].to(dst.device, dst.dtype)
                if src.shape == dst.shape:
                    dst.copy_(src)
                    report["copied"].append(key)
                    continue
                axis = _grown_axis(src, dst)
                if axis is None:
                    raise ValueError(f"cannot map {key}: {tuple(src.shape)} in the 2-D model, {tuple(dst.shape)} in "
                                     f"the 3-D one (only one axis may grow, e.g. the coordinate axis 2 -> 3)")
                if in_pe and (src.shape[axis], dst.shape[axis]) != (2, 3):
                    raise ValueError(f"cannot map encoding parameter {key}: {tuple(src.shape)} -> {tuple(dst.shape)} "
                                     f"(the same encoding and head sizes are needed; only c may go 2 -> 3)")
                if not in_pe:
                    dst.narrow(axis, src.shape[axis], dst.shape[axis] - src.shape[axis]).zero_()
                dst.narrow(axis, 0, src.shape[axis]).copy_(src)
                report["widened" if in_pe else "grown"].append(key)
            elif in_pe:
                if dst.is_floating_point():
                    dst.zero_()
                report["zeroed"].append(key)
            else:
                report["missing"].append(key)
        report["skipped"] = sorted(set(state) - set(own))
    if check and isinstance(source, nn.Module):
        src_modules = dict(source.named_modules(remove_duplicate=False))
        for name in sorted(pe_names):
            pe3 = modules[name]
            pe2 = src_modules.get(name)
            pe2 = pe2 if isinstance(pe2, PositionEncoding) else None
            if pe2 is not None and pe2.coord_dim >= pe3.coord_dim:
                continue
            if not logits_match(pe3, pe2):
                what = f"the 2-D {pe2.name!r} encoding" if pe2 is not None else "the identity"
                raise ValueError(f"{name}: the 3-D {pe3.name!r} encoding at z = 0 does not reproduce {what} (axial "
                                 f"RoPE splits its fixed pairs over 3 axes, ComRoPE-AP deals its blocks to the axes "
                                 f"in turn): the first forward pass would differ from the 2-D model's")
    return {k: sorted(set(v)) for k, v in report.items()}
