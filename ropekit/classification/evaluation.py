"""``ropekit eval``: a finished classification run's checkpoint evaluated on its test set -- at its own size or
another, with coordinate offsets or a resolution scaling, on other data, or (a native-resolution run) packed as it
evaluated itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ..encodings.scaling import ResolutionScaling, apply_resolution_scaling
from ..nn.vit import ViTConfig, VisionTransformer
from ..train.checkpoint import load_model_state
from ..train.distributed import resolve_device
from ..train.run_folder import load_run
from .config import TrainConfig, not_divisible
from .native import evaluate_native_run
from .trainer import eval_scaling, evaluate, is_streamed, load_data, open_streamed_data

__all__ = ["evaluate_run"]


def evaluate_run(run_dir: Any, *, image_size: Optional[int] = None, offset_std: float = 0.0, seed: int = 0,
                 batch_size: Optional[int] = None, device: str = "auto", data: Optional[str] = None,
                 data_root: Optional[str] = None, scaling: Optional[str] = None) -> Dict[str, Any]:
    """Evaluate a run's checkpoint on its test set, optionally at another resolution and with one random
    global coordinate offset per image drawn from ``N(0, offset_std^2 I)`` (seeded by ``seed``).

    A native-resolution run (``ropekit train --native-resolution``) is evaluated as it evaluated itself after every
    epoch -- its test images packed, each at its run's ``eval_tokens`` with its aspect ratio (``image_size`` is then
    ``None`` in the result and ``native_tokens`` that budget) -- unless ``image_size`` (one square size, the
    fixed-size pipeline) or other data is given.

    ``scaling``: a resolution-scaling method (``"pi"``, ``"ntk"``, ``"yarn"``, ``"cap"``; ``ropekit.encodings.scaling``)
    applied to the model's commuting encodings for the evaluation (:func:`eval_scaling`); ``None`` or ``"none"``:
    the encodings as trained.

    ``data`` / ``data_root``: evaluate on another data set or folder instead (an image folder: every image in it,
    or its ``val/`` in the train/val layout; another data set: its test split), at the run's image size unless
    ``image_size`` is given. The run's recorded ``data_root`` is absolute, so a run folder evaluates from any
    working directory.

    Raises:
        ValueError: the other data's classes (count or names) or channels differ from the model's, ``scaling``
            cannot apply (see :func:`eval_scaling`; an encoding without a RoPE form), or ``image_size`` is not a
            multiple of the model's patch size; one line.
    """
    config, ckpt = load_run(run_dir)
    tcfg = TrainConfig.from_dict(config.get("train", {}), source="config.json", strict=False)
    vit_cfg = ViTConfig.from_dict(ckpt["vit_config"], source=f"checkpoint {ckpt['path']}", strict=False)
    patch = int(vit_cfg.patch_size)
    if image_size is not None and int(image_size) % patch:  # (train refuses such a size too)
        raise ValueError(not_divisible(int(image_size), patch, model_patch=True))
    if offset_std > 0 and vit_cfg.rotary is None:  # (the model reads no coordinates: the offset would do nothing)
        raise ValueError(f"--offset-std shifts the coordinates of a rotary encoding; this run's model (pe "
                         f"{vit_cfg.pe}) has none")
    other = data is not None or data_root is not None
    packed = tcfg.data.native_resolution and image_size is None and not other  # as the run evaluated itself
    if packed and offset_std > 0:
        raise ValueError("--offset-std: a native-resolution run is evaluated packed, each image at its own grid; "
                         "give --image-size to evaluate it at one size with offsets")
    if other:
        changes: Dict[str, Any] = {}
        if data is not None:
            changes["data"] = data
        if data_root is not None:
            changes["data_root"] = str(Path(data_root).expanduser().resolve())
            if not Path(changes["data_root"]).exists():
                raise FileNotFoundError(f"data root not found: {data_root}")
        tcfg = tcfg.replace(**changes, train_fraction=1.0)
    model = VisionTransformer(vit_cfg)
    load_model_state(model, ckpt["model"], source=f"checkpoint {ckpt['path']}")
    dev = resolve_device(device)
    model.to(dev)
    size = image_size if image_size is not None else list(vit_cfg.image_size)
    scaled = None
    if scaling not in (None, "none"):
        scaled = eval_scaling(scaling, vit_cfg, tcfg, size)
        if not apply_resolution_scaling(model, scaled):
            raise ValueError(f"resolution scaling acts on a commuting rotary encoding's RoPE form; this run's "
                             f"encoding ({vit_cfg.pe}) has none")
    report = {"run_dir": str(run_dir), "checkpoint": ckpt["path"], "epoch": int(ckpt.get("epoch", 0)),
              "data": tcfg.data.name, "data_root": tcfg.data.data_root, "pe": vit_cfg.pe,
              "offset_std": float(offset_std), "seed": int(seed), "coord_dim": model.coord_dim,
              **_scaling_report(scaled, vit_cfg)}
    if packed:
        res = evaluate_native_run(model, tcfg, patch, dev)
        return {**report, "image_size": None, "native_tokens": res["eval_tokens"], **_scores(res)}
    if other and is_streamed(tcfg):
        _, test_ds, info = open_streamed_data(tcfg, size, whole=True)
    else:
        _, test_ds, info = load_data(tcfg, image_size=size)
    if other:
        _check_same_task(info, vit_cfg, config.get("data") or {}, tcfg)
    offsets = None
    if offset_std > 0:
        g = torch.Generator().manual_seed(int(seed))
        offsets = torch.randn(len(test_ds), model.coord_dim, generator=g) * float(offset_std)  # (N_test, c)
    res = evaluate(model, test_ds, batch_size=batch_size or tcfg.run.eval_batch_size, device=dev, offsets=offsets,
                   workers=tcfg.data.workers)
    return {**report, "image_size": list(info.image_size), "native_tokens": None, **_scores(res)}


def _scores(res: Dict[str, Any]) -> Dict[str, Any]:
    return {k: res[k] for k in ("test_acc", "test_loss", "num_examples")}


def _scaling_report(scaled: Optional[ResolutionScaling], vit_cfg: ViTConfig) -> Dict[str, Any]:
    """``scaling``, ``scale`` and ``train_extent`` of an evaluation: the method asked for, else the one the model
    carries (a run fine-tuned with a scaling), else ``"none"``."""
    fields = scaled.to_dict() if scaled is not None else dict(vit_cfg.resolution_scaling)
    if not fields:
        return {"scaling": "none", "scale": None, "train_extent": None}

    def listed(v: Any) -> Any:
        return v if v is None or isinstance(v, list) else [v] * vit_cfg.coord_dim

    return {"scaling": fields["method"], "scale": listed(fields["scale"]),
            "train_extent": listed(fields["train_extent"])}


def _check_same_task(info: Any, vit_cfg: ViTConfig, trained: Dict[str, Any], tcfg: TrainConfig) -> None:
    """One-line ``ValueError`` when the data ``info`` describes cannot be scored by a model of ``vit_cfg``."""
    where = tcfg.data.data_root or tcfg.data.name
    if int(info.num_classes) != int(vit_cfg.num_classes):
        raise ValueError(f"{where} has {info.num_classes} classes; the run's model was trained on "
                         f"{vit_cfg.num_classes}")
    if int(info.in_chans) != int(vit_cfg.in_chans):
        raise ValueError(f"{where} has {info.in_chans}-channel images; the run's model takes {vit_cfg.in_chans}")
    names, had = list(getattr(info, "class_names", None) or []), list(trained.get("class_names") or [])
    if names and had and names != had:
        diff = next(f"{a!r} where the run had {b!r}" for a, b in zip(names, had) if a != b)
        raise ValueError(f"{where}: its classes differ from the run's ({diff}); labels would not match")
