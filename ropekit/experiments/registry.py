"""The studies by name, their pinned recipes, and :func:`run_experiment` (what ``ropekit experiment NAME`` calls)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from .ablations import run_ablations
from .classify import run_classify
from .common import StudyResult
from .data_efficiency import run_data_efficiency
from .exact_vs_relaxed import run_exact_vs_relaxed
from .offset import run_offset
from .resolution import run_resolution
from .scale import run_scale
from .recipes import PRESETS, RECIPES, experiment_config, recipe
from .settings import ExperimentConfig, default_config, quick_config
from .shuffle import run_shuffle
from .video import run_video

__all__ = ["Study", "STUDIES", "study_config", "study_options", "run_experiment"]


@dataclass
class Study:
    """A study: its function ``fn(cfg, out, **options)``, a one-line help, the study options it accepts, the
    ``TrainConfig`` fields it changes from run to run besides ``pe`` and ``seed`` (``varies``; with
    ``varies_overrides`` also where the recipe's per-encoding overrides set them, as the sharing ablation does
    with the paper's sharing). A study with an
    entry in :data:`ropekit.experiments.recipes.RECIPES` takes its configuration from that pinned recipe;
    detect3d from its own pinned recipes (:mod:`ropekit.detection.recipes`), robot and aloha from their own
    configuration classes."""

    fn: Callable[..., StudyResult]
    help: str
    options: tuple = ()
    varies: tuple = ()
    varies_overrides: bool = False


STUDIES: Dict[str, Study] = {
    "classify": Study(run_classify, "accuracy of every encoding, paired by seed", (), ("pe_sharing",)),
    "resolution": Study(run_resolution, "train at one size, evaluate at other sizes, grid and normalised "
                                        "coordinates, scale augmentation", ("sizes", "coord_modes", "scale_sizes"),
                           ("pe_sharing", "coords", "augment_sizes")),
    "offset": Study(run_offset, "accuracy and logits under random global coordinate offsets",
                    ("rhos", "cls_pe"), ("pe_sharing", "cls")),
    "shuffle": Study(run_shuffle, "relative accuracy drop when the patches are permuted", (), ("pe_sharing",)),
    "data-efficiency": Study(run_data_efficiency, "accuracy vs training fraction at equal epochs and at equal "
                                                  "steps", ("fractions", "budgets"),
                             ("pe_sharing", "train_fraction", "epochs", "warmup_epochs")),
    "exact-vs-relaxed": Study(run_exact_vs_relaxed, "relaxed STRING exact=True vs exact=False, whole-patch shifts "
                                                    "on a padded canvas", ("shifts", "canvas_pad", "deltas"),
                              ("pe_options",)),
    "video": Study(run_video, "moving-digit clips labelled by direction of motion, (t, y, x) coordinates, frame "
                              "shuffling", (), ("pe_sharing",)),
    "ablations": Study(run_ablations, "sharing for every learnable encoding, block sizes, position jitter",
                       ("groups", "sharing_pe", "block_pe", "jitter_pe", "block_sizes_"),
                       ("pe_sharing", "per_head", "pe_options", "jitter"), varies_overrides=True),
    "scale": Study(run_scale, "depth and training length one at a time: which turns rotary vs APE",
                   ("arms",), ("pe_sharing", "model_options", "epochs")),
    "robot": Study(lambda cfg, out, **o: __import__("ropekit.robot.experiment", fromlist=["run_study"]).run_study(
        cfg, out, **o), "2-D vs 3-D STRING robot policies in and out of distribution (needs pybullet)"),
    "aloha": Study(lambda c, out, **o: __import__("ropekit.robot.aloha.experiment", fromlist=["run_study"]).run_study(
        c, out, **o), "bimanual ALOHA diffusion policies: APE vs RoPE vs STRING encoders (needs ropekit[aloha])"),
    "detect3d": Study(lambda c, out, **o: __import__("ropekit.detection.experiment", fromlist=["run_study"]).run_study(
        c, out, **o), "3-D boxes from RGB (ViT) vs RGB-D (ViTD: depth as input and coordinate) for each encoding "
                      "(needs pybullet)", ("inputs",)),
}

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
    study = _lookup(name)
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
    _lookup(name)
    return dict(recipe(name, preset)["study"]["options"]) if name in RECIPES else {}


def run_experiment(name: str, *, out: Any = None, quick: bool = False, overrides: Optional[Dict[str, Any]] = None,
                   cfg: Optional[ExperimentConfig] = None, preset: Optional[str] = None,
                   **options: Any) -> StudyResult:
    """Run study ``name`` and write its outputs into ``out`` (default ``runs/experiments/<name>``).

    Args:
        name: one of :data:`STUDIES`.
        quick: the tiny preset (seconds per study); the same as ``preset="quick"``.
        preset: ``default`` (2-core CPU), ``gpu`` (one GPU, under 30 minutes) or ``quick``.
        overrides: :class:`ExperimentConfig` fields to change (e.g. ``{"pes": ["mixed"], "seeds": [0, 1]}``).
        cfg: a complete configuration instead of recipe + overrides.
        **options: study options (``rhos``, ``cls_pe``, ``sizes``, ``fractions``, ``shifts``, ``groups``...);
            each defaults to the recipe's.

    Raises:
        ValueError: unknown study, preset or option.
    """
    study = _lookup(name)
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


def _lookup(name: str) -> Study:
    if name not in STUDIES:
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(STUDIES)}")
    return STUDIES[name]
