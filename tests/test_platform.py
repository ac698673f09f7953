"""The numerics fingerprint records what changes a run's floating-point results across machines."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ropekit._platform import cpu_model, numerics_fingerprint


def test_fingerprint_names_this_process():
    doc = numerics_fingerprint()
    assert doc["cpu"] == cpu_model() and doc["cpu"]
    assert doc["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert doc["torch"] == torch.__version__ and doc["threads"] == torch.get_num_threads()
    assert "gpu" not in doc  # a CPU run names no GPU


@pytest.mark.slow
def test_fingerprint_follows_a_lowered_instruction_set():
    """``ATEN_CPU_CAPABILITY=default`` switches PyTorch's CPU kernels to their scalar code, which rounds sums in
    another order (a 10-epoch MNIST run then ends at another accuracy): the fingerprint must tell the two apart."""
    code = "import json; from ropekit._platform import numerics_fingerprint as f; print(json.dumps(f()))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1])["cpu_capability"] == "DEFAULT"
