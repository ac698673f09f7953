"""Training and evaluation of ViTs with rotary position encodings (behind ``ropekit train`` / ``ropekit eval``).

>>> from ropekit.train import TrainConfig, train
>>> result = train(TrainConfig(data="digits", epochs=2, out="runs/demo"))      # doctest: +SKIP
>>> result.final["test_acc"]                                                    # doctest: +SKIP

The loop itself is :func:`ropekit.train.engine.fit`, shared with the 3-D detector and the robot policy: a task
supplies its model, batches and loss (:class:`ropekit.train.engine.Task`).
"""

from .._optional import require_extra

require_extra("train", "ropekit.train")  # before the submodules import what it installs

from .checkpoint import CHECKPOINT_NAME, CheckpointError, atomic_save, capture_rng, load_checkpoint, \
    load_model_state, restore_rng
from .config import TrainConfig, auto_patch_size, build_vit_config, load_config_file, parse_key_values
from .distributed import DistContext, init_distributed, resolve_device
from .engine import EngineOptions, NonFiniteLossError, RunLock, RunLockedError, SaveError, Schedule, fit, \
    warmup_cosine
from .metrics import METRIC_COLUMNS, TensorBoardLogger, plot_curves, read_metrics_csv, write_metrics_csv
from .run_folder import load_run
from .trainer import ClassificationTask, TrainResult, build_model, build_optimizer, build_scheduler, evaluate, \
    evaluate_run, fetch_batch, load_data, random_shift, train

__all__ = [
    "TrainConfig", "TrainResult", "train", "evaluate", "evaluate_run", "load_data", "load_run", "build_model",
    "build_optimizer", "build_scheduler", "build_vit_config", "auto_patch_size", "fetch_batch", "random_shift",
    "CHECKPOINT_NAME", "CheckpointError", "atomic_save", "load_checkpoint", "load_model_state", "capture_rng",
    "restore_rng", "load_config_file", "parse_key_values", "DistContext", "init_distributed", "METRIC_COLUMNS",
    "TensorBoardLogger", "plot_curves", "read_metrics_csv", "write_metrics_csv", "resolve_device", "fit",
    "EngineOptions", "Schedule", "warmup_cosine", "NonFiniteLossError", "SaveError", "RunLock", "RunLockedError",
    "ClassificationTask",
]
