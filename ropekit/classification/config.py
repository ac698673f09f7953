"""``TrainConfig``: everything a training run needs, in four sections (``model``, ``data``, ``optim``, ``run``: the
dataclasses :class:`ModelConfig`, :class:`DataConfig`, :class:`OptimConfig`, :class:`RunConfig`), saved with the run.

Precedence when resolving a run's configuration: dataclass defaults < ``--config FILE`` (YAML or JSON)
< command-line options. The resolved configuration (in its ``model`` / ``data`` / ``optim`` / ``run`` sections),
together with the model's :class:`ViTConfig`, is written to ``config.json`` in the run folder.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple, Union

from .._config_keys import known_keys
from ..coords.augment import check_coord_augment
from ..nn.vit import VIT_SIZES, ViTConfig, vit_config
from ..train.upgrade import FLAT_FIELDS, flatten, nest, upgrade_config

if TYPE_CHECKING:
    from ..train.engine import EngineOptions

__all__ = ["TrainConfig", "ModelConfig", "DataConfig", "OptimConfig", "RunConfig", "check_type", "load_config_file",
           "parse_key_values", "parse_value",
           "build_vit_config", "split_pending_scaling", "not_divisible", "auto_patch_size", "POSITION_FIELDS", "SECTION_TYPES"]


#: The ``ViTConfig`` fields that the ``model`` section states by name (the position encoding and its inputs):
#: every recorded configuration holds them, the other ``ViTConfig`` fields only when given (``model.options``).
POSITION_FIELDS = ("pe", "pe_options", "pe_sharing", "per_head", "ape", "cls", "coords", "jitter", "coord_augment",
                   "depth_input", "depth_scale_init")


@dataclass
class ModelConfig:
    """The ``model`` section: a ViT of a named size.

    size: ``tiny``, ``small`` or ``base`` (:data:`ropekit.nn.VIT_SIZES`); patch_size (``None``: ``auto_patch_size``,
    a power of two by the short side of the data's images); tubelet_size (video; ``None``: 2 frames, or 1 for clips
    shorter than 4); options: the :class:`ropekit.nn.ViTConfig` fields set on top of the size's own (``pe``,
    ``pe_options``, ``pe_sharing``, ``per_head``, ``ape``, ``cls``, ``coords``, ``jitter``, ``coord_augment``
    (``[shift, jitter, rescale]`` of the patch coordinates in training, as DINOv3; ``[0, 1, 1]``: off),
    ``depth_input``, ``depth_scale_init``, ``embed_dim``, ``depth``, ``num_heads``, ``drop_path_rate``...);
    init_from: a checkpoint whose matching weights initialise the model (fine-tuning). The data decide the rest
    (classes, channels, image size, modality) when the model is built (:func:`build_vit_config`).

    ``options`` keeps what was given, even a value equal to the size's own (a recorded run states every field);
    :meth:`vit` is the ``ViTConfig`` they make before the data are known.
    """

    size: str = "tiny"
    patch_size: Optional[int] = None
    tubelet_size: Optional[int] = None
    options: Dict[str, Any] = field(default_factory=dict)
    init_from: Optional[str] = None

    def __post_init__(self) -> None:
        """The position fields (:data:`POSITION_FIELDS`) not given are set to ``ViTConfig``'s values, so that
        a configuration states them all, as every recorded one does."""
        missing = [name for name in POSITION_FIELDS if name not in self.options]
        defaults = ViTConfig() if missing else None
        for name in missing:
            value = getattr(defaults, name)
            self.options[name] = list(value) if isinstance(value, tuple) else copy.deepcopy(value)

    def extra(self) -> Dict[str, Any]:
        """The ``ViTConfig`` fields given besides the position fields (what ``--model-opt`` sets; recorded as
        ``model.options``)."""
        return {k: copy.deepcopy(v) for k, v in self.options.items() if k not in POSITION_FIELDS}

    def vit(self) -> ViTConfig:
        """The size's ``ViTConfig`` with :attr:`options` set (data fields, patch and tubelet sizes at their
        defaults until :func:`build_vit_config` fills them)."""
        return vit_config(self.size, **self.options)


@dataclass
class DataConfig:
    """The ``data`` section: the dataset, its loader and its augmentation.

    name: dataset name (``ropekit.data.list_datasets()``, held in memory) or a streamed one decoded as it is read
    (``imagefolder``: ``data_root/<class>/<image>``, ``shards``: WebDataset shards written by ``ropekit data
    convert``); data_root: path of user data; image_size: resize / generate at this size (int or ``[H, W]``);
    data_options: dataset keyword options; split_seed: seed of the train/test split; normalize: standardise colour
    channels; train_fraction: use this (stratified) fraction of the training set (in-memory data); workers:
    data-loader processes of streamed data (0: decode in the training process); native_resolution: train and
    evaluate on packed batches of images at their own aspect ratio (``ropekit.classification.native``);
    native_options: its ``ropekit.data.native.NativeOptions`` fields (``seq_len``, ``rows``, ``min_tokens``,
    ``max_tokens``, ``eval_tokens``, ``max_images``, ``token_drop``, ``hflip``, ``aspect``).

    Augmentation: augment_shift (random translation by up to this many pixels, zero fill; 0 disables),
    augment_sizes (scale augmentation: each step resizes its batch to one image size drawn from this list --
    bilinear, antialiased when shrinking; ``[]`` disables; images only). Of streamed data only: crop_scale,
    crop_ratio (random resized crop's area fraction and aspect-ratio ranges), hflip (horizontal flip probability),
    auto_augment (``none``, ``randaugment``, ``trivialaugment`` or ``rand-m9-n2`` style), random_erasing
    (probability of erasing a rectangle), crop_pct (evaluation resizes to ``size / crop_pct`` and crops the
    centre). Mixing (any data, opt-in): mixup_alpha, cutmix_alpha (Beta parameters of MixUp and CutMix; 0 disables;
    both > 0: one of the two per batch). The loss then takes the mixed (soft) targets, with label smoothing on top.
    """

    name: str = "mnist"
    data_root: Optional[str] = None
    image_size: Optional[Union[int, List[int]]] = None
    data_options: Dict[str, Any] = field(default_factory=dict)
    split_seed: int = 0
    normalize: bool = True
    train_fraction: float = 1.0
    workers: int = 0
    native_resolution: bool = False
    native_options: Dict[str, Any] = field(default_factory=dict)
    augment_shift: int = 1
    augment_sizes: List[int] = field(default_factory=list)
    crop_scale: List[float] = field(default_factory=lambda: [0.08, 1.0])
    crop_ratio: List[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    hflip: float = 0.5
    auto_augment: str = "none"
    random_erasing: float = 0.0
    crop_pct: float = 0.875
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    def __post_init__(self) -> None:
        """One name per data set: the image-folder aliases (``folder-stream``, ``imagefolder-stream``) become
        ``imagefolder``."""
        if isinstance(self.name, str) and is_folder(self.name):
            self.name = FOLDER_NAMES[0]

    #: The fields that apply to streamed data only (the in-memory sets refuse values other than the defaults).
    STREAM_ONLY = ("crop_scale", "crop_ratio", "hflip", "auto_augment", "random_erasing", "crop_pct", "workers")


@dataclass
class OptimConfig:
    """The ``optim`` section: epochs, batch_size (global, split over DDP ranks), lr (peak), weight_decay,
    warmup_epochs, min_lr, label_smoothing, grad_clip (0 disables), lr_base_batch (when set, the learning rate is
    ``lr * batch_size / lr_base_batch``, the linear scaling rule of recipes such as DeiT's)."""

    epochs: int = 12
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    min_lr: float = 1e-5
    label_smoothing: float = 0.0
    grad_clip: float = 0.0
    lr_base_batch: Optional[int] = None

    @property
    def peak_lr(self) -> float:
        """The peak learning rate: ``lr``, scaled by ``batch_size / lr_base_batch`` when that is set."""
        return self.lr * self.batch_size / self.lr_base_batch if self.lr_base_batch else self.lr


@dataclass
class RunConfig:
    """The ``run`` section: seed, out (run folder; ``None``: ``runs/<data>-<pe>-<model>-s<seed>-<time>``), device
    (``auto``, ``cpu``, ``cuda``...), precision (``fp32``, ``bf16`` or ``fp16`` autocast), compile
    (``torch.compile`` the model: ``True`` or a backend name such as ``aot_eager``), eval_batch_size, progress
    (bar), tensorboard (event files when installed), threads (torch CPU threads; ``None``: half the cores per
    process, see ``trainer.resolve_threads``), log_every (steps between reads of the loss guard and running
    metrics, the only host synchronisations of training), checkpoint_every (also checkpoint every this many steps
    inside an epoch; 0: after each epoch only)."""

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

    def engine_options(self) -> "EngineOptions":
        """The run-execution settings for :func:`ropekit.train.engine.fit` (threads are set by the trainer)."""
        from ..train.engine import EngineOptions

        return EngineOptions(device=self.device, precision=self.precision, compile=self.compile, threads=None,
                             progress=self.progress, tensorboard=self.tensorboard)


#: The dataclass of each section.
SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "run": RunConfig}


@dataclass
class TrainConfig:
    """A training run: four sections, as ``config.json`` writes them (docs/configuration.md).

    >>> cfg = TrainConfig(data=DataConfig("digits"), optim=OptimConfig(epochs=2))
    >>> cfg.model.vit().pe, cfg.optim.lr, cfg.run.device
    ('cayley', 0.001, 'auto')

    ``model`` (:class:`ModelConfig`: the ViT's size and the :class:`ropekit.nn.ViTConfig` fields given),
    ``data`` (:class:`DataConfig`), ``optim`` (:class:`OptimConfig`) and ``run`` (:class:`RunConfig`).
    :meth:`from_dict` reads the nested form, keys spelled ``section.key``, and every flat form a run folder or a
    config file has had, through the one converter :func:`ropekit.train.upgrade.upgrade_config`; :meth:`to_nested`
    writes the nested form, and ``upgrade.flatten(cfg.to_nested())`` is the flat one that recorded runs and study
    hashes use.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    # ------------------------------------------------------------------ (de)serialisation
    def to_nested(self) -> Dict[str, Dict[str, Any]]:
        """The nested form: ``{"model": ..., "data": ..., "optim": ..., "run": ...}`` (:mod:`ropekit.train.upgrade`;
        ``model`` states the ViT's position fields by name and holds its other options in ``options``)."""
        vit = self.model.vit()
        model: Dict[str, Any] = {"size": self.model.size, "patch_size": self.model.patch_size,
                                 "tubelet_size": self.model.tubelet_size}
        for name in POSITION_FIELDS:
            value = self.model.options[name] if name in self.model.options else getattr(vit, name)
            model[name] = list(value) if isinstance(value, tuple) else copy.deepcopy(value)
        model["init_from"] = self.model.init_from
        model["options"] = self.model.extra()
        data = dataclasses.asdict(self.data)
        data = {"name": data.pop("name"), **data}
        return {"model": model, "data": data, "optim": dataclasses.asdict(self.optim),
                "run": dataclasses.asdict(self.run)}

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """The same as :meth:`to_nested`."""
        return self.to_nested()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "config", strict: bool = True) -> "TrainConfig":
        """Build from a mapping: the nested form of :meth:`to_nested`, keys spelled ``section.key``, or the flat
        fields of older ropekit versions. Every mapping goes through :func:`ropekit.train.upgrade.upgrade_config`
        (renamed keys under their new names; a recorded configuration, ``strict=False``, also gets the fields added
        since it was written at the value it trained with). Unknown keys raise ``ValueError`` naming them
        (``strict``: the user's own options; a nested key as ``section.key``), or -- reading a run folder written
        by another ropekit version -- give one warning and are ignored."""
        flat = flatten(upgrade_config(d, fill=not strict))
        flat = known_keys(flat, FLAT_FIELDS, {}, source=source, strict=strict)
        return cls._from_flat(flat).validate(source)

    @classmethod
    def _from_flat(cls, flat: Mapping[str, Any]) -> "TrainConfig":
        nested = nest(flat)
        model = dict(nested["model"])
        options = {k: model.pop(k) for k in POSITION_FIELDS if k in model}
        options.update(model.pop("options", {}) or {})
        data = dict(nested["data"])
        if "name" in data:
            data["name"] = data.pop("name")
        return cls(model=ModelConfig(**model, options=options), data=DataConfig(**data),
                   optim=OptimConfig(**nested["optim"]), run=RunConfig(**nested["run"]))

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with ``changes`` (keys ``section.key``, or the flat names of
        :data:`ropekit.train.upgrade.FLAT_FIELDS`;
        a ``ViTConfig`` field as ``model.NAME``), validated.

        Raises:
            ValueError: an unknown key (every one named) or a bad value.
        """
        flat = flatten(self.to_nested())
        new = flatten(upgrade_config(changes, fill=False))
        unknown = sorted(set(new) - set(FLAT_FIELDS))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}")
        if "model_options" in new:
            new["model_options"] = {**flat.get("model_options", {}), **new["model_options"]}
        return type(self)._from_flat({**flat, **new}).validate()

    def validate(self, source: str = "options") -> "TrainConfig":
        """Type and range checks that need no data, each failing with a one-line ``ValueError`` naming the option
        (the model configuration itself is validated when the model is built)."""
        for section, typ in SECTION_TYPES.items():
            part = getattr(self, section)
            if not isinstance(part, typ):
                raise ValueError(f"{source}: {section} must be a {typ.__name__}, got {part!r}")
            for f in dataclasses.fields(part):
                check_type(f.name, getattr(part, f.name), _FIELD_TYPES[section][f.name], source)
        m, d, o, r = self.model, self.data, self.optim, self.run
        d.__post_init__()
        if m.size not in VIT_SIZES:
            raise ValueError(f"unknown model size {m.size!r}; known: {', '.join(VIT_SIZES)}")
        vit_fields = {f.name: f for f in dataclasses.fields(ViTConfig)}
        bad = sorted(set(m.options) - set(vit_fields))
        if bad:
            raise ValueError(f"model_options: unknown ViTConfig field(s) {', '.join(bad)}")
        hints = typing.get_type_hints(ViTConfig)
        for k, v in m.options.items():
            if k == "coord_augment":
                check_type(k, v, List[float], source)
            elif k not in ("image_size",):
                check_type(k, v, hints[k], source if k in POSITION_FIELDS else "--model-opt")
        vit = m.vit()
        for name, value in (("epochs", o.epochs), ("batch_size", o.batch_size), ("eval_batch_size", r.eval_batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, value in (("threads", r.threads), ("patch_size", m.patch_size), ("tubelet_size", m.tubelet_size),
                            ("lr_base_batch", o.lr_base_batch), ("log_every", r.log_every)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < float(d.train_fraction) <= 1.0:
            raise ValueError(f"train_fraction must be in (0, 1], got {d.train_fraction}")
        if not o.lr > 0 or not math.isfinite(o.lr):
            raise ValueError(f"lr must be a positive finite number, got {o.lr}")
        for name, value in (("weight_decay", o.weight_decay), ("warmup_epochs", o.warmup_epochs),
                            ("min_lr", o.min_lr), ("grad_clip", o.grad_clip), ("jitter", vit.jitter),
                            ("augment_shift", d.augment_shift), ("workers", d.workers),
                            ("checkpoint_every", r.checkpoint_every), ("mixup_alpha", d.mixup_alpha),
                            ("cutmix_alpha", d.cutmix_alpha)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        check_coord_augment(vit.coord_augment)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in d.augment_sizes):
            raise ValueError(f"augment_sizes must be a list of positive image sizes, got {d.augment_sizes!r}")
        if m.patch_size is not None:
            bad_sizes = [v for v in d.augment_sizes if v % m.patch_size]
            if bad_sizes:
                raise ValueError("augment_sizes: " + not_divisible(bad_sizes[0], m.patch_size))
        for name in ("hflip", "random_erasing"):
            if not 0.0 <= getattr(d, name) <= 1.0:
                raise ValueError(f"{name} is a probability in [0, 1], got {getattr(d, name)}")
        if not 0.0 < d.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {d.crop_pct}")
        lo_hi = {"crop_scale": (0.0, 1.0), "crop_ratio": (0.0, math.inf)}
        for name, (lo, hi) in lo_hi.items():
            v = getattr(d, name)
            if len(v) != 2 or not lo < v[0] <= v[1] <= hi:
                raise ValueError(f"{name} must be [low, high] with {lo:g} < low <= high"
                                 f"{f' <= {hi:g}' if math.isfinite(hi) else ''}, got {v!r}")
        from ..data.transforms import parse_auto_augment

        with warnings.catch_warnings():  # (the data's transform says what it ignores, once, when it is built)
            warnings.simplefilter("ignore")
            parse_auto_augment(d.auto_augment)
        if not is_streamed_data(d.name):
            defaults = DataConfig.__dataclass_fields__
            given = [n for n in DataConfig.STREAM_ONLY if getattr(d, n) != _default(defaults[n])]
            if given:
                raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to streamed data "
                                 f"(--data imagefolder or shards); the in-memory set {d.name!r} augments with "
                                 f"augment_shift / augment_sizes")
        else:
            _check_stream_options(d.data_options)
        if not 0.0 <= o.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {o.label_smoothing}")
        if not math.isfinite(vit.depth_scale_init):
            raise ValueError(f"depth_scale_init must be finite, got {vit.depth_scale_init}")
        from ..train.options import PRECISIONS, check_compile_backend

        check_compile_backend(r.compile)
        if r.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {r.precision!r}")
        if d.image_size is not None:
            sizes = [d.image_size] if isinstance(d.image_size, int) else list(d.image_size)
            if not 1 <= len(sizes) <= 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
                raise ValueError(f"image_size must be a positive integer or [H, W], got {d.image_size!r}")
            if m.patch_size is not None:
                bad_sizes = [v for v in sizes if v % m.patch_size]
                if bad_sizes:
                    raise ValueError(not_divisible(bad_sizes[0], m.patch_size))
        for name, value in (("pe_options", vit.pe_options), ("data_options", d.data_options),
                            ("model_options", m.options), ("native_options", d.native_options)):
            if not isinstance(value, dict):
                raise ValueError(f"{name} must be a mapping, got {value!r}")
        _check_pe_options(vit.pe, vit.pe_options)
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


_FIELD_TYPES = {name: typing.get_type_hints(typ) for name, typ in SECTION_TYPES.items()}


def not_divisible(size: int, patch: int, *, model_patch: bool = False) -> str:
    """The one-line message for an image ``size`` that ``patch`` does not tile: the nearest sizes that it does, and
    (unless ``model_patch``: a trained model's patch size, which cannot change) the patch sizes that tile ``size``."""
    lo, hi = size - size % patch, size - size % patch + patch
    whose = "the model's patch size" if model_patch else "the patch size"
    text = (f"image size {size} is not a multiple of {whose} {patch} (the last {size % patch} pixels would be cut "
            f"off): use --image-size {f'{lo} or {hi}' if lo else hi}")
    if model_patch:
        return text
    divisors = [p for p in range(1, min(size, 32) + 1) if size % p == 0 and p > 1]
    return f"{text}, or a patch size that divides {size} ({', '.join(map(str, divisors)) or 'none'})"


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


def split_pending_scaling(cfg: TrainConfig) -> Tuple[TrainConfig, Dict[str, Any]]:
    """``(cfg without it, the request)`` when ``cfg`` asks for a resolution scaling by method only
    (``model_options.resolution_scaling`` without a ``scale``, e.g. ``{"method": "pi"}``: what ``ropekit train
    --scaling`` records before the run starts; its scale is found against ``init_from`` when the model is built);
    else ``(cfg, {})``."""
    request = cfg.model.options.get("resolution_scaling") or {}
    if not request or "scale" in request:
        return cfg, {}
    options = {k: v for k, v in cfg.model.options.items() if k != "resolution_scaling"}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, options=options)), dict(request)


