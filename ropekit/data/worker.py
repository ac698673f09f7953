"""What the image streams do inside a DataLoader worker: per-sample seeds mixed from integers, and errors carried
to the main process as values (so that a bad file fails with its own one-line error, not a worker traceback)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from ._common import DataFileError

__all__ = ["WorkerFailure", "failed_in_worker", "mix_seed", "sample_rng", "collate_samples"]


class WorkerFailure:
    """A :class:`DataFileError` raised in a DataLoader worker, carried to the main process as a value.

    DataLoader re-raises a worker's exception as a ``RuntimeError`` holding the worker's traceback, which would
    turn the one-line error into many; the loaders of this module raise the original instead.
    """

    def __init__(self, error: DataFileError) -> None:
        self.error = error


def failed_in_worker(error: DataFileError) -> "WorkerFailure":
    """``error`` as a value in a worker of :func:`make_loader` (the caller raises it otherwise)."""
    if get_worker_info() is None:
        raise error
    return WorkerFailure(error)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (numpy's SeedSequence: stable across versions and platforms)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(1, np.uint64)[0]
               >> np.uint64(1))


@contextlib.contextmanager
def sample_rng(seed: Optional[int]) -> Iterator[None]:
    """Run a transform under torch CPU seed ``seed``; in the main process the caller's RNG state is restored.

    Seeds the CPU generator only (``torch.manual_seed`` also queues seeds for every accelerator, with a stack
    trace each: about 30 times slower, for generators the CPU transforms never draw from).
    """
    if seed is None:
        yield
        return
    if get_worker_info() is None:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
    else:
        torch.default_generator.manual_seed(seed)
        yield


def collate_samples(items: Sequence[Any]) -> Tuple[Any, Any, int, Optional[WorkerFailure]]:
    """``(images, labels, skipped, failure)``: default collate of the samples that are not ``None`` (skipped) and,
    if a sample is a :class:`WorkerFailure`, that failure for the main process to raise."""
    failure = next((x for x in items if isinstance(x, WorkerFailure)), None)
    if failure is not None:
        return None, None, 0, failure
    kept = [x for x in items if x is not None]
    skipped = len(items) - len(kept)
    if not kept:
        return None, None, skipped, None
    images, labels = default_collate(kept)
    return images, labels, skipped, None
