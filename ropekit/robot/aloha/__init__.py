"""Bimanual ALOHA tasks in simulation (the optional extra ``ropekit[aloha]``: MuJoCo, dm_control, gym-aloha).

* :mod:`.sim` -- :class:`AlohaSim`, a lean driver of gym-aloha's scenes (chosen cameras and size, depth,
  no shadows, headless via ``MUJOCO_GL=egl``).
* :mod:`.expert` -- scripted experts, replayed demonstrations and the on-disk demo-set cache.
* :mod:`.policy` -- diffusion policies on a ropekit ViT (the encoder's position encoding is the variable)
  and batched evaluation.
* :mod:`.experiment` -- the study: ``ropekit robot aloha experiment`` (``ropekit experiment aloha`` is an alias).

Importing this package needs none of the simulator's packages; they are imported when a sim is built.
"""

from .expert import DemoConfig, collect_demos, load_or_collect
from .policy import ENCODINGS, AlohaChunks, AlohaPolicy, AlohaPolicyConfig, evaluate_policy, load_aloha_policy
from .sim import TASKS, AlohaSim, require_sim

__all__ = ["AlohaSim", "TASKS", "require_sim", "DemoConfig", "collect_demos", "load_or_collect", "ENCODINGS",
           "AlohaPolicy", "AlohaPolicyConfig", "AlohaChunks", "evaluate_policy", "load_aloha_policy"]
