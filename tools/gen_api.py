"""Write docs/api.md, the API reference, from the docstrings and signatures of ropekit's public names.

Usage (from the repository root, with this checkout first on the path)::

    PYTHONPATH=$PWD python tools/gen_api.py            # rewrite docs/api.md
    PYTHONPATH=$PWD python tools/gen_api.py --check    # exit 1 if docs/api.md is out of date

Every module in ``MODULES`` is documented through its ``__all__`` (in that order): functions and classes with
their signature and the first paragraph of their docstring, a class's own public methods and properties likewise,
constants with their value when it is short. A module that cannot be imported because an optional dependency is
missing is listed as such (``OPTIONAL``); any other import error is an error.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any, List

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "api.md"

#: (module, one-line description) in the order they appear on the page.
MODULES = [
    ("ropekit", "the encodings' factory and base class"),
    ("ropekit.encodings", "every encoding class, the registry and the coordinate check"),
    ("ropekit.nn", "attention layers and Vision Transformers that use the encodings"),
    ("ropekit.fold", "merging a commuting encoding's basis into the q/k projections"),
    ("ropekit.diagnostics", "how far an encoding is from being exactly relative"),
    ("ropekit.train", "the training engine behind `ropekit train`"),
    ("ropekit.classification", "image, RGB-D and video classification: `TrainConfig`, `train`, `evaluate_run` (`--task classification`)"),
    ("ropekit.multimodal", "image-text retrieval: the SigLIP loss, recall@k, the dual encoder, `--task retrieval`"),
    ("ropekit.coords", "coordinate maps (canonical coordinates for 3-D points)"),
    ("ropekit.kernels", "the fused GPU rotation kernel"),
    ("ropekit.integrations.timm", "ropekit encodings inside timm Vision Transformers"),
    ("ropekit.train.finetune", "2-D to 3-D fine-tuning"),
    ("ropekit.integrations.video_stream", "encoding tokens one at a time (KV caches)"),
]
#: Modules whose import may fail for a missing optional dependency or an absent optional part.
OPTIONAL = {"ropekit.kernels", "ropekit.integrations.timm"}

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: Methods every ``nn.Module`` overrides that say nothing about the API.
_SKIP_METHODS = {"extra_repr"}


def first_paragraph(obj: Any) -> str:
    """The first paragraph of ``obj``'s own docstring (not an inherited one), on one line; ``""`` if none."""
    doc = obj.__doc__ if isinstance(obj.__doc__, str) else None
    if not doc:
        return ""
    doc = inspect.cleandoc(doc)
    para = doc.split("\n\n", 1)[0]
    return " ".join(line.strip() for line in para.splitlines())


class _Raw:
    """An annotation written as a string (``from __future__ import annotations``), shown without quotes."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def signature(obj: Any) -> str:
    """``(args) -> ret`` of a callable (a class: its constructor), without memory addresses; ``""`` if unknown."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = [p.replace(annotation=_Raw(p.annotation)) if isinstance(p.annotation, str) else p
              for p in sig.parameters.values()]
    ret = sig.return_annotation
    sig = sig.replace(parameters=params, return_annotation=_Raw(ret) if isinstance(ret, str) else ret)
    return _ADDRESS.sub("", str(sig))


def class_signature(cls: type) -> str:
    """The constructor's signature if ropekit defines the constructor, else ``""`` (a subclass of another
    library's class, e.g. a re-classed timm module, whose signature is that library's and version-dependent)."""
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            return signature(cls) if klass.__module__.split(".")[0] == "ropekit" else ""
    return ""


def _own_members(cls: type) -> List[tuple]:
    """Public methods and properties defined by ``cls`` itself, in source order."""
    out = []
    for name, member in vars(cls).items():
        if name.startswith("_") or name in _SKIP_METHODS:
            continue
        if isinstance(member, property):
            out.append((name, "property", member.fget))
        elif isinstance(member, (staticmethod, classmethod)):
            out.append((name, "method", member.__func__))
        elif inspect.isfunction(member):
            out.append((name, "method", member))
    return out


def _value(obj: Any) -> str:
    text = _ADDRESS.sub("", repr(obj))
    return text if len(text) <= 100 else f"a {type(obj).__name__}"


def document_module(modname: str, summary: str, seen: dict) -> List[str]:
    """Markdown lines for one module; ``seen`` maps ``id`` of an object documented already to its module."""
    lines = [f"## `{modname}`", "", f"*{summary}.*", ""]
    try:
        mod = importlib.import_module(modname)
    except ImportError as exc:
        if modname not in OPTIONAL:
            raise
        return lines + [f"Not importable here ({type(exc).__name__}: an optional dependency or part is missing).",
                        ""]
    intro = first_paragraph(mod)
    if intro:
        lines += [intro, ""]
    names = getattr(mod, "__all__", None)
    if names is None:
        raise SystemExit(f"{modname} has no __all__: its public API is undefined")
    for name in names:
        obj = getattr(mod, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and id(obj) in seen:
            lines += [f"* `{name}`: see [`{seen[id(obj)]}`](#{seen[id(obj)].replace('.', '')})", ""]
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            seen[id(obj)] = modname
        if inspect.isclass(obj):
            lines += [f"### class `{name}{class_signature(obj)}`", ""]
            doc = first_paragraph(obj)
            if doc:
                lines += [doc, ""]
            for mname, kind, fn in _own_members(obj):
                head = f"`{mname}`" if kind == "property" else f"`{mname}{signature(fn)}`"
                doc = first_paragraph(fn)
                lines.append(f"* {head}{' (property)' if kind == 'property' else ''}" + (f": {doc}" if doc else ""))
            if _own_members(obj):
                lines.append("")
        elif callable(obj):
            lines += [f"### `{name}{signature(obj)}`", ""]
            doc = first_paragraph(obj)
            if doc:
                lines += [doc, ""]
        else:
            lines += [f"### `{name}` = `{_value(obj)}`", ""]
    return lines


def render() -> str:
    """The whole page."""
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `tools/gen_api.py` (do not edit by hand: run",
        "`PYTHONPATH=$PWD python tools/gen_api.py`). Each entry gives the signature and the first paragraph of the",
        "docstring; the docstrings themselves (`help(...)`) have the shapes, dtypes and errors in full.",
        "",
    ]
    lines += [f"* [`{m}`](#{m.replace('.', '')}): {s}" for m, s in MODULES] + [""]
    seen: dict = {}
    for modname, summary in MODULES:
        lines += document_module(modname, summary, seen)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from what it would be")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print("docs/api.md is out of date: run PYTHONPATH=$PWD python tools/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
