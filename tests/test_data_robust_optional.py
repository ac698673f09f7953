"""A missing optional dependency ends in one line that names the extra to install, not a traceback."""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path

import pytest

from ropekit import cli
from ropekit._optional import MissingDependency, require

SIM_HINT = 'needs pybullet: pip install "ropekit[sim]"'


@pytest.fixture
def no_pybullet(monkeypatch):
    """This process as it would be without pybullet: importing it raises ImportError."""
    monkeypatch.setitem(sys.modules, "pybullet", None)
    monkeypatch.setitem(sys.modules, "pybullet_data", None)
    from ropekit.robot import env

    monkeypatch.setattr(env, "p", None)  # what env.py's guarded import leaves behind without pybullet
    monkeypatch.setattr(env, "pybullet_data", None)


def test_require_imports_or_names_the_extra(monkeypatch):
    import json

    assert require("json", "none", "testing") is json
    monkeypatch.setitem(sys.modules, "pybullet", None)
    with pytest.raises(MissingDependency) as exc:
        require("pybullet", "sim", "rendering the scenes")
    assert str(exc.value) == 'rendering the scenes needs pybullet: pip install "ropekit[sim]"'
    assert isinstance(exc.value, ImportError) and exc.value.name == "pybullet"
    again = pickle.loads(pickle.dumps(exc.value))  # survives a trip back from a worker process
    assert type(again) is MissingDependency and str(again) == str(exc.value)


def test_require_says_why_a_present_module_failed(tmp_path: Path, monkeypatch):
    (tmp_path / "half_installed.py").write_text("import a_module_that_is_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingDependency) as exc:
        require("half_installed", "sim", "the test")
    msg = str(exc.value)
    assert msg.startswith('the test needs half_installed: pip install "ropekit[sim]"')
    assert "a_module_that_is_not_there" in msg and "\n" not in msg


def test_detection_scenes_without_pybullet(no_pybullet):
    from ropekit.detection.scenes import generate_scenes, render_scene

    for workers in (1, 2):  # with workers, the parent refuses before starting any
        with pytest.raises(MissingDependency, match=re.escape(f"detection scenes {SIM_HINT}")):
            generate_scenes(4, size=16, workers=workers, progress=False, chunk_size=1)
    with pytest.raises(MissingDependency, match=re.escape(SIM_HINT)):
        render_scene(0, 16, 0)


def test_robot_task_without_pybullet(no_pybullet):
    from ropekit.robot import PickEnv, collect_demos

    with pytest.raises(MissingDependency, match=re.escape(f"robot pick task (PickEnv) {SIM_HINT}")):
        PickEnv()
    with pytest.raises(MissingDependency, match=re.escape(SIM_HINT)):
        collect_demos(2, workers=2, progress=False)  # in the parent, before a worker pool is started




@pytest.mark.parametrize("argv", [["experiment", "detect3d", "--quick"], ["experiment", "robot", "--quick"]])
def test_cli_without_pybullet_is_one_line_exit_2(no_pybullet, tmp_path: Path, capsys, argv):
    code = cli.main(argv + ["--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("ropekit experiment: error: ") and err.endswith(SIM_HINT)
