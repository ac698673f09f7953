"""The experiment protocols behind ``ropekit experiment NAME`` (kept apart from the core library).

>>> from ropekit_studies import run_experiment
>>> result = run_experiment("offset", quick=True, out="runs/experiments/offset")      # doctest: +SKIP
>>> print(result.table)                                                               # doctest: +SKIP

Studies: ``classify`` (and ``classify-coords``, grid against normalised coordinates), ``resolution`` (and
``resolution-comrope``, ComRoPE's protocol), ``offset``, ``shuffle``, ``data-efficiency``, ``exact-vs-relaxed``,
``video`` (and ``video-coords``, grid against normalised coordinates), ``ablations``, ``scale``, ``mqa``
(multi-query attention), ``native-resolution`` (fixed-size against packed native-resolution training, with
resolution scaling), ``resolution-finetune`` (fine-tuning at twice the size with and without a scaling in place),
and the tasks' studies: ``detect3d``, ``robot``, ``aloha``, ``retrieval`` (and
``retrieval-depth``), ``owl``.
Each trains (or takes from the run cache) the same backbone for every encoding and seed, from its pinned recipe
(:mod:`ropekit_studies.recipes`; presets ``default``, ``gpu``, ``quick``), and writes ``<study>.csv``,
``<study>.json``, ``table.md``, ``<study>.png`` and ``config.json`` (with the recipe).
:mod:`ropekit_studies.verify` (``ropekit experiment verify FOLDER``) re-runs a sample of a committed study and
says whether its readings hold.
"""

from ropekit._optional import require_extra

require_extra("studies", "ropekit_studies")  # before the submodules import what it installs

from .common import StudyResult
from .recipes import PRESETS, RECIPES, compare_with_committed, recipe
from .registry import STUDIES, register_study
from .runner import run_experiment, study_config
from .settings import DEFAULT_PES, QUICK_PES, ExperimentConfig, default_config, quick_config

# Every study module, each registering its study (in this order: ``ropekit experiment all`` runs them so).
from . import classify, resolution, offset, shuffle, data_efficiency, exact_vs_relaxed, video, ablations  # noqa: E402,I001
from . import scale, task_studies, retrieval, owl, compute_efficiency, native_resolution  # noqa: E402,I001
from . import resolution_finetune  # noqa: E402,I001

__all__ = ["run_experiment", "study_config", "STUDIES", "register_study", "StudyResult", "ExperimentConfig", "default_config",
           "quick_config", "DEFAULT_PES", "QUICK_PES", "PRESETS", "RECIPES", "recipe", "compare_with_committed"]
