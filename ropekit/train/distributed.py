"""Distributed data parallel set-up: the same command runs alone or under ``torchrun --nproc_per_node N``.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; then the process
group is initialised with gloo on CPU (nccl on GPU). Rank 0 writes every file.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from .._platform import numerics_fingerprint

__all__ = ["DistContext", "init_distributed", "resolve_device"]


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False

    @property
    def device_name(self) -> str:
        """The device in words for run summaries: ``cpu``, or ``cuda (NVIDIA H200)``."""
        if self.device.type == "cuda":
            return f"cuda ({torch.cuda.get_device_name(self.device)})"
        return self.device.type

    @property
    def machine(self) -> Dict[str, Any]:
        """What decides this process's floating-point results (CPU, its vector instruction set, torch, threads,
        and the GPU on CUDA), for run summaries: see :func:`ropekit._platform.numerics_fingerprint`."""
        return numerics_fingerprint(self.device)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, values: List[float]) -> List[float]:
        """Sum a few numbers over ranks (identity when not distributed)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """``True`` on every rank when ``flag`` is true on at least one."""
        if not self.enabled:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather_objects(self, obj: Any) -> List[Any]:
        """Every rank's ``obj`` (in rank order), on every rank."""
        if not self.enabled:
            return [obj]
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        """Done with this context. A process group set up here stays up until the process exits (then it is
        destroyed), so that a second run in the same ``torchrun`` process reuses it: tearing a group down and
        setting it up again on the same ``torchrun`` store can hang."""
        self.initialized_here = False

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def resolve_device(device: str = "auto", *, world_size: int = 1, local_rank: int = 0) -> torch.device:
    """The ``torch.device`` a process uses, with a one-line ``ValueError`` where it cannot work.

    ``"auto"`` is CUDA when a GPU is visible, else the CPU. Under ``torchrun`` each process takes the GPU of its
    local rank, so it needs at least as many GPUs as processes per machine: with fewer, ``"auto"`` and ``"cuda"``
    are refused with a line saying so (``--device cpu`` runs every process on the CPU with gloo instead).

    Raises:
        ValueError: a device string torch does not know, ``cuda`` without a usable GPU, a GPU index that does not
            exist, or more processes than GPUs.
    """
    text = str(device).strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"--device {device}: no CUDA GPU is available on this machine; use --device cpu")
        if dev.index is None:
            if world_size > 1 and local_rank >= n:
                raise ValueError(f"{world_size} processes per machine but only {n} GPU(s): each process needs its "
                                 f"own GPU; start at most {n} (torchrun --nproc_per_node {n}) or use --device cpu "
                                 f"(gloo on the CPU)")
            dev = torch.device("cuda", local_rank if world_size > 1 else torch.cuda.current_device())
        elif dev.index >= n:
            raise ValueError(f"--device {device}: this machine has {n} GPU(s) (cuda:0 to cuda:{n - 1})")
    elif dev.type not in ("cpu", "mps", "xpu", "meta"):
        raise ValueError(f"unsupported device {device!r}; use auto, cpu, cuda or cuda:N")
    return dev


#: Environment variable: seconds a rank waits for its peers (process-group set-up and every collective) before
#: it stops with one line instead of hanging (default :data:`DEFAULT_DIST_TIMEOUT_S`).
DIST_TIMEOUT_ENV = "ROPEKIT_DIST_TIMEOUT"
DEFAULT_DIST_TIMEOUT_S = 600.0


def dist_timeout() -> timedelta:
    """The timeout of :data:`DIST_TIMEOUT_ENV` (seconds, > 0), else :data:`DEFAULT_DIST_TIMEOUT_S`.

    Raises:
        ValueError: not a positive number (one line).
    """
    text = os.environ.get(DIST_TIMEOUT_ENV, "").strip()
    if not text:
        return timedelta(seconds=DEFAULT_DIST_TIMEOUT_S)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{DIST_TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
    return timedelta(seconds=value)


def init_distributed(device: str = "auto") -> DistContext:
    """Initialise the process group if launched by ``torchrun`` (``WORLD_SIZE > 1``) and pick the device.

    The group's timeout (set-up and every collective) is :func:`dist_timeout`: a rank whose peer died or hangs
    stops after it with an error instead of waiting gloo's 30 minutes; ``ropekit`` reports it in one line.

    Args:
        device: ``"auto"`` (CUDA if available, else CPU), or any ``torch.device`` string (see
            :func:`resolve_device` for the rules with several processes).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, world_size=world, local_rank=local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ctx = DistContext(rank=rank, world_size=world, local_rank=local_rank, device=dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=dist_timeout())
        ctx.initialized_here = True
        atexit.register(_destroy_process_group)
    return ctx


#: How long a rank waits at exit for the others before it tears the process group down anyway.
EXIT_BARRIER_TIMEOUT_S = 60.0


def _destroy_process_group() -> None:
    """At interpreter exit: wait for every rank (gloo: at most :data:`EXIT_BARRIER_TIMEOUT_S`, so a crashed peer
    does not hang the exit), then destroy the group. Without the barrier a rank that finishes first tears its
    gloo threads down while a peer's last collective may still be in flight, which aborts the process at exit
    ("terminate called without an active exception") although the run itself succeeded."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=EXIT_BARRIER_TIMEOUT_S))
    except Exception:  # a peer is gone or failed: nothing left to wait for
        pass
    dist.destroy_process_group()
