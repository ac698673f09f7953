"""The test tiers hold: a test that uses a simulator carries the ``sim`` marker, the markers are declared, and CI
runs the README's test command with the 20 slowest tests reported.

A test that needs a simulator imports it or calls ``pytest.importorskip`` on it (so that it skips where the extra
is missing); the check reads every test module's source (ast) and finds those uses: at module level the module's
``pytestmark`` must hold ``pytest.mark.sim``; inside a test, the test's decorators (or the module's); inside a
fixture, those of every test that requests it, directly or through other fixtures.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIM_PACKAGES = {"pybullet", "pybullet_data", "mujoco", "gym_aloha"}


def _uses_sim(node: ast.AST) -> bool:
    """Whether ``node`` imports a simulator or calls ``importorskip`` on one."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Import) and any(a.name.split(".")[0] in SIM_PACKAGES for a in sub.names):
            return True
        if isinstance(sub, ast.ImportFrom) and (sub.module or "").split(".")[0] in SIM_PACKAGES:
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "importorskip" \
                and sub.args and isinstance(sub.args[0], ast.Constant) and sub.args[0].value in SIM_PACKAGES:
            return True
    return False


def _has_sim_mark(node: ast.expr) -> bool:
    return re.search(r"\bmark\.sim\b", ast.unparse(node)) is not None


def _is_fixture(fn: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(d) for d in fn.decorator_list)


def unmarked_sim_uses(source: str) -> list[str]:
    """The top-level definitions of a test module's ``source`` that use a simulator without the ``sim`` marker
    (``"<module>"`` for a use at module level)."""
    tree = ast.parse(source)
    module_marked = any(isinstance(s, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in s.targets)
                        and _has_sim_mark(s.value) for s in tree.body)
    if module_marked:
        return []
    defs = [s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    bad = ["<module>"] if any(_uses_sim(s) for s in tree.body if s not in defs) else []
    fixtures = {d.name: d for d in defs if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_fixture(d)}
    sim_fixtures = {name for name, fn in fixtures.items() if _uses_sim(fn)}
    grew = True
    while grew:  # a fixture that requests a simulator fixture needs the simulator too
        more = {name for name, fn in fixtures.items() if {a.arg for a in fn.args.args} & sim_fixtures}
        grew = not more <= sim_fixtures
        sim_fixtures |= more
    for d in defs:
        if d.name in fixtures:
            continue
        requested = {a.arg for a in d.args.args} if not isinstance(d, ast.ClassDef) else set()
        if (_uses_sim(d) or requested & sim_fixtures) and not any(_has_sim_mark(m) for m in d.decorator_list):
            bad.append(d.name)
    return bad


def test_the_check_finds_unmarked_uses_of_a_simulator():
    assert unmarked_sim_uses("import pytest\npybullet = pytest.importorskip('pybullet')\n") == ["<module>"]
    assert unmarked_sim_uses("import pytest\npytestmark = [pytest.mark.sim]\nimport mujoco\n") == []
    assert unmarked_sim_uses("def test_a():\n    from gym_aloha import env\n\n"
                             "@pytest.mark.sim\ndef test_b():\n    import pybullet\n") == ["test_a"]
    fixtures = ("@pytest.fixture\ndef sim():\n    pytest.importorskip('pybullet')\n\n"
                "@pytest.fixture(scope='module')\ndef run(sim):\n    return 1\n\n")
    assert unmarked_sim_uses(fixtures + "def test_a(run):\n    pass\n\n@pytest.mark.sim\ndef test_b(sim):\n    pass\n"
                                        "\ndef test_c(tmp_path):\n    pass\n") == ["test_a"]
    # naming a simulator without importing it (as a test of its absence does) is no use of it
    assert unmarked_sim_uses("def test_a(monkeypatch):\n    monkeypatch.setitem(sys.modules, 'pybullet', None)\n") == []


@pytest.mark.parametrize("path", sorted(Path(__file__).parent.glob("*.py")), ids=lambda p: p.name)
def test_every_use_of_a_simulator_is_marked_sim(path):
    assert unmarked_sim_uses(path.read_text()) == [], \
        f"{path.name} uses a simulator without @pytest.mark.sim (or pytestmark = pytest.mark.sim)"


def test_markers_are_declared_and_ci_reports_the_slowest_tests():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert [m.split(":")[0] for m in ini["markers"]] == ["slow", "sim", "gpu", "repro", "numerics"]
    assert "--strict-markers" in ini["addopts"].split() and "--durations=20" in ini["addopts"].split()
    assert ini["timeout"] > 0 and "-m" not in ini["addopts"].split()  # every tier runs by default
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"## Run the tests.*?```bash\n(.+?)\n```", readme, re.S).group(1).strip()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    # the README's command, then the numerical tests again under other BLAS and kernel summation orders
    assert ci[-2] == command, "the README's test command is not the next-to-last command of .ci/run"
    assert ci[-1] == "MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default python -m pytest -m numerics -p no:cacheprovider -q"
    assert command.startswith("python -m pytest") and " -m " not in command[len("python -m pytest"):]
