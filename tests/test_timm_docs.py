"""The documentation stands on its own and stays true: the API reference matches the code, every page is linked
from the index and every relative link resolves, no page cites internal documents, and the dependency bounds in
pyproject.toml are the ones docs/compatibility.md says are exercised."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md")) + sorted((DOCS / "integrations").glob("*.md"))
#: Citations of internal documents (the team's specification, issue numbers) a reader of the project cannot follow.
INTERNAL = [re.compile(p) for p in (r"SPEC\s*§", r"\bSPEC\.md\b", r"\bissue[- ]?#?\d+", r"\bIssue \d+")]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "tools" / "gen_api.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_api"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_api_reference_is_up_to_date():
    pytest.importorskip("timm")  # the reference documents the timm integration too
    text = _gen_api().render()
    assert (DOCS / "api.md").read_text() == text, \
        "docs/api.md is out of date: run PYTHONPATH=$PWD python tools/gen_api.py"
    for name in ("create_pe", "list_pes", "pe_options", "PositionEncoding", "commutator_error", "apply_pe"):
        assert f"`{name}" in text, name


def test_api_generator_handles_string_annotations_and_inherited_docs():
    gen = _gen_api()

    class Base:
        """Base summary.

        More detail."""

        def f(self, x: "int" = 1) -> "str":
            """F does it."""

    class Child(Base):
        pass

    assert gen.first_paragraph(Base) == "Base summary."
    assert gen.first_paragraph(Child) == ""  # an inherited docstring is not repeated
    assert gen.signature(Base.f) == "(self, x: int = 1) -> str"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_pages_cite_no_internal_documents(page):
    _assert_no_citation(page)


def test_code_readme_and_results_cite_no_internal_documents():
    """Docstrings, comments, help texts and result write-ups stand on their own too."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted((ROOT / "docs" / "results").rglob("*.md"))
    files += sorted(p for d in ("ropekit", "tests", "tools") for p in (ROOT / d).rglob("*.py"))
    for path in files:
        if path == Path(__file__).resolve():  # this file holds the patterns themselves
            continue
        _assert_no_citation(path)


def _assert_no_citation(path: Path) -> None:
    text = path.read_text()
    for pattern in INTERNAL:
        hit = pattern.search(text)
        assert hit is None, f"{path.relative_to(ROOT)} cites an internal document: " \
                            f"{text[max(0, hit.start() - 40):hit.end() + 20]!r}"


def test_index_links_every_page_and_links_resolve():
    index = (DOCS / "index.md").read_text()
    linked = {(DOCS / t.split("#")[0]).resolve() for t in LINK.findall(index) if "://" not in t}
    for page in PAGES:
        if page.name != "index.md":
            assert page.resolve() in linked, f"docs/index.md does not link {page.relative_to(DOCS)}"
    for page in PAGES + [ROOT / "README.md", ROOT / "CHANGELOG.md"]:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.name} links a missing file: {target}"


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()


def _lower_bound(spec: str, package: str) -> str:
    hit = re.search(rf'"{package}>=([0-9.]+)"', spec)
    assert hit, f"pyproject.toml declares no lower bound for {package}"
    return hit.group(1)


def test_declared_bounds_are_the_documented_ones():
    pyproject = (ROOT / "pyproject.toml").read_text()
    compat = (DOCS / "compatibility.md").read_text()
    python = re.search(r'requires-python = ">=([0-9.]+)"', pyproject).group(1)
    for package, bound in (("Python", python), ("torch", _lower_bound(pyproject, "torch")),
                           ("timm", _lower_bound(pyproject, "timm"))):
        row = next((line for line in compat.splitlines() if line.startswith(f"| {package}")), None)
        assert row is not None, f"docs/compatibility.md has no row for {package}"
        assert f"`>={bound}`" in row, f"pyproject.toml says {package}>={bound}, docs/compatibility.md says {row!r}"
        assert bound in compat.split("| exercised |", 1)[1], f"{package} {bound} is not listed as exercised"
