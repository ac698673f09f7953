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
