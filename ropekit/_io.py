"""Atomic file writes: the one helper every file ropekit writes goes through.

:func:`atomic_write` writes into a temporary file in the destination's own folder (``.<name>.tmp-<pid>-<thread>``),
flushes it to disk (``fsync``), renames it onto the destination with ``os.replace`` (atomic on POSIX and Windows
within one file system) and then syncs the folder so that the rename itself survives a crash. A reader therefore
sees the previous file or the new one, never a truncated one; a failed write (disk full, an exception in the
writer) removes its temporary file and leaves the previous file untouched. A killed process can leave a
temporary file behind: it matches :data:`TEMP_GLOB`, which the trainer sweeps from a run folder it holds.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import BinaryIO, Callable, Union

__all__ = ["atomic_write", "TEMP_GLOB"]

#: The names of :func:`atomic_write`'s temporary files (a glob, relative to the destination's folder).
TEMP_GLOB = ".*.tmp-*"

Data = Union[bytes, bytearray, str, Callable[[BinaryIO], object]]


def atomic_write(path: Union[str, os.PathLike], data: Data, *, encoding: str = "utf-8") -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); creates the folder; returns ``path``.

    Args:
        path: the destination file.
        data: ``bytes`` (written as they are), ``str`` (encoded with ``encoding``), or a writer called with the
            open binary temporary file, e.g. ``lambda f: torch.save(obj, f)``, ``lambda f: np.savez(f, **arrays)``
            or ``lambda f: fig.savefig(f, format="png")`` (a writer that picks a format from a file name must be
            told the format: the temporary file's name does not end in the destination's suffix).

    Raises:
        OSError: the folder or file cannot be written (the previous file is intact); whatever the writer raises.
        TypeError: ``data`` is none of the above.
    """
    path = Path(path)
    if not isinstance(data, (bytes, bytearray, str)) and not callable(data):
        raise TypeError(f"atomic_write: data must be bytes, str or a callable writer, got {type(data).__name__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:  # (created with the umask's permissions, as a plain open would)
            if isinstance(data, str):
                f.write(data.encode(encoding))
            elif isinstance(data, (bytes, bytearray)):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _sync_folder(path.parent)
    return path


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
