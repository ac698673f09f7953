"""``ropekit train --task robot``: a diffusion policy imitating the scripted pick demonstrations of ``ropekit robot
collect`` (the same training as ``ropekit robot train``).

::

    ropekit train --task robot --task-opt demos=runs/robot/demos.npz --out runs/robot/2d --task-opt steps=1500
    ropekit train --task robot --task-opt demos=runs/robot/demos.npz --task-opt modality=rgbd \\
        --init-from runs/robot/2d --out runs/robot/3d

Options: the common ones (:data:`~ropekit.tasks.RUN_OPTIONS`), ``--batch-size``, ``--lr``, ``--weight-decay``,
``--grad-clip``, ``--log-every`` (steps per metrics row and checkpoint); the encoder's ``--pe``, ``--pe-opt``,
``--model``, ``--model-opt``, ``--patch-size``, ``--image-size``, ``--depth-scale-init``; ``--init-from`` (a policy
run). ``--task-opt``: ``demos`` (required), ``modality`` (``image`` or ``rgbd``), ``all_episodes`` and any other
field of :class:`~ropekit.robot.train.PolicyTrainConfig` (``steps``, ``warmup_steps``, ``ema_decay``...) or
:class:`~ropekit.robot.policy.PolicyConfig` (``horizon``, ``n_action_steps``, ``keypoints``...).
"""

from __future__ import annotations

from typing import Any, Collection, Dict

from ..robot.policy import PolicyConfig
from ..robot.train import PolicyTaskConfig, PolicyTrainConfig, build_policy_task
from ..train.tasks import register_task
from . import OPTIM_OPTIONS, RUN_OPTIONS, engine_options, given_values, pick, refuse_unknown, required, run_folder

__all__ = ["OPTIONS", "TAKEN", "MODEL_FIELDS", "TRAIN_FIELDS", "model_fields", "run_robot",
           "build_policy_task"]

#: ``TrainConfig`` fields -> the policy's (:class:`PolicyConfig`).
MODEL_FIELDS = {"pe": "pe", "pe_options": "pe_options", "model": "vit_size", "image_size": "image_size"}
#: ``TrainConfig`` fields -> the training's (:class:`PolicyTrainConfig`).
TRAIN_FIELDS = {**{k: k for k in OPTIM_OPTIONS}, "threads": "num_threads"}
#: the ``TrainConfig`` fields ``ropekit train --task robot`` reads.
OPTIONS = RUN_OPTIONS | set(MODEL_FIELDS) | set(TRAIN_FIELDS) | {"model_options", "patch_size", "depth_scale_init",
                                                                 "init_from"}
#: policy and training fields that ``ropekit train`` options of their own set (field -> that option).
TAKEN = {"pe": "--pe", "pe_options": "--pe-opt", "vit_size": "--model", "image_size": "--image-size",
          "depth_scale_init": "--depth-scale-init", "vit_overrides": "--model-opt", "num_threads": "--threads",
          **{k: f"--{k.replace('_', '-')}" for k in OPTIM_OPTIONS}}


def model_fields(cfg: Any, given: Collection[str], defaults: Any) -> Dict[str, Any]:
    """The encoder fields of a policy configuration that the command line gave: ``--pe``, ``--pe-opt``,
    ``--model``, ``--image-size``, and ``--model-opt`` / ``--patch-size`` over ``defaults.vit_overrides``."""
    fields = given_values(cfg, given, MODEL_FIELDS)
    if "image_size" in fields and isinstance(fields["image_size"], (list, tuple)):
        raise ValueError("--image-size: the robot policy sees square images; give one number")
    overrides = cfg.model.extra() if "model_options" in given else {}
    if "patch_size" in given:
        overrides["patch_size"] = cfg.model.patch_size
    if overrides:
        fields["vit_overrides"] = {**defaults.vit_overrides, **overrides}
    return fields


def run_robot(cfg: Any, options: Dict[str, Any], *, resume: bool = False, given: Collection[str] = (),
              **_: Any) -> int:
    """Train the policy of ``ropekit train --task robot`` in ``--out`` (default ``runs/robot-<pe>-s<seed>``); the
    exit status."""
    from ..robot.demos import load_demos
    from ..robot.train import DemoChunks, new_policy, train_policy

    options = dict(options)
    demos_path = required(options, "demos", "robot", "demo file")
    modality = str(options.pop("modality", "image"))
    all_episodes = str(options.pop("all_episodes", False)).lower() in ("true", "1")
    train = {"num_threads": 1, **pick(options, PolicyTrainConfig, "robot", TAKEN),
             **given_values(cfg, given, TRAIN_FIELDS)}
    if all_episodes:
        train["only_successful"] = False
    policy_opts = pick(options, PolicyConfig, "robot", TAKEN)
    refuse_unknown(options, "robot", ["demos", "modality", "all_episodes", *PolicyTrainConfig.__dataclass_fields__,
                                      *PolicyConfig.__dataclass_fields__], TAKEN)
    if demos_path is None:
        raise ValueError("the robot task needs --task-opt demos=FILE (a demo file of `ropekit robot collect`)")
    tc = PolicyTrainConfig(**train)
    demos = load_demos(demos_path)
    init_from = cfg.model.init_from if "init_from" in given else None
    fields = model_fields(cfg, given, PolicyConfig())
    if init_from is None:
        fields = {"image_size": int(demos["config"].image_size), **fields, **policy_opts}
    elif policy_opts:
        fields.update(policy_opts)
    scale = cfg.model.vit().depth_scale_init if "depth_scale_init" in given else None
    policy, fresh = new_policy(modality, fields, init_from, scale)
    out = run_folder(cfg, "robot")
    rows = train_policy(policy, DemoChunks(demos, policy.config, tc.only_successful), tc, out, fit_normalizers=fresh,
                        progress=cfg.run.progress, extra_config={"demos": demos_path, "init_from": init_from},
                        resume=resume, options=engine_options(cfg))
    print(f"final loss {rows[-1]['loss']:.4f} after {tc.steps} steps; policy saved to {out / 'checkpoint.pt'}"
          if rows else f"policy saved to {out / 'checkpoint.pt'}")
    return 0


register_task("robot", "a diffusion policy imitating scripted pick demonstrations (pybullet)",
              config=PolicyTaskConfig, train=run_robot, options=OPTIONS)(build_policy_task)
