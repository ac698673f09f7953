"""Checkpoints: atomic writes, RNG state capture, and loading with one-line errors.

A checkpoint is a plain ``dict`` of tensors, numbers, strings, lists and dicts (loadable with
``torch.load(..., weights_only=True)``)::

    format, version        "ropekit-checkpoint", 1
    model                  the model's state_dict (learnable parameters only; caches are not persistent)
    vit_config             ViTConfig.to_dict() -- the model can be rebuilt from the checkpoint alone
    train_config           TrainConfig.to_nested() (older checkpoints: to_dict()'s flat fields; both load)
    optimizer, scheduler   their state_dicts
    epoch, step_in_epoch   epochs completed, and optimiser steps done in the current epoch (mid-epoch saves)
    global_step
    rng                    one entry per rank: torch CPU (and CUDA) generator states, python and numpy states
    task                   one entry per rank: the task's own state (e.g. a policy's generator and EMA weights)
    scaler, precision      the fp16 gradient scaler's state (else None), and the autocast precision
    history                the metrics rows of the completed epochs
    partial                running sums of the interrupted epoch (train loss, correct, count)

(``vit_config`` / ``train_config`` are the classification trainer's; other tasks store their own configs.)
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, Optional, Union

import numpy as np
import torch

from .._io import atomic_write

__all__ = ["CHECKPOINT_NAME", "CheckpointError", "atomic_save", "load_checkpoint", "capture_rng", "restore_rng",
           "load_model_state"]

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT = "ropekit-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match the model (the message is one line)."""


def atomic_save(obj: Any, path: Union[str, Path]) -> Path:
    """``torch.save`` of ``obj`` onto ``path`` through :func:`ropekit._io.atomic_write` (temporary file in the same
    folder, fsync, ``os.replace``): a crash at any point leaves either the previous file or the new one, never a
    truncated file."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def load_checkpoint(path: Union[str, Path], map_location: Any = "cpu") -> Dict[str, Any]:
    """Read a ropekit checkpoint (a file, or a run folder holding ``checkpoint.pt``).

    Raises:
        CheckpointError: missing, unreadable / truncated, or not a ropekit checkpoint.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / CHECKPOINT_NAME
    if not p.is_file():
        raise CheckpointError(f"no checkpoint at {p}")
    try:
        ckpt = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means a corrupt file
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {p} is corrupt or unreadable ({type(e).__name__}: {msg[:200]})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT or "model" not in ckpt:
        raise CheckpointError(f"{p} is not a ropekit checkpoint")
    if int(ckpt.get("version", 0)) > VERSION:
        raise CheckpointError(f"checkpoint {p} has version {ckpt.get('version')}; this ropekit reads up to {VERSION}")
    ckpt["path"] = str(p)
    return ckpt


def load_model_state(model: torch.nn.Module, state: Dict[str, Any], *, strict: bool = True,
                     source: str = "checkpoint") -> Dict[str, Any]:
    """Load a state_dict, turning every mismatch into a one-line :class:`CheckpointError`.

    With ``strict=False`` only the entries whose names and shapes match are loaded (fine-tuning); the
    returned dict lists ``loaded``, ``missing`` and ``skipped`` names.
    """
    own = model.state_dict()
    if strict:
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        wrong = sorted(k for k in set(own) & set(state) if tuple(own[k].shape) != tuple(state[k].shape))
        if missing or unexpected or wrong:
            parts = []
            if missing:
                parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
            if unexpected:
                parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
            if wrong:
                k = wrong[0]
                parts.append(f"{len(wrong)} with another shape (e.g. {k}: {tuple(state[k].shape)} in the "
                             f"{source}, {tuple(own[k].shape)} in the model)")
            raise CheckpointError(f"{source} does not match the model: {'; '.join(parts)} parameter(s)")
        model.load_state_dict(state, strict=True)
        return {"loaded": sorted(own), "missing": [], "skipped": []}
    keep = {k: v for k, v in state.items() if k in own and tuple(own[k].shape) == tuple(v.shape)}
    model.load_state_dict(keep, strict=False)
    return {"loaded": sorted(keep), "missing": sorted(set(own) - set(keep)), "skipped": sorted(set(state) - set(keep))}


# ---------------------------------------------------------------------------------------------------------
# random number generator states
# ---------------------------------------------------------------------------------------------------------


def capture_rng() -> Dict[str, Any]:
    """Every global RNG state, in a ``weights_only``-loadable form."""
    np_state = np.random.get_state()
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _to_lists(random.getstate()),
        "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Optional[Dict[str, Any]]) -> None:
    """Inverse of :func:`capture_rng` (``None`` is a no-op)."""
    if not state:
        return
    torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
    random.setstate(_to_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), int(n[2]), int(n[3]), float(n[4])))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu().to(torch.uint8) for s in state["cuda"]])


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, tuple) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x
