"""``TrainConfig``: everything a training run needs, as one dataclass saved with the run.

Precedence when resolving a run's configuration: dataclass defaults < ``--config FILE`` (YAML or JSON)
< command-line options. The resolved configuration (in its ``model`` / ``data`` / ``optim`` / ``run`` sections),
together with the model's :class:`ViTConfig`, is written to ``config.json`` in the run folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from .._config_keys import known_keys
from ..coords.augment import check_coord_augment
from ..nn.vit import VIT_SIZES, ViTConfig, vit_config
from ..train.upgrade import flatten, nest, upgrade_config

if TYPE_CHECKING:
    from ..train.engine import EngineOptions

__all__ = ["TrainConfig", "check_type", "load_config_file", "parse_key_values", "parse_value",
           "build_vit_config", "auto_patch_size", "model_fields"]


@dataclass
class TrainConfig:
    """A training run.

    Written down (``config.json``, a ``--config`` file, :meth:`to_nested`) the fields form four sections
    (:data:`ropekit.train.upgrade.SECTIONS`, docs/configuration.md): ``model`` (``model`` as ``size``,
    ``model_options`` as ``options``), ``data`` (``data`` as ``name``; augmentation and mixing included), ``optim``
    and ``run``; :meth:`from_dict` reads that form and every older flat one.

    Data:
        data: dataset name (``ropekit.data.list_datasets()``, held in memory) or a streamed one decoded as it is
        read (``folder-stream``: ``data_root/<class>/<image>``, ``shards``: WebDataset shards written by
        ``ropekit data convert``); data_root: path of user data;
        image_size: resize / generate at this size (int or ``[H, W]``); data_options: dataset keyword options;
        split_seed: seed of the train/test split; normalize: standardise colour channels;
        train_fraction: use this (stratified) fraction of the training set (in-memory data);
        workers: data-loader processes of streamed data (0: decode in the training process).
        native_resolution: train and evaluate on packed batches of images at their own aspect ratio and a sampled
        resolution (``ropekit.classification.native``); native_options: its ``ropekit.data.native.NativeOptions`` fields
        (``seq_len``, ``rows``, ``min_tokens``, ``max_tokens``, ``eval_tokens``, ``max_images``, ``token_drop``,
        ``hflip``, ``aspect``).
    Model (see :class:`ropekit.nn.ViTConfig`):
        model: ``tiny``, ``small`` or ``base``; patch_size (``None``: ``auto_patch_size``, a power of two by the
        short side); tubelet_size (video; ``None``: 2 frames, or 1 for clips shorter than 4); pe, pe_options,
        pe_sharing, per_head, ape, cls, coords, jitter, coord_augment (``[shift, jitter, rescale]`` of the patch
        coordinates in training, as DINOv3; ``[0, 1, 1]``: off), depth_input, depth_scale_init;
        model_options: any other ``ViTConfig`` field (``embed_dim``, ``depth``, ``num_heads``, ``drop_path_rate``...);
        init_from: a checkpoint whose matching weights initialise the model (fine-tuning).
    Optimisation:
        epochs, batch_size (global, split over DDP ranks), lr (peak), weight_decay, warmup_epochs, min_lr,
        label_smoothing, grad_clip (0 disables), augment_shift (random translation by up to this many pixels,
        zero fill; 0 disables), augment_sizes (scale augmentation: each step resizes its batch to one image size
        drawn from this list -- bilinear, antialiased when shrinking -- so the model trains on several token
        grids; ``[]`` disables; images only); lr_base_batch: when set, the learning rate is
        ``lr * batch_size / lr_base_batch`` (the linear scaling rule of recipes such as DeiT's).
    Augmentation of streamed data (``folder-stream``, ``shards``; the in-memory sets use ``augment_shift``):
        crop_scale, crop_ratio: random resized crop's area fraction and aspect-ratio ranges; hflip: horizontal flip
        probability; auto_augment: ``none``, ``randaugment``, ``trivialaugment`` or ``rand-m9-n2`` style;
        random_erasing: probability of erasing a rectangle; crop_pct: evaluation resizes to ``size / crop_pct`` and
        crops the centre.
    Mixing (any data, opt-in): mixup_alpha, cutmix_alpha: Beta parameters of MixUp and CutMix (0 disables; both
        > 0: one of the two per batch, with equal probability). The loss then takes the mixed (soft) targets, with
        label smoothing on top; the training accuracy counts the predictions that match a mixed target's largest
        class.
    Run:
        seed, out (run folder; ``None``: ``runs/<data>-<pe>-<model>-s<seed>-<time>``), device (``auto``, ``cpu``,
        ``cuda``...), precision (``fp32``, ``bf16`` or ``fp16`` autocast), compile (``torch.compile`` the model:
        ``True`` or a backend name such as ``aot_eager``),
        eval_batch_size, progress (bar), tensorboard (event files when installed), threads (torch
        CPU threads; ``None``: half the cores per process, see ``trainer.resolve_threads``); log_every: steps
        between reads of the loss guard and running metrics (the only host synchronisations of training);
        checkpoint_every: also checkpoint every this many steps inside an epoch (0: after each epoch only).
    """

    data: str = "mnist"
    data_root: Optional[str] = None
    image_size: Optional[Union[int, List[int]]] = None
    data_options: Dict[str, Any] = field(default_factory=dict)
    split_seed: int = 0
    normalize: bool = True
    train_fraction: float = 1.0
    workers: int = 0
    native_resolution: bool = False
    native_options: Dict[str, Any] = field(default_factory=dict)

    model: str = "tiny"
    patch_size: Optional[int] = None
    tubelet_size: Optional[int] = None
    pe: str = "cayley"
    pe_options: Dict[str, Any] = field(default_factory=dict)
    pe_sharing: str = "auto"
    per_head: bool = False
    ape: str = "none"
    cls: str = "none"
    coords: str = "grid"
    jitter: float = 0.0
    coord_augment: List[float] = field(default_factory=lambda: [0.0, 1.0, 1.0])
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
    augment_sizes: List[int] = field(default_factory=list)
    lr_base_batch: Optional[int] = None

    crop_scale: List[float] = field(default_factory=lambda: [0.08, 1.0])
    crop_ratio: List[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    hflip: float = 0.5
    auto_augment: str = "none"
    random_erasing: float = 0.0
    crop_pct: float = 0.875
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    seed: int = 0
    out: Optional[str] = None
    device: str = "auto"
    precision: str = "fp32"
    compile: Union[bool, str] = False
    eval_batch_size: int = 250
    progress: bool = True
    tensorboard: bool = True
    threads: Optional[int] = None
    log_every: int = 50
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        """One name per data set: the image-folder aliases (``folder-stream``, ``imagefolder-stream``) become
        ``imagefolder``. (``pe_sharing="head"`` is kept as written: it is the model's own short form of ``"layer"``
        with ``per_head=True``, recorded so by studies' recipes.)"""
        if isinstance(self.data, str) and is_folder(self.data):
            self.data = FOLDER_NAMES[0]

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def field_names(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def to_nested(self) -> Dict[str, Dict[str, Any]]:
        """The nested form: ``{"model": ..., "data": ..., "optim": ..., "run": ...}`` (:mod:`ropekit.train.upgrade`;
        ``model`` holds ``model_options``' ``ViTConfig`` fields by their own names)."""
        return nest(self.to_dict())

    @classmethod
    def from_dict(cls, d: Dict[str, Any], *, source: str = "config", strict: bool = True) -> "TrainConfig":
        """Build from a mapping: ``TrainConfig`` fields, or the nested form of :meth:`to_nested`. Every mapping goes
        through :func:`ropekit.train.upgrade.upgrade_config` (renamed keys under their new names; a recorded
        configuration, ``strict=False``, also gets the fields added since it was written at the value it trained
        with). Unknown keys raise ``ValueError`` naming them (``strict``: the user's own options; a nested key as
        ``section.key``), or -- reading a run folder written by another ropekit version -- give one warning and
        are ignored."""
        flat = flatten(upgrade_config(d, fill=not strict))
        return cls(**known_keys(flat, cls.field_names(), {}, source=source, strict=strict)).validate(source)

    def replace(self, **changes: Any) -> "TrainConfig":
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **changes).validate()

    @property
    def peak_lr(self) -> float:
        """The peak learning rate: ``lr``, scaled by ``batch_size / lr_base_batch`` when that is set."""
        return self.lr * self.batch_size / self.lr_base_batch if self.lr_base_batch else self.lr

    #: The fields that apply to streamed data only, with their defaults (the in-memory sets refuse other values).
    STREAM_ONLY = ("crop_scale", "crop_ratio", "hflip", "auto_augment", "random_erasing", "crop_pct", "workers")

    def engine_options(self) -> "EngineOptions":
        """The run-execution settings for :func:`ropekit.train.engine.fit` (threads are set by the trainer)."""
        from ..train.engine import EngineOptions

        return EngineOptions(device=self.device, precision=self.precision, compile=self.compile, threads=None,
                             progress=self.progress, tensorboard=self.tensorboard)

    def validate(self, source: str = "options") -> "TrainConfig":
        """Type and range checks that need no data, each failing with a one-line ``ValueError`` naming the option
        (the model configuration itself is validated when the model is built)."""
        for f in dataclasses.fields(self):
            check_type(f.name, getattr(self, f.name), _FIELD_TYPES[f.name], source)
        self.__post_init__()
        if self.model not in VIT_SIZES:
            raise ValueError(f"unknown model size {self.model!r}; known: {', '.join(VIT_SIZES)}")
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("threads", "patch_size", "tubelet_size", "lr_base_batch", "log_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not 0.0 < float(self.train_fraction) <= 1.0:
            raise ValueError(f"train_fraction must be in (0, 1], got {self.train_fraction}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        for name in ("weight_decay", "warmup_epochs", "min_lr", "grad_clip", "jitter", "augment_shift", "workers",
                     "checkpoint_every", "mixup_alpha", "cutmix_alpha"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        check_coord_augment(self.coord_augment)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in self.augment_sizes):
            raise ValueError(f"augment_sizes must be a list of positive image sizes, got {self.augment_sizes!r}")
        if self.patch_size is not None:
            bad = [v for v in self.augment_sizes if v % self.patch_size]
            if bad:
                raise ValueError("augment_sizes: " + _not_divisible(bad[0], self.patch_size))
        for name in ("hflip", "random_erasing"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a probability in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")
        lo_hi = {"crop_scale": (0.0, 1.0), "crop_ratio": (0.0, math.inf)}
        for name, (lo, hi) in lo_hi.items():
            v = getattr(self, name)
            if len(v) != 2 or not lo < v[0] <= v[1] <= hi:
                raise ValueError(f"{name} must be [low, high] with {lo:g} < low <= high"
                                 f"{f' <= {hi:g}' if math.isfinite(hi) else ''}, got {v!r}")
        from ..data.transforms import parse_auto_augment

        with warnings.catch_warnings():  # (the data's transform says what it ignores, once, when it is built)
            warnings.simplefilter("ignore")
            parse_auto_augment(self.auto_augment)
        if not is_streamed_data(self.data):
            defaults = TrainConfig.__dataclass_fields__
            given = [n for n in self.STREAM_ONLY if getattr(self, n) != _default(defaults[n])]
            if given:
                raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to streamed data "
                                 f"(--data imagefolder or shards); the in-memory set {self.data!r} augments with "
                                 f"augment_shift / augment_sizes")
        else:
            _check_stream_options(self.data_options)
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not math.isfinite(self.depth_scale_init):
            raise ValueError(f"depth_scale_init must be finite, got {self.depth_scale_init}")
        from ..train.options import PRECISIONS, check_compile_backend

        check_compile_backend(self.compile)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.image_size is not None:
            sizes = [self.image_size] if isinstance(self.image_size, int) else list(self.image_size)
            if not 1 <= len(sizes) <= 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
                raise ValueError(f"image_size must be a positive integer or [H, W], got {self.image_size!r}")
            if self.patch_size is not None:
                bad = [v for v in sizes if v % self.patch_size]
                if bad:
                    raise ValueError(_not_divisible(bad[0], self.patch_size))
        for name in ("pe_options", "data_options", "model_options", "native_options"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a mapping, got {getattr(self, name)!r}")
        vit_fields = {f.name: f for f in dataclasses.fields(ViTConfig)}
        bad = sorted(set(self.model_options) - set(vit_fields))
        if bad:
            raise ValueError(f"model_options: unknown ViTConfig field(s) {', '.join(bad)}")
        hints = typing.get_type_hints(ViTConfig)
        for k, v in self.model_options.items():
            check_type(k, v, hints[k], "--model-opt")
        _check_pe_options(self.pe, self.pe_options)
        return self


#: The ``allow_change`` entry of ``--allow-data-change``: resume although the data's fingerprint changed.
DATA_CHANGE = "data_fingerprint"


def plural(n: int, word: str) -> str:
    """``"1 epoch"``, ``"2 epochs"``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


#: The names of the one image-folder reader of ``ropekit train`` (streamed; the first is the one recorded).
FOLDER_NAMES = ("imagefolder", "folder-stream", "imagefolder-stream")
#: ``data_options`` a streamed data set accepts (keyword options of ``ropekit.data.streaming.open_stream``).
STREAM_OPTIONS = ("skip_corrupt", "test_fraction", "shuffle_buffer", "interpolation", "mean", "std")


def is_folder(name: str) -> bool:
    """Whether ``name`` names the image-folder reader (``imagefolder`` or one of its aliases)."""
    return str(name).strip().lower().replace("_", "-") in FOLDER_NAMES


def is_streamed_data(name: str) -> bool:
    """Whether ``ropekit train`` decodes ``name`` as it reads it (``imagefolder`` and its aliases, ``shards``)
    rather than holding it in memory."""
    from ..data.streaming import is_stream

    return is_folder(name) or is_stream(name)


def _check_stream_options(options: Dict[str, Any]) -> None:
    bad = sorted(set(options) - set(STREAM_OPTIONS))
    if bad:
        hint = " (streamed folders decode RGB)" if "mode" in bad else ""
        raise ValueError(f"data_options: unknown option(s) {', '.join(bad)} of streamed data{hint}; known: "
                         f"{', '.join(STREAM_OPTIONS)}")


def _default(f: "dataclasses.Field[Any]") -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_FIELD_TYPES = typing.get_type_hints(TrainConfig)


def _not_divisible(size: int, patch: int) -> str:
    lo, hi = size - size % patch, size - size % patch + patch
    divisors = [p for p in range(1, min(size, 32) + 1) if size % p == 0 and p > 1]
    return (f"image size {size} is not a multiple of the patch size {patch} (the last {size % patch} pixels would "
            f"be cut off): use --image-size {lo if lo else hi} or {hi}, or a patch size that divides {size} "
            f"({', '.join(map(str, divisors)) or 'none'})")


def check_type(name: str, value: Any, hint: Any, source: str = "options") -> None:
    """One-line ``ValueError`` when ``value`` does not fit the type annotation ``hint`` (``int``, ``float``, ``bool``,
    ``str``, ``Optional``, ``Union``, ``List``, ``Tuple``, ``Dict``; an int is accepted for a float, a bool is never
    a number)."""
    if not _fits(value, hint):
        raise ValueError(f"{source}: {name} must be {_describe(hint)}, got {value!r}")


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin is Union:
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, List, Tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return isinstance(value, (list, tuple)) and all(_fits(v, args[0]) for v in value) if args else \
            isinstance(value, (list, tuple))
    if origin in (dict, Dict):
        return isinstance(value, dict)
    return True


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Union:
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    if hint in names:
        return names[hint]
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a mapping"
    return str(hint)


def _check_pe_options(pe: str, options: Dict[str, Any]) -> None:
    """Types of ``--pe-opt`` values against the defaults of the encoding's constructor (unknown names are left to
    the encoding, which lists the ones it accepts)."""
    import inspect

    from ..encodings.registry import PE_REGISTRY

    cls = PE_REGISTRY.get(str(pe).lower().replace("_", "-"))
    if cls is None or not options:
        return
    params = inspect.signature(cls.__init__).parameters
    simple = {"int": int, "float": float, "bool": bool, "str": str}
    for k, v in options.items():
        p = params.get(k)
        if p is None:
            continue
        ann = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        parts = [a.strip() for a in str(ann).replace("Optional[", "").rstrip("]").split("|")]
        types = [simple[a] for a in parts if a in simple]
        if not types or len(types) + ("None" in parts) != len(parts):
            continue  # (tensors and other non-scalar options are left to the encoding)
        hint: Any = Union[tuple(types + ([type(None)] if "None" in parts else []))] if len(types) > 1 or \
            "None" in parts else types[0]
        check_type(k, v, hint, "--pe-opt")


# ---------------------------------------------------------------------------------------------------------
# parsing helpers
# ---------------------------------------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """``"8" -> 8``, ``"0.5" -> 0.5``, ``"true" -> True``, ``"null" -> None``, ``"[2, 4]" -> [2, 4]``, else the
    string."""
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
    """Read a YAML or JSON mapping of options: ``TrainConfig`` fields, or the nested form (``model``, ``data``,
    ``optim``, ``run`` sections, :mod:`ropekit.train.upgrade`). Returns ``TrainConfig`` fields (a nested key that
    belongs nowhere as ``"section.key"``, which ``TrainConfig.from_dict`` then names).

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
    try:
        return flatten(upgrade_config(data, fill=False))
    except ValueError as e:
        raise ValueError(f"config file {p}: {e}") from None


# ---------------------------------------------------------------------------------------------------------
# model configuration from a run configuration and a dataset
# ---------------------------------------------------------------------------------------------------------


def auto_patch_size(image_size) -> int:
    """A power of two by the shorter side: 16 from 112 px, 8 from 56, 4 from 16, 2 from 8, else 1 (4-14 patches per
    side up to 224 px, more above): 8 -> 2, 28 -> 4, 32 -> 4, 64 -> 8, 224 -> 16."""
    side = int(min(image_size))
    for p, least in ((16, 112), (8, 56), (4, 16), (2, 8)):
        if side >= least:
            return p
    return 1


#: TrainConfig fields that are also ViTConfig fields but are resolved from the data rather than copied.
_RESOLVED_FROM_DATA = ("image_size", "patch_size", "tubelet_size")


def model_fields() -> List[str]:
    """The ``TrainConfig`` fields that are copied into the model's :class:`ViTConfig` (the fields both share)."""
    vit = {f.name for f in dataclasses.fields(ViTConfig)}
    return [n for n in TrainConfig.field_names() if n in vit and n not in _RESOLVED_FROM_DATA]


def build_vit_config(cfg: TrainConfig, info: Any) -> ViTConfig:
    """The model configuration for ``cfg`` on a dataset described by ``info`` (a ``DatasetInfo``).

    Every field ``TrainConfig`` shares with ``ViTConfig`` is copied (:func:`model_fields`), ``model_options`` set
    any other ``ViTConfig`` field, and the data decide the rest (classes, channels, size, modality, patch size).

    Raises:
        ValueError: an explicit ``patch_size`` that does not divide the image size (an automatic one that does not
            divide it gives a warning saying how many pixels are cut off).
    """
    image_size = tuple(int(s) for s in info.image_size)
    patch = cfg.patch_size or auto_patch_size(image_size)
    bad = [v for v in image_size if v % patch]
    if bad and cfg.patch_size:
        raise ValueError(_not_divisible(bad[0], patch))
    if bad:
        warnings.warn(f"image size {'x'.join(map(str, image_size))} is not a multiple of the automatic patch size "
                      f"{patch}: the model uses the top-left {'x'.join(str(v - v % patch) for v in image_size)} "
                      f"pixels (set --patch-size or --image-size to use them all)", stacklevel=2)
    kw: Dict[str, Any] = {name: getattr(cfg, name) for name in model_fields()}
    kw.update(num_classes=int(info.num_classes), in_chans=int(info.in_chans), image_size=image_size,
              modality=info.kind, num_frames=getattr(info, "num_frames", None), patch_size=patch,
              pe_options=dict(cfg.pe_options), jitter=float(cfg.jitter), depth_scale_init=float(cfg.depth_scale_init))
    if info.kind == "video":
        t = int(info.num_frames or 1)
        kw["tubelet_size"] = cfg.tubelet_size or (2 if t >= 4 else 1)
    kw.update(cfg.model_options)
    return vit_config(cfg.model, **kw).resolved()
