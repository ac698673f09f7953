"""Fine-tuning from saved runs: a 2-D checkpoint into an RGB-D model (:func:`init_3d_from_checkpoint`), or any
checkpoint into a model of the same architecture (:func:`init_from_checkpoint`, training's ``init_from``).

The model-to-model part is :mod:`ropekit.nn.finetune` (:func:`init_3d_from_2d`, :func:`logits_match`); this module
adds reading the source from a run folder or a checkpoint file.
"""

from __future__ import annotations

from typing import Dict, List, Mapping

from torch import nn

from ..encodings import PositionEncoding
from ..nn.finetune import init_3d_from_2d, logits_match

__all__ = ["init_3d_from_2d", "init_3d_from_checkpoint", "init_from_checkpoint", "load_source_model", "logits_match"]


def load_source_model(run: str) -> nn.Module:
    """The ``ropekit.nn.VisionTransformer`` saved in a run folder or checkpoint written by ``ropekit train``."""
    from ..nn import VisionTransformer, ViTConfig
    from .checkpoint import load_model_state
    from .run_folder import load_run

    _, ckpt = load_run(run)
    source = VisionTransformer(ViTConfig.from_dict(ckpt["vit_config"], source=f"checkpoint {ckpt['path']}",
                                                   strict=False))
    load_model_state(source, ckpt["model"], source=f"checkpoint {ckpt['path']}")
    return source.eval()


def init_3d_from_checkpoint(model: nn.Module, run: str, *, check: bool = True) -> Dict[str, List[str]]:
    """:func:`init_3d_from_2d` from a run folder or checkpoint file written by ``ropekit train``."""
    return init_3d_from_2d(model, load_source_model(run), check=check)


def _coord_dim(model: nn.Module) -> int:
    return max((m.coord_dim for m in model.modules() if isinstance(m, PositionEncoding)), default=0)


def init_from_checkpoint(model: nn.Module, ckpt: Mapping[str, object]) -> str:
    """Initialise a freshly built ``ropekit.nn.VisionTransformer`` from a loaded ``ropekit train`` checkpoint
    (``--init-from``) and say what was done, in one line.

    A checkpoint of a model without a depth coordinate into an RGB-D model that lifts depth to one goes through
    :func:`init_3d_from_2d` (the first forward pass equals the 2-D model's); anything else loads every tensor
    whose name and shape match and leaves the rest as initialised.
    """
    from ..nn import VisionTransformer, ViTConfig
    from .checkpoint import load_model_state

    src_model = None
    where = ckpt.get("path", "the checkpoint")
    if "vit_config" in ckpt and getattr(getattr(model, "cfg", None), "modality", None) == "rgbd":
        try:
            src_model = VisionTransformer(ViTConfig.from_dict(ckpt["vit_config"],  # type: ignore[arg-type]
                                                              source=f"checkpoint {where}", strict=False))
        except (TypeError, ValueError):
            src_model = None
    if src_model is not None and _coord_dim(src_model) < _coord_dim(model):
        load_model_state(src_model, ckpt["model"], source=f"checkpoint {where}")  # type: ignore[arg-type]
        report = init_3d_from_2d(model, src_model.eval())
        return (f"initialised the 3-D model from the 2-D checkpoint {where} ({len(report['copied'])} copied, "
                f"{len(report['widened'])} encoding tensors widened, "
                f"{len(report['zeroed']) + len(report['depth_lift'])} new set to zero)")
    report = load_model_state(model, ckpt["model"], strict=False,  # type: ignore[arg-type]
                              source=f"checkpoint {where}")
    return (f"initialised {len(report['loaded'])} tensors from {where} ({len(report['missing'])} new, "
            f"{len(report['skipped'])} skipped)")
