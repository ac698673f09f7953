"""Training recipes: YAML files of ``TrainConfig`` options (in their ``model`` / ``data`` / ``optim`` / ``run`` sections,
docs/configuration.md), one per recipe, named by their file (``--preset NAME``).

A recipe is an ordinary ``--config`` file kept with the package; copy one to change it. Precedence when a run's
configuration is resolved: ``TrainConfig`` defaults < ``--preset`` < ``--config FILE`` < command-line options.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

__all__ = ["list_recipes", "recipe_path", "load_recipe"]

_HERE = Path(__file__).resolve().parent


def list_recipes() -> List[str]:
    """The names of the recipes shipped with ropekit (``deit-b16``, ...)."""
    return sorted(p.stem for p in _HERE.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The YAML file of recipe ``name``; ``ValueError`` listing the known ones for an unknown name."""
    key = str(name).strip().lower().replace("_", "-")
    path = _HERE / f"{key}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(list_recipes()) or 'none'}")
    return path


def load_recipe(name: str) -> Dict[str, Any]:
    """The options of recipe ``name`` as a mapping of ``TrainConfig`` fields (read as a ``--config`` file is, and
    checked where the configuration is resolved)."""
    from ..config import load_config_file

    return load_config_file(recipe_path(name))
