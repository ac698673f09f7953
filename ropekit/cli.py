"""The ``ropekit`` command line: ``ropekit <subcommand> [options]``.

Subcommands live in a registry (name -> :class:`Subcommand`) and are imported lazily: only the module of the
subcommand being run is imported, so ``ropekit --help`` is fast and a broken optional module never breaks
``ropekit train``. A module adds a subcommand in one of two ways:

* declare it in :data:`SUBCOMMANDS` with ``"module:function"`` strings (the module is imported only when the
  subcommand is used), e.g. ``"bench": Subcommand("benchmark the encodings", "ropekit.bench.cli:add_arguments",
  "ropekit.bench.cli:run")``;
* or call :func:`register_subcommand` with callables at import time of something ``ropekit`` imports.

Another installed distribution adds subcommands through the entry-point group :data:`ENTRY_POINT_GROUP`
(``ropekit.commands``): an entry point named ``NAME`` adds ``ropekit NAME``, one named ``PARENT.NAME`` adds
``ropekit PARENT NAME`` (a command that builds its own subcommands calls :func:`add_plugin_parsers`); its value,
``"module"`` or ``"module:object"``, names something with ``add_arguments(parser)`` and ``run(args)``. The studies
(``ropekit-studies``, in the repository's ``studies/`` folder, not in the ``ropekit`` wheel) add ``experiment``,
``robot.experiment``, ``robot.aloha.experiment`` and ``robot.aloha.merge`` so; where they are not installed those
commands print one line saying how to install them.

``run(args)`` returns the exit code (``None`` means 0). User mistakes are reported as one line on stderr,
``ropekit <subcommand>: error: <message>``, exit code 2, without a traceback: raise :class:`CommandError`
(``ValueError``, ``FileNotFoundError`` and checkpoint errors are reported the same way). Set
``ROPEKIT_DEBUG=1`` or pass ``--debug`` to see the traceback instead. Ctrl-C exits with code 130.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, NoReturn, Optional, Union

from ._errors import CommandError
from ._optional import MissingDependency

__all__ = ["CommandError", "Subcommand", "SUBCOMMANDS", "ENTRY_POINT_GROUP", "STUDIES_NOT_INSTALLED", "register_subcommand",
           "available_subcommands", "plugin_subcommands", "add_plugin_parsers", "run_plugin", "main"]

Target = Union[str, Callable]


@dataclass
class Subcommand:
    """``help`` shown by ``ropekit --help``; ``add_arguments(parser)`` and ``run(args) -> int | None`` as callables
    or lazy ``"module:function"`` strings; ``optional``: hidden when its module is not installed."""

    help: str
    add_arguments: Target
    run: Target
    optional: bool = False


SUBCOMMANDS: Dict[str, Subcommand] = {
    "train": Subcommand("train a Vision Transformer with a rotary position encoding",
                        "ropekit.train.commands:add_train_arguments", "ropekit.train.commands:run_train"),
    "eval": Subcommand("evaluate a run's checkpoint (optionally at another resolution or with coordinate offsets)",
                       "ropekit.train.commands:add_eval_arguments", "ropekit.train.commands:run_eval"),
    # Declared for the modules that provide them (each exposes add_arguments(parser) and run(args));
    # hidden until the module exists.
    "bench": Subcommand("benchmark the encodings", "ropekit.bench.cli:add_arguments", "ropekit.bench.cli:run",
                        optional=True),
    # provided by the ropekit-studies distribution (entry point "experiment"); this one says how to install it
    "experiment": Subcommand("run the experiment studies (offset, resolution, data efficiency, ...)",
                             "ropekit.cli:placeholder_arguments", "ropekit.cli:studies_not_installed"),
    "data": Subcommand("inspect and prepare datasets", "ropekit.data.cli:add_arguments", "ropekit.data.cli:run",
                       optional=True),
    "robot": Subcommand("train and evaluate the RGB-D robot policy", "ropekit.robot.cli:add_arguments",
                        "ropekit.robot.cli:run", optional=True),
}


#: The entry-point group through which other distributions add subcommands (see the module's docstring).
ENTRY_POINT_GROUP = "ropekit.commands"

#: What a study command says where the studies are not installed.
STUDIES_NOT_INSTALLED = ("the studies are not part of the ropekit package; install them from a clone of the "
                         "repository: pip install -e studies")


def placeholder_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a command whose distribution is missing: whatever is given, options included (the command
    only says how to install it)."""
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    parse = parser.parse_known_args

    def accept_all(args: Optional[List[str]] = None, namespace: Optional[argparse.Namespace] = None):
        ns, extra = parse(args, namespace)
        ns.rest = list(getattr(ns, "rest", None) or []) + list(extra)
        return ns, []

    parser.parse_known_args = accept_all  # type: ignore[method-assign]


