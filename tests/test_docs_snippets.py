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


# ----------------------------------------------------------------------------- README.md and docs/*.md
ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
#: Blocks that are not run, each with why: (page, block index) -> reason. Keep it short.
NOT_RUN = {
    ("contributing.md", 0): "a template: MyTask is the reader's own class",
}
#: Pages whose blocks take more than a few seconds (marked slow).
SLOW_PAGES = {"multimodal.md": "generates the 5,000 captioned scenes (about 20 s)"}


def _tiny_image_folder(root: Path, classes=("cat", "dog"), per_class=3, size=40) -> None:
    """A small ImageFolder (``root/<class>/*.png``) for snippets that read one."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            pixels = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(root / c / f"{i}.png")


def _page_params():
    out = []
    for path in PAGES:
        if not snippets(path):
            continue
        marks = [pytest.mark.slow] if path.name in SLOW_PAGES else []
        out.append(pytest.param(path, id=path.name, marks=marks))
    return out


@pytest.mark.parametrize("path", _page_params())
def test_page_snippets_run_as_written(path, monkeypatch, tmp_path):
    """Every ```python block of README.md and docs/*.md runs as written (the blocks of one page share a namespace,
    in order), in a temporary folder holding the small image folder ``imagenet/`` that docs/data.md reads."""
    blocks = snippets(path)
    for name in sorted(set().union(*map(third_party_imports, blocks))):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{path.name} needs {name}")
    if any('"imagenet/"' in code for code in blocks):
        _tiny_image_folder(tmp_path / "imagenet", per_class=170, size=24)  # one full batch of 256
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
    ran = 0
    for i, code in enumerate(blocks):
        if (path.name, i) in NOT_RUN:
            continue
        try:
            exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)
        except Exception as exc:  # name the block in the failure
            raise AssertionError(f"{path.name}, python block {i} failed: {exc!r}") from exc
        ran += 1
    assert ran or all((path.name, i) in NOT_RUN for i in range(len(blocks)))


def test_not_run_list_names_existing_blocks():
    """The skip list names blocks that exist (a moved or deleted block must leave the list too)."""
    pages = {p.name: len(snippets(p)) for p in PAGES}
    for (page, index), reason in NOT_RUN.items():
        assert page in pages and index < pages[page], (page, index)
        assert reason
    assert set(SLOW_PAGES) <= set(pages)
