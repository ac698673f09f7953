"""The task registry: a training task is a plugin of the engine. Its module registers how to build its
:class:`~ropekit.train.engine.Task` from its configuration with :func:`register_task`; ``ropekit train --task NAME``
finds it through :func:`lookup_task`. The engine names no task.

Tasks are found through the entry-point group ``ropekit.tasks`` (:data:`ENTRY_POINT_GROUP`): each entry is
``NAME = "module:object"``, the module registering the task ``NAME`` when imported (``object`` is usually the
builder that :func:`register_task` decorates, or a :class:`TaskSpec`). ropekit declares its own tasks there in its
``pyproject.toml``, and a package of your own adds one the same way::

    # pyproject.toml of your package
    [project.entry-points."ropekit.tasks"]
    my-task = "my_package.task:build_my_task"

Listing the tasks (:func:`task_names`) imports nothing; :func:`lookup_task` imports a task's module on first use,
so that a task whose optional dependencies are missing never stands in the way of the others (importing
``ropekit.train`` imports no task).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Union

__all__ = ["TaskSpec", "TASKS", "ENTRY_POINT_GROUP", "BUILTIN_ENTRY_POINTS", "register_task", "lookup_task",
           "task_names", "task_entry_points", "resolve"]

#: The entry-point group that lists the tasks (name -> ``"module:object"``).
ENTRY_POINT_GROUP = "ropekit.tasks"


@dataclass(frozen=True)
class TaskSpec:
    """A registered task: ``build(cfg)`` returns its :class:`~ropekit.train.engine.Task` (model, batches and loss,
    ready for :func:`~ropekit.train.engine.fit`) from a ``config`` instance; ``help`` is one line; ``command`` is
    the command that trains it when ``ropekit train`` does not (``None``: ``ropekit train --task NAME``).

    ``ropekit train --task NAME`` calls ``train(cfg, task_options, resume=, allow_change=) -> exit status`` (a
    callable, or a lazy ``"module:function"`` string; ``cfg``: the ``TrainConfig`` of the command line,
    ``task_options``: its ``--task-opt KEY=VALUE`` pairs) when the task gives one, else trains ``build(cfg)`` with
    the engine for ``cfg.epochs`` epochs. ``defaults``: the ``TrainConfig`` values it starts from instead of
    classification's (e.g. its dataset). ``options``: the ``TrainConfig`` fields it reads (``None``: all of them);
    ``ropekit train`` refuses any other given on the command line or in ``--config``, passes ``given=`` (the
    fields given) to ``train``, and such a task resumes in its own way (``--resume`` continues the run folder with
    the same options; no
    ``--preset``, no ``--allow-change``)."""

    name: str
    help: str
    build: Callable[..., Any]
    config: type
    command: Optional[str] = None
    train: Optional[Union[str, Callable[..., int]]] = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    options: Optional[FrozenSet[str]] = None


#: name -> :class:`TaskSpec`, in the order the tasks registered.
TASKS: Dict[str, TaskSpec] = {}

#: ropekit's own entries of :data:`ENTRY_POINT_GROUP`, the same as its ``pyproject.toml`` declares: used when
#: ropekit's installed metadata predates the group (an editable install made before it was added).
BUILTIN_ENTRY_POINTS: Dict[str, str] = {
    "classification": "ropekit.classification.trainer:build_classification_task",
    "native-resolution": "ropekit.classification.native:build_native_task",
    "detection": "ropekit.tasks.detection:build_detection_task",
    "robot": "ropekit.tasks.robot:build_policy_task",
    "aloha": "ropekit.tasks.aloha:build_aloha_task",
    "retrieval": "ropekit.multimodal.train:build_retrieval_task",
    "owl": "ropekit.detection.owl_task:build_owl_task",
}


def register_task(name: str, help: str, *, config: type, command: Optional[str] = None,
                  train: Optional[Union[str, Callable[..., int]]] = None, defaults: Optional[Mapping[str, Any]] = None,
                  options: Optional[Any] = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register the builder ``build(cfg) -> Task`` of the task ``name`` (see :class:`TaskSpec`).

    >>> @register_task("my-task", "what it learns", config=MyConfig)        # doctest: +SKIP
    ... def build_my_task(cfg: MyConfig) -> MyTask: ...

    Raises:
        ValueError: ``name`` is already registered.
    """
    def add(build: Callable[..., Any]) -> Callable[..., Any]:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered")
        TASKS[name] = TaskSpec(name, help, build, config, command, train, dict(defaults or {}),
                               None if options is None else frozenset(options))
        return build

    return add


def task_entry_points() -> Dict[str, str]:
    """name -> ``"module:object"`` of every entry of :data:`ENTRY_POINT_GROUP` in the installed packages' metadata
    (ropekit's own first; :data:`BUILTIN_ENTRY_POINTS` when ropekit's metadata lacks the group). Imports nothing."""
    found = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    ours = [ep for ep in found if _dist_name(ep) == "ropekit"]
    own = {ep.name: ep.value for ep in ours}
    # in the table's order (the metadata lists a group alphabetically), then any name ropekit's metadata adds
    table = ({**{k: own[k] for k in BUILTIN_ENTRY_POINTS if k in own}, **own} if ours else dict(BUILTIN_ENTRY_POINTS))
    for ep in found:
        table.setdefault(ep.name, ep.value)
    return table


def _dist_name(ep: Any) -> Optional[str]:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", None) if dist is not None else None


def resolve(target: Union[str, Callable[..., Any]]) -> Any:
    """The object ``"module:attr"`` names (importing the module), or ``target`` itself when it is no string."""
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module.strip())
    for part in filter(None, attr.strip().split(".")):
        obj = getattr(obj, part)
    return obj


def task_names() -> List[str]:
    """The names of the tasks the entry points declare and of every task registered since, without importing any
    task module."""
    return list(dict.fromkeys([*task_entry_points(), *TASKS]))


def lookup_task(name: str) -> TaskSpec:
    """The registered task ``name``, importing the module its entry point names when needed.

    Raises:
        ValueError: an unknown name (one line naming the known tasks), or an entry point that registers no task of
            its name.
    """
    if name not in TASKS:
        target = task_entry_points().get(name)
        if target is None:
            raise ValueError(f"unknown task {name!r}; known: {', '.join(task_names())}")
        obj = resolve(target)
        if name not in TASKS and isinstance(obj, TaskSpec) and obj.name == name:
            TASKS[name] = obj
        if name not in TASKS:
            raise ValueError(f"the entry point {name} = {target!r} of {ENTRY_POINT_GROUP} registers no task "
                             f"named {name!r} (decorate its builder with ropekit.train.tasks.register_task)")
    return TASKS[name]
