"""Training and evaluation of ViTs with rotary position encodings (behind ``ropekit train`` / ``ropekit eval``).

>>> from ropekit.train import TrainConfig, train
>>> result = train(TrainConfig(data="digits", epochs=2, out="runs/demo"))      # doctest: +SKIP
>>> result.final["test_acc"]                                                    # doctest: +SKIP

The loop itself is :func:`fit`, shared by every task: a task supplies its model, batches and loss (:class:`Task`),
:class:`FitOptions` the rest; tasks register themselves (:mod:`ropekit.train.tasks`, the entry-point group
``ropekit.tasks``) and the engine imports none of them. Classification (:func:`train`, :func:`evaluate`, ...) is
imported on first use of its names. The helpers behind them (checkpoint files, metrics files, distributed set-up,
augmentation, option parsing) are in the submodules ``checkpoint``, ``metrics``, ``distributed``, ``augment`` and
``config``; training recipes (``--preset``) in ``recipes``.
"""

from .._optional import require_extra as _require_extra

_require_extra("train", "ropekit.train")  # before the submodules import what it installs

from .checkpoint import CheckpointError, load_checkpoint
from .config import TrainConfig, build_vit_config
from .engine import EngineOptions, FitOptions, FitResult, NonFiniteLossError, RunLockedError, SaveError, Schedule, \
    StreamedEpoch, Task, build_optimizer, fit, warmup_cosine
from .run_folder import load_run
from .tasks import register_task

#: names of the classification task, imported from :mod:`ropekit.train.trainer` when first asked for
_CLASSIFICATION = ("ClassificationTask", "TrainResult", "evaluate", "evaluate_run", "load_data", "train")

__all__ = [
    "TrainConfig", "TrainResult", "train", "evaluate", "evaluate_run", "load_data", "load_run", "load_checkpoint",
    "build_vit_config", "fit", "FitOptions", "FitResult", "Task", "ClassificationTask", "EngineOptions", "Schedule",
    "build_optimizer", "warmup_cosine", "StreamedEpoch", "CheckpointError", "NonFiniteLossError", "SaveError", "RunLockedError",
    "register_task",
]


def __getattr__(name: str) -> object:
    if name in _CLASSIFICATION:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
