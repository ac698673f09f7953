"""The one converter of run configurations: any ``train`` section a ropekit version wrote -> the current nested form.

A run's configuration has four sections::

    model   the ViT: size (tiny, small, base), patch_size, tubelet_size, pe, pe_options, pe_sharing, per_head, ape,
            cls, coords, jitter, coord_augment, depth_input, depth_scale_init, init_from, and options: any other
            ``ropekit.nn.ViTConfig`` field (embed_dim, depth, num_heads, drop_path_rate...), which may also be
            given in ``model`` by its own name
    data    the dataset (name, data_root, image_size, ...), its loader and its augmentation
    optim   epochs, batch size, learning-rate schedule, weight decay, label smoothing, gradient clipping
    run     seed, run folder, device, precision, compile, evaluation batch, logging, threads, checkpoints

:func:`upgrade_config` reads every form a ``train`` section has had (the flat mapping of ``TrainConfig`` fields
that ``config.json`` and checkpoints record, or the nested one) and returns the nested form, with

* :data:`RENAMED` keys under their new names, and
* (a recorded configuration, ``fill=True``) every field of :data:`ADDED` it predates set to the value such runs
  trained with.

:func:`flatten` and :func:`nest` convert between the nested form and ``TrainConfig``'s fields. Architectures
recorded whole (a study recipe's ``model_options``, a detector's backbone, a policy's ``vit_overrides``) predate
fields of ``ViTConfig`` too: :func:`upgrade_architecture` fills them from :data:`ADDED_MODEL`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Mapping, Tuple

from ..nn.vit import ViTConfig

__all__ = ["SECTIONS", "NESTED_NAMES", "RENAMED", "ADDED", "ADDED_MODEL", "FLAT_FIELDS", "upgrade_config",
           "upgrade_architecture", "nest", "flatten", "is_nested", "undot"]

#: The ``TrainConfig`` fields of each section, in order. ``model`` holds besides them ``options``
#: (``TrainConfig.model_options``: any other ``ViTConfig`` field), whose fields it also accepts by their own names.
SECTIONS: Dict[str, Tuple[str, ...]] = {
    "model": ("model", "patch_size", "tubelet_size", "pe", "pe_options", "pe_sharing", "per_head", "ape", "cls",
              "coords", "jitter", "coord_augment", "depth_input", "depth_scale_init", "init_from"),
    "data": ("data", "data_root", "image_size", "data_options", "split_seed", "normalize", "train_fraction",
             "workers", "native_resolution", "native_options", "augment_shift", "augment_sizes", "crop_scale",
             "crop_ratio", "hflip", "auto_augment", "random_erasing", "crop_pct", "mixup_alpha", "cutmix_alpha"),
    "optim": ("epochs", "batch_size", "lr", "weight_decay", "warmup_epochs", "min_lr", "label_smoothing",
              "grad_clip", "lr_base_batch"),
    "run": ("seed", "out", "device", "precision", "compile", "eval_batch_size", "progress", "tensorboard", "threads",
            "log_every", "checkpoint_every"),
}

#: ``TrainConfig`` fields named otherwise in the nested form (``model.size``, ``data.name``).
NESTED_NAMES: Dict[str, str] = {"model": "size", "data": "name"}

#: ``TrainConfig`` fields renamed since runs were first written: old name -> new name.
RENAMED: Dict[str, str] = {}

#: ``TrainConfig`` fields added after runs were committed (``docs/results``), each with the value those runs
#: trained with: a recorded configuration that lacks one is read as holding it.
ADDED: Dict[str, Any] = {
    "crop_scale": [0.08, 1.0], "crop_ratio": [3 / 4, 4 / 3], "hflip": 0.5, "auto_augment": "none",
    "random_erasing": 0.0, "crop_pct": 0.875, "workers": 0,  # streamed data (in-memory sets refuse other values)
    "lr_base_batch": None, "mixup_alpha": 0.0, "cutmix_alpha": 0.0, "native_resolution": False,
    "native_options": {}, "coord_augment": [0.0, 1.0, 1.0],
}

#: ``ViTConfig`` fields added after committed architectures were recorded whole, with the value they trained with
#: (``num_kv_heads=None``: multi-head attention; ``coord_augment`` off; ``resolution_scaling`` none).
#: ``coord_augment`` is also a ``TrainConfig`` field, so only a whole backbone (one that states ``coords``) records
#: it; a recipe's ``model_options`` never does.
ADDED_MODEL: Dict[str, Any] = {"num_kv_heads": None, "coord_augment": [0.0, 1.0, 1.0], "resolution_scaling": {}}

#: Every flat name a ``train`` section has had (the fields of the flat ``TrainConfig`` of ropekit <= 0.1, which
#: ``config.json`` files, checkpoints and ``--set`` / ``--config`` still accept): each section's, then
#: ``model_options``.
FLAT_FIELDS: Tuple[str, ...] = (*(n for names in SECTIONS.values() for n in names), "model_options")

_SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}
_VIT_FIELDS = frozenset(f.name for f in dataclasses.fields(ViTConfig))


def is_nested(d: Mapping[str, Any]) -> bool:
    """Whether ``d`` is a nested configuration (a section given as a mapping) rather than ``TrainConfig`` fields
    (where ``model`` and ``data`` are names)."""
    return any(isinstance(d.get(s), Mapping) for s in SECTIONS)


def nest(flat: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """``TrainConfig`` fields -> the nested form (``model_options`` as ``model.options``). Keys that are no field
    are kept, at the top level, for the reader to refuse or ignore."""
    out: Dict[str, Any] = {s: {} for s in SECTIONS}
    for key, value in flat.items():
        if key == "model_options":
            out["model"]["options"] = copy.deepcopy(value)
        elif key in _SECTION_OF:
            out[_SECTION_OF[key]][NESTED_NAMES.get(key, key)] = copy.deepcopy(value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def flatten(nested: Mapping[str, Any]) -> Dict[str, Any]:
    """The nested form -> ``TrainConfig`` fields. ``model.options`` is ``model_options``; another ``ViTConfig`` field
    given by its own name in ``model`` (``depth: 4``) joins it. A key that belongs nowhere comes back as
    ``"section.key"`` (top-level keys as they are), so that the reader names it in its error or warning.

    Raises:
        ValueError: a section that is not a mapping, or a ``ViTConfig`` field given both by name and in
            ``model.options`` with two values.
    """
    flat: Dict[str, Any] = {}
    by_name: Dict[str, Any] = {}
    for key, value in nested.items():
        if key not in SECTIONS:
            flat[key] = copy.deepcopy(value)
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"section {key} must be a mapping of options, got {value!r}")
        renamed = {v: k for k, v in NESTED_NAMES.items() if _SECTION_OF[k] == key}  # nested name -> field
        for name, v in value.items():
            field = renamed.get(name, name)
            if key == "model" and name == "options":
                flat["model_options"] = copy.deepcopy(v)
            elif _SECTION_OF.get(field) == key and (name in renamed or field not in NESTED_NAMES):
                flat[field] = copy.deepcopy(v)
            elif key == "model" and field in _VIT_FIELDS:
                by_name[field] = copy.deepcopy(v)
            else:
                flat[f"{key}.{name}"] = v
    if by_name:
        options = flat.get("model_options")
        if isinstance(options, Mapping):
            clash = sorted(k for k in set(by_name) & set(options) if by_name[k] != options[k])
            if clash:
                raise ValueError(f"model: {clash[0]} is given twice, as model.{clash[0]} and in model.options")
            by_name = {**options, **by_name}
        flat["model_options"] = by_name
    return flat


def undot(d: Mapping[str, Any]) -> Dict[str, Any]:
    """``{"optim.lr": 0.1, "model.options.depth": 4, "seed": 1}`` -> ``{"optim": {"lr": 0.1}, "model": {"options":
    {"depth": 4}}, "seed": 1}``: keys spelled ``section.key`` (``--set optim.lr=0.1``) join their section (a
    section also given as a mapping is merged into; other keys are kept as they are)."""
    dotted = {k: v for k, v in d.items() if "." in str(k) and str(k).partition(".")[0] in SECTIONS}
    out: Dict[str, Any] = {k: copy.deepcopy(v) for k, v in d.items() if k not in dotted}
    for key, value in dotted.items():
        head, _, rest = key.partition(".")
        node = out.setdefault(head, {})
        *parents, last = rest.split(".")
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node
        if not isinstance(node, dict):
            raise ValueError(f"{key}: {key.rpartition('.')[0]} is a value, not a section")
        node[last] = copy.deepcopy(value)
    return out


def upgrade_config(d: Mapping[str, Any], *, fill: bool = True) -> Dict[str, Any]:
    """Any recorded form of a ``train`` section -> the current nested form (left unchanged: a new dict).

    Args:
        d: the flat mapping of ``TrainConfig`` fields of any ropekit version, or the nested form.
        fill: set every field of :data:`ADDED` that ``d`` lacks to the value runs that predate it trained with (a
            recorded configuration; a user's own options leave missing fields at their defaults).

    Returns:
        ``{"model": {...}, "data": {...}, "optim": {...}, "run": {...}}`` plus, at the top level, any key that is no
        field (for the reader to refuse or ignore).
    """
    if any("." in str(k) for k in d):
        d = undot(d)
    if is_nested(d):
        flat = flatten(d)
    else:
        flat = dict(d)
    for old, new in RENAMED.items():
        if old in flat and new not in flat:
            flat[new] = flat.pop(old)
        flat.pop(old, None)
    if fill:
        for name, value in ADDED.items():
            flat.setdefault(name, copy.deepcopy(value))
    return nest(flat)


def upgrade_architecture(options: Mapping[str, Any]) -> Dict[str, Any]:
    """``options`` (the ``ViTConfig`` fields of a recorded architecture) with every field of :data:`ADDED_MODEL`
    it predates set to the value it trained with; ``coord_augment`` only for a whole backbone (one stating
    ``coords``, a field a recipe's ``model_options`` never holds)."""
    added = {k: v for k, v in ADDED_MODEL.items() if k != "coord_augment" or "coords" in options}
    return {**copy.deepcopy(added), **options}

