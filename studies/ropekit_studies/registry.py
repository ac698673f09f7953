"""The study registry: every study registers itself with :func:`register_study`; ``ropekit experiment`` and
:func:`ropekit_studies.run_experiment` read :data:`STUDIES`.

Importing :mod:`ropekit_studies` imports every study module (its ``__init__`` is the one list of them), so
:data:`STUDIES` is complete whenever this module can be reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

__all__ = ["Study", "STUDIES", "register_study", "lookup_study"]


@dataclass
class Study:
    """A study: its function ``fn(cfg, out, **options)``, a one-line help, the study options it accepts, the
    ``TrainConfig`` fields it changes from run to run besides ``pe`` and ``seed`` (``varies``; with
    ``varies_overrides`` also where the recipe's per-encoding overrides set them, as the sharing ablation does
    with the paper's sharing). A study with an
    entry in :data:`ropekit_studies.recipes.RECIPES` takes its configuration from that pinned recipe;
    detect3d from its own pinned recipes (:mod:`ropekit_studies.recipes.detect3d`), robot and aloha from their own
    configuration classes. ``compare(doc)``: the differences between a committed ``config.json`` (``doc``) and
    what its recipe or recorded commands train now, for a study whose recipes have their own format (detect3d,
    robot, retrieval, owl; aloha's also takes ``folder`` and ``extra_args``); called by
    :func:`ropekit_studies.recipes.compare_with_committed`, the one comparison."""

    fn: Callable
    help: str
    options: tuple = ()
    varies: tuple = ()
    varies_overrides: bool = False
    compare: Optional[Callable[..., List[str]]] = None


#: name -> :class:`Study`, in the order the studies registered (``ropekit experiment all`` runs them so).
STUDIES: Dict[str, Study] = {}


def register_study(name: str, help: str, *, options: tuple = (), varies: tuple = (), varies_overrides: bool = False,
                   compare: Optional[Callable[..., List[str]]] = None) -> Callable[[Callable], Callable]:
    """Decorator: register the study function ``fn(cfg, out, **options)`` under ``name`` (see :class:`Study`).

    >>> @register_study("my-study", "what it measures", options=("sizes",))        # doctest: +SKIP
    ... def run_my_study(cfg, out, sizes=None): ...
    """
    def add(fn: Callable) -> Callable:
        if name in STUDIES:
            raise ValueError(f"study {name!r} is already registered")
        STUDIES[name] = Study(fn, help, tuple(options), tuple(varies), varies_overrides, compare)
        return fn

    return add


def lookup_study(name: str) -> Study:
    """The registered study ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in STUDIES:
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(STUDIES)}")
    return STUDIES[name]
