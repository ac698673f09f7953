"""Distributed data parallel set-up: the same command runs alone or under ``torchrun --nproc_per_node N``.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; then the process
group is initialised with gloo on CPU (nccl on GPU). Rank 0 writes every file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist

__all__ = ["DistContext", "init_distributed"]


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False

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
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()
            self.initialized_here = False

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def init_distributed(device: str = "auto") -> DistContext:
    """Initialise the process group if launched by ``torchrun`` (``WORLD_SIZE > 1``) and pick the device.

    Args:
        device: ``"auto"`` (CUDA if available, else CPU), or any ``torch.device`` string.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank if world > 1 else torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ctx = DistContext(rank=rank, world_size=world, local_rank=local_rank, device=dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
        ctx.initialized_here = True
    return ctx