def studies_not_installed(args: argparse.Namespace) -> int:
    """Run a study command without the studies installed: :class:`CommandError` with the one-line hint."""
    raise CommandError(STUDIES_NOT_INSTALLED)


class _EntryPointTarget:
    """``add_arguments`` or ``run`` of an entry point's object, loaded when first called."""

    def __init__(self, entry_point: importlib.metadata.EntryPoint, attr: str) -> None:
        self.entry_point, self.attr = entry_point, attr

    def __call__(self, *args: object) -> object:
        return getattr(self.entry_point.load(), self.attr)(*args)


def plugin_subcommands(parent: str = "", load_help: bool = False) -> Dict[str, Subcommand]:
    """The subcommands installed distributions add under ``ropekit [parent]`` (``parent``: e.g. ``"robot"`` or
    ``"robot.aloha"``) through :data:`ENTRY_POINT_GROUP`, by name. Nothing is imported unless ``load_help``
    (then each help is its object's docstring's first line; otherwise its distribution's summary)."""
    prefix = f"{parent}." if parent else ""
    found: Dict[str, Subcommand] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        name = ep.name[len(prefix):] if ep.name.startswith(prefix) else ""
        if not name or "." in name:
            continue
        if load_help:
            help = ((ep.load().__doc__ or "").strip().splitlines() or [""])[0].rstrip(".")
        else:
            dist = getattr(ep, "dist", None)
            help = (dist.metadata["Summary"] or "") if dist is not None else ""
        found[name] = Subcommand(help, _EntryPointTarget(ep, "add_arguments"), _EntryPointTarget(ep, "run"))
    return found


def add_plugin_parsers(sub: "argparse._SubParsersAction", parent: str, placeholders: Dict[str, str],
                       command: Optional[str] = None) -> Dict[str, Subcommand]:
    """Add to ``sub`` (the subparsers of ``ropekit PARENT``, e.g. ``parent="robot"``) the subcommands installed
    distributions add there (a name of ``placeholders``, name -> help, keeps that help), and for each name of
    ``placeholders`` that none adds, one that says how
    to install the studies. Only ``command``'s arguments are added when it is given (others get an empty parser).
    Each parser sets ``plugin_run`` (its ``run``) as a default: the parent's ``run`` hands ``args`` with one to
    :func:`run_plugin`. Returns name -> :class:`Subcommand`."""
    subs = plugin_subcommands(parent, load_help=True)
    for name, help in placeholders.items():
        if name in subs:
            subs[name].help = help  # the declared help, as for a top-level command
        else:
            subs[name] = Subcommand(help, placeholder_arguments, studies_not_installed)
    for name, spec in subs.items():
        p = sub.add_parser(name, help=spec.help, description=spec.help)
        p.set_defaults(plugin_run=spec.run)
        if command is None or name == command:
            _resolve(spec.add_arguments)(p)
    return subs


def run_plugin(args: argparse.Namespace) -> Optional[int]:
    """Run the subcommand :func:`add_plugin_parsers` added and ``args`` were parsed for."""
    return _resolve(args.plugin_run)(args)


def register_subcommand(name: str, add_arguments: Target, run: Target, help: str = "") -> None:
    """Add (or replace) the subcommand ``name``."""
    SUBCOMMANDS[name] = Subcommand(help, add_arguments, run)


def _module_of(target: Target) -> Optional[str]:
    return target.partition(":")[0] if isinstance(target, str) else None


def _exists(module: str) -> bool:
    """Whether ``module`` can be imported, decided without importing anything (a ``ropekit.*`` module is looked
    up as a file, so that e.g. a package importing an optional simulator is not loaded for ``--help``)."""
    parts = module.split(".")
    if parts[0] == "ropekit":
        base = Path(__file__).resolve().parent.joinpath(*parts[1:])
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
    try:
        return importlib.util.find_spec(parts[0]) is not None
    except (ImportError, ValueError):
        return False


