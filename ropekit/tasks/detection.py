"""``ropekit train --task detection``: a 3-D box detector (:class:`~ropekit.detection.Detector3D`, a ViT with the
Hungarian set loss) on RGB-D scenes, then its AP and matched IoU on the test scenes.

::

    ropekit train --task detection --pe cayley --task-opt steps=300 --out runs/det3d/cayley
    ropekit train --task detection --task-opt scenes=train.npz --task-opt test_scenes=test.npz

Scenes: ``--task-opt scenes=FILE`` (and ``test_scenes=FILE``), ``.npz`` files of a ``SceneSet``'s ``arrays()``;
otherwise ``num_train`` (default 1000) and ``num_test`` (default 200) scenes rendered with pybullet
(``ropekit[sim]``) at ``--image-size`` (default 64) from the stream ``scene_seed`` (default 0; test scenes
``scene_seed + 1``), ``--workers`` processes (default 2), cached in ``cache_dir`` (default ``.cache/scenes``).

Options: the common ones (:data:`~ropekit.tasks.RUN_OPTIONS`), ``--batch-size``, ``--lr``, ``--weight-decay``,
``--grad-clip``, ``--log-every`` (steps per metrics row and checkpoint); the backbone's ``--pe``, ``--model``,
``--model-opt``, ``--patch-size``, ``--depth-scale-init``. ``--task-opt``: ``input`` (``rgbd``, ``rgb``,
``rgbd-channel``, ``rgbd-coord``), ``intrinsics``, ``box_param``, ``head_hidden``, and any field of
:class:`~ropekit.detection.train.DetTrainConfig` (``steps``, ``warmup_steps``, loss weights...).
"""

from __future__ import annotations

import json
from typing import Any, Collection, Dict, Tuple

from ..detection.train import DetectionTaskConfig, DetTrainConfig, build_detection_task
from ..train.tasks import register_task
from . import OPTIM_OPTIONS, RUN_OPTIONS, engine_options, given_values, pick, refuse_unknown, required, run_folder

__all__ = ["OPTIONS", "run_detection", "build_detection_task"]

#: the ``TrainConfig`` fields ``ropekit train --task detection`` reads.
OPTIONS = RUN_OPTIONS | set(OPTIM_OPTIONS) | {"pe", "model", "model_options", "patch_size", "image_size",
                                              "depth_scale_init", "workers"}
_DETECTOR = ("input", "intrinsics", "box_param", "head_hidden")
_SCENES = ("scenes", "test_scenes", "num_train", "num_test", "scene_seed", "cache_dir")


def _scenes(cfg: Any, options: Dict[str, Any], given: Collection[str]) -> Tuple[Any, Any]:
    """The training and test scenes (the test ones ``None`` when a scene file without ``test_scenes`` is given)."""
    from ..detection.train import load_scenes

    train_file = required(options, "scenes", "detection", "scene file")
    val_file = required(options, "test_scenes", "detection", "scene file")
    if train_file is not None:
        extra = sorted(set(options) & set(_SCENES))
        if extra or "image_size" in given:
            raise ValueError(f"--task-opt scenes gives the scenes; {', '.join(extra) or '--image-size'} would "
                             f"render others")
        return load_scenes(train_file), load_scenes(val_file) if val_file else None
    if val_file is not None:
        raise ValueError("--task-opt test_scenes needs --task-opt scenes (the training scenes) too")
    from ..detection.scenes import generate_scenes

    size = cfg.data.image_size if "image_size" in given else 64
    if isinstance(size, (list, tuple)):
        raise ValueError("--image-size: the detector's scenes are square; give one number")
    seed = int(options.pop("scene_seed", 0))
    kw = dict(size=int(size), workers=cfg.data.workers if "workers" in given else 2,
              cache_dir=str(options.pop("cache_dir", ".cache/scenes")), progress=cfg.run.progress)
    n_train, n_test = int(options.pop("num_train", 1000)), int(options.pop("num_test", 200))
    return generate_scenes(n_train, seed=seed, **kw), generate_scenes(n_test, seed=seed + 1, **kw) if n_test else None


def run_detection(cfg: Any, options: Dict[str, Any], *, resume: bool = False, given: Collection[str] = (),
                  **_: Any) -> int:
    """Train the detector of ``ropekit train --task detection`` in ``--out`` (default
    ``runs/detection-<pe>-s<seed>``), write the test scenes' metrics to ``metrics.json`` there; the exit status."""
    from ..detection.model import detector_config
    from ..detection.scenes import CLASS_NAMES
    from ..detection.train import evaluate_detector, new_detector, train_detector

    options = dict(options)
    detector = {k: options.pop(k) for k in _DETECTOR if k in options}
    if "head_hidden" in detector:
        detector["head_hidden"] = int(detector["head_hidden"])
    taken = {k: f"--{k.replace('_', '-')}" for k in OPTIM_OPTIONS}
    tc = DetTrainConfig(**{**pick(options, DetTrainConfig, "detection", taken),
                           **given_values(cfg, given, {k: k for k in OPTIM_OPTIONS})})
    scene_opts = {k: options.pop(k) for k in _SCENES if k in options}
    refuse_unknown(options, "detection", [*_DETECTOR, *_SCENES, *DetTrainConfig.__dataclass_fields__], taken)
    train_set, test_set = _scenes(cfg, scene_opts, given)
    dcfg = detector_config(cfg.model.vit().pe, str(detector.pop("input", "rgbd")), size=cfg.model.size,
                           num_classes=len(CLASS_NAMES),
                           image_size=int(train_set.rgb.shape[1]),
                           patch_size=cfg.model.patch_size if "patch_size" in given else 8,
                           **({"depth_scale_init": cfg.model.vit().depth_scale_init}
                              if "depth_scale_init" in given else {}),
                           **detector, **(cfg.model.extra() if "model_options" in given else {}))
    out = run_folder(cfg, "detection")
    model = new_detector(dcfg, train_set, tc.seed)
    rows = train_detector(model, train_set, tc, out_dir=out, resume=resume, options=engine_options(cfg),
                          val_scenes=test_set)
    line = f"final loss {rows[-1]['loss']:.4f} after {tc.steps} steps" if rows else "trained"
    if test_set is not None:
        metrics = evaluate_detector(model, test_set, tc)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
        line += f"; test mAP@0.25 {metrics.get('mAP@0.25', float('nan')):.4f}, mean IoU {metrics['mean_iou']:.4f}"
    print(f"{line}; run folder {out}")
    return 0


register_task("detection", "3-D boxes from RGB-D images: a ViT detector with the Hungarian set loss",
              config=DetectionTaskConfig, train=run_detection, options=OPTIONS)(build_detection_task)
