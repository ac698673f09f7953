"""``ropekit train --task aloha``: a diffusion policy on bimanual ALOHA demonstrations (the training of ``ropekit
robot aloha train``, on the shared engine with a resumable run folder).

::

    ropekit train --task aloha --pe cayley --task-opt steps=1500 --out runs/aloha/cayley      # collects (MuJoCo)
    ropekit train --task aloha --task-opt demos=demos.npz --out runs/aloha/cayley

Demonstrations: ``--task-opt demos=FILE`` (a demo set of :func:`~ropekit.robot.aloha.expert.save_demo_set`);
otherwise the cached demo set of ``sim_task`` (``transfer_cube`` or ``insertion``), ``episodes`` (default 50),
``demo_seed``, ``camera``, ``fovy``, ``frame_stride`` at ``--image-size`` (one number, or ``--set
image_size=[H,W]``; default 48x64), collected with MuJoCo (``ropekit[aloha]``, ``--workers`` processes) into
``cache_dir`` when absent.

Options: the common ones (:data:`~ropekit.tasks.RUN_OPTIONS`), ``--batch-size``, ``--lr``, ``--weight-decay``,
``--grad-clip``, ``--log-every``; the encoder's ``--pe`` (``absolute`` for a learned embedding), ``--pe-opt``,
``--model``, ``--model-opt``, ``--patch-size``, ``--depth-scale-init``. ``--task-opt``: ``modality`` (``image`` or
``rgbd``), ``train_episodes`` (how many of the set's episodes to train on), and any other field of
:class:`~ropekit.robot.train.PolicyTrainConfig` (``steps``, ``shift``: default 0 here, as ``ropekit robot aloha
train``) or :class:`~ropekit.robot.aloha.policy.AlohaPolicyConfig` (``aux_weight``, ``horizon``...).
"""

from __future__ import annotations

from typing import Any, Collection, Dict, Tuple

from ..robot.aloha.policy import AlohaPolicyConfig, AlohaTaskConfig, build_aloha_task
from ..robot.train import PolicyTrainConfig
from ..train.tasks import register_task
from . import OPTIM_OPTIONS, RUN_OPTIONS, engine_options, given_values, pick, refuse_unknown, required, run_folder
from .robot import TRAIN_FIELDS, TAKEN, model_fields

__all__ = ["OPTIONS", "run_aloha", "build_aloha_task"]

#: the ``TrainConfig`` fields ``ropekit train --task aloha`` reads.
OPTIONS = RUN_OPTIONS | set(OPTIM_OPTIONS) | {"pe", "pe_options", "model", "model_options", "patch_size",
                                              "image_size", "depth_scale_init", "workers", "threads"}
_DEMOS = ("demos", "sim_task", "episodes", "demo_seed", "camera", "fovy", "frame_stride", "cache_dir")


def _hw(cfg: Any, given: Collection[str]) -> Tuple[int, int]:
    if "image_size" not in given:
        return AlohaPolicyConfig().image_hw
    size = cfg.data.image_size
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _demos(cfg: Any, options: Dict[str, Any], given: Collection[str], depth: bool
           ) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """The demo set and where it came from (``{"demos": file}``, and ``"task"`` for a collected set)."""
    from ..robot.aloha.expert import load_demo_set

    path = required(options, "demos", "aloha", "demo set")
    if path is not None:
        extra = sorted(set(options) & set(_DEMOS))
        if extra:
            raise ValueError(f"--task-opt demos gives the demo set; {', '.join(extra)} would collect another")
        return load_demo_set(path), {"demos": path}
    from ..robot.aloha.expert import DemoConfig, load_or_collect

    dc = DemoConfig(task=str(options.pop("sim_task", "transfer_cube")), episodes=int(options.pop("episodes", 50)),
                    seed=int(options.pop("demo_seed", 0)), cameras=(str(options.pop("camera", "top")),),
                    image_hw=_hw(cfg, given), fovy=options.pop("fovy", None), depth=depth,
                    frame_stride=int(options.pop("frame_stride", 2)))
    demos, where, _ = load_or_collect(dc, options.pop("cache_dir", None), progress=cfg.run.progress,
                                      workers=cfg.data.workers if "workers" in given else 1)
    return demos, {"demos": str(where), "task": dc.task}


def run_aloha(cfg: Any, options: Dict[str, Any], *, resume: bool = False, given: Collection[str] = (),
              **_: Any) -> int:
    """Train the policy of ``ropekit train --task aloha`` in ``--out`` (default ``runs/aloha-<pe>-s<seed>``); the
    exit status."""
    from ..robot.aloha.policy import AlohaChunks, AlohaPolicy
    from ..robot.train import train_policy

    options = dict(options)
    modality = str(options.pop("modality", "image"))
    episodes = options.pop("train_episodes", None)
    tc = PolicyTrainConfig(**{"num_threads": 1, "shift": 0, **pick(options, PolicyTrainConfig, "aloha", TAKEN),
                              **given_values(cfg, given, TRAIN_FIELDS)})
    policy_opts = pick(options, AlohaPolicyConfig, "aloha", {**TAKEN, "image_hw": "--image-size"})
    demo_opts = {k: options.pop(k) for k in _DEMOS if k in options}
    refuse_unknown(options, "aloha", ["modality", "train_episodes", *_DEMOS, *PolicyTrainConfig.__dataclass_fields__,
                                      *AlohaPolicyConfig.__dataclass_fields__], TAKEN)
    demos, where = _demos(cfg, demo_opts, given, modality == "rgbd")
    fields = {k: v for k, v in model_fields(cfg, given, AlohaPolicyConfig()).items() if k != "image_size"}
    hw = tuple(int(n) for n in demos["rgb"].shape[1:3])
    if "image_size" in given and _hw(cfg, given) != hw:
        raise ValueError(f"--image-size {cfg.data.image_size}: the demo set's images are {hw[0]}x{hw[1]}")
    pcfg = AlohaPolicyConfig(**{**fields, **policy_opts, "modality": modality, "image_hw": hw,
                                **({"depth_scale_init": cfg.model.vit().depth_scale_init}
                                   if "depth_scale_init" in given else {})})
    policy = AlohaPolicy(pcfg)
    out = run_folder(cfg, "aloha")
    rows = train_policy(policy, AlohaChunks(demos, pcfg, None if episodes is None else int(episodes)), tc, out,
                        progress=cfg.run.progress, extra_config=where, resume=resume, options=engine_options(cfg))
    print(f"final loss {rows[-1]['loss']:.4f} after {tc.steps} steps; policy saved to {out / 'checkpoint.pt'}"
          if rows else f"policy saved to {out / 'checkpoint.pt'}")
    return 0


register_task("aloha", "a diffusion policy on bimanual ALOHA demonstrations (MuJoCo)", config=AlohaTaskConfig,
              train=run_aloha, options=OPTIONS)(build_aloha_task)
