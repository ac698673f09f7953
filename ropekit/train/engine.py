"""The one training loop of ropekit: classification, 3-D detection and robot policies plug into it as *tasks*.

A task supplies its model, its batches and its loss (:class:`Task`); the engine owns everything else that a
training run needs, the same way for every task:

* device and distributed set-up (``torchrun``: gloo on CPU, nccl on GPU; see :mod:`ropekit.train.distributed`),
* precision (``"fp32"``, ``"bf16"`` or ``"fp16"`` autocast; a gradient scaler for fp16) and ``torch.compile``,
* AdamW with the no-weight-decay groups (:func:`build_optimizer`) and linear warm-up + cosine decay
  (:func:`warmup_cosine`), gradient-norm clipping,
* a guard that stops at a non-finite loss before anything trained on it is saved (see *Host synchronisation*),
* atomic checkpoints after every epoch, every ``checkpoint_every`` steps and on Ctrl-C, with every RNG state, so
  that a resumed run continues bit for bit (also mid-epoch); a lock on the run folder while a run writes it,
* a progress bar, ``metrics.csv``, TensorBoard scalars (when installed), ``curves.png`` and ``summary.json``.

Batches: ``epoch_batches`` returns either a ``Sequence`` (indexed by step: index lists, ready tensors) or a
streamed epoch -- any object with ``__len__`` and ``iter_from(step)`` such as :class:`StreamedEpoch` around a data
loader that can start at a given batch -- so that a run resumed mid-epoch restarts the loader at that batch.

Host synchronisation: a step reads nothing back from the device. The loss guard, the metric sums and the
deferred coordinate checks (:func:`ropekit.encodings.check_deferred_coords`) accumulate on the device and are
read once per ``log_every`` steps (before that step's update), before every checkpoint and at the end of an epoch;
under DDP that read is one collective, which also carries Ctrl-C / ``on_step`` stop requests. So a NaN loss at
step ``s`` is reported at the next check, naming step ``s``: with ``log_every=1`` before the update of step ``s``
(the run holds no bad update), otherwise the updates after it were made in memory but never saved -- a checkpoint
is only written after a clean check, so the last checkpoint is always good. A stop request takes effect after the
step it came in with one process, and at the next log step or checkpoint under DDP (every rank stops at the same
step). (An fp16 gradient scaler reads its overflow flag every step; that is its nature.)

An *epoch* is whatever the task calls one: a pass over the data (classification) or ``log_every`` steps
(detection, policies). One metrics row is written per epoch, and a checkpoint after each.

Reproducibility contract: a task's batches for an epoch are a pure function of the task's settings and the epoch
(``epoch_batches``), and every other random draw comes from the global RNGs or from state the task returns in
``state_dict`` -- both are saved with every checkpoint (one entry per rank).

The options and the optimiser live in :mod:`ropekit.train.options`, the run folder's lock and safe writes in
:mod:`ropekit.train.run_folder`; both are re-exported here.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..encodings.counting import count_parameters
from .._io import atomic_write
from ..encodings.ops.validation import check_deferred_coords
from .checkpoint import CheckpointError, atomic_save, capture_rng, load_checkpoint, load_model_state, restore_rng
from .distributed import DistContext, init_distributed
from .metrics import TensorBoardLogger, write_metrics_csv
from .options import (PRECISIONS, EngineOptions, FitOptions, Schedule, autocast_dtype, build_optimizer,
                      seed_everything, warmup_cosine)
from .run_folder import (RunLock, RunLockedError, SaveError, remove_stale_temporaries, safe_write, versions,
                         write_json)

__all__ = ["Task", "EngineOptions", "Schedule", "FitOptions", "FitResult", "fit", "build_optimizer", "warmup_cosine",
           "StreamedEpoch",
           "NonFiniteLossError", "SaveError", "RunLock", "RunLockedError", "PRECISIONS", "versions",
           "autocast_dtype", "seed_everything"]

class NonFiniteLossError(FloatingPointError, ValueError):
    """The loss became NaN or infinite; raised before the update, the last checkpoint is untouched."""


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

    def epoch_batches(self, epoch: int, ctx: DistContext) -> Union[Sequence[Any], "StreamedEpoch"]:
        """This rank's batches for ``epoch`` -- a pure function of the epoch: a ``Sequence`` indexed by step (e.g.
        index lists), or a streamed epoch (``__len__`` and ``iter_from(step)``, see :class:`StreamedEpoch`)."""

    def loss(self, model: nn.Module, batch: Any, device: torch.device) -> Tuple[Tensor, Dict[str, Any]]:
        """``(loss, sums)``: the scalar loss to minimise and numbers to add up over the epoch (for ``epoch_row``).

        ``sums`` values are 0-d tensors (added up on the device: no host synchronisation) or numbers. Called under
        autocast; ``model`` may be a compiled version of ``self.model``.
        """

    def epoch_row(self, epoch: int, sums: Dict[str, float], info: Dict[str, Any], ctx: DistContext) -> Dict[str, Any]:
        """The metrics row of a finished epoch from the summed ``sums`` (of this rank, as floats) and ``info``
        (``lr``, ``epoch_time``, ``elapsed``, ``global_step``); may evaluate (every rank calls it)."""


class StreamedEpoch:
    """An epoch of ``length`` batches that is iterated rather than indexed: ``open(step)`` returns an iterable of
    the batches from ``step`` on (e.g. a data loader started at ``start_batch=step``), so that a run resumed
    mid-epoch skips the batches already trained on without producing them.

    The batches must be a function of the epoch (and the rank) only, as for a ``Sequence``.
    """

    def __init__(self, length: int, open: Callable[[int], Iterable[Any]]) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"StreamedEpoch: length must be an integer >= 0, got {length!r}")
        self._length, self._open = int(length), open

    def __len__(self) -> int:
        return self._length

    def iter_from(self, step: int) -> Iterator[Any]:
        """The batches ``step, step + 1, ...`` of the epoch."""
        return iter(self._open(int(step)))


def _iter_from(batches: Any, start: int) -> Iterator[Any]:
    """The batches of an epoch from step ``start``: ``iter_from(start)`` of a streamed epoch, else by index."""
    iter_from = getattr(batches, "iter_from", None)
    if callable(iter_from):
        return iter(iter_from(start))
    return (batches[i] for i in range(start, len(batches)))


def _call(task: Any, name: str, *args: Any, default: Any = None) -> Any:
    fn = getattr(task, name, None)
    return fn(*args) if callable(fn) else default



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


class _DeviceSums:
    """The epoch's metric sums, added up where they come from: tensors on the device (float64 where the device has
    it, so that the totals match a host-side float sum), numbers on the host; read with one synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.dtype = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
        self.values: Dict[str, Any] = {}

    def add(self, sums: Dict[str, Any]) -> None:
        for k, v in sums.items():
            cur = self.values.get(k, 0.0)
            if isinstance(v, Tensor):
                v = v.detach().to(self.dtype)
                if not isinstance(cur, Tensor):  # (a restored or host total joins the device total in order)
                    cur = torch.tensor(float(cur), dtype=self.dtype, device=v.device)
                self.values[k] = cur + v
            else:
                self.values[k] = cur + float(v)

    def read(self) -> Dict[str, float]:
        """The sums as floats (one host synchronisation for all the device ones)."""
        keys = [k for k, v in self.values.items() if isinstance(v, Tensor)]
        read = dict(zip(keys, torch.stack([self.values[k].reshape(()) for k in keys]).tolist())) if keys else {}
        return {k: read.get(k, v) for k, v in self.values.items()}

    def load(self, values: Dict[str, float]) -> None:
        self.values = {k: float(v) for k, v in values.items()}


