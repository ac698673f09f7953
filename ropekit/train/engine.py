"""The one training loop of ropekit: classification, 3-D detection and robot policies plug into it as *tasks*.

A task supplies its model, its batches and its loss (:class:`Task`); the engine owns everything else that a
training run needs, the same way for every task:

* device and distributed set-up (``torchrun``: gloo on CPU, nccl on GPU; see :mod:`ropekit.train.distributed`),
* precision (``"fp32"``, ``"bf16"`` or ``"fp16"`` autocast; a gradient scaler for fp16) and ``torch.compile``,
* AdamW with the no-weight-decay groups (:func:`build_optimizer`) and linear warm-up + cosine decay
  (:func:`warmup_cosine`), gradient-norm clipping,
* a guard that stops at the first non-finite loss (before the update, so the last checkpoint stays good),
* atomic checkpoints after every epoch and on Ctrl-C, with every RNG state, so that a resumed run continues
  bit for bit; a lock on the run folder while a run writes it,
* a progress bar, ``metrics.csv``, TensorBoard scalars (when installed), ``curves.png`` and ``summary.json``.

An *epoch* is whatever the task calls one: a pass over the data (classification) or ``log_every`` steps
(detection, policies). One metrics row is written per epoch, and a checkpoint after each.

Reproducibility contract: a task's batches for an epoch are a pure function of the task's settings and the epoch
(``epoch_batches``), and every other random draw comes from the global RNGs or from state the task returns in
``state_dict`` -- both are saved with every checkpoint (one entry per rank).
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..encodings.counting import count_parameters
from ..encodings.validation import check_deferred_coords
from .checkpoint import CheckpointError, atomic_save, capture_rng, load_checkpoint, load_model_state, restore_rng
from .distributed import DistContext, init_distributed
from .metrics import TensorBoardLogger, atomic_write_text, write_metrics_csv

__all__ = ["Task", "EngineOptions", "Schedule", "FitResult", "fit", "build_optimizer", "warmup_cosine",
           "NonFiniteLossError", "SaveError", "RunLock", "RunLockedError", "PRECISIONS", "versions",
           "autocast_dtype", "seed_everything"]

PRECISIONS = ("fp32", "bf16", "fp16")
StepCallback = Callable[[int], Optional[bool]]


class NonFiniteLossError(FloatingPointError, ValueError):
    """The loss became NaN or infinite; raised before the update, the last checkpoint is untouched."""


class SaveError(CheckpointError):
    """A checkpoint or run file could not be written (disk full, read-only folder); the previous one is intact."""


class RunLockedError(ValueError):
    """Another process is writing the run folder."""


# ---------------------------------------------------------------------------------------------------------
# what a task supplies
# ---------------------------------------------------------------------------------------------------------


class Task(Protocol):
    """What a training task supplies to :func:`fit` (only ``model``, ``epoch_batches``, ``loss`` and ``epoch_row``
    are required; the engine uses defaults for the rest when a task lacks them).

    Attributes:
        model: the ``nn.Module`` whose parameters are trained (moved to the run's device by the engine).
        name: a short label for the progress bar.
    """

    model: nn.Module
    name: str

    def epoch_batches(self, epoch: int, ctx: DistContext) -> Sequence[Any]:
        """This rank's batch descriptors for ``epoch`` (e.g. index lists) -- a pure function of the epoch."""

    def loss(self, model: nn.Module, batch: Any, device: torch.device) -> Tuple[Tensor, Dict[str, float]]:
        """``(loss, sums)``: the scalar loss to minimise and numbers to add up over the epoch (for ``epoch_row``).

        Called under autocast; ``model`` may be a compiled version of ``self.model``.
        """

    def epoch_row(self, epoch: int, sums: Dict[str, float], info: Dict[str, Any], ctx: DistContext) -> Dict[str, Any]:
        """The metrics row of a finished epoch from the summed ``sums`` (of this rank) and ``info`` (``lr``,
        ``epoch_time``, ``elapsed``, ``global_step``); may evaluate (every rank calls it)."""


def _call(task: Any, name: str, *args: Any, default: Any = None) -> Any:
    fn = getattr(task, name, None)
    return fn(*args) if callable(fn) else default


# ---------------------------------------------------------------------------------------------------------
# options, optimiser, schedule
# ---------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------
# run folder: versions, lock, safe writes
# ---------------------------------------------------------------------------------------------------------


def versions() -> Dict[str, Optional[str]]:
    """``{"ropekit", "torch", "python", "git"}``: the versions that produced a run (``git``: the commit of the
    ropekit checkout with ``+dirty`` when it has uncommitted changes; ``None`` outside a git checkout)."""
    from .. import __version__

    root = Path(__file__).resolve().parents[2]
    git = None
    if (root / ".git").exists():
        try:
            head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=5)
            if head.returncode == 0:
                git = head.stdout.strip()
                dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                       capture_output=True, text=True, timeout=5)
                if dirty.returncode == 0 and dirty.stdout.strip():
                    git += "+dirty"
        except (OSError, subprocess.SubprocessError):
            git = None
    return {"ropekit": __version__, "torch": torch.__version__, "python": sys.version.split()[0], "git": git}


