"""A run folder of ``ropekit train``: reading it (its ``config.json`` and checkpoint, :func:`load_run`) and writing it
while a run owns it -- the versions that produced it, an exclusive lock (``filelock``), and writes that either
complete or leave the previous file intact, failing with one line (:class:`SaveError`).

Kept apart from the training loop so that code which only reads runs (fine-tuning, evaluation, experiment
reports) does not import it.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from .checkpoint import CheckpointError, load_checkpoint
from .._io import TEMP_GLOB, atomic_write

__all__ = ["load_run", "load_run_config", "SaveError", "RunLockedError", "versions", "RunLock", "safe_write",
           "remove_stale_temporaries", "write_json"]


def load_run(run_dir: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(config, checkpoint)`` of a run folder or a checkpoint file.

    ``config`` is the parsed ``config.json`` (``{"train": ..., "model": ..., ...}``), or, when the folder has none
    or a checkpoint file is given, ``{"train", "model"}`` taken from the checkpoint.

    Raises:
        FileNotFoundError: no such folder. CheckpointError: no readable checkpoint, or a ``config.json`` that is
            not JSON (one-line messages).
    """
    run = Path(run_dir).expanduser()
    if not run.exists():
        raise FileNotFoundError(f"run folder not found: {run}")
    if run.is_file():  # a checkpoint file: take the config from it
        ckpt = load_checkpoint(run)
        return {"train": ckpt.get("train_config", {}), "model": ckpt["vit_config"]}, ckpt
    cfg_path = run / "config.json"
    ckpt = load_checkpoint(run)
    if cfg_path.is_file():
        config = _read_config(cfg_path)
    else:
        config = {"train": ckpt.get("train_config", {}), "model": ckpt.get("vit_config", {})}
    return config, ckpt


def load_run_config(run_dir: Any) -> Dict[str, Any]:
    """The ``config`` of :func:`load_run` without loading the weights when the folder's ``config.json`` holds the
    model's configuration (``"model"``).

    Raises:
        as :func:`load_run`.
    """
    run = Path(run_dir).expanduser()
    if run.is_dir() and (run / "config.json").is_file():
        config = _read_config(run / "config.json")
        if "model" in config:
            return config
    return load_run(run)[0]


def _read_config(path: Path) -> Dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} does not hold a mapping")
    return config


class SaveError(CheckpointError):
    """A checkpoint or run file could not be written (disk full, read-only folder); the previous one is intact."""


class RunLockedError(ValueError):
    """Another process is writing the run folder."""


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


_HELD: Dict[str, Any] = {}  # lock file -> its FileLock while this process holds it (kept alive by this reference)


class RunLock:
    """An exclusive lock on a run folder (``<run>/.lock``, a ``filelock.FileLock``), held while a run writes it.

    Re-entrant within a process (the trainer takes it before loading data, the engine again: one lock object per
    folder, counted). A second process gets :class:`RunLockedError` at once, without waiting, naming the holder's
    pid. The operating system releases the lock when its process dies, so a killed run never blocks the folder;
    the lock file is removed when the last holder releases it (a finished run leaves no ``.lock``).
    """

    def __init__(self, run_dir: Union[str, Path]) -> None:
        self.run_dir = Path(run_dir)
        self._lock: Any = None

    def acquire(self) -> "RunLock":
        from filelock import FileLock, Timeout

        if self._lock is not None:
            return self
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SaveError(f"cannot create the run folder {self.run_dir}: {e.strerror or e}") from None
        path = self.run_dir.resolve() / ".lock"
        lock = FileLock(str(path), timeout=0, is_singleton=True, thread_local=False, on_acquired=_write_pid)
        try:
            lock.acquire()
        except Timeout:
            try:
                owner = path.read_text(errors="replace").strip()[:32]
            except OSError:
                owner = ""
            raise RunLockedError(f"run folder {self.run_dir} is being written by another run"
                                 f"{f' (pid {owner})' if owner else ''}; wait for it to end or choose another "
                                 f"--out") from None
        except OSError as e:
            raise SaveError(f"cannot write the run folder {self.run_dir}: {e.strerror or e}") from None
        self._lock = _HELD[str(path)] = lock
        return self

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is None:
            return
        if lock.lock_counter == 1:  # the last holder: remove the file while it is still ours
            try:
                Path(lock.lock_file).unlink(missing_ok=True)
            except OSError:
                pass
            _HELD.pop(str(lock.lock_file), None)
        lock.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _write_pid(fd: int) -> None:
    """Record this process's pid in a freshly acquired lock file (named by a refused second run)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)


def safe_write(what: str, path: Path, fn: Callable[[], Any]) -> Any:
    """Run a write; any failure of it becomes a one-line :class:`SaveError` (the temporary file is already gone):
    an ``OSError``, or the ``RuntimeError`` that ``torch.save`` raises when the disk fills while it writes
    (``unexpected pos ...``)."""
    try:
        return fn()
    except OSError as e:
        reason = e.strerror or (os.strerror(e.errno) if e.errno else str(e))
        hint = " (disk full?)" if e.errno == errno.ENOSPC else ""
        raise SaveError(f"could not write the {what} {path}: {reason}{hint}; the previous {what} is intact") from None
    except RuntimeError as e:  # (torch's writer reports a short write as "unexpected pos N vs M")
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SaveError(f"could not write the {what} {path}: {first} (disk full?); the previous {what} is "
                        f"intact") from None


def remove_stale_temporaries(run_dir: Path) -> List[str]:
    """Delete the temporary files a killed write left in ``run_dir`` (``.<name>.tmp-<pid>``); call it while holding
    the folder's :class:`RunLock`, when no other process can be writing them. Returns the names removed."""
    removed = []
    for tmp in run_dir.glob(TEMP_GLOB):
        try:
            if tmp.is_file():
                tmp.unlink()
                removed.append(tmp.name)
        except OSError:
            pass
    return removed


def write_json(path: Path, doc: Dict[str, Any], what: str = "file") -> None:
    """``doc`` as indented JSON, atomically; :class:`SaveError` on a failed write."""
    safe_write(what, path, lambda: atomic_write(path, json.dumps(doc, indent=2) + "\n"))
