"""Every ```python block in docs/integrations/*.md runs (the blocks of one page share a namespace, in order)."""

import ast
import importlib.util
import re
from pathlib import Path

import pytest
import torch

DOCS = sorted((Path(__file__).resolve().parent.parent / "docs" / "integrations").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets(path: Path) -> list:
    return BLOCK.findall(path.read_text())


def third_party_imports(code: str) -> set:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_every_guide_has_a_snippet():
    assert DOCS, "no docs/integrations/*.md"
    for path in DOCS:
        assert snippets(path), f"{path.name} has no ```python block"


@pytest.mark.parametrize("path", DOCS, ids=[p.stem for p in DOCS])
def test_snippets_run(path, monkeypatch, tmp_path):
    blocks = snippets(path)
    for name in sorted(set().union(*map(third_party_imports, blocks))):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{path.name} needs {name}")
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    torch.manual_seed(0)
    namespace = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)
        except Exception as exc:  # name the block in the failure
            raise AssertionError(f"{path.name}, python block {i} failed: {exc!r}") from exc
