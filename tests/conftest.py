"""Fixtures shared by several test modules."""

from __future__ import annotations

import signal

import pytest


@pytest.fixture
def ctrl_c_delivered():
    """SIGINT raises ``KeyboardInterrupt`` during the test, as Ctrl-C does in a terminal, also where pytest was
    started with SIGINT ignored (a shell's background job, ``nohup ... &``); the previous handler is restored."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def one_thread():
    """One torch CPU thread during the test (training tests on a shared machine), the previous count restored."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def torchrun():
    """``run(worker, out, timeout)``: run the test script ``worker`` (a file beside the tests) under ``torchrun
    --standalone --nproc_per_node 2`` on the CPU with ``out`` as its argument, one thread per process, and assert
    that it succeeded (its stderr's tail otherwise); skips where torch.distributed or torchrun is missing."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    import torch

    if not torch.distributed.is_available() or shutil.which("torchrun") is None:
        pytest.skip("torch.distributed / torchrun not available")
    here = Path(__file__).parent

    def run(worker: str, out: Path, timeout: float = 300) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "2", str(here / worker), str(out)],
                              capture_output=True, text=True, env=env, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]

    return run


@pytest.fixture(scope="module")
def triton_mode():
    """The Triton mode for a kernel test module: compiled kernels on a CUDA device when there is one, else Triton's
    interpreter on the CPU (``TRITON_INTERPRET=1`` for that module's tests only, restored afterwards; ropekit's
    kernel modules re-import themselves in the mode the variable asks for). Yields the device to test on."""
    import os

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0" if device == "cuda" else "1"
    yield device
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.fixture
def no_data(monkeypatch):
    """Loading data in ``ropekit train`` fails loudly: the option checks must come first."""
    from ropekit.classification import trainer

    def refuse(*a, **k):
        raise AssertionError("data loaded before the options were checked")

    monkeypatch.setattr(trainer, "load_data", refuse)


def pytest_configure(config):
    """Under pytest-xdist (``-n 2`` in the test command), one torch CPU thread per worker process: two workers on two
    cores, rather than two processes of two threads each fighting over them."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