_HELD: Dict[str, List[Any]] = {}  # resolved run folder -> [file descriptor, holders] of this process


class RunLock:
    """An exclusive lock on a run folder (``<run>/.lock``, ``flock``), held while a run writes the folder.

    Re-entrant within a process (the trainer takes it before loading data, the engine again). A second process
    gets :class:`RunLockedError` at once, without waiting. The lock dies with its process, so a killed run never
    leaves a stale lock behind.
    """

    def __init__(self, run_dir: Union[str, Path]) -> None:
        self.run_dir = Path(run_dir)
        self._key: Optional[str] = None

    def acquire(self) -> "RunLock":
        import fcntl

        if self._key is not None:
            return self
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SaveError(f"cannot create the run folder {self.run_dir}: {e.strerror or e}") from None
        key = str(self.run_dir.resolve())
        if key in _HELD:
            _HELD[key][1] += 1
            self._key = key
            return self
        try:
            fd = os.open(self.run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise SaveError(f"cannot write the run folder {self.run_dir}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
            except OSError:
                owner = ""
            os.close(fd)
            raise RunLockedError(f"run folder {self.run_dir} is being written by another run"
                                 f"{f' (pid {owner})' if owner else ''}; wait for it to end or choose another "
                                 f"--out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        _HELD[key] = [fd, 1]
        self._key = key
        return self

    def release(self) -> None:
        import fcntl

        if self._key is None:
            return
        entry = _HELD.get(self._key)
        self._key = None
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        for k, v in list(_HELD.items()):
            if v is entry:
                del _HELD[k]
        fcntl.flock(entry[0], fcntl.LOCK_UN)
        os.close(entry[0])

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _safe(what: str, path: Path, fn: Callable[[], Any]) -> Any:
    """Run a write; an ``OSError`` becomes a one-line :class:`SaveError` (the temporary file is already gone)."""
    try:
        return fn()
    except OSError as e:
        reason = e.strerror or (os.strerror(e.errno) if e.errno else str(e))
        hint = " (disk full?)" if e.errno == errno.ENOSPC else ""
        raise SaveError(f"could not write the {what} {path}: {reason}{hint}; the previous {what} is intact") from None


def write_json(path: Path, doc: Dict[str, Any], what: str = "file") -> None:
    """``doc`` as indented JSON, atomically; :class:`SaveError` on a failed write."""
    _safe(what, path, lambda: atomic_write_text(path, json.dumps(doc, indent=2) + "\n"))


# ---------------------------------------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------------------------------------


class _StopRequest:
    """SIGINT / SIGTERM set a flag that the loop checks after each step (a second Ctrl-C aborts at once)."""

    def __init__(self, verbose: bool, enabled: bool = True) -> None:
        self.requested = False
        self.verbose = verbose
        self.enabled = enabled
        self._old: Dict[int, Any] = {}

    def __enter__(self) -> "_StopRequest":
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # (background jobs ignore SIGINT: keep it so)
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.verbose:
            print("\nstopping after this step and saving a checkpoint (press Ctrl-C again to abort)",
                  file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------------


class _TaskStep(nn.Module):
    """``forward(batch) -> (loss, sums)``: the task's loss as a module call, so that DDP sees a forward pass."""

    def __init__(self, task: Any, model: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self._task = task
        self._device = device

    def forward(self, batch: Any) -> Tuple[Tensor, Dict[str, float]]:
        return self._task.loss(self.model, batch, self._device)


@dataclass
class FitResult:
    """What :func:`fit` returns (files are written by rank 0 only)."""

    history: List[Dict[str, Any]]
    interrupted: bool
    wall_time: float
    run_dir: Optional[Path]
    ctx: DistContext
    global_step: int = 0
    resumed_from: Optional[int] = None  # global step of the checkpoint a resumed run started from
    num_params: int = 0

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main


def _log(msg: str, ctx: DistContext, quiet: bool) -> None:
    if ctx.is_main and not quiet:
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stderr)


def _deferred_coord_error(device: torch.device) -> Optional[ValueError]:
    """The error :func:`ropekit.encodings.check_deferred_coords` raises for ``device``, or ``None``."""
    try:
        check_deferred_coords(device)
    except ValueError as e:
        return e
    return None


def fit(task: Any, schedule: Schedule, epochs: int, *, options: Optional[EngineOptions] = None,
        run_dir: Optional[Union[str, Path]] = None, checkpoint_name: str = "checkpoint.pt", resume: bool = False,
        ctx: Optional[DistContext] = None, on_step: Optional[StepCallback] = None, quiet: bool = False,
        config_doc: Optional[Dict[str, Any]] = None, checkpoint_extra: Optional[Dict[str, Any]] = None,
        metric_columns: Optional[Sequence[str]] = None, optimizer: Optional[torch.optim.Optimizer] = None,
        fresh_start: Optional[Callable[[DistContext], None]] = None) -> FitResult:
    """Train ``task.model`` for ``epochs`` epochs of ``task.epoch_batches``.

    Args:
        task: see :class:`Task`. Optional hooks: ``state_dict()`` / ``load_state_dict(d)`` (task RNG, EMA...),
            ``after_step(step)`` (0-based global step, after the update), ``compile_targets()`` (modules to compile;
            default ``[task.model]``), ``plot(history, path)``, ``summary(history) -> dict``,
            ``describe(row) -> str`` (a log line per epoch), ``find_unused_parameters`` (DDP).
        schedule: optimiser and learning-rate schedule.
        options: device, precision, compile, threads, progress bar, TensorBoard.
        run_dir: the run folder (``None``: nothing is written and Ctrl-C is not intercepted).
        checkpoint_name: file name of the training checkpoint in ``run_dir``.
        resume: continue from ``run_dir / checkpoint_name`` (bit-exact when nothing changed).
        ctx: an initialised distributed context (default: :func:`init_distributed` with ``options.device``,
            closed again on return).
        on_step: called after every step with the global step; returning ``True`` stops like Ctrl-C.
        config_doc: written as ``config.json`` (with ``versions``, ``world_size``, ``num_params``, ``engine``).
        checkpoint_extra: more entries for every checkpoint (e.g. the model's config).
        metric_columns: column order of ``metrics.csv`` (default: the keys of the rows).
        optimizer: an optimiser over the task's parameters (default: :func:`build_optimizer`).
        fresh_start: called on every rank when the run does not resume, after the model and optimiser are built
            (e.g. to seed the per-rank random streams).

    Raises:
        NonFiniteLossError: a NaN / Inf loss (step named; nothing saved after the last good checkpoint).
        ValueError: NaN / Inf coordinates counted on the device by ``ropekit.encodings.check_deferred_coords``
            (an accelerator, or a compiled model), raised at the step that used them, before the update.
        SaveError: a checkpoint could not be written (the previous one is intact).
        RunLockedError: another process is writing ``run_dir``.
        CheckpointError: ``resume`` without a usable checkpoint, or a checkpoint that does not fit.
    """
    opts = (options or EngineOptions()).validate()
    own_ctx = ctx is None
    ctx = ctx or init_distributed(opts.device)
    previous_threads = torch.get_num_threads()
    if opts.threads:
        torch.set_num_threads(int(opts.threads))
    run = Path(run_dir) if run_dir is not None else None
    lock = RunLock(run) if run is not None and ctx.is_main else None
    try:
        if lock is not None:
            lock.acquire()
        return _fit(task, schedule, epochs, opts, run, checkpoint_name, resume, ctx, on_step, quiet,
                    config_doc, checkpoint_extra, metric_columns, optimizer, fresh_start)
    finally:
        if lock is not None:
            lock.release()
        torch.set_num_threads(previous_threads)
        if own_ctx:
            ctx.close()


def _fit(task: Any, schedule: Schedule, epochs: int, opts: EngineOptions, run: Optional[Path], checkpoint_name: str,
         resume: bool, ctx: DistContext, on_step: Optional[StepCallback], quiet: bool,
         config_doc: Optional[Dict[str, Any]], checkpoint_extra: Optional[Dict[str, Any]],
         metric_columns: Optional[Sequence[str]], optimizer: Optional[torch.optim.Optimizer],
         fresh_start: Optional[Callable[[DistContext], None]]) -> FitResult:
    t_start = time.time()
    device = ctx.device
    ckpt_path = run / checkpoint_name if run is not None else None
    ckpt = None
    if resume:
        if ckpt_path is None:
            raise ValueError("resume needs a run folder")
        ckpt = load_checkpoint(ckpt_path)
    elif ckpt_path is not None and ckpt_path.exists():
        raise ValueError(f"run folder {run} already holds a checkpoint; continue it with --resume or choose "
                         f"another --out")

    model: nn.Module = task.model
    model.to(device)
    opt = optimizer or build_optimizer(model, schedule.lr, schedule.weight_decay)
    factor = warmup_cosine(schedule.total_steps, schedule.warmup_steps, schedule.min_lr / schedule.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    amp_dtype = autocast_dtype(opts.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=opts.precision == "fp16")

    start_epoch, start_step, global_step, elapsed_before = 0, 0, 0, 0.0
    history: List[Dict[str, Any]] = []
    partial: Dict[str, float] = {}
    if ckpt is not None:
        load_model_state(model, ckpt["model"], source=f"checkpoint {ckpt['path']}")
        try:
            opt.load_state_dict(ckpt["optimizer"])
            sched.load_state_dict(ckpt["scheduler"])
            if scaler.is_enabled() and ckpt.get("scaler"):
                scaler.load_state_dict(ckpt["scaler"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {ckpt['path']} does not match the optimiser: "
                                  f"{str(e).splitlines()[0]}") from None
        # the schedule may have been stretched (more epochs): continue on the current one
        for group, base in zip(opt.param_groups, sched.base_lrs):
            group["lr"] = base * factor(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in opt.param_groups]  # type: ignore[attr-defined]
        start_epoch, start_step = int(ckpt["epoch"]), int(ckpt.get("step_in_epoch", 0))
        global_step, elapsed_before = int(ckpt.get("global_step", 0)), float(ckpt.get("elapsed_time", 0.0))
        history = list(ckpt.get("history", []))
        partial = dict(ckpt.get("partial") or {})
        rng = ckpt.get("rng") or []
        if ctx.rank < len(rng):
            restore_rng(rng[ctx.rank])
        task_states = ckpt.get("task") or []
        if ctx.rank < len(task_states) and task_states[ctx.rank] is not None:
            _call(task, "load_state_dict", task_states[ctx.rank])
    elif fresh_start is not None:
        fresh_start(ctx)

    n_params = count_parameters(model)  # encodings by their effective count
    if run is not None and ctx.is_main:
        if config_doc is not None:
            doc = {**config_doc, "engine": {"precision": opts.precision, "compile": opts.compile,
                                            "device": str(device)},
                   "world_size": ctx.world_size, "num_params": n_params, "versions": versions()}
            write_json(run / "config.json", doc, "config")
        if history:
            _write_metrics(run, history, metric_columns)
    tb = TensorBoardLogger(run / "tb", enabled=run is not None and opts.tensorboard and ctx.is_main) \
        if run is not None else None

    # compile (in place: the state_dict keeps its names) and DDP
    if opts.compile:
        backend = opts.compile if isinstance(opts.compile, str) else "inductor"
        for m in _call(task, "compile_targets", default=None) or [model]:
            m.compile(backend=backend)
    step_module: nn.Module = _TaskStep(task, model, device)
    if ctx.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        step_module = DDP(step_module, device_ids=[device.index] if device.type == "cuda" else None,
                          find_unused_parameters=bool(getattr(task, "find_unused_parameters", False)))
    params = [p for p in model.parameters() if p.requires_grad]

    def save(epoch_done: int, step_in_epoch: int, part: Dict[str, float]) -> None:
        rng_states = ctx.gather_objects(capture_rng())
        task_states = ctx.gather_objects(_call(task, "state_dict"))
        failure = None
        if ctx.is_main and ckpt_path is not None:
            doc = {"format": "ropekit-checkpoint", "version": 1, "model": model.state_dict(),
                   **(checkpoint_extra or {}), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                   "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                   "epoch": epoch_done, "step_in_epoch": step_in_epoch, "global_step": global_step,
                   "elapsed_time": elapsed_before + (time.time() - t_start), "rng": rng_states, "task": task_states,
                   "history": history, "partial": part, "world_size": ctx.world_size, "precision": opts.precision}
            try:
                _safe("checkpoint", ckpt_path, lambda: atomic_save(doc, ckpt_path))
            except SaveError as e:
                failure = e
        if ctx.any(failure is not None):
            raise failure or SaveError(f"rank 0 could not write the checkpoint {ckpt_path}")

    from tqdm import tqdm

    interrupted = False
    total_steps = int(schedule.total_steps)
    bar = tqdm(total=total_steps, initial=min(global_step, total_steps), desc=getattr(task, "name", "train"),
               disable=not (opts.progress and ctx.is_main), leave=False, dynamic_ncols=True, file=sys.stderr)
    resumed_from = global_step if ckpt is not None else None
    check_deferred_coords(device)  # sets up the device's counter before a compiled model traces its checks
    model.train()
    with _StopRequest(verbose=ctx.is_main and not quiet, enabled=run is not None) as stop:
        for epoch in range(start_epoch, epochs):
            batches = task.epoch_batches(epoch, ctx)
            if start_step > len(batches):
                raise CheckpointError(f"checkpoint {ckpt_path} stopped at step {start_step} of an epoch, but an "
                                      f"epoch now has {len(batches)} steps (batch size or data changed)")
            t_epoch = time.time() - float(partial.pop("time", 0.0))
            model.train()
            for step in range(start_step, len(batches)):
                with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                    loss, sums = step_module(batches[step])
                value = float(loss.detach())
                coord_error = _deferred_coord_error(device)  # the host waits for the device here anyway
                if ctx.any(coord_error is not None or not math.isfinite(value)):
                    where = (f"at step {global_step + 1} (epoch {epoch + 1}, batch {step + 1}): stopped before the "
                             f"update" + (f"; the last good checkpoint {ckpt_path} is intact"
                                          if ckpt_path is not None and ckpt_path.exists() else ""))
                    if coord_error is not None:
                        raise ValueError(f"{coord_error} ({where})") from None
                    raise NonFiniteLossError(f"non-finite loss ({value}) {where}")
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                if schedule.grad_clip > 0:
                    scaler.unscale_(opt)
                    nn.utils.clip_grad_norm_(params, schedule.grad_clip)
                scaler.step(opt)
                scaler.update()
                with warnings.catch_warnings():  # (fp16: the scaler skips the steps whose gradients overflowed)
                    warnings.simplefilter("ignore", UserWarning)
                    sched.step()
                _call(task, "after_step", global_step)
                global_step += 1
                for k, v in sums.items():
                    partial[k] = partial.get(k, 0.0) + float(v)
                bar.update(1)
                if "loss" in sums or "loss_sum" in sums:
                    n = partial.get("count", 1.0) or 1.0
                    bar.set_postfix(loss=f"{partial.get('loss_sum', partial.get('loss', 0.0)) / n:.4f}",
                                    epoch=f"{epoch + 1}/{epochs}", refresh=False)
                wants_stop = bool(on_step(global_step)) if on_step is not None else False
                if ctx.any(stop.requested or wants_stop):
                    save(epoch, step + 1, {**partial, "time": time.time() - t_epoch})
                    interrupted = True
                    break
            if interrupted:
                break
            start_step = 0
            info = {"lr": opt.param_groups[0]["lr"], "epoch_time": time.time() - t_epoch,
                    "elapsed": elapsed_before + time.time() - t_start, "global_step": global_step}
            row = task.epoch_row(epoch, partial, info, ctx)
            history.append(row)
            partial = {}
            save(epoch + 1, 0, {})
            if run is not None and ctx.is_main:
                _write_metrics(run, history, metric_columns)
                if tb is not None:
                    tb.log(row, step=int(row.get("step", row.get("epoch", global_step))))
            line = _call(task, "describe", row)
            if line:
                bar.clear()
                _log(line, ctx, quiet)
            if ctx.any(stop.requested):
                interrupted = epoch + 1 < epochs
                break
    bar.close()
    if tb is not None:
        tb.close()
    wall = elapsed_before + time.time() - t_start
    if run is not None and ctx.is_main and history and opts.plots:
        plot = getattr(task, "plot", None)
        try:
            if callable(plot):
                plot(history, run / "curves.png")
            else:
                _plot_generic(history, run / "curves.png", getattr(task, "name", "train"))
        except OSError as e:
            raise SaveError(f"could not write the plot {run / 'curves.png'}: {e.strerror or e}") from None
    result = FitResult(history=history, interrupted=interrupted, wall_time=wall, run_dir=run, ctx=ctx,
                       global_step=global_step, resumed_from=resumed_from, num_params=n_params)
    summary = _call(task, "summary", history)
    if run is not None and ctx.is_main and summary is not None:
        write_json(run / "summary.json", {**summary, "epochs_done": len(history), "interrupted": interrupted,
                                          "wall_time": wall, "num_params": n_params, "world_size": ctx.world_size,
                                          "device": ctx.device_name, "machine": ctx.machine,
                                          "precision": opts.precision}, "summary")
    ctx.barrier()
    return result


def _write_metrics(run: Path, history: List[Dict[str, Any]], columns: Optional[Sequence[str]]) -> None:
    _safe("metrics file", run / "metrics.csv", lambda: write_metrics_csv(run / "metrics.csv", history, columns))


def _plot_generic(history: Sequence[Dict[str, Any]], path: Path, title: str) -> None:
    """Every ``loss*`` column against the first column (``step`` or ``epoch``), as a PNG."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    x_key = next(iter(history[0]))
    keys = [k for k in history[0] if k.startswith("loss")]
    if not keys:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r[x_key] for r in history]
    for k in keys:
        ax.plot(xs, [r.get(k) for r in history], "-", label=k)
    ax.set_xlabel(x_key)
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
