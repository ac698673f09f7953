"""Image / RGB-D / video classification: the task behind ``ropekit train`` (``--task classification``, the default,
and ``native-resolution``) and ``ropekit eval``, a plugin of the training engine (:mod:`ropekit.train`).

>>> from ropekit.classification import TrainConfig, train
>>> result = train(TrainConfig(data="digits", epochs=2, out="runs/demo"))      # doctest: +SKIP
>>> result.final["test_acc"]                                                    # doctest: +SKIP

Modules: ``config`` (:class:`TrainConfig`, the run's configuration, and :func:`build_vit_config`), ``trainer``
(:class:`ClassificationTask`, :func:`train`, :func:`evaluate`, :func:`evaluate_run`, :func:`load_data`),
``native`` (packed native-resolution batches) and ``recipes`` (the ``--preset`` training recipes, YAML files).
"""

from .._optional import require_extra as _require_extra

_require_extra("train", "ropekit.classification")  # before the submodules import what it installs

from .config import TrainConfig, build_vit_config
from .trainer import ClassificationTask, TrainResult, evaluate, evaluate_run, load_data, train

__all__ = ["TrainConfig", "TrainResult", "train", "evaluate", "evaluate_run", "load_data", "build_vit_config",
           "ClassificationTask"]