class _Guard:
    """The first non-finite loss since the last check, recorded on the device: its global step and value."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending = False  # steps since the last check
        self._where: Dict[int, Tuple[int, int]] = {}  # global step -> (epoch, step in epoch), since the last check
        self.reset()

    def reset(self) -> None:
        self.first = torch.full((), -1, dtype=torch.int64, device=self.device)
        self.value = torch.zeros((), dtype=torch.float32, device=self.device)
        self._where.clear()
        self.pending = False

    def watch(self, loss: Tensor, global_step: int, epoch: int, step: int) -> None:
        loss = loss.detach().float().reshape(())
        new = torch.isfinite(loss).logical_not() & (self.first < 0)
        self.first = torch.where(new, global_step, self.first)
        self.value = torch.where(new, loss, self.value)
        self._where[global_step] = (epoch, step)
        self.pending = True

    def read(self) -> Optional[Tuple[int, float, int, int]]:
        """``(global step, value, epoch, step in epoch)`` of the first non-finite loss, or ``None``."""
        first, value = torch.stack([self.first.double(), self.value.double()]).tolist()
        if first < 0:
            return None
        epoch, step = self._where.get(int(first), (-1, -1))
        return int(first), value, epoch, step


def fit(task: Task, options: FitOptions) -> FitResult:
    """Train ``task.model`` for ``options.epochs`` epochs of ``task.epoch_batches`` (see :class:`FitOptions`).

    ``task``: see :class:`Task`. Optional hooks: ``state_dict()`` / ``load_state_dict(d)`` (task RNG, EMA...),
    ``after_step(step)`` (0-based global step, after the update), ``compile_targets()`` (modules to compile;
    default ``[task.model]``), ``plot(history, path)``, ``summary(history) -> dict``, ``describe(row) -> str`` (a
    log line per epoch), ``find_unused_parameters`` (DDP).

    Raises:
        NonFiniteLossError: a NaN / Inf loss (step named; nothing saved after the last good checkpoint).
        ValueError: NaN / Inf coordinates counted on the device by ``ropekit.encodings.check_deferred_coords``
            (an accelerator, or a compiled model), raised at the step that used them, before the update.
        SaveError: a checkpoint could not be written (the previous one is intact).
        RunLockedError: another process is writing ``run_dir``.
        CheckpointError: ``resume`` without a usable checkpoint, or a checkpoint that does not fit.
    """
    execution = options.execution.validate()
    options.validate()
    ctx = options.ctx or init_distributed(execution.device)
    previous_threads = torch.get_num_threads()
    if execution.threads:
        torch.set_num_threads(int(execution.threads))
    run = Path(options.run_dir) if options.run_dir is not None else None
    lock = RunLock(run) if run is not None and ctx.is_main else None
    try:
        if lock is not None:
            lock.acquire()
            removed = remove_stale_temporaries(run)  # type: ignore[arg-type]
            if removed:
                _log(f"removed {len(removed)} temporary file(s) a killed run left in {run}: {', '.join(removed)}",
                     ctx, options.quiet)
        return _Fit(task, options, ctx, run).run()
    finally:
        if lock is not None:
            lock.release()
        torch.set_num_threads(previous_threads)
        if options.ctx is None:
            ctx.close()


class _Fit:
    """One call of :func:`fit`: the run's state and its steps (setup, resume, epochs, evaluation, checkpoints,
    summary), in the order :meth:`run` calls them."""

    def __init__(self, task: Any, options: FitOptions, ctx: DistContext, run: Optional[Path]) -> None:
        self.task, self.o, self.ctx, self.run_dir = task, options, ctx, run
        self.execution = options.execution
        self.t_start = time.time()
        self.ckpt_path = run / options.checkpoint_name if run is not None else None
        self.start_epoch, self.start_step, self.global_step, self.elapsed_before = 0, 0, 0, 0.0
        self.history: List[Dict[str, Any]] = []
        self.sums = _DeviceSums(ctx.device)
        self.partial_time = 0.0  # seconds of the current epoch before a resume
        self.guard = _Guard(ctx.device)
        self.stop_wanted = False  # an on_step request not yet agreed on by every rank
        self.checked_at = 0  # global steps covered by the last check of the guard
        self.interrupted = False

    def run(self) -> FitResult:
        ckpt = self._checkpoint_to_resume()
        self._setup()
        if ckpt is not None:
            self._resume(ckpt)
        elif self.o.fresh_start is not None:
            self.o.fresh_start(self.ctx)
        self.num_params = count_parameters(self.model)  # encodings by their effective count
        self._write_start_files()
        self._compile_and_wrap()
        self._open_progress(resumed=ckpt is not None)
        with _StopRequest(verbose=self.ctx.is_main and not self.o.quiet, enabled=self.run_dir is not None) as stop:
            for epoch in range(self.start_epoch, self.o.epochs):
                if not self._train_epoch(epoch, stop):
                    break
                row = self._evaluate(epoch)
                self._save(epoch + 1, 0)
                self._log_epoch(row)
                if self.ctx.any(stop.requested or self.stop_wanted):
                    self.interrupted = epoch + 1 < self.o.epochs
                    break
        return self._finish()

    # ------------------------------------------------------------------ setup and resume
    def _checkpoint_to_resume(self) -> Optional[Dict[str, Any]]:
        """The checkpoint ``resume`` continues; a fresh run refuses a folder that already holds one."""
        if self.o.resume:
            if self.ckpt_path is None:
                raise ValueError("resume needs a run folder")
            return load_checkpoint(self.ckpt_path)
        if self.ckpt_path is not None and self.ckpt_path.exists():
            raise ValueError(f"run folder {self.run_dir} already holds a checkpoint; continue it with --resume or "
                             f"choose another --out")
        return None

    def _setup(self) -> None:
        """The model on the run's device, the optimiser, the learning-rate schedule and the gradient scaler."""
        schedule, device = self.o.schedule, self.ctx.device
        self.model: nn.Module = self.task.model
        self.model.to(device)
        self.opt = self.o.optimizer or build_optimizer(self.model, schedule.lr, schedule.weight_decay)
        self.factor = warmup_cosine(schedule.total_steps, schedule.warmup_steps, schedule.min_lr / schedule.lr)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.factor)
        self.amp_dtype = autocast_dtype(self.execution.precision)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.execution.precision == "fp16")

    def _resume(self, ckpt: Dict[str, Any]) -> None:
        """Model, optimiser, schedule, scaler, counters, history, RNG and task states from ``ckpt``."""
        load_model_state(self.model, ckpt["model"], source=f"checkpoint {ckpt['path']}")
        try:
            self.opt.load_state_dict(ckpt["optimizer"])
            self.sched.load_state_dict(ckpt["scheduler"])
            if self.scaler.is_enabled() and ckpt.get("scaler"):
                self.scaler.load_state_dict(ckpt["scaler"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {ckpt['path']} does not match the optimiser: "
                                  f"{str(e).splitlines()[0]}") from None
        # the schedule may have been stretched (more epochs): continue on the current one
        for group, base in zip(self.opt.param_groups, self.sched.base_lrs):
            group["lr"] = base * self.factor(self.sched.last_epoch)
        self.sched._last_lr = [g["lr"] for g in self.opt.param_groups]  # type: ignore[attr-defined]
        self.start_epoch, self.start_step = int(ckpt["epoch"]), int(ckpt.get("step_in_epoch", 0))
        self.global_step, self.elapsed_before = int(ckpt.get("global_step", 0)), float(ckpt.get("elapsed_time", 0.0))
        self.checked_at = self.global_step
        self.history = list(ckpt.get("history", []))
        partial = ckpt.get("partial") or {}
        if isinstance(partial, list):  # (one entry per rank; a dict in checkpoints of one process before)
            partial = partial[self.ctx.rank] if self.ctx.rank < len(partial) else {}
        partial = dict(partial)
        self.partial_time = float(partial.pop("time", 0.0))
        self.sums.load(partial)
        rng = ckpt.get("rng") or []
        if self.ctx.rank < len(rng):
            restore_rng(rng[self.ctx.rank])
        task_states = ckpt.get("task") or []
        if self.ctx.rank < len(task_states) and task_states[self.ctx.rank] is not None:
            _call(self.task, "load_state_dict", task_states[self.ctx.rank])

    def _write_start_files(self) -> None:
        """``config.json`` (and, resuming, ``metrics.csv`` so far); the TensorBoard writer."""
        run, ctx = self.run_dir, self.ctx
        if run is not None and ctx.is_main:
            if self.o.config_doc is not None:
                doc = {**self.o.config_doc, "engine": {"precision": self.execution.precision,
                                                       "compile": self.execution.compile, "device": str(ctx.device)},
                       "world_size": ctx.world_size, "num_params": self.num_params, "versions": versions()}
                write_json(run / "config.json", doc, "config")
            if self.history:
                _write_metrics(run, self.history, self.o.metric_columns)
        self.tb = TensorBoardLogger(run / "tb", enabled=self.execution.tensorboard and ctx.is_main) \
            if run is not None else None

    def _compile_and_wrap(self) -> None:
        """``torch.compile`` in place (the state_dict keeps its names), then DDP around the task's loss."""
        compile_with = self.execution.compile
        if compile_with:
            backend = compile_with if isinstance(compile_with, str) else "inductor"
            for m in _call(self.task, "compile_targets", default=None) or [self.model]:
                m.compile(backend=backend)
        device = self.ctx.device
        self.step_module: nn.Module = _TaskStep(self.task, self.model, device)
        if self.ctx.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.step_module = DDP(self.step_module, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=bool(getattr(self.task, "find_unused_parameters", False)))
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def _open_progress(self, resumed: bool) -> None:
        from tqdm import tqdm

        total_steps = int(self.o.schedule.total_steps)
        self.bar = tqdm(total=total_steps, initial=min(self.global_step, total_steps),
                        desc=getattr(self.task, "name", "train"),
                        disable=not (self.execution.progress and self.ctx.is_main), leave=False, dynamic_ncols=True,
                        file=sys.stderr)
        self.resumed_from = self.global_step if resumed else None
        check_deferred_coords(self.ctx.device)  # sets up the device's counter before a compiled model traces its checks
        self.model.train()

    # ------------------------------------------------------------------ one epoch
    def _train_epoch(self, epoch: int, stop: _StopRequest) -> bool:
        """The epoch's remaining steps; ``False`` when a stop request ended it early (a checkpoint is saved)."""
        ctx, every = self.ctx, self.o.checkpoint_every
        batches = self.task.epoch_batches(epoch, ctx)
        n = len(batches)
        if self.start_step > n:
            raise CheckpointError(f"checkpoint {self.ckpt_path} stopped at step {self.start_step} of an epoch, but "
                                  f"an epoch now has {n} steps (batch size or data changed)")
        self.t_epoch = time.time() - self.partial_time
        self.partial_time = 0.0
        self.model.train()
        done = self.start_step
        # (the batches first: after the last one the loader is asked once more, so that it ends -- and runs what it
        # does at the end of an epoch, e.g. counting skipped files -- rather than being left suspended)
        for batch, step in zip(_iter_from(batches, self.start_step), range(self.start_step, n)):
            done = step + 1
            log_step = (self.global_step + 1) % self.o.log_every == 0
            stop_seen = self._step(epoch, step, batch, check=log_step, stop=stop)
            if self.o.on_step is not None and self.o.on_step(self.global_step):
                self.stop_wanted = True
            save_due = every > 0 and self.global_step % every == 0 and step + 1 < n
            if not ctx.enabled:
                stop_seen = stop.requested or self.stop_wanted  # (one process: no collective, at once)
            elif save_due and not log_step:
                stop_seen = ctx.any(stop.requested or self.stop_wanted)
            if stop_seen:
                self._save(epoch, step + 1)
                self.interrupted = True
                return False
            if save_due:
                self._save(epoch, step + 1)
        if done < n:
            raise RuntimeError(f"the data of epoch {epoch + 1} ended after {done} of its {n} batches (the loader "
                               f"yielded fewer batches than its length says)")
        self._check(epoch, "at the end of the epoch")
        self.start_step = 0
        return True

    def _step(self, epoch: int, step: int, batch: Any, *, check: bool, stop: _StopRequest) -> bool:
        """Forward, the device-side loss guard (read when ``check``, on every rank together, before the update),
        backward, clipping and the update; whether a stop was agreed on at this step's check."""
        device = self.ctx.device
        with torch.autocast(device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None):
            loss, sums = self.step_module(batch)
        self.guard.watch(loss, self.global_step, epoch, step)
        self.sums.add(sums)
        stop_seen = False
        if check:
            stop_seen = self._check(epoch, "before the update", stop=stop.requested or self.stop_wanted, step=step)
            self._show_loss(epoch)
        opt, scaler = self.opt, self.scaler
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if self.o.schedule.grad_clip > 0:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(self.params, self.o.schedule.grad_clip)
        scaler.step(opt)
        scaler.update()
        with warnings.catch_warnings():  # (fp16: the scaler skips the steps whose gradients overflowed)
            warnings.simplefilter("ignore", UserWarning)
            self.sched.step()
        _call(self.task, "after_step", self.global_step)
        self.global_step += 1
        self.bar.update(1)
        return stop_seen

    def _check(self, epoch: int, when: str, stop: bool = False, step: int = -1) -> bool:
        """Read the loss guard and the deferred coordinate checks (one host synchronisation) and agree on them and
        on ``stop`` over the ranks (one collective); raise on a bad loss or coordinate anywhere, else whether any
        rank asked to stop."""
        if not self.guard.pending and not self.ctx.enabled:
            return stop
        device, ctx = self.ctx.device, self.ctx
        bad = self.guard.read() if self.guard.pending else None
        coord_error = _deferred_coord_error(device)
        any_bad, any_coord, any_stop = (v > 0 for v in ctx.all_reduce_sum(
            [float(bad is not None), float(coord_error is not None), float(stop)]))
        self.guard.reset()
        since, self.checked_at = self.checked_at, self.global_step + (when == "before the update")
        if not (any_bad or any_coord):
            return any_stop
        intact = (f"; the last good checkpoint {self.ckpt_path} is intact"
                  if self.ckpt_path is not None and self.ckpt_path.exists() else "")
        if when == "before the update":
            seen = f"at step {self.global_step + 1} (epoch {epoch + 1}, batch {step + 1})"
        else:
            seen = f"after step {self.global_step} (epoch {epoch + 1})"
        if any_coord:
            counted = seen if since == self.checked_at - 1 else f"in steps {since + 1}-{self.checked_at}, found {seen}"
            raise ValueError(f"{coord_error or 'non-finite coordinates on another rank'} ({counted}: stopped "
                             f"{when}{intact})") from None
        if bad is None:
            raise NonFiniteLossError(f"non-finite loss on another rank (found {seen}): stopped {when}{intact}")
        g, value, e, b = bad
        at = f"at step {g + 1} (epoch {e + 1}, batch {b + 1})"
        if when == "before the update" and g == self.global_step:
            raise NonFiniteLossError(f"non-finite loss ({value}) {at}: stopped before the update{intact}")
        raise NonFiniteLossError(f"non-finite loss ({value}) {at}, found {seen} (log_every {self.o.log_every}): "
                                 f"nothing trained since was saved{intact}")

    def _show_loss(self, epoch: int) -> None:
        """The running loss of the epoch on the progress bar (reads the sums: only at log steps)."""
        if self.bar.disable:
            return
        part = self.sums.read()
        if "loss" in part or "loss_sum" in part:
            n = part.get("count", 1.0) or 1.0
            shown = {"loss": f"{part.get('loss_sum', part.get('loss', 0.0)) / n:.4f}"}
            if "correct" in part:  # (a classifier's running training accuracy)
                shown["acc"] = f"{part['correct'] / n:.4f}"
            self.bar.set_postfix(**shown, epoch=f"{epoch + 1}/{self.o.epochs}", refresh=False)

    # ------------------------------------------------------------------ evaluation, checkpoint, log
    def _evaluate(self, epoch: int) -> Dict[str, Any]:
        """The task's metrics row of the finished epoch (it may evaluate), appended to the history."""
        info = {"lr": self.opt.param_groups[0]["lr"], "epoch_time": time.time() - self.t_epoch,
                "elapsed": self.elapsed_before + time.time() - self.t_start, "global_step": self.global_step}
        row = self.task.epoch_row(epoch, self.sums.read(), info, self.ctx)
        self.history.append(row)
        self.sums = _DeviceSums(self.ctx.device)
        return row

    def _save(self, epoch_done: int, step_in_epoch: int) -> None:
        """The checkpoint after ``epoch_done`` epochs and ``step_in_epoch`` more steps, with every rank's RNG,
        metric sums and task state (rank 0 writes it; a failed write raises on every rank). The loss guard is read
        first: nothing trained on a non-finite loss is ever saved."""
        ctx, ckpt_path = self.ctx, self.ckpt_path
        self._check(epoch_done - (step_in_epoch == 0), "before saving")
        part = {**self.sums.read(), "time": time.time() - self.t_epoch} if step_in_epoch else {}
        parts = ctx.gather_objects(part)  # (each rank's own sums of the epoch so far)
        rng_states = ctx.gather_objects(capture_rng())
        task_states = ctx.gather_objects(_call(self.task, "state_dict"))
        failure = None
        if ctx.is_main and ckpt_path is not None:
            doc = {"format": "ropekit-checkpoint", "version": 1, "model": self.model.state_dict(),
                   **(self.o.checkpoint_extra or {}), "optimizer": self.opt.state_dict(),
                   "scheduler": self.sched.state_dict(),
                   "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                   "epoch": epoch_done, "step_in_epoch": step_in_epoch, "global_step": self.global_step,
                   "elapsed_time": self.elapsed_before + (time.time() - self.t_start), "rng": rng_states,
                   "task": task_states, "history": self.history, "partial": parts, "world_size": ctx.world_size,
                   "precision": self.execution.precision}
            try:
                safe_write("checkpoint", ckpt_path, lambda: atomic_save(doc, ckpt_path))
            except SaveError as e:
                failure = e
        if ctx.any(failure is not None):
            raise failure or SaveError(f"rank 0 could not write the checkpoint {ckpt_path}")

    def _log_epoch(self, row: Dict[str, Any]) -> None:
        """``metrics.csv``, TensorBoard scalars and the task's log line of a finished epoch."""
        if self.run_dir is not None and self.ctx.is_main:
            _write_metrics(self.run_dir, self.history, self.o.metric_columns)
            if self.tb is not None:
                self.tb.log(row, step=int(row.get("step", row.get("epoch", self.global_step))))
        line = _call(self.task, "describe", row)
        if line:
            self.bar.clear()
            _log(line, self.ctx, self.o.quiet)

    # ------------------------------------------------------------------ summary
    def _finish(self) -> FitResult:
        """Close the bar and TensorBoard, write ``curves.png`` and ``summary.json``; the result."""
        run, ctx, history = self.run_dir, self.ctx, self.history
        self.bar.close()
        if self.tb is not None:
            self.tb.close()
        wall = self.elapsed_before + time.time() - self.t_start
        if run is not None and ctx.is_main and history and self.execution.plots:
            plot = getattr(self.task, "plot", None)
            try:
                if callable(plot):
                    plot(history, run / "curves.png")
                else:
                    _plot_generic(history, run / "curves.png", getattr(self.task, "name", "train"))
            except OSError as e:
                raise SaveError(f"could not write the plot {run / 'curves.png'}: {e.strerror or e}") from None
        result = FitResult(history=history, interrupted=self.interrupted, wall_time=wall, run_dir=run, ctx=ctx,
                           global_step=self.global_step, resumed_from=self.resumed_from, num_params=self.num_params)
        summary = _call(self.task, "summary", history)
        if run is not None and ctx.is_main and summary is not None:
            write_json(run / "summary.json", {**summary, "epochs_done": len(history), "interrupted": self.interrupted,
                                              "wall_time": wall, "num_params": self.num_params,
                                              "world_size": ctx.world_size, "device": ctx.device_name,
                                              "machine": ctx.machine, "precision": self.execution.precision},
                       "summary")
        ctx.barrier()
        return result


def _write_metrics(run: Path, history: List[Dict[str, Any]], columns: Optional[Sequence[str]]) -> None:
    safe_write("metrics file", run / "metrics.csv", lambda: write_metrics_csv(run / "metrics.csv", history, columns))


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
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format=path.suffix.lstrip(".") or "png"))
    plt.close(fig)
