"""A compiled ViT training step compiles once and never again, for every encoding, on the path a GPU takes.

On CUDA the folded rotations go through the fused kernel's dispatch and TF32-aware products, Python that a CPU
run never reaches: a graph break there (a string Dynamo could not trace) made every step hand the model's
prepared states to a new frame guarded on their object identity, so compiled Cayley recompiled at every step and
compiled ComRoPE failed in Dynamo. ``tools/recompiles.py --kernel-path torch`` makes that path reachable on the
CPU -- ropekit's dispatch is told the fused kernel runs there (as under ``TRITON_INTERPRET=1``) and the kernel
module's entry points compute with the PyTorch rotation -- and reads Dynamo's counters over several steps of the
compiled model (forward, AOT-compiled backward) and compiled optimiser step. Each case runs in a fresh process, as
a training run does: module-level state filled on first use (the cache that made the model compile twice) is
then as a user meets it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ropekit.encodings import list_pes

ROOT = Path(__file__).resolve().parents[1]
PES = ["absolute"] + [pe for pe in list_pes() if pe != "none"] + ["none"]


def _run_all(tmp_path: Path, *args: str) -> list:
    out = tmp_path / "recompiles.json"
    device = [] if "--device" in args else ["--device", "cpu"]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "recompiles.py"), *device, "--json", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def _run(tmp_path: Path, *args: str) -> dict:
    return _run_all(tmp_path, *args)[0]


def _assert_once(row: dict) -> None:
    assert row["error"] is None, row["error"]
    assert row["graph_breaks"] == 0, row["break_reasons"]
    assert row["model_graphs"] == 1, row  # forward (and its AOT backward) in one graph
    assert row["recompiles"] == 0 and row["compiled_after_first_step"] == 0, row


#: the encodings whose compiled step went wrong on the GPU (a new frame per step guarded on their states' identity;
#: a Dynamo failure): each in a fresh process, as a training run meets module-level state filled on first use
FRESH = ["cayley", "comrope-ld"]


@pytest.mark.slow
@pytest.mark.parametrize("pe", FRESH)
def test_compiled_training_step_compiles_once_on_the_gpu_path(pe, tmp_path):
    """Eight steps, aot_eager (Dynamo and AOT autograd, no code generation): one graph for the model, no graph
    break, nothing compiled after the first step, no recompilation."""
    _assert_once(_run(tmp_path, "--kernel-path", "torch", "--pes", pe, "--steps", "8"))


@pytest.mark.slow
def test_every_encoding_compiles_once_on_the_gpu_path(tmp_path):
    """The same for every other encoding (and APE, and no encoding), one after another in one process with Dynamo
    reset between them (a process each would cost CI minutes): the first of them meets the module-level state
    unfilled."""
    rows = _run_all(tmp_path, "--kernel-path", "torch", "--pes", *[pe for pe in PES if pe not in FRESH],
                    "--steps", "5")
    assert [r["pe"] for r in rows] == [pe for pe in PES if pe not in FRESH]
    for row in rows:
        _assert_once(row)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pe", ["cayley", "comrope-ld"])
def test_compiled_training_step_compiles_once_on_cuda(pe, tmp_path):
    """The same on a GPU, its own path (fused kernel, TF32-aware products, bf16 autocast, fused AdamW)."""
    _assert_once(_run(tmp_path, "--device", "cuda", "--pes", pe, "--steps", "6"))
