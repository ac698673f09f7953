"""``ExperimentConfig``: the backbone, data, schedule, seeds and encodings shared by every run of a study.

Every study trains the *same* backbone for each encoding in ``pes`` and each seed in ``seeds``; only the
encoding (or, in ``ablations``, one option of it) changes. :meth:`ExperimentConfig.train_config` turns the
experiment settings into the :class:`ropekit.classification.TrainConfig` of one run; runs are cached by a hash of that
resolved configuration (see :mod:`ropekit_studies.runs`), so studies that need the same model share it.

The studies take their settings from pinned recipes (:mod:`ropekit_studies.recipes`: ``default`` for a
2-core CPU, ``gpu``, ``quick``), which give every ``TrainConfig`` field explicitly. :func:`default_config` and
:func:`quick_config` below remain for studies without a recipe (detect3d, robot).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ropekit.classification import TrainConfig
from ropekit.train.upgrade import FLAT_FIELDS

__all__ = ["ExperimentConfig", "DEFAULT_PES", "QUICK_PES", "SCALE_PES", "quick_config", "default_config",
           "shared_train_fields"]

#: The encodings every comparison study trains unless ``--pe`` says otherwise.
DEFAULT_PES: Tuple[str, ...] = ("none", "absolute", "axial", "mixed", "cayley", "circulant", "liere",
                                "liere-commute", "comrope-ap", "comrope-ld")

#: ``--quick``: one encoding without coordinates, one commuting, one non-commuting.
QUICK_PES: Tuple[str, ...] = ("absolute", "mixed", "liere")

#: The scale study: the learned absolute embedding (its reference) against the fixed rotary encoding and the two
#: STRING variants the papers lead with.
SCALE_PES: Tuple[str, ...] = ("absolute", "axial", "cayley", "circulant")


@dataclass
class ExperimentConfig:
    """Settings shared by all runs of a study.

    Encodings and seeds:
        pes: encodings to compare (``None``: the study's default list); seeds: one run per seed.
    Data:
        data, data_root, data_options, image_size (training size; ``None``: the dataset's), split_seed,
        train_fraction (stratified fraction of the training set every run uses).
    Backbone (see :class:`ropekit.nn.ViTConfig`):
        model (named size), model_options (overrides: ``embed_dim``, ``num_heads``, ``depth``...), patch_size,
        tubelet_size (video).
    Schedule:
        epochs, batch_size, lr, weight_decay, warmup_epochs, augment_shift; train_options: any other
        ``TrainConfig`` field.
    Evaluation and running:
        eval_limit (use the first N test examples in evaluations; ``None``: all), eval_batch_size,
        cache_dir (trained runs, keyed by config hash), threads (torch CPU threads; 1 is friendliest on a shared
        machine), progress (bars), quick (the quick preset is in use), preset (the recipe preset's name,
        recorded in the outputs; see :mod:`ropekit_studies.recipes`).
    Per encoding:
        pe_overrides: ``TrainConfig`` fields set for one encoding only (``{"mixed": {"pe_sharing": "head"}}``),
        applied after ``train_options``.
    """

    pes: Optional[List[str]] = None
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])

    data: str = "mnist"
    data_root: Optional[str] = None
    data_options: Dict[str, Any] = field(default_factory=dict)
    image_size: Optional[int] = None
    split_seed: int = 0
    train_fraction: float = 1.0

    model: str = "tiny"
    model_options: Dict[str, Any] = field(default_factory=lambda: dict(embed_dim=64, num_heads=2, depth=2))
    patch_size: Optional[int] = 7
    tubelet_size: Optional[int] = None

    epochs: int = 5
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 0.5
    augment_shift: int = 0
    train_options: Dict[str, Any] = field(default_factory=dict)

    eval_limit: Optional[int] = None
    eval_batch_size: int = 250
    cache_dir: str = ".cache/ropekit-experiments"
    threads: Optional[int] = 1
    progress: bool = True
    quick: bool = False
    preset: str = "default"
    pe_overrides: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    # ------------------------------------------------------------------ helpers
    def replace(self, **changes: Any) -> "ExperimentConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def pe_list(self, default: Sequence[str]) -> List[str]:
        """``pes`` if given, else ``default`` (``QUICK_PES``-sized in quick mode)."""
        return list(self.pes) if self.pes else list(default)

    def train_config(self, pe: str, seed: int, **changes: Any) -> TrainConfig:
        """The :class:`TrainConfig` of one run: this backbone and schedule with encoding ``pe`` and ``seed``.

        ``changes`` override any ``TrainConfig`` field (``pe_options``, ``pe_sharing``, ``cls``, ``jitter``,
        ``train_fraction``...). Runtime-only fields (``out``, ``progress``, ``tensorboard``, ``threads``) are set
        by the run cache, not here.
        """
        base: Dict[str, Any] = {name: copy.deepcopy(getattr(self, name)) for name in shared_train_fields()}
        base.update(pe=pe, seed=int(seed))
        base.update(self.train_options)
        base.update(self.pe_overrides.get(pe.lower().replace("_", "-"), {}))
        base.update(changes)
        return TrainConfig.from_dict(base, source="experiment")


def shared_train_fields() -> List[str]:
    """The ``ExperimentConfig`` fields that are ``TrainConfig`` fields too, and are copied into every run's
    configuration (all but the runtime-only ``threads`` and ``progress``, which the run cache sets)."""
    train = set(FLAT_FIELDS)
    return [f.name for f in dataclasses.fields(ExperimentConfig) if f.name in train
            and f.name not in ("threads", "progress")]


def default_config(**changes: Any) -> ExperimentConfig:
    """The preset behind the committed results (``docs/results``)."""
    return ExperimentConfig(**changes)


def quick_config(**changes: Any) -> ExperimentConfig:
    """``--quick``: a tiny model on a few hundred images for one epoch, one seed (seconds per study)."""
    base = ExperimentConfig(
        seeds=[0], train_fraction=0.1, model_options=dict(embed_dim=32, num_heads=2, depth=1), epochs=1,
        batch_size=32, lr=2e-3, warmup_epochs=0.2, eval_limit=200, quick=True,
    )
    return dataclasses.replace(base, **changes)
