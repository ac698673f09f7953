"""Optional dependencies: import them where they are needed, and say which extra installs them when absent.

ropekit's core (``encodings``, ``kernels``, ``fold``, ``nn``, ``coords``, ``diagnostics``) needs only torch. The
rest needs more, grouped into the extras of ``pyproject.toml`` (listed in :data:`EXTRAS` by the names their
modules are imported as): ``train`` for the training engine, the datasets and ``ropekit train``; ``studies`` for
``ropekit experiment`` and 3-D detection; ``sim`` (pybullet) for the detection scenes and the robot task; ``aloha``
(MuJoCo) for the ALOHA tasks; ``timm`` and ``transformers`` for their integrations; ``export`` for ONNX export.

:func:`require` imports one such module on first use and, when it is missing, raises :class:`MissingDependency`
whose one-line message names the extra::

    p = require("pybullet", "sim", "rendering the detection scenes")
    # MissingDependency: rendering the detection scenes needs pybullet: pip install "ropekit[sim]"

:func:`require_extra` checks a whole extra without importing it, at the import of a package that needs all of
it (``ropekit.train``, ``ropekit.data``, ...), so that a missing package is named before any work starts.
The command line reports a :class:`MissingDependency` as one line with exit code 2, like other user errors.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Dict, Tuple

__all__ = ["EXTRAS", "MissingDependency", "require", "require_extra"]

_TRAIN = ("numpy", "tqdm", "yaml", "matplotlib", "PIL", "sklearn", "mlxtend", "torchvision", "webdataset",
          "filelock")

#: extra -> the modules it installs, by import name (``pyproject.toml``'s ``[project.optional-dependencies]``,
#: an extra that includes another listing that one's modules too); ``all`` and ``test`` are left out.
EXTRAS: Dict[str, Tuple[str, ...]] = {
    "train": _TRAIN,
    "studies": _TRAIN + ("scipy", "pycocotools"),
    "sim": _TRAIN + ("pybullet",),
    "aloha": _TRAIN + ("gym_aloha",),
    "timm": ("timm",),
    "transformers": ("transformers",),
    "export": ("onnx", "onnxruntime", "onnxscript"),
}


class MissingDependency(ImportError):
    """An optional module is not installed; the message says which extra to ``pip install``.

    A subclass of ``ImportError``, so code that already falls back on ``ImportError`` keeps working.
    ``name`` is the missing module (as on any ``ImportError``).
    """


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module``, or fail with one line that names the extra that installs it.

    Args:
        module: dotted module name, e.g. ``"pybullet"`` or ``"pybullet_data"``.
        extra: the ropekit extra that installs it (a key of ``[project.optional-dependencies]``), e.g. ``"sim"``.
        purpose: what needs it, as the start of a sentence, e.g. ``"ropekit experiment robot"``.

    Returns:
        the imported module.

    Raises:
        MissingDependency: the module (or a module it imports) cannot be imported; the message reads
            ``"<purpose> needs <module>: pip install "ropekit[<extra>]""`` and, when the import failed for
            another reason than absence (e.g. a broken binary), ends with that reason.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None)
        hint = _hint(module, extra, purpose)
        if missing not in (None, module) and not module.startswith(f"{missing}."):
            # the module exists but one of its own imports failed: say which, as it is the thing to fix
            hint += f" ({' '.join(str(e).split())})"
        raise MissingDependency(hint, name=module) from e


def require_extra(extra: str, purpose: str) -> None:
    """Check that every module of ``extra`` is installed (found, not imported), or fail with one line naming it.

    Args:
        extra: a key of :data:`EXTRAS`, e.g. ``"train"``.
        purpose: what needs it, as the start of a sentence, e.g. ``"ropekit.train"``.

    Raises:
        MissingDependency: the first module of ``extra`` that is not installed, with the message of
            :func:`require`.
        ValueError: ``extra`` is not a key of :data:`EXTRAS`.
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a finder refusing it, or a half-imported module without a spec
            found = False
        if not found:
            raise MissingDependency(_hint(module, extra, purpose), name=module)


def _hint(module: str, extra: str, purpose: str) -> str:
    return f'{purpose} needs {module}: pip install "ropekit[{extra}]"'
