"""A compiled ViT training step compiles once on the CPU's own path, with Inductor, and with the real fused kernel
in Triton's interpreter (the GPU path's cases are in ``test_compile_step.py``; two files, so that two test workers
share the compilations)."""

from __future__ import annotations

import pytest
from test_compile_step import _assert_once, _run


@pytest.mark.slow
@pytest.mark.parametrize("pe", ["cayley", "comrope-ld"])
def test_compiled_training_step_compiles_once_on_the_cpu_path(pe, tmp_path):
    """The CPU's own dispatch (no kernel), as a CPU user compiles the step."""
    _assert_once(_run(tmp_path, "--pes", pe, "--steps", "6"))


@pytest.mark.slow
def test_compiled_training_step_compiles_once_with_inductor(tmp_path):
    """Inductor's code generation end to end on the GPU path, for the encoding with a learned dense basis."""
    _assert_once(_run(tmp_path, "--kernel-path", "torch", "--pes", "cayley", "--steps", "5", "--backend",
                      "inductor"))


@pytest.mark.slow
def test_compiled_training_step_compiles_once_with_the_triton_interpreter(tmp_path):
    """The real fused kernel (Triton's interpreter on the CPU) inside the compiled step: its custom operator is
    traced, not the kernel's launch."""
    pytest.importorskip("triton")
    _assert_once(_run(tmp_path, "--kernel-path", "interpret", "--pes", "axial", "--steps", "3"))
