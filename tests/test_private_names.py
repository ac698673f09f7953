"""No module of ``ropekit`` uses another module's private name: the seams between modules are public.

A *private name* is one that starts with a single underscore (dunder names such as ``__all__`` or ``__init__`` are
not private). The scan reads every module of the package with :mod:`ast` and reports

* ``from X import _name`` where ``X`` is a module of ``ropekit`` (absolute or relative);
* ``X._name`` where ``X`` was bound by ``import ropekit.x as X`` or ``from ropekit import x as X``;
* ``obj._name`` on any receiver other than ``self`` / ``cls`` / ``super()``, when ``_name`` is defined (a function,
  a class, a method or an assignment) in another module of ``ropekit`` and not in the module that uses it -- the
  attribute calls such as ``pe.param_dtype()`` from ``ropekit.nn`` into an encoding's private method.

A private module's own public names (``ropekit._errors.ConfigError``) are fine: the module is the package's, its
names are its interface.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ropekit"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def _private_definitions(tree: ast.AST) -> Set[str]:
    """Private names a module defines anywhere (module level, class bodies, assignments to attributes of self)."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_private(node.name):
            names.add(node.name)
        elif isinstance(node, (ast.Name,)) and isinstance(node.ctx, ast.Store) and _is_private(node.id):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _is_private(node.target.id):
            names.add(node.target.id)
    return names


def private_uses() -> List[str]:
    """Every use of another module's private name inside ``ropekit``, as ``'path:line: text'``."""
    modules: Dict[Path, ast.AST] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        modules[path] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    defined = {path: _private_definitions(tree) for path, tree in modules.items()}
    found: List[str] = []
    for path, tree in modules.items():
        module = _module_name(path)
        is_package = path.name == "__init__.py"
        elsewhere = set().union(*(names for other, names in defined.items() if other != path)) - defined[path]
        aliases: Set[str] = set()  # local names bound to a ropekit module
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node.level, node.module)
                if not (source == "ropekit" or source.startswith("ropekit.")):
                    continue
                for alias in node.names:
                    if _is_private(alias.name):
                        found.append(f"{rel}:{node.lineno}: from {source} import {alias.name}")
                    else:
                        aliases.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "ropekit" or alias.name.startswith("ropekit."):
                        aliases.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                continue
            if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super":
                continue
            root = receiver
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif node.attr in elsewhere:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_scan_finds_what_it_should(tmp_path: Path) -> None:
    """The scan's rules on hand-written cases: a private import and attribute are found, the allowed forms not."""
    tree = ast.parse("from ropekit.x import _a, b\nimport ropekit.y as y\nclass C:\n    def _m(self): self._m()\n")
    assert _private_definitions(tree) == {"_m"}
    assert _resolve("ropekit.nn.attention", False, 2, "encodings") == "ropekit.encodings"
    assert _resolve("ropekit.nn", True, 1, "vit") == "ropekit.nn.vit"
    assert _resolve("ropekit.nn.vit", False, 1, None) == "ropekit.nn"
    assert _is_private("_a") and not _is_private("__all__") and not _is_private("a")


def test_no_module_uses_another_modules_private_name() -> None:
    uses = private_uses()
    assert not uses, f"{len(uses)} uses of another module's private name:\n" + "\n".join(uses)


if __name__ == "__main__":  # pragma: no cover
    for line in private_uses():
        print(line)
    pytest.main([__file__, "-q"])
