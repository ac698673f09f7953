"""One command per job: the ALOHA study is ``ropekit robot aloha experiment``; ``ropekit experiment aloha`` is an
alias of it that runs the same configuration and records the same command (so its results verify the same way)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from ropekit.cli import main


@pytest.fixture
def captured(monkeypatch):
    """Replace the ALOHA study's runner by one that records its configuration and command (no simulator)."""
    import ropekit_studies.aloha as experiment

    calls = []

    def fake_run(cfg, out, command=None, device="cpu", workers=1):
        calls.append({"cfg": cfg, "command": command, "device": device, "workers": workers, "out": str(out)})
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "table.md").write_text("| table |\n")
        return {"timings_s": {"total": 1.0}}

    monkeypatch.setattr(experiment, "run_experiment", fake_run)
    monkeypatch.setattr(experiment, "summary_rows", lambda doc: [])
    return calls


@pytest.mark.parametrize("extra", [["--quick"], ["--seeds", "3,4", "--pe", "cayley,axial", "--threads", "1"]])
def test_experiment_aloha_is_the_robot_command(tmp_path, monkeypatch, captured, capsys, extra):
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", "aloha", "--out", "a", "--no-progress", *extra]) == 0
    (alias,) = captured
    words = shlex.split(alias["command"])
    assert words[:4] == ["ropekit", "robot", "aloha", "experiment"]
    # the recorded command, run as a user would type it, gives the same study
    monkeypatch.setattr("sys.argv", words)
    assert main(words[1:]) == 0
    direct = captured[1]
    assert direct["cfg"] == alias["cfg"] and direct["command"] == alias["command"]
    assert (direct["device"], direct["workers"], direct["out"]) == (alias["device"], alias["workers"], "a")
    if "--quick" in extra:
        from ropekit_studies.aloha import PRESETS

        assert alias["cfg"].train == PRESETS["quick"]().train
    else:
        assert alias["cfg"].seeds == [3, 4] and alias["cfg"].threads == 1
        assert alias["cfg"].encodings == ["Cayley-STRING", "RoPE (axial)"]
    assert alias["cfg"].progress is False
