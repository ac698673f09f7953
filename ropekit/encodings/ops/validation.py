"""The finiteness check of coordinates, shared by every execution path of every encoding.

The module path (``pe(q, k, coords)``, ``prepare``, ``rotate``, through ``check_coords``), the folded path of
``ropekit.nn.Attention``, ``apply_frequency_rope`` and the fused kernels of ``ropekit.kernels`` all call
:func:`check_finite` on their coordinates. Nothing is cached between calls: a value written in place (also through
``.data`` or a NumPy view, which no version counter sees) is checked at the next call.

How it checks, by mode (:func:`set_coord_validation`):

* ``"auto"`` (default): ``"eager"`` for CPU tensors, ``"deferred"`` on an accelerator and inside ``torch.compile``;
* ``"eager"``: a reduction read on the host; raises ``ValueError`` naming the count at once. On an accelerator this
  is a host synchronisation per call (for debugging);
* ``"deferred"``: the count of non-finite entries is added to a per-device counter on the device, asynchronously --
  no host synchronisation, and no device-side assert (which would leave a CUDA context unusable).
  :func:`check_deferred_coords` reads the counters and raises the same ``ValueError``; the training engine calls it
  at every step, right after it reads the loss (where the host waits for the device anyway);
* ``"off"``: no check.

Inside ``torch.compile`` a check counts (without a graph break) on a device whose counter existed when the graph was
traced: the CPU's always; an accelerator's after its first eager check or a call of
``check_deferred_coords(device)``. A graph traced by ``torch.export`` (and so an ONNX export) holds no check: it can
neither raise nor keep a counter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["MODES", "set_coord_validation", "check_finite", "check_real", "check_deferred_coords"]

MODES = ("auto", "eager", "deferred", "off")

_MODE = ["auto"]
#: device -> int64 scalar on that device: non-finite coordinate entries counted by deferred checks, not yet reported
_PENDING: dict[torch.device, Tensor] = {}


def set_coord_validation(mode: str) -> str:
    """Choose how every execution path checks coordinates for NaN and infinity; returns the previous mode.

    Args:
        mode: ``"auto"`` (the default: eager on the CPU, deferred on an accelerator and inside ``torch.compile``),
            ``"eager"`` (read on the host, ``ValueError`` at once: a synchronisation per call on an accelerator),
            ``"deferred"`` (counted on the device, raised by :func:`check_deferred_coords`) or ``"off"`` (no check:
            the last microsecond, at the price of silent NaN outputs for non-finite coordinates).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"coordinate validation mode must be one of {', '.join(MODES)}, got {mode!r}")
    previous, _MODE[0] = _MODE[0], mode
    return previous


def _message(name: str, count: int, where: str = "") -> str:
    plural = "value" if count == 1 else "values"
    return f"{count} non-finite {plural} (NaN or infinite) in {name}{where}; mask invalid tokens before encoding"


def _resolve(mode: str, device_type: str, compiling: bool) -> str:
    """The mode a check runs in: ``"auto"`` is ``"eager"`` on the CPU and ``"deferred"`` elsewhere; inside
    ``torch.compile`` every check that runs is deferred (reading a value on the host would break the graph)."""
    if mode == "auto":
        mode = "eager" if device_type == "cpu" else "deferred"
    return "deferred" if mode == "eager" and compiling else mode


def _counter(device: torch.device) -> Tensor:
    """The pending count of ``device``, created on first use (outside inference mode: it outlives it)."""
    counter = _PENDING.get(device)
    if counter is None:
        with torch.inference_mode(False):
            counter = torch.zeros((), dtype=torch.int64, device=device)
        _PENDING[device] = counter
    return counter


def check_finite(values: Tensor, name: str = "coords") -> None:
    """Check that ``values`` (coordinates of any shape, real dtype) are real numbers without NaN or infinity.

    Args:
        values: the tensor to check; integer tensors and tensors without data (the meta device) always pass the
            finiteness check.
        name: what the error calls it (``"coords"``, ``"k_coords"``, ``"coord_offset"``).

    Raises:
        ValueError: ``"<name> must be real numbers, got dtype torch.bool"`` for boolean or complex values (a
            check of the dtype only: no value is read, on any device); ``"<n> non-finite values (NaN or
            infinite) in <name> ..."``, at once in the eager mode; in the deferred mode by
            :func:`check_deferred_coords` later.
    """
    check_real(values, name)
    if not values.is_floating_point() or values.device.type == "meta" or torch.compiler.is_exporting():
        return  # an exported graph (torch.export, ONNX) can neither raise nor keep a counter
    compiling = torch.compiler.is_compiling()
    mode = _resolve(_MODE[0], values.device.type, compiling)
    if mode == "eager":
        if not bool(torch.isfinite(values).all()):
            raise ValueError(_message(name, int(torch.isfinite(values).logical_not().sum())))
    elif mode == "deferred" and (values.device in _PENDING or not compiling):
        # (no counter is created while Dynamo traces: that would fail the graph's guard at the next call)
        _counter(values.device).add_(torch.isfinite(values).logical_not().sum())


def check_real(values: Tensor, name: str = "coords") -> None:
    """Refuse boolean and complex coordinates in one line (``ValueError``): a boolean mask passed where
    coordinates belong would otherwise rotate by 0 and 1, and a complex tensor lose its imaginary part. Reads the
    dtype only (no host synchronisation)."""
    if values.dtype == torch.bool or values.is_complex():
        raise ValueError(f"{name} must be real numbers, got dtype {values.dtype}")


def check_deferred_coords(device: Any = None) -> None:
    """Report what deferred checks counted since the last call, and reset the count.

    Reads one number per device: a host synchronisation, so call it where the host waits for the device anyway
    (after reading a loss, at a log interval). Passing a device also sets up its counter, so that a model compiled
    afterwards counts there too.

    Args:
        device: the device to report (and set up); ``None``: every device with a counter.

    Raises:
        ValueError: ``"<n> non-finite values (NaN or infinite) in coords ..."`` when any was counted.
    """
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "meta":
            return
        _counter(device)
    bad = []
    for dev, counter in list(_PENDING.items()):
        if device is not None and dev != device:
            continue
        count = int(counter)
        if count:
            counter.zero_()
            bad.append((dev, count))
    if bad:
        where = ", ".join(str(dev) for dev, _ in bad)
        raise ValueError(_message("coords", sum(n for _, n in bad),
                                  f" since the last check (counted on {where} without a host synchronisation)"))


_counter(torch.device("cpu"))
