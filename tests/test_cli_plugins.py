"""Subcommands from other distributions: the ``ropekit.commands`` entry-point group, and the one line that a study
command prints where the studies (``ropekit-studies``) are not installed.

The installed entry points are replaced by fakes (``importlib.metadata.entry_points`` monkeypatched), so these
tests do not depend on whether ``studies/`` is installed here; the real declarations are read from
``studies/pyproject.toml`` and resolved against ``studies/ropekit_studies``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import tomllib
import types
from pathlib import Path
from typing import List

import pytest

from ropekit import cli

ROOT = Path(__file__).resolve().parents[1]


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, entries: dict) -> None:
    """Make ``entries`` (name -> value) the whole ``ropekit.commands`` group; every other group stays as it is."""
    real = importlib.metadata.entry_points
    eps = [importlib.metadata.EntryPoint(name=n, value=v, group=cli.ENTRY_POINT_GROUP) for n, v in entries.items()]

    def entry_points(**params):
        if params.get("group") == cli.ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints(eps)
        return real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def _plugin_module(monkeypatch: pytest.MonkeyPatch, name: str, calls: List[argparse.Namespace]) -> None:
    """A module ``name`` with ``add_arguments`` (one option, ``--n``) and ``run`` (records its arguments, exits 3),
    and an object ``NESTED`` with the same two, under another help."""
    mod = types.ModuleType(name)
    mod.__doc__ = "a plugin command. More text."

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--n", type=int, required=True)

    def run(args: argparse.Namespace) -> int:
        calls.append(args)
        return 3

    mod.add_arguments, mod.run = add_arguments, run
    mod.NESTED = type("NESTED", (), {"__doc__": "a nested command", "add_arguments": staticmethod(add_arguments),
                                     "run": staticmethod(run)})
    monkeypatch.setitem(sys.modules, name, mod)


def _main(argv: List[str], capsys: pytest.CaptureFixture) -> tuple:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [["experiment"], ["experiment", "offset", "--quick", "--pe", "cayley"],
                                  ["experiment", "--quick"], ["experiment", "verify", "docs/results/classify"]])
def test_experiment_without_the_studies_says_how_to_install_them_in_one_line(argv, monkeypatch, capsys):
    _fake_entry_points(monkeypatch, {})
    code, out, err = _main(argv, capsys)
    assert code == 2 and out == ""
    assert err.splitlines() == [f"ropekit experiment: error: {cli.STUDIES_NOT_INSTALLED}"]
    assert "pip install -e studies" in cli.STUDIES_NOT_INSTALLED


@pytest.mark.parametrize("argv", [["robot", "experiment", "--quick"], ["robot", "aloha", "experiment", "--preset", "gpu"],
                                  ["robot", "aloha", "merge", "a", "b", "--out", "c"]])
def test_nested_study_commands_without_the_studies(argv, monkeypatch, capsys):
    pytest.importorskip("numpy")
    _fake_entry_points(monkeypatch, {})
    code, out, err = _main(argv, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and err.rstrip().endswith(cli.STUDIES_NOT_INSTALLED), err


def test_a_plugin_adds_a_top_level_command_and_replaces_the_experiment_placeholder(monkeypatch, capsys):
    calls: List[argparse.Namespace] = []
    _plugin_module(monkeypatch, "fake_ropekit_plugin", calls)
    _fake_entry_points(monkeypatch, {"hello": "fake_ropekit_plugin", "experiment": "fake_ropekit_plugin"})
    assert {"hello", "experiment"} <= set(cli.available_subcommands())
    code, out, err = _main(["hello", "--n", "5"], capsys)
    assert code == 3 and calls[-1].n == 5 and calls[-1].command == "hello"
    code, out, err = _main(["experiment", "--n", "7"], capsys)
    assert code == 3 and calls[-1].n == 7
    with pytest.raises(SystemExit) as exit:  # the plugin's own parser reports its missing option (argparse exits)
        cli.main(["hello"])
    assert exit.value.code == 2 and "--n" in capsys.readouterr().err and len(calls) == 2
    # the declared help of experiment is kept; the plugin's parser is used
    assert cli._all_subcommands()["experiment"].help == cli.SUBCOMMANDS["experiment"].help


def test_listing_the_commands_imports_no_plugin(monkeypatch):
    _fake_entry_points(monkeypatch, {"hello": "a_module_that_does_not_exist_anywhere"})
    assert "hello" in cli.available_subcommands()  # found without importing it
    with pytest.raises(ModuleNotFoundError):
        cli.main(["hello"])  # ... and imported only when it runs


def test_nested_plugins_go_under_their_parent_only(monkeypatch, capsys):
    pytest.importorskip("numpy")
    calls: List[argparse.Namespace] = []
    _plugin_module(monkeypatch, "fake_ropekit_plugin", calls)
    _fake_entry_points(monkeypatch, {"robot.hello": "fake_ropekit_plugin:NESTED",
                                     "robot.aloha.merge": "fake_ropekit_plugin:NESTED",
                                     "robot.aloha.too.deep": "fake_ropekit_plugin"})
    assert set(cli.plugin_subcommands("robot")) == {"hello"}
    assert set(cli.plugin_subcommands("robot.aloha")) == {"merge"}
    assert set(cli.plugin_subcommands()) == set()  # no top-level name among them
    assert cli.plugin_subcommands("robot", load_help=True)["hello"].help == "a nested command"
    code, out, err = _main(["robot", "hello", "--n", "2"], capsys)
    assert code == 3 and calls[-1].n == 2
    code, out, err = _main(["robot", "aloha", "merge", "--n", "4"], capsys)
    assert code == 3 and calls[-1].n == 4
    code, out, err = _main(["robot", "aloha", "experiment"], capsys)  # no plugin: the placeholder's line
    assert code == 2 and err.rstrip().endswith(cli.STUDIES_NOT_INSTALLED)


def test_the_studies_declare_their_commands_and_each_resolves(monkeypatch):
    """``studies/pyproject.toml``'s entry points name objects of ``ropekit_studies`` with ``add_arguments`` and
    ``run``; the studies are not part of the root distribution's packages."""
    pytest.importorskip("scipy")
    studies = tomllib.loads((ROOT / "studies" / "pyproject.toml").read_text())
    declared = studies["project"]["entry-points"][cli.ENTRY_POINT_GROUP]
    assert set(declared) == {"experiment", "robot.experiment", "robot.aloha.experiment", "robot.aloha.merge"}
    monkeypatch.syspath_prepend(str(ROOT / "studies"))
    for name, value in declared.items():
        module, _, attr = value.partition(":")
        obj = importlib.import_module(module)
        obj = getattr(obj, attr) if attr else obj
        assert callable(obj.add_arguments) and callable(obj.run), name
        obj.add_arguments(argparse.ArgumentParser())  # builds without error
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = root["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include == ["ropekit", "ropekit.*"]
    assert studies["project"]["name"] == "ropekit-studies"
    assert "ropekit[studies]" in studies["project"]["dependencies"]
