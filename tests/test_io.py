"""ropekit._io.atomic_write: every form of data, failures that leave the previous file, concurrent writers."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from ropekit._io import TEMP_GLOB, atomic_write
from ropekit.train.run_folder import remove_stale_temporaries


def test_bytes_text_and_writer_forms_write_exactly_their_data(tmp_path):
    blob = bytes(range(256)) * 3
    assert atomic_write(tmp_path / "a" / "b.bin", blob) == tmp_path / "a" / "b.bin"  # the folder is created
    assert (tmp_path / "a" / "b.bin").read_bytes() == blob
    atomic_write(tmp_path / "t.txt", "é\n", encoding="utf-8")
    assert (tmp_path / "t.txt").read_bytes() == "é\n".encode("utf-8")
    arrays = {"x": np.arange(7, dtype=np.int64), "y": np.linspace(0, 1, 5)}
    atomic_write(tmp_path / "z.npz", lambda f: np.savez(f, **arrays))  # a writer given the open file
    with np.load(tmp_path / "z.npz") as z:
        assert all(np.array_equal(z[k], v) for k, v in arrays.items())
    atomic_write(tmp_path / "m.pt", lambda f: torch.save({"w": torch.ones(3)}, f))
    assert torch.equal(torch.load(tmp_path / "m.pt")["w"], torch.ones(3))
    assert not list(tmp_path.rglob(TEMP_GLOB))


def test_the_file_gets_the_permissions_a_plain_open_gives(tmp_path):
    with open(tmp_path / "plain", "wb"):
        pass
    atomic_write(tmp_path / "atomic", b"x")
    assert (tmp_path / "atomic").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_a_failing_writer_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    atomic_write(path, '{"old": 1}')

    def half_then_fail(f):
        f.write(b'{"new": ')
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == '{"old": 1}'
    assert not list(tmp_path.glob(TEMP_GLOB))
    with pytest.raises(TypeError, match="bytes, str or a callable"):
        atomic_write(path, 3)  # type: ignore[arg-type]
    assert path.read_text() == '{"old": 1}'


def test_a_killed_write_leaves_the_previous_file_and_a_temporary_the_sweep_removes(tmp_path):
    path = tmp_path / "checkpoint.pt"
    atomic_write(path, b"old")
    code = ("import os\nfrom ropekit._io import atomic_write\n"
            f"atomic_write({str(path)!r}, lambda f: (f.write(b'new' * 1000), f.flush(), os._exit(3)))\n")
    assert subprocess.run([sys.executable, "-c", code], cwd=os.getcwd()).returncode == 3
    assert path.read_bytes() == b"old"
    left = list(tmp_path.glob(TEMP_GLOB))
    assert len(left) == 1 and left[0].name.startswith(".checkpoint.pt.tmp-")
    assert remove_stale_temporaries(tmp_path) == [left[0].name] and not list(tmp_path.glob(TEMP_GLOB))


def test_concurrent_writers_never_mix_their_data(tmp_path):
    path = tmp_path / "shared.bin"
    payloads = [bytes([i]) * 200_000 for i in range(8)]
    errors = []

    def write(data):
        try:
            for _ in range(5):
                atomic_write(path, data)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert path.read_bytes() in payloads  # one writer's complete data, never a mixture or a truncation
    assert not list(tmp_path.glob(TEMP_GLOB))