def build_vit_config(cfg: TrainConfig, info: Any) -> ViTConfig:
    """The model configuration for ``cfg`` on a dataset described by ``info`` (a ``DatasetInfo``): the size of
    ``cfg.model`` with its ``options`` set, and the data deciding the rest (classes, channels, size, modality,
    patch size when ``cfg.model.patch_size`` is ``None``, tubelet size of video).

    Raises:
        ValueError: an explicit ``patch_size`` that does not divide the image size (an automatic one that does not
            divide it gives a warning saying how many pixels are cut off).
    """
    m = cfg.model
    image_size = tuple(int(s) for s in info.image_size)
    patch = m.patch_size or auto_patch_size(image_size)
    bad = [v for v in image_size if v % patch]
    if bad and m.patch_size:
        raise ValueError(not_divisible(bad[0], patch))
    if bad:
        warnings.warn(f"image size {'x'.join(map(str, image_size))} is not a multiple of the automatic patch size "
                      f"{patch}: the model uses the top-left {'x'.join(str(v - v % patch) for v in image_size)} "
                      f"pixels (set --patch-size or --image-size to use them all)", stacklevel=2)
    kw: Dict[str, Any] = dict(num_classes=int(info.num_classes), in_chans=int(info.in_chans), image_size=image_size,
                              modality=info.kind, num_frames=getattr(info, "num_frames", None), patch_size=patch)
    if info.kind == "video":
        t = int(info.num_frames or 1)
        kw["tubelet_size"] = m.tubelet_size or (2 if t >= 4 else 1)
    kw.update(copy.deepcopy(m.options))
    for name in ("jitter", "depth_scale_init"):
        if name in kw:
            kw[name] = float(kw[name])
    return vit_config(m.size, **kw).resolved()
