"""Image / RGB-D / video classification: the task behind ``ropekit train`` (``--task classification``, the default,
and ``native-resolution``) and ``ropekit eval``, a plugin of the training engine (:mod:`ropekit.train`).

>>> from ropekit.classification import DataConfig, OptimConfig, RunConfig, TrainConfig, train
>>> cfg = TrainConfig(data=DataConfig("digits"), optim=OptimConfig(epochs=2), run=RunConfig(out="runs/demo"))
>>> result = train(cfg)                                                         # doctest: +SKIP
>>> result.final["test_acc"]                                                    # doctest: +SKIP

A run's configuration (:class:`TrainConfig`) has four sections: ``model`` (:class:`ModelConfig`: a ViT size and the
:class:`ropekit.nn.ViTConfig` fields set on it), ``data`` (:class:`DataConfig`), ``optim`` (:class:`OptimConfig`) and
``run`` (:class:`RunConfig`); ``TrainConfig.from_dict`` also reads keys spelled ``section.key`` and the flat names
of older versions (docs/configuration.md).

Modules: ``config`` (the configuration and :func:`build_vit_config`), ``trainer``
(:class:`ClassificationTask`, :func:`train`, :func:`evaluate`, :func:`load_data`), ``evaluation``
(:func:`evaluate_run`, behind ``ropekit eval``), ``native`` (packed native-resolution batches) and ``recipes`` (the
``--preset`` training recipes, YAML files).
"""

from .._optional import require_extra as _require_extra

_require_extra("train", "ropekit.classification")  # before the submodules import what it installs

from .config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig, build_vit_config
from .trainer import ClassificationTask, TrainResult, evaluate, load_data, train
from .evaluation import evaluate_run

__all__ = ["TrainConfig", "ModelConfig", "DataConfig", "OptimConfig", "RunConfig", "TrainResult", "train", "evaluate",
           "evaluate_run", "load_data", "build_vit_config", "ClassificationTask"]
