"""The core installs with torch alone; every other part names the extra that installs what it needs.

Each check runs in a subprocess whose ``sys.meta_path`` refuses the blocked packages, as if they were not
installed: the core (``encodings``, ``kernels``, ``fold``, ``nn``, ``coords``, ``diagnostics``) must work with
every non-core package blocked, and a non-core entry point must fail with one line naming its extra.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Iterable

import pytest

from ropekit._optional import EXTRAS

ROOT = Path(__file__).resolve().parents[1]

#: Every module an extra installs, and packages those bring along that the core must not rely on either.
NON_CORE = sorted({m for modules in EXTRAS.values() for m in modules} | {
    "pybullet_data", "dm_control", "mujoco", "pandas", "torchvision", "tensorboard", "huggingface_hub"})

#: Installs ``BLOCKED`` (names substituted in) as a finder that makes them unimportable, as when absent, and
#: records in ``ATTEMPTS`` which module tried to import each of them.
BLOCKER = """
import sys
BLOCKED = set({blocked!r})
ATTEMPTS = []

class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in BLOCKED:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen")):
            frame = frame.f_back
        ATTEMPTS.append((name, frame.f_globals.get("__name__") if frame is not None else None))
        raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, _Absent())
"""

CORE_SCRIPT = """
import json
import torch
import ropekit
from ropekit.fold import fold
from ropekit.nn import VisionTransformer, vit_config

torch.manual_seed(0)
done = []
for name in ropekit.list_pes():
    pe = ropekit.create_pe(name, head_dim=16, coord_dim=2, num_heads=2)
    q = torch.randn(2, 2, 1 + 6, 16, requires_grad=True)  # (B, H, 1 + N, d): a CLS token, then N = 6 tokens
    k = torch.randn(2, 2, 1 + 6, 16, requires_grad=True)
    coords = torch.randn(6, 2) * 3  # (N, c)
    qr, kr = pe(q, k, coords, num_prefix_tokens=1)
    (qr @ kr.transpose(-1, -2)).square().sum().backward()  # (B, H, 1 + N, 1 + N) logits
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all(), name

    model = VisionTransformer(vit_config("tiny", num_classes=3, in_chans=1, image_size=(8, 8), patch_size=4,
                                         embed_dim=32, depth=1, num_heads=2, pe=name))
    images = torch.rand(2, 1, 8, 8)  # (B, C, H, W)
    logits = model(images)  # (B, K)
    logits.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        folded = fold(model, strict=False)
        assert torch.allclose(folded(images), model(images), atol=1e-4), name
    done.append(name)
assert not [a for a in ATTEMPTS if (a[1] or "").startswith("ropekit")], ATTEMPTS  # torch's own tries are its own
print(json.dumps(done))
"""


def _run(blocked: Iterable[str], script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter (this checkout's ropekit) where the ``blocked`` packages are absent."""
    code = BLOCKER.format(blocked=sorted(blocked)) + script
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_core_works_with_every_non_core_package_absent():
    proc = _run(NON_CORE, CORE_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import ropekit

    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ropekit.list_pes()


#: blocked packages -> [(what is imported, or the ``ropekit`` command line; the one line expected)].
ENTRY_POINTS = {
    "core only": (NON_CORE, [
        ("ropekit.train", 'ropekit.train needs numpy: pip install "ropekit[train]"'),
        ("ropekit.data", 'ropekit.data needs numpy: pip install "ropekit[train]"'),
        ("ropekit_studies", 'ropekit_studies needs numpy: pip install "ropekit[studies]"'),
        ("ropekit.detection", 'ropekit.detection needs numpy: pip install "ropekit[studies]"'),
        ("ropekit.robot", 'ropekit.robot needs numpy: pip install "ropekit[train]"'),
        ("ropekit.integrations.timm", 'ropekit.integrations.timm needs timm: pip install "ropekit[timm]"'),
        (["train", "--help"], 'ropekit train: error: ropekit.train needs numpy: pip install "ropekit[train]"'),
        (["train"], 'ropekit train: error: ropekit.train needs numpy: pip install "ropekit[train]"'),
        (["eval", "--help"], 'ropekit eval: error: ropekit.train needs numpy: pip install "ropekit[train]"'),
        (["data", "--help"], 'ropekit data: error: ropekit.data needs numpy: pip install "ropekit[train]"'),
        (["experiment", "--help"],
         'ropekit experiment: error: ropekit_studies needs numpy: pip install "ropekit[studies]"'),
    ]),
    "no tqdm": (["tqdm"], [
        (["train", "--help"], 'ropekit train: error: ropekit.train needs tqdm: pip install "ropekit[train]"'),
    ]),
    "no scipy": (["scipy"], [
        (["experiment", "--help"],
         'ropekit experiment: error: ropekit_studies needs scipy: pip install "ropekit[studies]"'),
        ("ropekit.detection", 'ropekit.detection needs scipy: pip install "ropekit[studies]"'),
    ]),
}

#: Prints, per target, ``[exit code, the error's text]``: the command line's stderr, or the import's message.
ENTRY_SCRIPT = """
import contextlib, io, json
from ropekit._optional import MissingDependency
from ropekit.cli import main

out = []
for target in json.loads({targets!r}):
    if isinstance(target, list):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            out.append([main(target), err.getvalue()])
    else:
        try:
            __import__(target)
            out.append([0, ""])
        except MissingDependency as e:
            out.append([2, str(e)])
print(json.dumps(out))
"""


@pytest.mark.parametrize("install", list(ENTRY_POINTS))
def test_non_core_entry_point_names_its_extra_in_one_line(install):
    blocked, cases = ENTRY_POINTS[install]
    proc = _run(blocked, ENTRY_SCRIPT.format(targets=json.dumps([target for target, _ in cases])))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (target, expected), (code, message) in zip(cases, results, strict=True):
        assert code == 2 and message.splitlines() == [expected], (target, message)


def test_core_dependencies_are_torch_and_the_extras_match_their_modules():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [re.split(r"[<>=!~ ]", d)[0] for d in project["dependencies"]] == ["torch"]
    extras = project["optional-dependencies"]

    def dists(extra: str) -> set:
        out = set()
        for req in extras[extra]:
            name = re.split(r"[<>=!~ ;]", req)[0]
            if name.startswith("ropekit["):
                for included in name[len("ropekit["):-1].split(","):
                    out |= dists(included)
            else:
                out.add(_normal(name))
        return out

    installed_by = packages_distributions()
    for extra, modules in EXTRAS.items():
        assert dists(extra) == {_normal(d) for m in modules for d in installed_by[m]}, extra
    assert dists("all") == set().union(*(dists(e) for e in EXTRAS))
    assert dists("test") >= dists("all")


def _normal(dist: str) -> str:
    """A distribution's name as pip compares it (``PyYAML`` and ``pyyaml``, ``gym_aloha`` and ``gym-aloha``)."""
    return re.sub(r"[-_.]+", "-", dist).lower()
