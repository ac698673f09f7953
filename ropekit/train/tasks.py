"""The task registry: every training task registers how to build its :class:`~ropekit.train.engine.Task` from its
configuration with :func:`register_task`, in the module that defines it; ``ropekit train --task NAME`` reads
:data:`TASKS`.

ropekit's own tasks are named in :data:`TASK_MODULES`, the one place that says where each is defined: listing them
(:func:`task_names`) imports nothing, and :func:`lookup_task` imports a task's module on first use, so that a task
whose optional dependencies are missing never stands in the way of the others.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional

__all__ = ["TaskSpec", "TASKS", "TASK_MODULES", "register_task", "lookup_task", "task_names"]


@dataclass(frozen=True)
class TaskSpec:
    """A registered task: ``build(cfg)`` returns its :class:`~ropekit.train.engine.Task` (model, batches and loss,
    ready for :func:`~ropekit.train.engine.fit`) from a ``config`` instance; ``help`` is one line; ``command`` is
    the command that trains it when ``ropekit train`` does not (``None``: ``ropekit train --task NAME``).

    A task that ``ropekit train --task NAME`` trains from the usual ``TrainConfig`` options besides classification
    gives ``train(cfg, task_options, resume=, allow_change=) -> exit status`` (``task_options``: the
    ``--task-opt KEY=VALUE`` pairs) and ``defaults``, the ``TrainConfig`` values it starts from instead of
    classification's (e.g. its dataset)."""

    name: str
    help: str
    build: Callable[..., Any]
    config: type
    command: Optional[str] = None
    train: Optional[Callable[..., int]] = None
    defaults: Mapping[str, Any] = field(default_factory=dict)


#: name -> :class:`TaskSpec`, in the order the tasks registered.
TASKS: Dict[str, TaskSpec] = {}

#: ropekit's own tasks: name -> the module that registers it (imported by :func:`lookup_task`).
TASK_MODULES: Dict[str, str] = {
    "classification": "ropekit.train.trainer",
    "native-resolution": "ropekit.train.native",
    "detection": "ropekit.detection.train",
    "robot": "ropekit.robot.train",
    "aloha": "ropekit.robot.aloha.policy",
    "retrieval": "ropekit.multimodal.train",
    "owl": "ropekit.detection.owl_task",
}


def register_task(name: str, help: str, *, config: type, command: Optional[str] = None,
                  train: Optional[Callable[..., int]] = None,
                  defaults: Optional[Mapping[str, Any]] = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register the builder ``build(cfg) -> Task`` of the task ``name`` (see :class:`TaskSpec`).

    >>> @register_task("my-task", "what it learns", config=MyConfig)        # doctest: +SKIP
    ... def build_my_task(cfg: MyConfig) -> MyTask: ...
    """
    def add(build: Callable[..., Any]) -> Callable[..., Any]:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered")
        TASKS[name] = TaskSpec(name, help, build, config, command, train, dict(defaults or {}))
        return build

    return add


def task_names() -> List[str]:
    """The names of ropekit's tasks and of every task registered since, without importing any task module."""
    return list(dict.fromkeys([*TASK_MODULES, *TASKS]))


def lookup_task(name: str) -> TaskSpec:
    """The registered task ``name`` (importing its module from :data:`TASK_MODULES` when needed); ``ValueError``
    naming the known tasks otherwise."""
    if name not in TASKS and name in TASK_MODULES:
        importlib.import_module(TASK_MODULES[name])
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(task_names())}")
    return TASKS[name]
