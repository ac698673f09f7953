"""The training engine: the loop every task shares (:func:`fit`), behind ``ropekit train``.

A task supplies its model, batches and loss (:class:`Task`), :class:`FitOptions` the rest; tasks register themselves
(:mod:`ropekit.train.tasks`, the entry-point group ``ropekit.tasks``) and the engine imports none of them
(classification, the default task, is :mod:`ropekit.classification`). The helpers of the engine (checkpoint files,
metrics files, distributed set-up, augmentation, option checks, the converter of recorded configurations) are the
submodules ``checkpoint``, ``metrics``, ``distributed``, ``augment``, ``options`` and ``upgrade``.
"""

from .._optional import require_extra as _require_extra

_require_extra("train", "ropekit.train")  # before the submodules import what it installs

from .checkpoint import CheckpointError, load_checkpoint
from .engine import EngineOptions, FitOptions, FitResult, NonFiniteLossError, RunLockedError, SaveError, Schedule, \
    StreamedEpoch, Task, build_optimizer, fit, warmup_cosine
from .run_folder import load_run
from .tasks import register_task

__all__ = [
    "load_run", "load_checkpoint", "fit", "FitOptions", "FitResult", "Task", "EngineOptions", "Schedule",
    "build_optimizer", "warmup_cosine", "StreamedEpoch", "CheckpointError", "NonFiniteLossError", "SaveError",
    "RunLockedError", "register_task",
]
