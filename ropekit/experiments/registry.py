"""The studies by name, their presets, and :func:`run_experiment` (what ``ropekit experiment NAME`` calls)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from .ablations import run_ablations
from .classify import run_classify
from .common import StudyResult
from .data_efficiency import run_data_efficiency
from .exact_vs_relaxed import run_exact_vs_relaxed
from .offset import run_offset
from .resolution import run_resolution
from .settings import ExperimentConfig, default_config, quick_config
from .shuffle import run_shuffle
from .video import VIDEO_DEFAULTS, VIDEO_QUICK, run_video

__all__ = ["Study", "STUDIES", "study_config", "run_experiment"]


@dataclass
class Study:
    """A study: its function ``fn(cfg, out, **options)``, a one-line help, the study options it accepts, and
    the presets it changes (default and ``--quick``)."""

    fn: Callable[..., StudyResult]
    help: str
    options: tuple = ()
    defaults: Dict[str, Any] = field(default_factory=dict)
    quick: Dict[str, Any] = field(default_factory=dict)


STUDIES: Dict[str, Study] = {
    "classify": Study(run_classify, "accuracy of every encoding (SPEC §6.1)"),
    "resolution": Study(run_resolution, "train at one size, evaluate at smaller and larger ones (§6.2)", ("sizes",)),
    "offset": Study(run_offset, "accuracy and logits under random global coordinate offsets (§6.3)",
                    ("rhos", "cls_pe")),
    "shuffle": Study(run_shuffle, "relative accuracy drop when the patches are permuted (§6.4)"),
    "data-efficiency": Study(run_data_efficiency, "accuracy vs training fraction; epochs to reach APE (§6.5)",
                             ("fractions",)),
    "exact-vs-relaxed": Study(run_exact_vs_relaxed, "relaxed STRING exact=True vs exact=False on MNIST (§6.6)",
                              ("deltas",)),
    "video": Study(run_video, "moving-digits clips with (t, y, x) coordinates (§6.7)", (),
                   VIDEO_DEFAULTS, VIDEO_QUICK),
    "ablations": Study(run_ablations, "sharing model/layer/head, block size, position jitter (§6.10)",
                       ("groups", "sharing_pe", "block_pe", "jitter_pe", "block_sizes_")),
    "robot": Study(lambda cfg, out, **o: __import__("ropekit.robot.experiment", fromlist=["run_study"]).run_study(
        cfg, out, **o), "2-D vs 3-D STRING robot policies in and out of distribution (§6.9; needs pybullet)"),
    "aloha": Study(lambda c, out, **o: __import__("ropekit.robot.aloha.experiment", fromlist=["run_study"]).run_study(
        c, out, **o), "bimanual ALOHA diffusion policies: APE vs RoPE vs STRING encoders (needs ropekit[aloha])"),
    "detect3d": Study(lambda c, out, **o: __import__("ropekit.detection.experiment", fromlist=["run_study"]).run_study(
        c, out, **o), "3-D boxes from RGB (ViT) vs RGB-D (ViTD) for each encoding (§6.8; needs pybullet)"),
}


def study_config(name: str, quick: bool = False, overrides: Optional[Dict[str, Any]] = None) -> ExperimentConfig:
    """The :class:`ExperimentConfig` of study ``name``: the preset, the study's changes, then ``overrides``.

    ``model_options`` given in ``overrides`` are merged into the preset's (unless ``model`` is given too, in
    which case they replace them: a named size brings its own width and depth); ``data_options`` likewise.
    """
    study = _lookup(name)
    base = quick_config() if quick else default_config()
    preset = copy.deepcopy(study.quick if quick else study.defaults)
    cfg = base.replace(**preset)
    over = dict(overrides or {})
    if "model" in over and "model_options" not in over:
        over["model_options"] = {}
    elif "model_options" in over and "model" not in over:
        over["model_options"] = {**cfg.model_options, **over["model_options"]}
    if "data_options" in over and "data" not in over:
        over["data_options"] = {**cfg.data_options, **over["data_options"]}
    elif "data" in over and "data_options" not in over and over["data"] != cfg.data:
        over["data_options"] = {}
    if over.get("pes") is not None:
        over["pes"] = [p.lower().replace("_", "-") for p in over["pes"]]
    return cfg.replace(**over)


def run_experiment(name: str, *, out: Any = None, quick: bool = False, overrides: Optional[Dict[str, Any]] = None,
                   cfg: Optional[ExperimentConfig] = None, **options: Any) -> StudyResult:
    """Run study ``name`` and write its outputs into ``out`` (default ``runs/experiments/<name>``).

    Args:
        name: one of :data:`STUDIES`.
        quick: the tiny preset (seconds per study).
        overrides: :class:`ExperimentConfig` fields to change (e.g. ``{"pes": ["mixed"], "seeds": [0, 1]}``).
        cfg: a complete configuration instead of preset + overrides.
        **options: study options (``rhos``, ``cls_pe``, ``sizes``, ``fractions``, ``deltas``, ``groups``).

    Raises:
        ValueError: unknown study or option.
    """
    study = _lookup(name)
    unknown = sorted(k for k in options if k not in study.options)
    if unknown:
        def flags(names):
            return ", ".join("--" + n.rstrip("_").replace("_", "-") for n in names)

        takes = f"; it takes {flags(study.options)}" if study.options else ""
        raise ValueError(f"experiment {name} takes no option {flags(unknown)}{takes}")
    cfg = cfg if cfg is not None else study_config(name, quick, overrides)
    out = Path(out) if out is not None else Path("runs") / "experiments" / name
    return study.fn(cfg, out, **options)


def _lookup(name: str) -> Study:
    if name not in STUDIES:
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(STUDIES)}")
    return STUDIES[name]
