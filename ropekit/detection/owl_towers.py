"""The two towers of an open-vocabulary detector: from a contrastive (retrieval) checkpoint, or from scratch.

A contrastive model is a vision tower (a :class:`~ropekit.nn.VisionTransformer`, pooled, then projected into the
shared space) and a text tower (:class:`~ropekit.nn.text.TextTransformer`, pooled, then projected).  The detector
keeps the vision tower's tokens unpooled (its class head starts at the image projection) and the text tower
with its projection, so that query embeddings live where the contrastive training put the captions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..nn import VisionTransformer, vit_config
from .owl import OwlDetector

__all__ = ["Towers", "ProjectedText", "build_detector", "load_towers", "scratch_towers", "towers_from_config",
           "towers_from_retrieval", "pretrain_towers", "SCRATCH_DEFAULTS"]

#: The from-scratch towers' settings (any of them may be given in ``towers_from_config``'s ``spec``).
SCRATCH_DEFAULTS: Dict[str, Any] = {"pe": "cayley", "input": "rgb", "image_size": 32, "patch_size": 4,
                                    "vit": {"embed_dim": 96, "depth": 4, "num_heads": 2},
                                    "text": {"embed_dim": 64, "depth": 2, "num_heads": 2}, "embed_dim": 64}


@dataclass
class Towers:
    """A vision tower, a text tower with its tokenizer, the text embedding width and the vision input
    (``"rgb"`` / ``"rgbd"``) -- what an :class:`OwlDetector` is built from.  ``tokenize(list of str) -> (Q, L)``
    token ids.  ``vision_proj``: the contrastive model's projection of pooled image features into the text space
    (``D -> E``), copied into the class head when given."""

    vision: nn.Module
    text: nn.Module
    tokenize: Callable[[List[str]], Tensor]
    embed_dim: int
    input: str
    vision_proj: Optional[nn.Linear] = None
    source: str = "scratch"
    colour_stats: Optional[Tuple[Sequence[float], Sequence[float]]] = None


def build_detector(towers: Towers, boxes: str, head_hidden: int = 0) -> OwlDetector:
    """An :class:`OwlDetector` on ``towers``; its class head starts at the contrastive projection when there is
    one (OWL-ViT reuses the image-text projection), so a token's first class embedding is its projected
    feature."""
    model = OwlDetector(towers.vision, towers.text, towers.embed_dim, boxes=boxes, input=towers.input,
                        head_hidden=head_hidden, colour_stats=towers.colour_stats)
    proj = towers.vision_proj
    if proj is not None and tuple(proj.weight.shape) == tuple(model.heads.class_embed.weight.shape):
        with torch.no_grad():
            model.heads.class_embed.weight.copy_(proj.weight)
            if proj.bias is not None:
                model.heads.class_embed.bias.copy_(proj.bias)
            else:
                model.heads.class_embed.bias.zero_()
    return model


class ProjectedText(nn.Module):
    """A text tower followed by its projection into the shared space: ids ``(Q, L)`` -> ``(Q, E)``."""

    def __init__(self, tower: nn.Module, proj: nn.Module) -> None:
        super().__init__()
        self.tower, self.proj = tower, proj

    def no_weight_decay(self) -> set:
        return {f"tower.{n}" for n in self.tower.no_weight_decay()} if hasattr(self.tower, "no_weight_decay") else set()

    def forward(self, ids: Tensor) -> Tensor:
        return self.proj(self.tower(ids))


def _vision(pe: str, input: str, image_size: int, patch_size: int, **vit: Any) -> VisionTransformer:
    modality = "image" if input == "rgb" else "rgbd"
    extra = {} if input == "rgb" else {"depth_input": "auto"}
    return VisionTransformer(vit_config("tiny", num_classes=0, in_chans=3, image_size=(image_size, image_size),
                                        patch_size=patch_size, pe=pe, modality=modality, cls="none",
                                        **{**extra, **vit}))


def towers_from_config(spec: Dict[str, Any]) -> Towers:
    """Towers from scratch: :data:`SCRATCH_DEFAULTS` updated by ``spec`` (the no-pretraining control)."""
    from ..data.text import Tokenizer
    from ..nn.text import TextConfig, TextTransformer

    unknown = sorted(set(spec) - set(SCRATCH_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown tower setting(s) {', '.join(unknown)}; known: {', '.join(SCRATCH_DEFAULTS)}")
    s = {**SCRATCH_DEFAULTS, **spec}
    vision = _vision(s["pe"], s["input"], s["image_size"], s["patch_size"], **s["vit"])
    tok = Tokenizer()
    text = TextTransformer(TextConfig(vocab_size=tok.vocab_size, context_length=tok.context_length, **s["text"]))
    e = int(s["embed_dim"])
    return Towers(vision, ProjectedText(text, nn.Linear(text.embed_dim, e)), tok, e, s["input"],
                  vision_proj=nn.Linear(vision.cfg.embed_dim, e), source="scratch")


def towers_from_retrieval(path: Union[str, Path]) -> Towers:
    """The towers of a ``retrieval`` run folder or checkpoint (:func:`ropekit.multimodal.train.load_retrieval_run`):
    its vision tower and image projection, its text tower with the text projection, its tokenizer, and the colour
    statistics its images were standardised with (recomputed from its data settings when it trained with
    ``normalize``)."""
    from ..multimodal.train import load_retrieval_run

    dual, tok, rcfg = load_retrieval_run(path)
    dual.train()
    return Towers(dual.vision, ProjectedText(dual.text, dual.text_proj), tok, int(dual.text_proj.out_features),
                  "rgbd" if dual.vision.cfg.modality == "rgbd" else "rgb", vision_proj=dual.vision_proj,
                  source=str(path), colour_stats=_colour_stats(rcfg.train.to_nested()))


def _colour_stats(train_config: Dict[str, Any]) -> Optional[Tuple[Sequence[float], Sequence[float]]]:
    """The per-channel mean and std a ``ropekit train`` run (its ``train`` section, any form) standardised its
    images with (``None`` without ``normalize``): recomputed by loading its data."""
    from ..classification.config import TrainConfig
    from ..classification.trainer import load_data

    tc = TrainConfig.from_dict(train_config, source="the contrastive run", strict=False)
    if not tc.data.normalize:
        return None
    _, _, info = load_data(tc)
    if info.mean is None:
        return None
    return tuple(info.mean)[:3], tuple(info.std)[:3]


def pretrain_towers(encoding: str, input: str, seed: int, *, data: Dict[str, Any], towers: Dict[str, Any],
                    schedule: Dict[str, Any], run_dir: Union[str, Path], device: str = "cpu",
                    threads: int = 1) -> Dict[str, Any]:
    """Train the contrastive model whose towers an open-vocabulary detector starts from (``ropekit train --task
    retrieval`` on captioned scenes) into ``run_dir``; returns its final metrics row.

    ``encoding``: the vision tower's ``pe``; ``input``: ``"rgb"`` (an RGB ViT: the depth channel ignored) or
    ``"rgbd"`` (ViTD: depth as the third coordinate of a rotary encoding, as an input channel for APE);
    ``data``: the owl recipe's scene settings (scene counts, size, objects, seed; the contrastive split uses
    the same digits and generation seeds as :func:`~ropekit.detection.owl_task.load_scenes`); ``towers``: patch
    size, vision width / depth / heads / MLP ratio, joint width and text width / depth / heads; ``schedule``:
    epochs, batch size, lr, weight decay, warm-up epochs, min lr, gradient clipping.  Images are not
    standardised (colours in ``[0, 1]``, as the detector reads them).
    """
    from ..multimodal.train import RetrievalConfig, RetrievalOptions, train_retrieval
    from ..classification.config import TrainConfig
    from .model import is_rotary

    if input not in ("rgb", "rgbd"):
        raise ValueError(f"input must be 'rgb' or 'rgbd'; got {input!r}")
    depth_input = "ignore" if input == "rgb" else ("coord" if is_rotary(encoding) else "channel")
    opts = {k: data[k] for k in ("num_train", "num_test", "min_objects", "max_objects", "shape_fraction")}
    tc = TrainConfig.from_dict(dict(data="captioned-scenes", data_options={**opts, "seed": int(data["seed"])},
                     image_size=int(data["image_size"]), split_seed=int(data["seed"]), normalize=False,
                     model="tiny", patch_size=int(towers["patch_size"]), pe=encoding, depth_input=depth_input,
                     model_options={"embed_dim": towers["width"], "depth": towers["depth"],
                                    "num_heads": towers["heads"], "mlp_ratio": towers["mlp_ratio"]},
                     augment_shift=0, seed=int(seed), out=str(run_dir), device=device, threads=threads or None,
                     progress=False, tensorboard=False, **schedule))
    ro = RetrievalOptions(embed_dim=int(towers["embed_dim"]), text_width=int(towers["text_width"]),
                          text_depth=int(towers["text_depth"]), text_heads=int(towers["text_heads"]), num_queries=0)
    result = train_retrieval(RetrievalConfig(tc, ro), quiet=True)
    if result.interrupted:
        raise KeyboardInterrupt(f"contrastive pretraining interrupted; checkpoint saved in {run_dir}")
    return {k: v for k, v in (result.final or {}).items() if isinstance(v, (int, float))}


def _checkpoint_task(ckpt: Dict[str, Any]) -> str:
    """The task that wrote a loaded checkpoint (``"classification"`` for ``ropekit train``'s default)."""
    if "task" in ckpt and isinstance(ckpt["task"], str):
        return ckpt["task"]
    for key, name in (("retrieval_options", "retrieval"), ("owl_config", "owl"), ("det_train_config", "detection"),
                      ("policy_config", "robot")):
        if key in ckpt:
            return name
    return "classification" if "vit_config" in ckpt else "unknown"


def load_towers(path: Union[str, Path]) -> Towers:
    """The towers of a contrastive run (a ``retrieval`` run folder or checkpoint).

    Raises:
        FileNotFoundError: no such path. CheckpointError: unreadable. ValueError: a checkpoint of another task
            (one line, naming it).
    """
    from ..train.checkpoint import load_checkpoint

    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"contrastive run not found: {p}")
    ckpt = load_checkpoint(p)
    task = _checkpoint_task(ckpt)
    if task != "retrieval":
        raise ValueError(f"{ckpt['path']} is a checkpoint of the {task} task; open-vocabulary detection starts "
                         f"from a contrastive run (ropekit train --task retrieval)")
    return towers_from_retrieval(p)


def scratch_towers(spec: Optional[Dict[str, Any]]) -> Towers:
    """Towers from scratch (:func:`towers_from_config` of ``spec``; ``None``: :data:`SCRATCH_DEFAULTS`)."""
    return towers_from_config(spec or {})
