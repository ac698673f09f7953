"""Running a registered study: its configuration from the pinned recipe and overrides (:func:`study_config`), its
options (:func:`study_options`), and :func:`run_experiment` (what ``ropekit experiment NAME`` calls)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from .common import StudyResult
from .recipes import PRESETS, RECIPES, experiment_config, recipe
from .registry import lookup_study
from .settings import ExperimentConfig, default_config, quick_config

__all__ = ["study_config", "study_options", "run_experiment"]

#: The size keys of a named model (``--model small`` replaces them; the recipe's other architecture fields stay).
_SIZE_KEYS = ("embed_dim", "depth", "num_heads", "mlp_ratio")


def _preset_name(quick: bool, preset: Optional[str]) -> str:
    if preset is None:
        return "quick" if quick else "default"
    if quick and preset != "quick":
        raise ValueError(f"--quick and --preset {preset} contradict each other; give one")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    return preset


def study_config(name: str, quick: bool = False, overrides: Optional[Dict[str, Any]] = None,
                 preset: Optional[str] = None) -> ExperimentConfig:
    """The :class:`ExperimentConfig` of study ``name``: its pinned recipe at ``preset`` (``default``, ``gpu``,
    or ``quick``; ``quick=True`` means ``preset="quick"``), then ``overrides``.

    ``model_options`` given in ``overrides`` are merged into the recipe's; a ``model`` given without them
    replaces only the size (width, depth, heads, MLP ratio) and keeps the recipe's other architecture fields.
    ``data_options`` are merged likewise (a different ``data`` without options starts from none).

    Raises:
        ValueError: unknown study or preset.
    """
    study = lookup_study(name)
    preset = _preset_name(quick, preset)
    if name in RECIPES:
        cfg = experiment_config(name, preset)
    else:
        cfg = (quick_config() if preset == "quick" else default_config()).replace(preset=preset)
    over = dict(overrides or {})
    if "model" in over and "model_options" not in over:
        over["model_options"] = {k: v for k, v in cfg.model_options.items() if k not in _SIZE_KEYS}
    elif "model_options" in over and "model" not in over:
        over["model_options"] = {**cfg.model_options, **over["model_options"]}
    if "data_options" in over and "data" not in over:
        over["data_options"] = {**cfg.data_options, **over["data_options"]}
    elif "data" in over and "data_options" not in over and over["data"] != cfg.data:
        over["data_options"] = {}
    if "train_options" in over:
        over["train_options"] = {**cfg.train_options, **over["train_options"]}
    if over.get("pes") is not None:
        over["pes"] = [p.lower().replace("_", "-") for p in over["pes"]]
    return cfg.replace(**over)


def study_options(name: str, preset: str = "default") -> Dict[str, Any]:
    """The study options (shifts, sizes, fractions...) the recipe of ``name`` states at ``preset``."""
    lookup_study(name)
    return dict(recipe(name, preset)["study"]["options"]) if name in RECIPES else {}


def run_experiment(name: str, *, out: Any = None, quick: bool = False, overrides: Optional[Dict[str, Any]] = None,
                   cfg: Optional[ExperimentConfig] = None, preset: Optional[str] = None,
                   **options: Any) -> StudyResult:
    """Run study ``name`` and write its outputs into ``out`` (default ``runs/experiments/<name>``).

    Args:
        name: one of :data:`~ropekit_studies.registry.STUDIES`.
        quick: the tiny preset (seconds per study); the same as ``preset="quick"``.
        preset: ``default`` (2-core CPU), ``gpu`` (one GPU, under 30 minutes) or ``quick``.
        overrides: :class:`ExperimentConfig` fields to change (e.g. ``{"pes": ["mixed"], "seeds": [0, 1]}``).
        cfg: a complete configuration instead of recipe + overrides.
        **options: study options (``rhos``, ``cls_pe``, ``sizes``, ``fractions``, ``shifts``, ``groups``...);
            each defaults to the recipe's.

    Raises:
        ValueError: unknown study, preset or option.
    """
    study = lookup_study(name)
    unknown = sorted(k for k in options if k not in study.options)
    if unknown:
        def flags(names):
            return ", ".join("--" + n.rstrip("_").replace("_", "-") for n in names)

        takes = f"; it takes {flags(study.options)}" if study.options else ""
        raise ValueError(f"experiment {name} takes no option {flags(unknown)}{takes}")
    cfg = cfg if cfg is not None else study_config(name, quick, overrides, preset)
    opts = {**study_options(name, cfg.preset if cfg.preset in PRESETS else "default"), **options}
    out = Path(out) if out is not None else Path("runs") / "experiments" / name
    return study.fn(cfg, out, **opts)
