"""Tasks trained for a number of steps from their own configuration (3-D detection, robot policies, ALOHA), as
plugins of ``ropekit train --task NAME``: each module here registers its task
(:func:`~ropekit.train.tasks.register_task`, found through the ``ropekit.tasks`` entry points) and maps the common
``ropekit train`` options onto the task's trainer, which runs on the shared engine
(:func:`ropekit.train.engine.fit`).

What every such task takes from ``ropekit train`` (:data:`RUN_OPTIONS`): ``--out``, ``--device``,
``--precision``, ``--compile``, ``--threads``, ``--no-progress``, ``--no-tensorboard``, ``--seed``, ``--resume``;
and, where the task has them, ``--batch-size``, ``--lr``, ``--weight-decay``, ``--grad-clip``, ``--log-every`` and
the model options. Training length is ``--task-opt steps=N`` (these tasks count optimiser steps, not epochs);
everything else of the task's own configuration is a ``--task-opt KEY=VALUE``. Only the options given override the
task's own defaults, so ``ropekit train --task robot --task-opt demos=FILE`` trains what ``ropekit robot train
--demos FILE`` trains.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Collection, Dict, Mapping, Optional

__all__ = ["RUN_OPTIONS", "OPTIM_OPTIONS", "engine_options", "pick", "given_values", "refuse_unknown", "run_folder",
           "required"]

#: ``TrainConfig`` fields that every step-counted task reads: where and how the run executes, and its seed.
RUN_OPTIONS = frozenset({"out", "device", "precision", "compile", "threads", "progress", "tensorboard", "seed"})

#: ``TrainConfig`` optimisation fields with the same meaning in the tasks' own training configurations.
OPTIM_OPTIONS = ("batch_size", "lr", "min_lr", "weight_decay", "grad_clip", "seed", "log_every")


def engine_options(cfg: Any) -> Any:
    """The :class:`~ropekit.train.engine.EngineOptions` of a ``TrainConfig``, its thread count included."""
    return dataclasses.replace(cfg.run.engine_options(), threads=cfg.run.threads)


def given_values(cfg: Any, given: Collection[str], fields: Mapping[str, str]) -> Dict[str, Any]:
    """``{task field: value}`` for each ``TrainConfig`` field of ``fields`` (``TrainConfig`` name -> the task's
    name) that the command line gave (``given``), read from ``cfg``."""
    from ..train.upgrade import flatten

    flat = flatten(cfg.to_nested())
    return {task: flat[ours] for ours, task in fields.items() if ours in given}


def pick(options: Dict[str, Any], config: type, task: str, taken: Mapping[str, str] = {}) -> Dict[str, Any]:
    """Remove and return the ``--task-opt`` entries of ``options`` that are fields of the dataclass ``config``.

    Raises:
        ValueError: an entry that is set by a ``ropekit train`` option of its own (``taken``: field -> that option).
    """
    names = {f.name for f in dataclasses.fields(config)}
    for key in options:
        if key in taken and key in names:
            raise ValueError(f"--task-opt {key}: the {task} task takes it from {taken[key]} (one spelling per "
                             f"setting)")
    return {k: options.pop(k) for k in list(options) if k in names}


def refuse_unknown(options: Mapping[str, Any], task: str, known: Collection[str],
                   taken: Collection[str] = ()) -> None:
    """One-line ``ValueError`` for ``--task-opt`` keys the task does not know (naming the ``known`` ones but those
    ``taken`` from options of their own)."""
    if options:
        raise ValueError(f"unknown --task-opt {', '.join(sorted(options))} for the {task} task; known: "
                         f"{', '.join(sorted(set(known) - set(taken)))}")


def run_folder(cfg: Any, task: str) -> Path:
    """``--out``, or ``runs/<task>-<pe>-s<seed>``."""
    return Path(cfg.run.out) if cfg.run.out else Path("runs") / f"{task}-{cfg.model.vit().pe}-s{cfg.run.seed}"


def required(options: Dict[str, Any], key: str, task: str, what: str) -> Optional[str]:
    """``options[key]`` as a path that exists (removed from ``options``), or ``None`` when absent."""
    value = options.pop(key, None)
    if value is None:
        return None
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--task-opt {key}: {what} not found: {value}")
    return str(path)
