"""Where a computation ran, in the terms that decide its floating-point results.

Training is deterministic on one machine, but not across machines: the CPU's vector instruction set (which
PyTorch's own kernels and the BLAS library pick when they start) changes the order in which sums are rounded, and
a few hundred optimisation steps grow that last-bit difference into a different model. Run summaries record
:func:`numerics_fingerprint` so that two results of one configuration can be told apart by where they came from.
"""

from __future__ import annotations

import platform
from typing import Any, Dict

import torch

__all__ = ["cpu_model", "numerics_fingerprint"]


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (e.g. ``"AMD EPYC"``), else what :mod:`platform` reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def numerics_fingerprint(device: Any = None) -> Dict[str, Any]:
    """What decides the rounding of a run on ``device`` (a ``torch.device``, or ``None`` for the CPU).

    Returns ``{"cpu", "cpu_capability", "torch", "threads"}`` -- the CPU model, the vector instruction set
    PyTorch's CPU kernels use (``"AVX2"``, ``"AVX512"``, ``"DEFAULT"``...; the ``ATEN_CPU_CAPABILITY``
    environment variable can lower it), the torch version and the intra-op thread count -- plus ``"gpu"`` and
    ``"cuda"`` for a CUDA device.
    """
    doc: Dict[str, Any] = {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "torch": torch.__version__, "threads": torch.get_num_threads()}
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        doc.update(gpu=torch.cuda.get_device_name(dev), cuda=torch.version.cuda)
    return doc
