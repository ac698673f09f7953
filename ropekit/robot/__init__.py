"""Simulated RGB-D pick task (pybullet), scripted expert and demonstrations.

Needs the optional dependency ``pybullet`` (``pip install ropekit[sim]``); importing this package
without it works, constructing :class:`PickEnv` raises ``ImportError``.
"""

from .._optional import require_extra

require_extra("train", "ropekit.robot")  # before the submodules import what it installs

from .demos import RolloutResult, collect_demos, episode_seeds, load_demos, rollout
from .env import ACTION_DIM, STATE_DIM, STATE_SLICES, CameraParams, PickConfig, PickEnv
from .expert import ScriptedExpert

__all__ = [
    "ACTION_DIM",
    "STATE_DIM",
    "STATE_SLICES",
    "CameraParams",
    "PickConfig",
    "PickEnv",
    "ScriptedExpert",
    "RolloutResult",
    "collect_demos",
    "episode_seeds",
    "load_demos",
    "rollout",
]
