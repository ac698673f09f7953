"""``TrainConfig``: everything a training run needs, as one dataclass saved with the run.

Precedence when resolving a run's configuration: dataclass defaults < ``--config FILE`` (YAML or JSON)
< command-line options. The resolved configuration, together with the model's :class:`ViTConfig`, is
written to ``config.json`` in the run folder.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ..nn.vit import VIT_SIZES, ViTConfig, vit_config

__all__ = ["TrainConfig", "load_config_file", "parse_key_values", "parse_value", "build_vit_config", "auto_patch_size"]


@dataclass
class TrainConfig:
    """A training run.

    Data:
        data: dataset name (``ropekit.data.list_datasets()``); data_root: path of user data;
        image_size: resize / generate at this size (int or ``[H, W]``); data_options: dataset keyword options;
        split_seed: seed of the train/test split; normalize: standardise colour channels;
        train_fraction: use this (stratified) fraction of the training set.
    Model (see :class:`ropekit.nn.ViTConfig`):
        model: ``tiny``, ``small`` or ``base``; patch_size (``None``: ``auto_patch_size``, 4-14 patches on the
        short side); tubelet_size (video; ``None``: 2 frames, or 1 for clips shorter than 4); pe, pe_options,
        pe_sharing, per_head, ape, cls, coords, jitter, depth_input, depth_scale_init;
        model_options: any other ``ViTConfig`` field (``embed_dim``, ``depth``, ``num_heads``, ``drop_path_rate``...);
        init_from: a checkpoint whose matching weights initialise the model (fine-tuning).
    Optimisation:
        epochs, batch_size (global, split over DDP ranks), lr (peak), weight_decay, warmup_epochs, min_lr,
        label_smoothing, grad_clip (0 disables), augment_shift (random translation by up to this many pixels,
        zero fill; 0 disables).
    Run:
        seed, out (run folder; ``None``: ``runs/<data>-<pe>-<model>-s<seed>-<time>``), device (``auto``, ``cpu``,
        ``cuda``...), eval_batch_size, progress (bar), tensorboard (event files when installed), threads (torch
        CPU threads; ``None``: half the cores per process, see ``trainer.resolve_threads``).
    """

    data: str = "mnist"
    data_root: Optional[str] = None
    image_size: Optional[Union[int, List[int]]] = None
    data_options: Dict[str, Any] = field(default_factory=dict)
    split_seed: int = 0
    normalize: bool = True
    train_fraction: float = 1.0

    model: str = "tiny"
    patch_size: Optional[int] = None
    tubelet_size: Optional[int] = None
    pe: str = "cayley"
    pe_options: Dict[str, Any] = field(default_factory=dict)
    pe_sharing: str = "model"
    per_head: bool = False
    ape: str = "none"
    cls: str = "none"
    coords: str = "grid"
    jitter: float = 0.0
    depth_input: str = "auto"
    depth_scale_init: float = 1.0
    model_options: Dict[str, Any] = field(default_factory=dict)
    init_from: Optional[str] = None

    epochs: int = 12
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    min_lr: float = 1e-5
    label_smoothing: float = 0.0
    grad_clip: float = 0.0
    augment_shift: int = 1

    seed: int = 0
    out: Optional[str] = None
    device: str = "auto"
    eval_batch_size: int = 250
    progress: bool = True
    tensorboard: bool = True
    threads: Optional[int] = None

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def field_names(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any], *, source: str = "config") -> "TrainConfig":
        """Build from a mapping; unknown keys raise ``ValueError`` naming them."""
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"{source}: unknown option(s) {', '.join(unknown)}")
        return cls(**d).validate()

    def replace(self, **changes: Any) -> "TrainConfig":
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **changes).validate()

    def validate(self) -> "TrainConfig":
        """Cheap checks that need no data (the model config is validated when the model is built)."""
        if self.model not in VIT_SIZES:
            raise ValueError(f"unknown model size {self.model!r}; known: {', '.join(VIT_SIZES)}")
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not 0.0 < float(self.train_fraction) <= 1.0:
            raise ValueError(f"train_fraction must be in (0, 1], got {self.train_fraction}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        for name in ("pe_options", "data_options", "model_options"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a mapping, got {getattr(self, name)!r}")
        bad = sorted(set(self.model_options) - {f.name for f in dataclasses.fields(ViTConfig)})
        if bad:
            raise ValueError(f"model_options: unknown ViTConfig field(s) {', '.join(bad)}")
        return self


# ---------------------------------------------------------------------------------------------------------
# parsing helpers
# ---------------------------------------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """``"8" -> 8``, ``"0.5" -> 0.5``, ``"true" -> True``, ``"null" -> None``, ``"[2, 4]" -> [2, 4]``, else the string."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_key_values(items: Optional[List[str]], what: str) -> Dict[str, Any]:
    """``["block_size=8", "init=zero"] -> {"block_size": 8, "init": "zero"}``; ``ValueError`` on a bad item."""
    out: Dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} expects KEY=VALUE, got {item!r}")
        out[key.strip().replace("-", "_")] = parse_value(value)
    return out


def load_config_file(path: Union[str, Path]) -> Dict[str, Any]:
    """Read a YAML or JSON mapping of ``TrainConfig`` fields.

    A run folder's ``config.json`` is accepted too (its ``train`` section is used).
    """
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p}")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"config file {p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {first}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping of options, got {type(data).__name__}")
    if "train" in data and isinstance(data["train"], dict):
        data = data["train"]
    return data


# ---------------------------------------------------------------------------------------------------------
# model configuration from a run configuration and a dataset
# ---------------------------------------------------------------------------------------------------------


def auto_patch_size(image_size) -> int:
    """A power of two giving 4-14 patches on the shorter side: 8 -> 2, 28 -> 4, 32 -> 4, 64 -> 8, 224 -> 16."""
    side = int(min(image_size))
    for p, least in ((16, 112), (8, 56), (4, 16), (2, 8)):
        if side >= least:
            return p
    return 1


def build_vit_config(cfg: TrainConfig, info: Any) -> ViTConfig:
    """The model configuration for ``cfg`` on a dataset described by ``info`` (a ``DatasetInfo``)."""
    image_size = tuple(int(s) for s in info.image_size)
    kw: Dict[str, Any] = dict(
        num_classes=int(info.num_classes), in_chans=int(info.in_chans), image_size=image_size,
        modality=info.kind, num_frames=getattr(info, "num_frames", None),
        patch_size=cfg.patch_size or auto_patch_size(image_size),
        pe=cfg.pe, pe_options=dict(cfg.pe_options), pe_sharing=cfg.pe_sharing, per_head=cfg.per_head, ape=cfg.ape,
        cls=cfg.cls, coords=cfg.coords, jitter=float(cfg.jitter), depth_input=cfg.depth_input,
        depth_scale_init=float(cfg.depth_scale_init),
    )
    if info.kind == "video":
        t = int(info.num_frames or 1)
        kw["tubelet_size"] = cfg.tubelet_size or (2 if t >= 4 else 1)
    kw.update(cfg.model_options)
    return vit_config(cfg.model, **kw).resolved()
