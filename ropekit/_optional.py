"""Optional dependencies: import them where they are needed, and say which extra installs them when absent.

ropekit's core needs only torch and numpy. Some features need more (the pybullet simulator for the RGB-D
detection scenes and the robot task, timm for its integration, onnx for export); ``pyproject.toml`` groups
them into extras. :func:`require` imports such a module on first use and, when it is missing, raises
:class:`MissingDependency` whose one-line message names the extra::

    p = require("pybullet", "sim", "rendering the detection scenes")
    # MissingDependency: rendering the detection scenes needs pybullet: pip install "ropekit[sim]"

The command line reports a :class:`MissingDependency` as one line with exit code 2, like other user errors.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingDependency", "require"]


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
        hint = f'{purpose} needs {module}: pip install "ropekit[{extra}]"'
        if missing not in (None, module) and not module.startswith(f"{missing}."):
            # the module exists but one of its own imports failed: say which, as it is the thing to fix
            hint += f" ({' '.join(str(e).split())})"
        raise MissingDependency(hint, name=module) from e
