"""How a training run of :func:`ropekit.train.fit` is executed and what it optimises with: the option dataclasses
(:class:`EngineOptions`, :class:`Schedule`, :class:`FitOptions`), AdamW with the no-weight-decay groups, the
warm-up + cosine schedule, seeding and the autocast dtype of a precision name."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .distributed import DistContext

__all__ = ["PRECISIONS", "StepCallback", "EngineOptions", "check_compile_backend", "Schedule", "FitOptions",
           "warmup_cosine", "build_optimizer", "seed_everything", "autocast_dtype"]

PRECISIONS = ("fp32", "bf16", "fp16")
StepCallback = Callable[[int], Optional[bool]]


@dataclass
class EngineOptions:
    """How a run is executed (as opposed to what it learns).

    device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; precision: ``"fp32"``,
    ``"bf16"`` or ``"fp16"`` (autocast; fp16 with a gradient scaler); compile: ``torch.compile`` the task's
    modules (``True`` for the default backend, or a backend name such as ``"aot_eager"``); threads: torch CPU
    threads during the run (``None``: leave as is); progress: show a progress bar; tensorboard: write event files
    when the ``tensorboard`` package is installed; plots: write ``curves.png``.
    """

    device: str = "auto"
    precision: str = "fp32"
    compile: Union[bool, str] = False
    threads: Optional[int] = None
    progress: bool = True
    tensorboard: bool = True
    plots: bool = True

    def validate(self) -> "EngineOptions":
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        check_compile_backend(self.compile)
        return self


def check_compile_backend(compile: Union[bool, str]) -> None:
    """One-line ``ValueError`` unless ``compile`` is a bool or a ``torch.compile`` backend name."""
    if isinstance(compile, bool):
        return
    if not isinstance(compile, str):
        raise ValueError(f"compile must be true, false or a torch.compile backend name, got {compile!r}")
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if compile not in known:
        raise ValueError(f"unknown torch.compile backend {compile!r}; known: {', '.join(sorted(known))}")


@dataclass
class Schedule:
    """AdamW hyper-parameters and the per-step learning-rate schedule of a run.

    ``lr`` is the peak; linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr`` at
    ``total_steps``; ``grad_clip`` > 0 clips the global gradient norm.
    """

    lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 0.0


@dataclass
class FitOptions:
    """Everything :func:`fit` needs besides the task.

    Attributes:
        schedule: optimiser and learning-rate schedule.
        epochs: epochs to train (a resumed run continues up to this many).
        execution: device, precision, compile, threads, progress bar, TensorBoard, plots.
        run_dir: the run folder (``None``: nothing is written and Ctrl-C is not intercepted).
        checkpoint_name: file name of the training checkpoint in ``run_dir``.
        resume: continue from ``run_dir / checkpoint_name`` (bit-exact when nothing changed).
        ctx: an initialised distributed context (``None``: :func:`init_distributed` with ``execution.device``,
            closed again on return).
        on_step: called after every step with the global step; returning ``True`` stops like Ctrl-C.
        quiet: no log lines (the progress bar follows ``execution.progress``).
        config_doc: written as ``config.json`` (with ``versions``, ``world_size``, ``num_params``, ``engine``).
        checkpoint_extra: more entries for every checkpoint (e.g. the model's config).
        metric_columns: column order of ``metrics.csv`` (``None``: the keys of the rows).
        optimizer: an optimiser over the task's parameters (``None``: :func:`build_optimizer`).
        fresh_start: called on every rank when the run does not resume, after the model and optimiser are built
            (e.g. to seed the per-rank random streams).
        log_every: steps between the reads of the device-side loss guard and metric sums (and the progress bar's
            loss); 1 checks every step before its update, as a step-by-step loop would.
        checkpoint_every: also save a checkpoint every this many global steps inside an epoch (0: only after each
            epoch and on a stop request); a run resumed from it continues at that step.
    """

    schedule: Schedule
    epochs: int
    execution: EngineOptions = field(default_factory=EngineOptions)
    run_dir: Optional[Union[str, Path]] = None
    checkpoint_name: str = "checkpoint.pt"
    resume: bool = False
    ctx: Optional[DistContext] = None
    on_step: Optional[StepCallback] = None
    quiet: bool = False
    config_doc: Optional[Dict[str, Any]] = None
    checkpoint_extra: Optional[Dict[str, Any]] = None
    metric_columns: Optional[Sequence[str]] = None
    optimizer: Optional[torch.optim.Optimizer] = None
    fresh_start: Optional[Callable[[DistContext], None]] = None
    log_every: int = 50
    checkpoint_every: int = 0

    def validate(self) -> "FitOptions":
        for name, least in (("log_every", 1), ("checkpoint_every", 0), ("epochs", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {v!r}")
        return self


def warmup_cosine(total_steps: int, warmup_steps: int, floor: float) -> Callable[[int], float]:
    """The learning-rate factor of step ``s`` (0-based): ``(s + 1) / (w + 1)`` during the ``w`` warm-up steps, then
    ``floor + (1 - floor) (1 + cos(pi t)) / 2`` with ``t`` going 0 -> 1 over the remaining steps.

    ``w`` is clipped to ``total_steps - 1`` so that at least one step is at the peak.
    """
    total = max(1, int(total_steps))
    warm = max(0, min(int(warmup_steps), total - 1))
    floor = min(1.0, float(floor))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        t = (step - warm) / max(1, total - warm)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))

    return factor


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    betas: Tuple[float, float] = (0.9, 0.999)) -> torch.optim.AdamW:
    """AdamW with two groups: weight decay for matrices, none for ``model.no_weight_decay()`` names (encodings,
    depth lift, CLS, APE) and for every parameter with fewer than two dimensions (norms, biases).

    Parameters shared under several names are listed once; frozen ones are left out.
    """
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    named = dict(model.named_parameters(remove_duplicate=False))
    skip_ids = {id(named[n]) for n in skip if n in named}
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if id(p) in skip_ids or p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def seed_everything(seed: int) -> None:
    """Seed the python, numpy and torch global random number generators."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast_dtype(precision: str) -> Optional[torch.dtype]:
    """``None`` for fp32, else the autocast dtype of ``"bf16"`` / ``"fp16"``."""
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