def _all_subcommands() -> Dict[str, Subcommand]:
    """:data:`SUBCOMMANDS` with those of installed distributions (which replace a declared one of the same name,
    keeping its help)."""
    merged = dict(SUBCOMMANDS)
    for name, spec in plugin_subcommands().items():
        if name in merged and merged[name].help:
            spec.help = merged[name].help
        merged[name] = spec
    return merged


def available_subcommands() -> List[str]:
    """Names of the subcommands that can run here (optional ones only when their module exists)."""
    names = []
    for name, sub in _all_subcommands().items():
        module = _module_of(sub.run)
        if sub.optional and module is not None and not _exists(module):
            continue
        names.append(name)
    return names


def _resolve(target: Target) -> Callable:
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


#: Reported as one line (checkpoint errors are ``ValueError`` subclasses).
USER_ERRORS = (CommandError, MissingDependency, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
               IsADirectoryError, PermissionError)


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (FileNotFoundError, PermissionError)) and e.filename and str(e.filename) not in msg:
        msg = f"{msg}: {e.filename}"
    return msg


def _is_distributed_error(e: BaseException) -> bool:
    """Whether ``e`` is torch.distributed's report of a lost or silent peer (``DistError`` and its subclasses;
    gloo's "Connection closed by peer" / timeouts raised as plain ``RuntimeError`` inside an initialised group)."""
    if any(c.__name__ in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
           for c in type(e).__mro__):
        return True
    dist = sys.modules.get("torch.distributed")
    if isinstance(e, RuntimeError) and dist is not None and dist.is_available() and dist.is_initialized():
        text = str(e)
        return any(k in text for k in ("Connection closed by peer", "Connection reset by peer", "Timed out",
                                       "timed out", "[gloo", "NCCL"))
    return False


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``<prog>: error: <message>`` (no usage block), with a "did
    you mean" for a mistyped option or choice (difflib; ``argparse``'s own ``suggest_on_error`` needs Python 3.14).

    ``suggest_from``: the parser whose option strings are suggested for an unrecognised option (the subcommand's,
    since the top-level parser is the one that reports unrecognised arguments)."""

    suggest_from: Optional[argparse.ArgumentParser] = None

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        prog = self.suggest_from.prog if self.suggest_from is not None and "unrecognized" in message else self.prog
        self.exit(2, f"{prog}: error: {message}{self._suggestion(message)} (see {prog} --help)\n")

    def _suggestion(self, message: str) -> str:
        import difflib
        import re

        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            return f"; did you mean {close[0]!r}?" if close else ""
        if "unrecognized arguments" not in message:
            return ""
        source = self.suggest_from or self
        known = [o[2:] for a in source._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for word in re.findall(r"(?<!\S)--([\w-]+)", message.partition(":")[2]):
            close = difflib.get_close_matches(word, known, n=1, cutoff=0.7)
            if close:
                hints.append(f"--{close[0]} for --{word}")
        return f"; did you mean {', '.join(hints)}?" if hints else ""


def build_parser(command: Optional[str]) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s arguments are added (and its module imported)."""
    from . import __version__

    parser = OneLineParser(
        prog="ropekit", description="Learnable N-dimensional rotary position encodings for Vision Transformers.")
    parser.add_argument("--version", action="version", version=f"ropekit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    commands = _all_subcommands()
    for name in available_subcommands():
        spec = commands[name]
        p = sub.add_parser(name, help=spec.help, description=spec.help)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full traceback of errors")
        if name == command:
            _resolve(spec.add_arguments)(p)
            parser.suggest_from = p
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``ropekit`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    debug = bool(os.environ.get("ROPEKIT_DEBUG")) or "--debug" in argv
    prog = f"ropekit {command}" if command else "ropekit"
    try:
        commands = _all_subcommands()
        parser = build_parser(command if command in commands else None)
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help(sys.stderr)
            return 2
        run = _resolve(commands[args.command].run)
        code = run(args)
        return int(code or 0)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - only a distributed run's lost peer is answered here; others re-raise
        if debug or not _is_distributed_error(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        print(f"{prog}: error: a peer process of the distributed run stopped or did not answer in time "
              f"(ROPEKIT_DIST_TIMEOUT seconds): {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # python -m ropekit.cli (also under torchrun -m ropekit.cli)
    # run the imported module's main, so that exception classes match the ones subcommands import
    from ropekit.cli import main as _main

    sys.exit(_main())
