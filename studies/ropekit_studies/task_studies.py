"""The studies of the tasks other than classification: 3-D detection, the robot policies and ALOHA.

Each is registered here; its code (and the simulator or renderer it needs) is imported when it runs or when a
committed result is compared, so that ``ropekit experiment`` lists them where those packages are missing.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from .common import StudyResult
from .registry import register_study

__all__ = ["run_detect3d", "run_robot", "run_aloha"]


def _compare_robot(doc: Dict[str, Any]) -> List[str]:
    from .robot import compare_recipe

    return compare_recipe(doc)


def _compare_detect3d(doc: Dict[str, Any]) -> List[str]:
    from .detection import compare_recipe

    return compare_recipe(doc)


def _compare_aloha(doc: Dict[str, Any], folder: str = "aloha", extra_args: Sequence[str] = ()) -> List[str]:
    from .aloha_cli import compare_commands

    return compare_commands(doc, folder, extra_args)


@register_study("robot", "2-D vs 3-D STRING robot policies in and out of distribution (needs pybullet)",
                compare=_compare_robot)
def run_robot(cfg: Any, out: Any, **options: Any) -> StudyResult:
    """:func:`ropekit_studies.robot.run_study`."""
    from .robot import run_study

    return run_study(cfg, out, **options)


@register_study("aloha", "bimanual ALOHA diffusion policies: APE vs RoPE vs STRING encoders (needs ropekit[aloha])",
                compare=_compare_aloha)
def run_aloha(cfg: Any, out: Any, **options: Any) -> StudyResult:
    """:func:`ropekit_studies.aloha.run_study`."""
    from .aloha import run_study

    return run_study(cfg, out, **options)


@register_study("detect3d", "3-D boxes from RGB (ViT) vs RGB-D (ViTD: depth as input and coordinate) for each encoding "
                            "(needs pybullet)", options=("inputs",), compare=_compare_detect3d)
def run_detect3d(cfg: Any, out: Any, **options: Any) -> StudyResult:
    """:func:`ropekit_studies.detection.run_study`."""
    from .detection import run_study

    return run_study(cfg, out, **options)
